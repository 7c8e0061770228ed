"""Worker processes simulated in memory for the breaker's tests: a process's consumer and
producer that say nothing more once the process is dead, and a `Worker` built on them."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError

from schemas import Job, SamplingSpec, encode
from tests.fakes import FakeConsumer, MemoryProducer, ScriptedEngine
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import Settings, settings_from
from worker.core.limits import RecordLimits
from worker.delivery.commits import CommittedReader
from worker.delivery.offsets import Commit
from worker.loop.worker import Worker

JOBS, RESULTS, DLQ = "jobs", "results", "dlq"


def job(job_id: str, **metadata: str) -> bytes:
    return encode(
        Job(job_id=job_id, prompt="hi", sampling=SamplingSpec(max_tokens=2), metadata=metadata)
    )


class Process:
    """A process's consumer and producer: once dead, nothing it commits or sends lands."""

    def __init__(self, committed: dict[TopicPartition, Commit]) -> None:
        self.committed = committed
        self.dead = False
        process = self

        class Consumer(FakeConsumer):
            async def commit(self, offsets: dict[TopicPartition, Commit]) -> None:
                if process.dead:
                    raise KafkaConnectionError("the process is gone")
                await super().commit(offsets)
                process.committed.update(offsets)

        class Producer(MemoryProducer):
            def _deliver(self, delivery: Any, records: Any) -> None:
                if not process.dead:
                    super()._deliver(delivery, records)

        self.consumer = Consumer()
        self.producer = Producer({RESULTS: 1, DLQ: 1})


def process_settings(**overrides: Any) -> Settings:
    """Quick polls and commits, and short waits: a dead process's stop takes no time."""
    values: dict[str, Any] = {
        "jobs_topic": JOBS,
        "results_topic": RESULTS,
        "dead_letter_topic": DLQ,
        "engine": "mock",
        "commit_interval_ms": 0,
        "poll_timeout_ms": 20,
        "shutdown_grace_s": 0.05,
        "close_timeout_s": 0.5,
        "commit_timeout_s": 0.5,
        "revoke_grace_s": 0.1,
        **overrides,
    }
    return settings_from(values, {})


def worker_on(
    process: Process,
    engine: ScriptedEngine,
    settings: Settings,
    read_committed: CommittedReader | None = None,
) -> Worker:
    return Worker(
        settings,
        consumer=process.consumer,
        producer=process.producer,
        engine=engine,
        limits=RecordLimits.from_topic_limits(settings, {}),
        read_committed=read_committed,
        clock=SYSTEM_CLOCK,
    )


def run(worker: Worker) -> asyncio.Task[int]:
    return asyncio.create_task(worker.run())
