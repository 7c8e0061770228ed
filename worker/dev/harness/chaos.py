"""Chaos at scale: worker processes killed at random while they serve, and jobs that kill them.

Run by the chaos tests (`tests/integration/chaos/test_chaos.py`, a short plan) and by
`bench/chaos.py` (the full plan, figures only).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from schemas import Job
from worker.dev.harness.answers import AnswersSeen
from worker.dev.harness.clients import committed, job_record, produce_spread
from worker.dev.harness.runs import (
    ProcessRun,
    Spawn,
    hello_jobs,
    partition_ends,
    until_all_answered,
    until_answered,
)
from worker.dev.harness.topics import Topics
from worker.dev.harness.waiting import wait_for


@dataclass
class ChaosPlan:
    """What `Chaos` does: `jobs` jobs spread over `partitions`, served by `workers` processes
    (static members, each restarted under its own instance id), of which `kills` are SIGKILLed
    at random and `term_kills` SIGTERMed and SIGKILLed `term_kill_after_s` later if still
    running; `crash_jobs` jobs hold the mock engine's crash token and kill whoever runs them.
    Every `long_every`-th job runs long, so stops cut some jobs short."""

    jobs: int = 5000
    partitions: int = 8
    workers: int = 2
    kills: int = 50
    term_kills: int = 10
    term_kill_after_s: float = 2.0
    crash_jobs: int = 3
    crash_token: int = 99_999
    max_in_flight: int = 16
    per_token_ms: int = 10
    long_every: int = 100
    long_tokens: int = 300
    seed: int = 0
    timeout_s: float = 900.0
    #: Jobs are produced in 20 even parts over this many seconds (0: all at once), so that the
    #: kills, planned at shares of the jobs answered, land over the whole run and under load:
    #: a worker restarts in seconds, and a run whose jobs were all there at the start is over
    #: before most of its kills.
    produce_over_s: float = 0.0


@dataclass
class ChaosFigures:
    """What a chaos run saw."""

    jobs: int
    lost: int
    dead_lettered: set[str]
    crash_jobs: set[str]
    failed_innocent: set[str]
    duplicates: int
    in_flight_at_kills: int
    kills: int
    term_kills: int
    crash_deaths: int
    committed: dict[int, int | None]
    ends: dict[int, int]
    seconds: float
    #: Kills that landed before 90 % of the jobs were answered (under load).
    kills_under_load: int = 0

    def line(self) -> str:
        return (
            f"chaos: jobs={self.jobs} lost={self.lost} dead_lettered={len(self.dead_lettered)} "
            f"(crash-token {len(self.dead_lettered & self.crash_jobs)} of "
            f"{len(self.crash_jobs)}, others {len(self.dead_lettered - self.crash_jobs)}) "
            f"failed_innocent={len(self.failed_innocent)} duplicates={self.duplicates} "
            f"in_flight_at_kills={self.in_flight_at_kills} sigkills={self.kills} "
            f"sigterm_then_sigkill={self.term_kills} crash_deaths={self.crash_deaths} "
            f"kills_before_90%_answered={self.kills_under_load} "
            f"committed_at_end={self.committed == self.ends} committed={self.committed} "
            f"seconds={self.seconds:.1f}"
        )


class Chaos(ProcessRun[ChaosPlan]):
    """Runs a `ChaosPlan` on a broker: `spawn(topics, **flags)` starts `python -m worker serve`
    (a `WorkerProcess`).

    Kills land at random moments spread over the run (once a random share of the jobs is
    answered), on a worker that serves normally: one that is running the suspects of an
    earlier death one at a time is spared, as a death then blames the suspect that runs (which
    the breaker cannot tell from the suspect killing the process; see the README).
    """

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        spawn: Spawn,
        plan: ChaosPlan,
        log: Callable[[str], None] = print,
    ) -> None:
        super().__init__(bootstrap, topics, spawn, plan, log)
        self._rng = random.Random(plan.seed)
        self._slots = [str(slot) for slot in range(plan.workers)]
        self._ours: set[str] = set()  # slots whose current exit the harness caused
        self.crash_deaths = 0
        self.in_flight_at_kills = 0
        self.kills = self.term_kills = 0
        #: Jobs answered at each kill: how the kills spread over the run.
        self.answered_at_kills: list[int] = []
        self._sampled = ""  # what the victim's metrics said when it was chosen

    def _jobs(self) -> list[Job]:
        plan = self.plan
        jobs = hello_jobs(
            plan.jobs - plan.crash_jobs,
            lambda i: plan.long_tokens if i % plan.long_every == 7 else 2 + i % 5,
        )
        prefix = uuid.uuid4().hex[:6]
        for k in range(plan.crash_jobs):
            killer = Job(job_id=f"{prefix}-killer-{k}", prompt_token_ids=[1, plan.crash_token, 2])
            jobs.insert(self._rng.randrange(len(jobs) // 10, len(jobs)), killer)
        return jobs

    def _start(self, slot: str) -> None:
        plan = self.plan
        self._start_worker(
            slot,
            max_in_flight=plan.max_in_flight,
            mock_per_token_latency_ms=plan.per_token_ms,
            mock_crash_token_id=plan.crash_token,
            max_crash_attempts=3,
            revoke_grace_s=2,
        )

    async def _supervise(self) -> None:
        """Restart every worker that exits; count those that died by themselves."""
        while True:
            for slot, worker in list(self.workers.items()):
                if not worker.alive():
                    if slot not in self._ours:
                        self.crash_deaths += 1
                        self._log(f"  worker {slot} died by itself (rc {worker.proc.returncode})")
                    self._ours.discard(slot)
                    worker.stop_now()
                    self._start(slot)
            await asyncio.sleep(0.05)

    async def _victim(self) -> str:
        """A worker serving normally: holding partitions, no suspects (near the end it may be
        idle). What it has started and not committed (what the kill may repeat) is counted."""
        while True:
            slots = list(self._slots)
            self._rng.shuffle(slots)
            for slot in slots:
                sampled = await self._sample(slot)
                if sampled is None:
                    continue
                worker, metrics = sampled
                if (
                    metrics.get("vkw_assigned_partitions", 0) > 0
                    and metrics.get("vkw_crash_suspects", 1) == 0
                    and self.workers[slot] is worker
                ):
                    self.in_flight_at_kills += int(metrics.get("vkw_jobs_uncommitted", 0))
                    self._sampled = (
                        f"pid {worker.pid}, "
                        f"{metrics.get('vkw_assigned_partitions')} partitions, "
                        f"{metrics.get('vkw_crash_suspects')} suspects"
                    )
                    return slot
            await asyncio.sleep(0.1)

    async def _kill(self, kind: str, seen: AnswersSeen) -> None:
        slot = await self._victim()
        worker = self.workers[slot]
        self._ours.add(slot)
        if kind == "kill":
            self.kills += 1
            worker.signal(signal.SIGKILL)
        else:
            self.term_kills += 1
            worker.signal(signal.SIGTERM)
            with contextlib.suppress(AssertionError):
                await worker.wait(self.plan.term_kill_after_s)
            if worker.alive():
                worker.signal(signal.SIGKILL)
        self.answered_at_kills.append(len(seen.answered()))
        self._log(
            f"  {time.strftime('%H:%M:%S')} {kind} {self.kills + self.term_kills} of worker "
            f"{slot} ({self._sampled}) at {len(seen.answered())} answered"
        )
        await wait_for(lambda: not worker.alive(), 30, "the kill")

    async def run(self) -> ChaosFigures:
        """Produce, serve under the kills, and return what happened once every job is answered
        and every partition committed to its end."""
        plan, bs, topics = self.plan, self._bootstrap, self._topics
        t0 = time.monotonic()
        jobs = self._jobs()
        job_ids = {j.job_id for j in jobs}
        crash_ids = {j.job_id for j in jobs if "-killer-" in j.job_id}
        ends = partition_ends(plan.jobs, plan.partitions)
        producing = asyncio.create_task(self._produce(jobs))
        if not plan.produce_over_s:
            await producing
        kinds = ["kill"] * plan.kills + ["term"] * plan.term_kills
        self._rng.shuffle(kinds)
        low, high = plan.jobs // 20, plan.jobs * 9 // 10
        thresholds = sorted(self._rng.randrange(low, high) for _ in kinds)
        async with self._answers_seen() as seen:
            for slot in self._slots:
                self._start(slot)
            supervisor = asyncio.create_task(self._supervise())
            try:
                for kind, threshold in zip(kinds, thresholds, strict=True):
                    await until_answered(seen, threshold, plan.timeout_s)
                    await self._kill(kind, seen)
                await until_all_answered(seen, job_ids, plan.timeout_s)
                await self._committed_to_ends(ends)
            finally:
                supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await supervisor
                await producing
                await self._stop_all(30)
            final = await committed(bs, topics.group, topics.jobs)
            await wait_for(lambda: seen.dead_lettered >= crash_ids, 30, "the dead-letter copies")
            history = seen.history(job_ids)
            failed = seen.failed()
        return ChaosFigures(
            jobs=len(jobs),
            lost=len(history.lost),
            dead_lettered=set(seen.dead_lettered),
            crash_jobs=crash_ids,
            failed_innocent=failed - crash_ids,
            duplicates=history.duplicates,
            in_flight_at_kills=self.in_flight_at_kills,
            kills=self.kills,
            term_kills=self.term_kills,
            crash_deaths=self.crash_deaths,
            committed=final,
            ends=ends,
            seconds=time.monotonic() - t0,
            kills_under_load=sum(a < plan.jobs * 9 // 10 for a in self.answered_at_kills),
        )

    async def _produce(self, jobs: list[Job]) -> None:
        """Produce the jobs, job i to partition i % partitions: all at once, or in 20 even
        parts over `produce_over_s` (each part a multiple of the partitions, so the mapping
        holds across parts)."""
        plan, records = self.plan, [job_record(j) for j in jobs]
        if not plan.produce_over_s:
            await produce_spread(self._bootstrap, self._topics.jobs, records, plan.partitions)
            return
        part = max(plan.partitions, len(records) // 20 // plan.partitions * plan.partitions)
        pause_s = plan.produce_over_s / max(len(records) // part, 1)
        for start in range(0, len(records), part):
            if start:
                await asyncio.sleep(pause_s)
            chunk = records[start : start + part]
            await produce_spread(self._bootstrap, self._topics.jobs, chunk, plan.partitions)
