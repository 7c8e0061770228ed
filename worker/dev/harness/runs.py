"""A run of worker processes under load: what the chaos and elastic runs share.

Each worker has a name and is a static member under it (`--group-instance-id`), so a process
restarted under the same name takes its partitions back; each serves /metrics on a port of its
own, read from its log.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from schemas import Job, SamplingSpec
from worker.dev.harness.answers import AnswersSeen
from worker.dev.harness.clients import committed
from worker.dev.harness.metrics import SCRAPE_ERRORS, Scraper
from worker.dev.harness.processes import WorkerProcess, stop_all
from worker.dev.harness.topics import Topics
from worker.dev.harness.waiting import wait_for


class Spawn(Protocol):
    """Starts `python -m worker serve` on `topics` with `flags` (a `WorkerProcess`)."""

    def __call__(self, topics: Topics, **flags: Any) -> WorkerProcess: ...


PlanT = TypeVar("PlanT")


def spawner(bootstrap: str, logs: Path, name: str = "worker") -> Spawn:
    """A `Spawn` for a run outside the tests: worker n logs to `logs/name-n.log`, on
    `bootstrap` unless its flags name another (`bootstrap=`)."""
    started = 0

    def spawn(topics: Topics, **flags: Any) -> WorkerProcess:
        nonlocal started
        started += 1
        on = flags.pop("bootstrap", bootstrap)
        return WorkerProcess(on, topics, logs / f"{name}-{started}.log", **flags)

    return spawn


class ProcessRun(Generic[PlanT]):
    """Runs a plan with worker processes, each under a name, on `topics`; `spawn` starts one."""

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        spawn: Spawn,
        plan: PlanT,
        log: Callable[[str], None] = print,
    ) -> None:
        self.plan = plan
        self._bootstrap = bootstrap
        self._topics = topics
        self._spawn = spawn
        self._log = log
        #: The process now serving under each name.
        self.workers: dict[str, WorkerProcess] = {}
        #: Every process started, restarts included, in order.
        self.started: list[WorkerProcess] = []

    def _start_worker(self, name: str, **flags: Any) -> WorkerProcess:
        worker = self._spawn(
            self._topics,
            group_instance_id=f"{self._topics.instance}-{name}",
            metrics_port=0,
            metrics_host="127.0.0.1",
            **flags,
        )
        self.workers[name] = worker
        self.started.append(worker)
        return worker

    async def _sample(self, name: str) -> tuple[WorkerProcess, dict[str, float]] | None:
        """The process now serving under `name` and its metrics, or None while it has no port
        yet, does not answer, or is gone (what answered may then not have been this process)."""
        worker = self.workers[name]
        try:
            port = await worker.metrics_port(timeout_s=0.5)
        except AssertionError:
            return None
        try:
            async with Scraper(port) as scraper:
                metrics = await scraper.sample()
        except SCRAPE_ERRORS:
            return None
        if self.workers[name] is not worker or not worker.alive():
            return None
        return worker, metrics

    async def _in_flight(self) -> int:
        """Jobs started and not committed by every worker that answers: what a scale event or
        a kill now may repeat at most."""
        total = 0
        for name in list(self.workers):
            if (sampled := await self._sample(name)) is not None:
                total += int(sampled[1].get("vkw_jobs_uncommitted", 0))
        return total

    async def _committed_to_ends(self, ends: dict[int, int], timeout_s: float = 60) -> None:
        bootstrap, topics = self._bootstrap, self._topics

        async def at_end() -> bool:
            return await committed(bootstrap, topics.group, topics.jobs) == ends

        await wait_for(at_end, timeout_s, "every partition committed to its end")

    async def _stop_all(self, timeout_s: float) -> None:
        await stop_all(self.workers.values(), timeout_s)

    def _answers_seen(self) -> AnswersSeen:
        return AnswersSeen(self._bootstrap, self._topics.results, self._topics.dlq)


def partition_ends(jobs: int, partitions: int) -> dict[int, int]:
    """Where each partition ends once job i went to partition i % partitions."""
    return {p: len(range(p, jobs, partitions)) for p in range(partitions)}


def hello_jobs(count: int, max_tokens: Callable[[int], int]) -> list[Job]:
    """`count` jobs with ids unique to this run, job i generating `max_tokens(i)` tokens."""
    prefix = uuid.uuid4().hex[:6]
    return [
        Job(
            job_id=f"{prefix}-{i}",
            prompt="hello",
            sampling=SamplingSpec(max_tokens=max_tokens(i)),
        )
        for i in range(count)
    ]


async def until_answered(seen: AnswersSeen, count: int, timeout_s: float) -> None:
    await wait_for(lambda: len(seen.answered()) >= count, timeout_s, f"{count} jobs answered")


async def until_all_answered(seen: AnswersSeen, job_ids: set[str], timeout_s: float) -> None:
    await wait_for(
        lambda: seen.answered() >= job_ids,
        timeout_s,
        lambda: f"every job answered ({len(job_ids - seen.answered())} to go)",
    )
