"""Chaos: the real `python -m worker serve` process, SIGKILLed and SIGTERMed with jobs in flight.

Crash tests restart the worker with the same `--group-instance-id` (static membership): noida-db
never evicts a SIGKILLed member, and a restarted static member takes its place at once. Every job
must get a `completed` result (lost = 0); a crash may repeat at most the jobs that were answered but
not yet committed, which the in-flight cap bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas import Completed, Job, SamplingSpec, decode_result
from tests.kafka_helpers import committed, job_record, produce, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.broker]

MAX_IN_FLIGHT = 32
_REPO = Path(__file__).resolve().parent.parent


@dataclass
class Topics:
    jobs: str
    results: str
    dlq: str
    group: str = field(default_factory=lambda: f"chaos-{uuid.uuid4().hex[:8]}")
    instance: str = field(default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def topics(new_topic: Any) -> Topics:
    return Topics(jobs=await new_topic(1), results=await new_topic(1), dlq=await new_topic(1))


class WorkerProcess:
    """`python -m worker serve --engine mock ...` in a subprocess, stderr to a file."""

    def __init__(self, bootstrap: str, topics: Topics, log: Path, **flags: Any) -> None:
        args = {
            "bootstrap-servers": bootstrap,
            "jobs-topic": topics.jobs,
            "results-topic": topics.results,
            "dead-letter-topic": topics.dlq,
            "group-id": topics.group,
            "group-instance-id": topics.instance,
            "engine": "mock",
            "max-in-flight": MAX_IN_FLIGHT,
            "commit-interval-ms": 0,
            "poll-timeout-ms": 50,
            "session-timeout-ms": 6000,
            "heartbeat-interval-ms": 500,
            "shutdown-grace-s": 10,
            "mock-per-token-latency-ms": 50,
            "mock-num-layers": 4,
        }
        args.update({k.replace("_", "-"): v for k, v in flags.items()})
        argv = [sys.executable, "-m", "worker", "serve"]
        for name, value in args.items():
            argv += [f"--{name}", str(value)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("VKW_")}
        self.log = log
        self._log_file = log.open("ab")
        self.proc = subprocess.Popen(
            argv, cwd=_REPO, env=env, stdout=self._log_file, stderr=subprocess.STDOUT
        )

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    async def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while (rc := self.proc.poll()) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"worker still running after {timeout_s}s; log {self.log}")
            await asyncio.sleep(0.02)
        self._log_file.close()
        return rc

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop_now(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()


@pytest.fixture
def spawn(kafka_bootstrap_servers: str, tmp_path: Path) -> Iterator[Any]:
    started: list[WorkerProcess] = []

    def start(topics: Topics, **flags: Any) -> WorkerProcess:
        worker = WorkerProcess(
            kafka_bootstrap_servers, topics, tmp_path / f"worker-{len(started)}.log", **flags
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop_now()


class Watcher:
    """Reads the results topic from the beginning in the background, keeping every record."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.records: list[Completed | Any] = []
        self._bootstrap = bootstrap
        self._topic = topic
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Watcher:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        await consumer.start()
        tp = TopicPartition(self._topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        self._task = asyncio.create_task(self._run(consumer))
        return self

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while True:
                for batch in (await consumer.getmany(timeout_ms=100)).values():
                    self.records.extend(decode_result(r.value) for r in batch)
        finally:
            await consumer.stop()

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    @property
    def answered(self) -> set[str]:
        return {r.job_id for r in self.records if isinstance(r, Completed)}

    @property
    def duplicates(self) -> int:
        counts = Counter(r.job_id for r in self.records)
        return sum(n - 1 for n in counts.values())


@contextlib.asynccontextmanager
async def watching(bootstrap: str, topic: str) -> AsyncIterator[Watcher]:
    async with Watcher(bootstrap, topic) as watcher:
        yield watcher


async def _produce_jobs(bootstrap: str, topic: str, count: int, max_tokens: int) -> set[str]:
    prefix = uuid.uuid4().hex[:6]
    jobs = [
        Job(job_id=f"{prefix}-{i}", prompt="hello", sampling=SamplingSpec(max_tokens=max_tokens))
        for i in range(count)
    ]
    await produce(bootstrap, topic, [job_record(j) for j in jobs])
    return {j.job_id for j in jobs}


async def _crash_and_restart(
    bootstrap: str, topics: Topics, spawn: Any, *, kills: int, jobs: int = 300
) -> None:
    t0 = time.monotonic()
    job_ids = await _produce_jobs(bootstrap, topics.jobs, jobs, max_tokens=4)
    async with watching(bootstrap, topics.results) as watch:
        worker = spawn(topics)
        for kill in range(1, kills + 1):
            # Kill once a share of the work is answered: the cap's worth of jobs is in flight then.
            threshold = jobs * kill // (kills + 1)
            await wait_for(lambda t=threshold: len(watch.answered) >= t, 30, f"{threshold} results")
            answered_before = len(watch.answered)
            worker.signal(signal.SIGKILL)
            assert await worker.wait(10) == -signal.SIGKILL
            assert answered_before < jobs, "the kill came after every job was answered"
            worker = spawn(topics)  # same --group-instance-id: takes the dead member's place
        await wait_for(lambda: watch.answered >= job_ids, 60, "every job answered")
        await wait_for(lambda: _committed_is(bootstrap, topics, jobs), 20, "commit of every job")
        worker.signal(signal.SIGTERM)
        assert await worker.wait(15) == 0
        seconds = time.monotonic() - t0
        lost = len(job_ids - watch.answered)
        print(
            f"\ncrash x{kills}: jobs={jobs} answered={len(watch.answered & job_ids)} lost={lost} "
            f"duplicates={watch.duplicates} records={len(watch.records)} seconds={seconds:.1f}"
        )
        assert lost == 0
        assert all(isinstance(r, Completed) for r in watch.records)
        assert watch.duplicates <= kills * MAX_IN_FLIGHT


async def _committed_is(bootstrap: str, topics: Topics, offset: int) -> bool:
    return await committed(bootstrap, topics.group, topics.jobs) == {0: offset}


async def test_sigkill_then_restart_loses_nothing(kafka_bootstrap_servers, topics, spawn):
    await _crash_and_restart(kafka_bootstrap_servers, topics, spawn, kills=1)


async def test_two_sigkills_lose_nothing(kafka_bootstrap_servers, topics, spawn):
    await _crash_and_restart(kafka_bootstrap_servers, topics, spawn, kills=2)


async def test_sigterm_drains_in_flight_jobs_within_grace(kafka_bootstrap_servers, topics, spawn):
    bs = kafka_bootstrap_servers
    jobs = 120
    job_ids = await _produce_jobs(bs, topics.jobs, jobs, max_tokens=4)
    grace = 10.0
    async with watching(bs, topics.results) as watch:
        # 4 tokens x 100 ms: each job runs 0.4 s, 16 at a time.
        worker = spawn(
            topics, max_in_flight=16, mock_per_token_latency_ms=100, shutdown_grace_s=grace
        )
        await wait_for(lambda: len(watch.answered) >= 16, 30, "first results")
        t0 = time.monotonic()
        worker.signal(signal.SIGTERM)
        assert await worker.wait(grace) == 0
        drain_s = time.monotonic() - t0
        log = worker.text()
        assert "draining" in log
        assert "cancelled" not in log  # every started job finished inside the grace
        first_run = set(watch.answered)
        # Everything answered is committed, and nothing past it.
        await wait_for(
            lambda: _committed_is(bs, topics, len(first_run)), 10, "commit of the drained jobs"
        )
        assert len(first_run) < jobs
        worker = spawn(topics, max_in_flight=16, mock_per_token_latency_ms=0)
        await wait_for(lambda: watch.answered >= job_ids, 30, "the rest after the restart")
        worker.signal(signal.SIGTERM)
        assert await worker.wait(15) == 0
        print(
            f"\ndrain: jobs={jobs} answered-before-restart={len(first_run)} drain_s={drain_s:.2f} "
            f"lost={len(job_ids - watch.answered)} duplicates={watch.duplicates}"
        )
        assert watch.duplicates == 0
        assert len(watch.records) == jobs


async def test_sigterm_with_short_grace_leaves_the_rest_to_the_next_worker(
    kafka_bootstrap_servers, topics, spawn
):
    bs = kafka_bootstrap_servers
    jobs = 60
    job_ids = await _produce_jobs(bs, topics.jobs, jobs, max_tokens=4)
    async with watching(bs, topics.results) as watch:
        # 4 tokens x 250 ms: each job needs 1 s; a 0.2 s grace cannot finish the ones in flight.
        worker = spawn(
            topics, max_in_flight=16, mock_per_token_latency_ms=250, shutdown_grace_s=0.2
        )
        await wait_for(lambda: len(watch.answered) >= 1, 30, "first results")
        t0 = time.monotonic()
        worker.signal(signal.SIGTERM)
        assert await worker.wait(10) == 0
        stop_s = time.monotonic() - t0
        assert "cancelled" in worker.text()  # some jobs were unfinished
        first_run = set(watch.answered)
        assert len(first_run) < jobs
        worker = spawn(topics, max_in_flight=16, mock_per_token_latency_ms=0)
        await wait_for(lambda: watch.answered >= job_ids, 30, "redelivered jobs answered")
        worker.signal(signal.SIGTERM)
        assert await worker.wait(15) == 0
        lost = len(job_ids - watch.answered)
        print(
            f"\nshort grace: jobs={jobs} answered-before-stop={len(first_run)} "
            f"stop_s={stop_s:.2f} lost={lost} duplicates={watch.duplicates}"
        )
        assert lost == 0
        assert watch.duplicates == 0
