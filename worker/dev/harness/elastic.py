"""Scaling out and in under load, with real worker processes on a real broker: what a user does
when the fleet grows ("run one more worker in the group") and shrinks (a SIGTERM).

Run by the elastic tests (`tests/integration/chaos/test_elastic.py`, a short plan on each
broker) and by `bench/elastic.py` (the full plan, figures only).
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from worker.dev.harness.clients import job_record, produce_spread
from worker.dev.harness.runs import (
    ProcessRun,
    hello_jobs,
    partition_ends,
    until_all_answered,
    until_answered,
)

#: Log lines of the crash-loop breaker: a record blamed for a death, a suspect run alone.
BLAME_LINES = re.compile(r"died with \d+ records in flight|worker deaths: running it alone")


@dataclass(frozen=True)
class ElasticPlan:
    """`jobs` jobs over `partitions`, each `tokens` x `per_token_ms` long on the mock engine.
    Worker A serves alone; B joins once `join_b_at` jobs are answered, C at `join_c_at`, and A
    leaves by SIGTERM at `leave_a_at`. Every worker is a static member (its own instance id)."""

    jobs: int = 3000
    partitions: int = 8
    tokens: int = 8
    per_token_ms: int = 50
    max_in_flight: int = 32
    join_b_at: int = 500
    join_c_at: int = 1200
    leave_a_at: int = 2000
    revoke_grace_s: float = 5.0
    #: Worker flags for the broker (tansu: no idempotent producer).
    flags: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 420.0


@dataclass
class ScaleEvent:
    """One join or leave, and what followed it."""

    name: str
    at_answered: int
    at_s: float
    #: Started and not committed by every worker at the event: what it may repeat at most.
    in_flight: int
    #: Answers per second over the 5 s before the event.
    rate_before: float = 0.0
    #: The longest gap between two answers from the event to the next one (the rebalance's
    #: stall), and the seconds from the event until answers came again after it.
    longest_gap_s: float = 0.0
    recovered_s: float | None = None


@dataclass
class ElasticFigures:
    jobs: int
    lost: int
    answered_twice: int
    duplicates: int
    dead_lettered: int
    failed: int
    blamed: int
    events: list[ScaleEvent]
    committed_at_end: bool
    seconds: float

    @property
    def in_flight_at_events(self) -> int:
        return sum(event.in_flight for event in self.events)

    def lines(self) -> list[str]:
        out = [
            f"elastic: jobs={self.jobs} lost={self.lost} answered_twice={self.answered_twice} "
            f"duplicates={self.duplicates} (in flight at the events {self.in_flight_at_events}) "
            f"dead_lettered={self.dead_lettered} failed={self.failed} "
            f"breaker_lines={self.blamed} committed_at_end={self.committed_at_end} "
            f"seconds={self.seconds:.1f}"
        ]
        for event in self.events:
            recovered = "never" if event.recovered_s is None else f"{event.recovered_s:.1f}s"
            out.append(
                f"  {event.name}: at {event.at_answered} answered (t={event.at_s:.1f}s), "
                f"{event.in_flight} in flight, {event.rate_before:.1f} answers/s before; "
                f"longest stall {event.longest_gap_s:.1f}s, answers steady again {recovered} "
                "after the event"
            )
        return out


class Elastic(ProcessRun[ElasticPlan]):
    """Runs an `ElasticPlan` on a broker: `spawn(topics, **flags)` starts `python -m worker
    serve` (a `WorkerProcess`)."""

    async def _start(self, name: str) -> None:
        plan = self.plan
        worker = self._start_worker(
            name,
            max_in_flight=plan.max_in_flight,
            mock_per_token_latency_ms=plan.per_token_ms,
            revoke_grace_s=plan.revoke_grace_s,
            # Scaled in, not restarted: the group hands A's partitions over at once.
            leave_group_on_stop=True,
            **plan.flags,
        )
        await worker.metrics_port(timeout_s=60)

    async def run(self) -> ElasticFigures:
        plan, bs, topics = self.plan, self._bootstrap, self._topics
        jobs = hello_jobs(plan.jobs, lambda _: plan.tokens)
        job_ids = {j.job_id for j in jobs}
        ends = partition_ends(plan.jobs, plan.partitions)
        events: list[ScaleEvent] = []
        async with self._answers_seen() as seen:
            await self._start("a")
            t0 = time.monotonic()
            await produce_spread(bs, topics.jobs, [job_record(j) for j in jobs], plan.partitions)
            try:
                for name, threshold in (
                    ("B joins", plan.join_b_at),
                    ("C joins", plan.join_c_at),
                    ("A leaves", plan.leave_a_at),
                ):
                    await until_answered(seen, threshold, plan.timeout_s)
                    event = ScaleEvent(
                        name, len(seen.answered()), time.monotonic() - t0, await self._in_flight()
                    )
                    events.append(event)
                    self._log(f"  {name} at {event.at_answered} answered")
                    if name == "A leaves":
                        self.workers["a"].signal(signal.SIGTERM)
                    else:
                        await self._start(name[0].lower())
                with contextlib.suppress(AssertionError):  # lost jobs are counted below
                    await until_all_answered(seen, job_ids, plan.timeout_s)
                try:
                    await self._committed_to_ends(ends)
                    committed_at_end = True
                except AssertionError:
                    committed_at_end = False
            finally:
                await self._stop_all(60)
            seconds = time.monotonic() - t0
            history = seen.history(job_ids)
            times = [t - t0 for t in seen.times]
            failed = seen.failed()
        _follow(events, times)
        blamed = sum(len(BLAME_LINES.findall(worker.text())) for worker in self.started)
        return ElasticFigures(
            jobs=plan.jobs,
            lost=len(history.lost),
            answered_twice=history.answered_twice,
            duplicates=history.duplicates,
            dead_lettered=len(seen.dead_lettered),
            failed=len(failed),
            blamed=blamed,
            events=events,
            committed_at_end=committed_at_end,
            seconds=seconds,
        )


def _follow(events: list[ScaleEvent], times: list[float]) -> None:
    """Fill in each event's rate before it, its longest gap between answers, and when the
    answers came back after that gap (the rebalance's stall), from `times`: the seconds since
    the start at which answers arrived, in order."""
    for i, event in enumerate(events):
        stop = events[i + 1].at_s if i + 1 < len(events) else (times[-1] if times else 0.0)
        before = [t for t in times if event.at_s - 5 <= t < event.at_s]
        event.rate_before = len(before) / 5
        after = [t for t in times if event.at_s <= t <= stop]
        gaps = [(b - a, b) for a, b in zip([event.at_s, *after], after, strict=False)]
        if gaps:
            event.longest_gap_s, resumed = max(gaps)
            event.recovered_s = resumed - event.at_s
