"""Worker variants with a defect planted on purpose: the checker must flag each (its tests).

Each is a context manager that patches the real worker code for the length of a run: one
small defect a competent developer could write, one rule of partition state and delivery
broken (its docstring says which, and what it costs). `bench/mutants.py` runs each on fresh
seeds until the checker flags it; `tests/unit/test_sim.py` replays the seed that caught each.
A mutant no seed catches is a hole in the net: a fault the schedule never draws, or an
invariant the checker lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import msgspec

from schemas import ResultAssembler
from worker.answering.runner import JobRunner
from worker.client import inflight, steering
from worker.client.fleet import Fleet
from worker.client.inflight import InFlight
from worker.client.rollout import RolloutClient
from worker.control import catch_up, plane
from worker.delivery import committed_maps, offset_map
from worker.delivery.commits import Committer
from worker.delivery.hand_overs import RefusedHandOvers
from worker.delivery.offset_map import OffsetMapError
from worker.delivery.offsets import PartitionOffsets
from worker.delivery.outbox import Outbox
from worker.delivery.parking import Parking
from worker.delivery.publish import Delivery
from worker.delivery.refusals import RefusedAnswers
from worker.engines.steerable import SteerableEngine
from worker.loop.breaker import CrashLoopBreaker
from worker.loop.rebalance import Rebalances
from worker.loop.starts import JobStarts

__all__ = ["MUTANTS"]


@contextlib.contextmanager
def commit_before_ack() -> Iterator[None]:
    """Finishes a job's offset when its answer is queued, not when the broker acknowledges
    it: a death (or a refused send) before the acknowledgement loses the answer."""
    real_queue = Delivery.queue

    def queue(self: Delivery, ticket: Any) -> bool:
        ticket.owner.acknowledged(ticket.offset)
        return bool(real_queue(self, ticket))

    with (
        mock.patch.object(Delivery, "queue", queue),
        mock.patch.object(Delivery, "_acknowledged", lambda self, ticket: None),
    ):
        yield


@contextlib.contextmanager
def skip_record() -> Iterator[None]:
    """Marks every 41st record answered without running it."""
    real = JobStarts._runnable

    def runnable(self: JobStarts, tp: Any, fetched: list[Any]) -> Any:
        kept = []
        for record in fetched:
            if record.offset % 41 == 7:
                partition = self._committer.partition(tp)
                if partition.start(record.offset):
                    partition.finish(record.offset)
            else:
                kept.append(record)
        return real(self, tp, kept) if kept else []

    with mock.patch.object(JobStarts, "_runnable", runnable):
        yield


@contextlib.contextmanager
def commit_past_running() -> Iterator[None]:
    """Commits past the last record started, not below the first unfinished one (commit
    order): a death then loses every job still running behind the position."""

    def commit_position(self: PartitionOffsets) -> int | None:
        if self.last_started is None:
            return self.anchor
        return max(self.last_started + 1, self.floor)

    with mock.patch.object(PartitionOffsets, "commit_position", commit_position):
        yield


@contextlib.contextmanager
def failed_send_finishes() -> Iterator[None]:
    """Finishes the offsets of a batch whose delivery failed, as if acknowledged, before
    sending it again: a death before the re-send lands loses those answers."""
    real = Delivery._on_delivery

    def on_delivery(self: Delivery, members: list[Any], delivery: Any) -> None:
        if not delivery.cancelled() and delivery.exception() is not None:
            for ticket, _ in members:
                ticket.owner.acknowledged(ticket.offset)
        real(self, members, delivery)

    with mock.patch.object(Delivery, "_on_delivery", on_delivery):
        yield


@contextlib.contextmanager
def revoke_leaves_jobs_running() -> Iterator[None]:
    """A revoke that neither cancels nor parks the jobs still running at the grace's end:
    they go on and send their answers after the hand-over named them running, and the next
    owner runs them again."""
    real = Rebalances.revoked

    class _Unwatched:
        def __init__(self, jobs: Any) -> None:
            self._jobs = jobs

        def __getattr__(self, name: str) -> Any:
            return getattr(self._jobs, name)

        def busy(self, partitions: Any = None) -> int:
            return 0

        async def abort(self, partitions: Any) -> None:
            return None

    async def revoked(self: Rebalances, partitions: set[Any]) -> None:
        jobs = self._jobs
        self._jobs = _Unwatched(jobs)  # type: ignore[assignment]
        try:
            await real(self, partitions)
        finally:
            self._jobs = jobs

    with mock.patch.object(Rebalances, "revoked", revoked):
        yield


@contextlib.contextmanager
def adopt_unchecked() -> Iterator[None]:
    """Adopts every parked partition assigned back without reading whether the group's commit
    is still this member's: another member may have run and committed it meanwhile, and both
    answer its jobs."""
    real = Parking.adopt

    async def adopt(self: Parking, assigned: set[Any]) -> set[Any]:
        read = self._read_committed
        parked = dict(self._tracker.parked())

        async def as_handed_over(partitions: list[Any]) -> dict[Any, Any]:
            return {tp: parked[tp].committed for tp in partitions}

        self._read_committed = as_handed_over if read is not None else None
        try:
            return await real(self, assigned)
        finally:
            self._read_committed = read

    with mock.patch.object(Parking, "adopt", adopt):
        yield


@contextlib.contextmanager
def parked_answers_sent_after_move() -> Iterator[None]:
    """Sends the answers parked jobs finish after the hand-over without waiting for the
    verdict: a partition that moved is answered here and by its next owner."""

    async def answer_stays(self: Rebalances, tp: Any, partition: Any) -> bool:
        return True

    with mock.patch.object(Rebalances, "answer_stays", answer_stays):
        yield


@contextlib.contextmanager
def moved_jobs_run_on() -> Iterator[None]:
    """Parked partitions that moved keep their jobs running (cancelled nowhere) and their
    answers go out: the verdict is read, but a moved partition is treated as adopted."""
    real = Rebalances._decide_parked

    async def decide(self: Rebalances, adopted: set[Any]) -> None:
        await real(self, adopted | self._parked.awaiting())

    with mock.patch.object(Rebalances, "_decide_parked", decide):
        yield


@contextlib.contextmanager
def inherited_map_ignored() -> Iterator[None]:
    """Reads the previous owner's offset map as unreadable: what it answered out of order runs
    again after every hand-over, and the crash counts it carried are lost."""

    def decode(position: int, metadata: str, *, end: int | None = None) -> Any:
        raise OffsetMapError("not read")

    with mock.patch.object(committed_maps, "decode_offset_map", decode):
        yield


@contextlib.contextmanager
def map_run_ends_early() -> Iterator[None]:
    """Encodes each run of answered offsets one short (an off-by-one at a run's end): the
    last record of every run is named neither answered nor running, and runs again."""
    real = offset_map._runs

    def runs(position: int, offsets: Any) -> list[Any]:
        return [
            (start, stop - 1, count) if stop - start > 1 else (start, stop, count)
            for start, stop, count in real(position, offsets)
        ]

    with mock.patch.object(offset_map, "_runs", runs):
        yield


@contextlib.contextmanager
def hand_over_not_clean() -> Iterator[None]:
    """Hands partitions over with commits not marked clean: the next owner, finding the writer
    gone once it stopped, counts a death against every job the hand-over names running."""
    real = PartitionOffsets.plan

    def plan(self: PartitionOffsets, *, clean: bool = False, **kwargs: Any) -> Any:
        return real(self, clean=False, **kwargs)

    with mock.patch.object(PartitionOffsets, "plan", plan):
        yield


@contextlib.contextmanager
def no_final_hand_over() -> Iterator[None]:
    """A stopping worker skips its final hand-over (it believes the interval's commit did it):
    what it answered since is run again, and what ran is blamed for a death."""

    async def hand_over_until(self: Committer, deadline: float) -> bool:
        return True

    async def hand_over(self: Committer) -> None:
        return None

    with (
        mock.patch.object(Committer, "hand_over_until", hand_over_until),
        mock.patch.object(Committer, "hand_over", hand_over),
    ):
        yield


@contextlib.contextmanager
def refused_hand_overs_dropped() -> Iterator[None]:
    """Drops a hand-over the group refused instead of landing it after rejoining: the next
    owner finds the live writer's older map, runs again what it answered, and once the writer
    stopped blames what it names running."""

    def refused(self: RefusedHandOvers, offsets: Any, before: Any) -> None:
        return None

    with mock.patch.object(RefusedHandOvers, "refused", refused):
        yield


@contextlib.contextmanager
def no_rewind_after_assignment() -> Iterator[None]:
    """Fetches an assigned partition from where aiokafka positioned it as it joined, not from
    where the maps read after the assignment say: a hand-over that landed after that lookup
    is run again behind, and the position moves back."""
    real = Committer.assigned

    async def assigned(self: Committer, partitions: set[Any]) -> dict[Any, int]:
        await real(self, partitions)
        return {}

    with mock.patch.object(Committer, "assigned", assigned):
        yield


@contextlib.contextmanager
def no_write_ahead() -> Iterator[None]:
    """Starts jobs without the commit that names them running: a record that kills the
    process is never seen in flight at a death, and kills every owner for ever."""

    async def write_ahead(self: Committer) -> None:
        return None

    with mock.patch.object(Committer, "write_ahead", write_ahead):
        yield


@contextlib.contextmanager
def deaths_counted_twice() -> Iterator[None]:
    """Counts a dead writer's running jobs two deaths each (the breaker's count): a healthy job
    in flight at two kills reaches the limit and is dead-lettered."""
    real = PartitionOffsets.start

    def start(self: PartitionOffsets, offset: int) -> bool:
        # Counted again when first started after the inheritance that counted it.
        if self.deaths.get(offset) and self.last_started is None:
            self.deaths[offset] += 1
        return bool(real(self, offset))

    with mock.patch.object(PartitionOffsets, "start", start):
        yield


@contextlib.contextmanager
def together_without_quiet() -> Iterator[None]:
    """Runs suspects of two deaths (and more) without waiting for the worker to be quiet:
    healthy jobs in flight beside a record that kills the process collect its deaths."""

    def quiet(self: CrashLoopBreaker) -> bool:
        return True

    with mock.patch.object(CrashLoopBreaker, "_quiet", quiet):
        yield


@contextlib.contextmanager
def queued_answers_kept_at_revoke() -> Iterator[None]:
    """Keeps a revoked partition's answers not yet handed to the producer (a broker away)
    instead of leaving them to the next owner: sent after the hand-over, they answer their
    jobs twice."""
    real = Delivery.settle

    async def settle(self: Delivery, partitions: Any, deadline: float) -> None:
        if partitions is None:
            await real(self, partitions, deadline)
            return
        with mock.patch.object(Outbox, "drop", lambda self, whose: []):
            await real(self, partitions, deadline)

    with mock.patch.object(Delivery, "settle", settle):
        yield


@contextlib.contextmanager
def resent_after_hand_over() -> Iterator[None]:
    """Sends again an answer whose delivery failed after its partition was handed over: the
    next owner answers that job too."""
    real = Delivery._on_delivery

    def on_delivery(self: Delivery, members: list[Any], delivery: Any) -> None:
        for ticket, _ in members:
            ticket.handed_over = False
        real(self, members, delivery)

    with mock.patch.object(Delivery, "_on_delivery", on_delivery):
        yield


@contextlib.contextmanager
def refused_answer_not_shrunk() -> Iterator[None]:
    """Sends an answer a topic refused for its size again unchanged, instead of a smaller one:
    the broker refuses it until the worker's patience runs out and it exits 1."""

    def shrink(self: RefusedAnswers, ticket: Any, index: int, refused_by: str) -> None:
        return None

    with mock.patch.object(RefusedAnswers, "shrink", shrink):
        yield


@contextlib.contextmanager
def stale_weight_stamp() -> Iterator[None]:
    """Stamps a result with the weight version served when its job started, read once before
    the engine ran it: after an update under way, the result names weights that did not make
    it."""
    real = JobRunner.run

    async def run(
        self: JobRunner, tp: Any, record: Any, job: Any, trace: Any, **kwargs: Any
    ) -> Any:
        version = self._engine.weight_version
        ran = await real(self, tp, record, job, trace, **kwargs)
        return msgspec.structs.replace(
            ran, result=msgspec.structs.replace(ran.result, weight_version=version)
        )

    with mock.patch.object(JobRunner, "run", run):
        yield


@contextlib.contextmanager
def restart_keeps_the_running_jobs() -> Iterator[None]:
    """Takes an update that says `restart` as `keep`: the running jobs continue on the new
    weights instead of running again from the start, so their answers, finished after the
    acknowledgement, still carry tokens of the old weights."""
    real = SteerableEngine._update

    async def update(self: SteerableEngine, mode: Any, load: Any) -> None:
        await real(self, "keep" if mode == "restart" else mode, load)

    with mock.patch.object(SteerableEngine, "_update", update):
        yield


@contextlib.contextmanager
def catch_up_takes_refused_updates() -> Iterator[None]:
    """A starting worker's catch-up takes every update on the control topic, also those the
    fleet refused: it loads weights the rest of the fleet does not serve."""
    real = catch_up.plan_catch_up

    def plan_catch_up(log: Any, state: Any, start_version: int, **kwargs: Any) -> Any:
        everything = dataclasses.replace(
            state, applied=state.applied | {command.command_id for _, command in log.addressed}
        )
        return real(log, everything, start_version, **kwargs)

    with mock.patch.object(plane, "plan_catch_up", plan_catch_up):
        yield


@contextlib.contextmanager
def catch_up_keeps_the_last_record_of_an_id() -> Iterator[None]:
    """A starting worker's reading of the control topic keeps the last record of each command
    id, not the first: a replayed copy takes the original's place in topic order, so an old
    update replayed after newer ones reads as the fleet's newest."""

    def take(self: catch_up.ControlLog, offset: int, command: Any, *, addressed: bool) -> bool:
        self.ids[command.command_id] = offset
        self.addressed = [(o, c) for o, c in self.addressed if c.command_id != command.command_id]
        if addressed:
            self.addressed.append((offset, command))
        return True

    with mock.patch.object(catch_up.ControlLog, "take", take):
        yield


@contextlib.contextmanager
def rollback_below_start_version_dropped() -> Iterator[None]:
    """A starting worker's catch-up drops every update below the version it starts on, forced
    rollbacks too: a fleet rolled back below `--weight-version` gets its restarted workers back
    on weights the trainer left."""
    real = catch_up.plan_catch_up

    def plan_catch_up(log: Any, state: Any, start_version: int, **kwargs: Any) -> Any:
        plan = real(log, state, start_version, **kwargs)
        plan.checkpoints = [u for u in plan.checkpoints if u.version >= start_version]
        if plan.transfer is not None and plan.transfer.version < start_version:
            plan.transfer = None
        return plan

    with mock.patch.object(plane, "plan_catch_up", plan_catch_up):
        yield


@contextlib.contextmanager
def needs_weights_left_out_of_heartbeats() -> Iterator[None]:
    """Heartbeats leave out that the worker lacks the fleet's transfer: the trainer cannot see
    it, and a worker starting once the transfer's acknowledgements left the status tail serves
    older weights as if they were the fleet's."""
    real = plane.ControlPlane.status

    def status(self: plane.ControlPlane, *, engine_healthy: bool = True) -> Any:
        return msgspec.structs.replace(
            real(self, engine_healthy=engine_healthy),
            needs_weights=False,
            needs_weights_command_id=None,
        )

    with mock.patch.object(plane.ControlPlane, "status", status):
        yield


@contextlib.contextmanager
def replayed_record_obeyed() -> Iterator[None]:
    """A following worker applies every signed record addressed to it, a copy of one it took
    before included: a replayed update, pause or rollback is obeyed again."""

    async def take(self: plane.ControlPlane, record: Any) -> None:
        command, reason, detail = catch_up.take_command(record.value or b"", self._key)
        if command is None:
            self._status.drop(record, reason, detail)
            return
        self._commands.applied.add(command.command_id)
        if self._commands.addressed(command):
            await self._commands.apply(command, offset=record.offset)

    with mock.patch.object(plane.ControlPlane, "_take", take):
        yield


@contextlib.contextmanager
def unanswered_applied_after_the_fleets_state() -> Iterator[None]:
    """A starting worker applies every command nobody answered after the fleet's state,
    whatever their order in the topic: a command for it sent while it was down, older than
    the fleet's newest update or resume, undoes it."""
    real = catch_up.plan_catch_up

    def plan_catch_up(log: Any, state: Any, start_version: int, **kwargs: Any) -> Any:
        plan = real(log, state, start_version, **kwargs)
        overtaken = [(offset, command) for offset, command, _ in plan.superseded]
        plan.unanswered = sorted(plan.unanswered + overtaken, key=lambda pair: pair[0])
        plan.superseded = []
        return plan

    with mock.patch.object(plane, "plan_catch_up", plan_catch_up):
        yield


@contextlib.contextmanager
def answers_by_job_id_only() -> Iterator[None]:
    """The trainer's client takes any answer that names a job id in flight, not only the one
    that echoes its sending: a re-run turn, or a restarted loop's job, takes the late answer to
    an earlier asking of its id."""

    def answers(pending: Any, result: Any) -> bool:
        return True

    with mock.patch.object(inflight, "_answers", answers):
        yield


@contextlib.contextmanager
def finished_ids_by_job_id() -> Iterator[None]:
    """The assembler remembers finished jobs by id alone: a job id asked again after its
    earlier asking was answered (a turn that failed, run again) has its real answer dropped as
    a duplicate, and the call expires every time it is run."""
    real = ResultAssembler.add

    def add(self: ResultAssembler, result: Any) -> Any:
        if result.job_id is not None and any(job_id == result.job_id for job_id, _ in self._done):
            return None
        return real(self, result)

    with mock.patch.object(ResultAssembler, "add", add):
        yield


@contextlib.contextmanager
def expiry_on_the_monotonic_clock() -> Iterator[None]:
    """The client's sweep compares deadlines (wall-clock seconds) with `time.monotonic()`: no
    job ever expires, so a call whose answer never comes never ends, and a late answer is
    taken long after the deadline."""

    async def sweep(self: RolloutClient) -> None:
        while True:
            await asyncio.sleep(0.2)
            self._inflight.expire(time.monotonic())

    with mock.patch.object(RolloutClient, "_sweep", sweep):
        yield


@contextlib.contextmanager
def resubmission_renames_the_job() -> Iterator[None]:
    """A resubmission renames the caller's job to the id it travels under (`<id>~retry<n>`),
    not only its sending: the answer reaches the caller under an id it never sent."""
    real = InFlight._retry

    def retry(self: InFlight, pending: Any, failed: Any) -> bool:
        resent = bool(real(self, pending, failed))
        if resent:
            pending.job = msgspec.structs.replace(pending.job, job_id=pending.wire_id)
        return resent

    with mock.patch.object(InFlight, "_retry", retry):
        yield


@contextlib.contextmanager
def update_returns_at_the_first_ack() -> Iterator[None]:
    """The client's `update_weights` stops waiting at the first worker's acknowledgement and
    judges only the acknowledgements that came: it returns while other live workers of the
    target still serve the old weights."""
    real_acks = Fleet.acks
    real_check = steering._check_every_worker_updated

    async def acks(self: Fleet, command_id: str, workers: Any, since: Any, timeout_s: float) -> Any:
        return await real_acks(self, command_id, sorted(workers)[:1], since, timeout_s)

    def check(version: int, live: Any, got: Any, timeout_s: float) -> None:
        real_check(version, list(got) or live, got, timeout_s)

    with (
        mock.patch.object(Fleet, "acks", acks),
        mock.patch.object(steering, "_check_every_worker_updated", check),
    ):
        yield


MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "commit_before_ack": commit_before_ack,
    "skip_record": skip_record,
    "commit_past_running": commit_past_running,
    "failed_send_finishes": failed_send_finishes,
    "revoke_leaves_jobs_running": revoke_leaves_jobs_running,
    "adopt_unchecked": adopt_unchecked,
    "parked_answers_sent_after_move": parked_answers_sent_after_move,
    "moved_jobs_run_on": moved_jobs_run_on,
    "inherited_map_ignored": inherited_map_ignored,
    "map_run_ends_early": map_run_ends_early,
    "hand_over_not_clean": hand_over_not_clean,
    "no_final_hand_over": no_final_hand_over,
    "refused_hand_overs_dropped": refused_hand_overs_dropped,
    "no_rewind_after_assignment": no_rewind_after_assignment,
    "no_write_ahead": no_write_ahead,
    "deaths_counted_twice": deaths_counted_twice,
    "together_without_quiet": together_without_quiet,
    "queued_answers_kept_at_revoke": queued_answers_kept_at_revoke,
    "resent_after_hand_over": resent_after_hand_over,
    "refused_answer_not_shrunk": refused_answer_not_shrunk,
    "stale_weight_stamp": stale_weight_stamp,
    "restart_keeps_the_running_jobs": restart_keeps_the_running_jobs,
    "catch_up_takes_refused_updates": catch_up_takes_refused_updates,
    "catch_up_keeps_the_last_record_of_an_id": catch_up_keeps_the_last_record_of_an_id,
    "rollback_below_start_version_dropped": rollback_below_start_version_dropped,
    "needs_weights_left_out_of_heartbeats": needs_weights_left_out_of_heartbeats,
    "replayed_record_obeyed": replayed_record_obeyed,
    "unanswered_applied_after_the_fleets_state": unanswered_applied_after_the_fleets_state,
    "answers_by_job_id_only": answers_by_job_id_only,
    "finished_ids_by_job_id": finished_ids_by_job_id,
    "expiry_on_the_monotonic_clock": expiry_on_the_monotonic_clock,
    "resubmission_renames_the_job": resubmission_renames_the_job,
    "update_returns_at_the_first_ack": update_returns_at_the_first_ack,
}
