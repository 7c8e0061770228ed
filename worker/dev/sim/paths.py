"""What a run records beyond the cluster's events: the weights each generation ran on, and
how many times each path of partition state and delivery worth reaching ran.

The checker judges results against the engine's own account (`generated`, `loaded`): the
version a result carries must be the version of the weights that generated it. The path
counts (`History.paths`) show a path no seed reaches: a rule whose defect no fault schedule
could reveal. Both wrap the real worker's methods for the length of a run, as the planted
defects do (`worker.dev.sim.mutants`), and change nothing they wrap: no await is added, so a
seed replays the same with or without them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

from worker.delivery.commit_plan import CommitPlanner
from worker.delivery.commits import Committer
from worker.delivery.hand_overs import RefusedHandOvers
from worker.delivery.inheritance import Inheritance
from worker.delivery.offsets import OffsetTracker, PartitionOffsets
from worker.delivery.outbox import Outbox
from worker.delivery.publish import Delivery
from worker.delivery.refusals import RefusedAnswers
from worker.dev.sim.fleet import SimEngine
from worker.dev.sim.history import History
from worker.loop.breaker import CrashLoopBreaker, Suspect
from worker.loop.rebalance import Rebalances

__all__ = ["PATHS", "observed"]

#: Every path counted, in the order `bench/sim.py` prints them, with what it means.
PATHS: dict[str, str] = {
    "parked": "partitions handed over with jobs still running, kept until the next assignment",
    "adopted": "parked partitions assigned back unchanged: their jobs finished here",
    "parked_moved": "parked partitions that moved: their jobs cancelled, answers dropped",
    "parked_dropped": "parked partitions let go before the verdict (a record that will not run)",
    "hand_overs_refused": "hand-over commits refused or unanswered, kept to land after rejoining",
    "hand_overs_awaited": "new owners that waited for a live last owner's hand-over",
    "positions_taken_over": "commits that found the group's position ahead and took it over",
    "answers_taken_back": "answers not yet handed to the producer, left to the next owner",
    "batches_failed": "answer batches whose delivery failed",
    "resends": "answers sent again on their own after a failed batch",
    "shrunk": "answers too large for their topic, answered smaller",
    "redirected": "answers a topic refused, answered elsewhere",
    "suspects_retried": "suspects of one death run again beside others",
    "suspects_together": "suspects of two deaths run together",
    "suspects_alone": "suspects of three deaths or more run alone",
    "maps_degraded": "offset maps that left sections out to fit",
    "interrupted_generations": "generations an update stopped or continued on other weights",
}


@contextlib.contextmanager
def observed(history: History) -> Iterator[None]:
    """Record generations and loads, and count the paths of `PATHS`, while the run lasts."""
    with contextlib.ExitStack() as stack:
        for owner, name, wrapper in _wrappers(history):
            stack.enter_context(mock.patch.object(owner, name, wrapper(getattr(owner, name))))
        yield


def _wrappers(  # noqa: PLR0915 - one wrapper per path
    history: History,
) -> list[tuple[type, str, Callable[[Any], Any]]]:
    count = history.count

    def after(path: str, how_many: Callable[[Any, tuple[Any, ...], Any], int]) -> Any:
        """A wrapper of a plain method counting `how_many(self, args, result)` times."""

        def wrap(real: Any) -> Any:
            @functools.wraps(real)
            def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
                result = real(self, *args, **kwargs)
                count(path, how_many(self, args, result))
                return result

            return counted

        return wrap

    def after_async(path: str, how_many: Callable[[Any, tuple[Any, ...], Any], int]) -> Any:
        def wrap(real: Any) -> Any:
            @functools.wraps(real)
            async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
                result = await real(self, *args, **kwargs)
                count(path, how_many(self, args, result))
                return result

            return counted

        return wrap

    def before_async(path: str) -> Any:
        def wrap(real: Any) -> Any:
            @functools.wraps(real)
            async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
                count(path)
                return await real(self, *args, **kwargs)

            return counted

        return wrap

    def decided(real: Any) -> Any:
        @functools.wraps(real)
        async def counted(self: Rebalances, adopted: set[Any]) -> None:
            count("parked_moved", len(self._parked.awaiting() - adopted))
            await real(self, adopted)

        return counted

    def chosen(real: Any) -> Any:
        @functools.wraps(real)
        def counted(self: CrashLoopBreaker, suspect: Suspect) -> None:
            count("suspects_together" if self.runs_together(suspect.deaths) else "suspects_alone")
            real(self, suspect)

        return counted

    def taken(real: Any) -> Any:
        @functools.wraps(real)
        def counted(self: CrashLoopBreaker, tp: Any, partition: Any, records: list[Any]) -> Any:
            result = real(self, tp, partition, records)
            count(
                "suspects_retried",
                sum(1 for r in result.run if 0 < partition.deaths.get(r.offset, 0) <= 1),
            )
            return result

        return counted

    def delivered(real: Any) -> Any:
        @functools.wraps(real)
        def counted(self: Delivery, members: list[Any], delivery: Any) -> None:
            if not delivery.cancelled() and delivery.exception() is not None:
                count("batches_failed")
            real(self, members, delivery)

        return counted

    def generate(real: Any) -> Any:
        @functools.wraps(real)
        async def recorded(self: SimEngine, job: Any, request_id: str, **kwargs: Any) -> Any:
            began = _process_of(self)
            if began is not None:
                history.add(
                    "generating",
                    worker=began,
                    job=job.job_id,
                    record=_record_of(job.job_id, request_id),
                )
            try:
                output = await real(self, job, request_id, **kwargs)
            finally:
                if began is not None:
                    # Also cancelled (a revoke, a moved parked partition, a kill): over.
                    history.add("generation_over", worker=began, job=job.job_id)
            process = _process_of(self)
            if process is not None:
                history.add(
                    "generated",
                    worker=process,
                    job=job.job_id,
                    version=output.weight_version,
                    interrupted=output.interrupted,
                )
                count("interrupted_generations", int(output.interrupted))
            return output

        return recorded

    def load(real: Any) -> Any:
        @functools.wraps(real)
        async def recorded(self: SimEngine, path: str, version: int) -> None:
            await real(self, path, version)
            process = _process_of(self)
            if process is not None:
                history.add("loaded", worker=process, version=version)

        return recorded

    declared: set[tuple[str, int, str]] = set()

    def degraded(real: Any) -> Any:
        """Record each commit a worker planned with its answered section left out to fit its
        cap (`map_degraded`): the docs give those records plain at-least-once, and the
        checker excuses exactly their second answers (`worker.dev.sim.checker`)."""

        @functools.wraps(real)
        def declared_plan(self: OffsetTracker, *args: Any, **kwargs: Any) -> Any:
            planned = real(self, *args, **kwargs)
            for tp, plan in planned.items():
                position, metadata = plan.commit
                key = (f"{tp.topic}-{tp.partition}", position, metadata)
                if "answered" in plan.dropped and key not in declared:
                    declared.add(key)
                    history.add("map_degraded", tp=key[0], offset=position, metadata=metadata)
            return planned

        return declared_plan

    def in_flight(_self: Any, _args: tuple[Any, ...], result: Any) -> int:
        return len(result)

    return [
        (Committer, "revoked", after_async("parked", in_flight)),
        (Committer, "adopt", after_async("adopted", in_flight)),
        (Committer, "drop_parked", after("parked_dropped", lambda *_: 1)),
        (
            CommitPlanner,
            "_note_degraded",
            after("maps_degraded", lambda _s, a, _r: int(bool(a[1].dropped))),
        ),
        (Rebalances, "_decide_parked", decided),
        (RefusedHandOvers, "refused", after("hand_overs_refused", lambda _s, a, _r: len(a[0]))),
        (Inheritance, "_await_hand_overs", before_async("hand_overs_awaited")),
        (OffsetTracker, "plan", degraded),
        (PartitionOffsets, "overtaken", after("positions_taken_over", lambda *_: 1)),
        (Outbox, "drop", after("answers_taken_back", lambda _s, _a, r: len(r))),
        (Delivery, "_on_delivery", delivered),
        (Delivery, "_resend", before_async("resends")),
        (RefusedAnswers, "shrink", after("shrunk", lambda *_: 1)),
        (RefusedAnswers, "redirect", after("redirected", lambda *_: 1)),
        (CrashLoopBreaker, "_choose", chosen),
        (CrashLoopBreaker, "take", taken),
        (SimEngine, "generate", generate),
        (SimEngine, "load_weights", load),
    ]


def _record_of(job_id: str, request_id: str) -> str:
    """The place (`topic-partition@offset`) of the record an engine request runs, from the
    request id the job runner gives it (`worker.answering.runner`: `job_id@place`, and
    `/index` after it for a continuation). A job id names no record: the trainer appends a job
    again when its acknowledgement was lost, and a worker may run either copy."""
    return request_id.removeprefix(f"{job_id}@").split("/", 1)[0]


def _process_of(engine: SimEngine) -> str | None:
    """The name of the live process whose engine `engine` is; None once it is gone."""
    fleet, worker_id = engine._fleet, engine._worker_id
    process = fleet.processes.get(worker_id)
    service = fleet.services.get(worker_id)
    served = getattr(service, "engine", None)
    # The service serves it behind a `SteerableEngine`, which follows the control plane.
    if process is None or not process.alive or getattr(served, "_inner", served) is not engine:
        return None
    return process.name
