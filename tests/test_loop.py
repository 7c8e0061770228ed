"""The consume loop against an in-memory consumer and producer: flow control, commits, rebalance."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import TopicPartition

from schemas import Job, SamplingSpec, decode_result, encode
from tests.fakes import FakeConsumer, MemoryProducer, ScriptedEngine
from tests.kafka_helpers import wait_for
from worker.config import Settings, settings_from
from worker.limits import RecordLimits
from worker.service import Worker

JOBS, RESULTS, DLQ = "jobs", "results", "dlq"
P0, P1 = TopicPartition(JOBS, 0), TopicPartition(JOBS, 1)


@dataclass
class Loop:
    worker: Worker
    consumer: FakeConsumer
    producer: MemoryProducer
    engine: ScriptedEngine
    task: asyncio.Task[int]

    def answered(self) -> list[str]:
        return [
            decode_result(value).job_id or ""
            for topic, _, value, _ in self.producer.sent
            if topic == RESULTS and value is not None
        ]


def settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "jobs_topic": JOBS,
        "results_topic": RESULTS,
        "dead_letter_topic": DLQ,
        "engine": "mock",
        "commit_interval_ms": 0,
        "poll_timeout_ms": 20,
        "shutdown_grace_s": 2,
    }
    values.update(overrides)
    return settings_from(values, {})


@pytest.fixture
async def start_loop() -> AsyncIterator[Callable[..., Any]]:
    loops: list[Loop] = []

    async def start(consumer: FakeConsumer, engine: ScriptedEngine, **overrides: Any) -> Loop:
        s = settings(**overrides)
        producer = MemoryProducer({RESULTS: 1, DLQ: 1})
        worker = Worker(
            s,
            consumer=consumer,
            producer=producer,
            engine=engine,
            limits=RecordLimits.from_topic_limits(s, {}),
        )
        loop = Loop(worker, consumer, producer, engine, asyncio.create_task(worker.run()))
        loops.append(loop)
        return loop

    yield start
    for loop in loops:
        loop.worker.request_stop()
        if loop.consumer.commit_gate is not None:
            loop.consumer.commit_gate.set()
        await asyncio.wait_for(loop.task, 10)


def job(job_id: str, **metadata: str) -> bytes:
    return encode(
        Job(job_id=job_id, prompt="hi", sampling=SamplingSpec(max_tokens=2), metadata=metadata)
    )


async def test_partitions_assigned_at_the_cap_stay_paused_and_lose_no_record(start_loop):
    consumer = FakeConsumer()
    consumer.add(P0, job("a", gate="g"))
    consumer.add(P0, job("b", gate="g"))
    for i in range(3):
        consumer.add(P1, job(f"p1-{i}"))
    consumer.assign({P0})
    engine = ScriptedEngine()
    loop = await start_loop(consumer, engine, max_in_flight=2)
    await wait_for(lambda: len(engine.started) == 2, what="the cap to fill")
    consumer.assign({P0, P1})  # a rebalance while full: aiokafka starts P1 unpaused
    await wait_for(lambda: P1 in consumer.assignment(), what="the new assignment")
    await asyncio.sleep(0.2)  # several polls at the cap
    assert engine.started == ["a", "b"], "a partition assigned at the cap must stay paused"
    assert {P0, P1} <= consumer.paused()
    engine.release("g")
    await wait_for(lambda: len(loop.answered()) == 5, what="every job answered")
    assert sorted(loop.answered()) == ["a", "b", "p1-0", "p1-1", "p1-2"]
    await wait_for(
        lambda: consumer.commits and consumer.commits[-1].get(P1) == 3, what="P1 committed"
    )


async def test_a_slow_commit_does_not_hold_up_fetching(start_loop):
    consumer = FakeConsumer()
    consumer.commit_gate = asyncio.Event()  # the coordinator does not answer
    consumer.add(P0, job("first"))
    consumer.assign({P0})
    loop = await start_loop(consumer, ScriptedEngine(), commit_timeout_s=30)
    await wait_for(lambda: consumer.commits_started >= 1, what="a commit to start")
    consumer.add(P0, job("second"))
    await wait_for(lambda: "second" in loop.answered(), what="a job fetched while committing")
    assert consumer.commits == []  # still blocked
    consumer.commit_gate.set()
    await wait_for(
        lambda: consumer.commits and consumer.commits[-1] == {P0: 2}, what="the commit of both"
    )


async def test_a_job_task_that_dies_of_a_bug_stops_the_worker_uncommitted(start_loop, monkeypatch):
    consumer = FakeConsumer()
    consumer.add(P0, job("doomed"))
    consumer.assign({P0})
    loop = await start_loop(consumer, ScriptedEngine())

    def broken_queue(ticket: Any) -> bool:
        raise RuntimeError("a bug in delivery")

    monkeypatch.setattr(loop.worker._delivery, "queue", broken_queue)
    assert await asyncio.wait_for(loop.task, 10) == 1
    assert all(commit.get(P0, 0) == 0 for commit in consumer.commits)
