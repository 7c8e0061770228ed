"""A hand-over that did not land blames nobody while its writer is alive: incarnations announced
to the group, named in the offset maps, and checked by the next owner."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from worker.core.config import Settings, settings_from
from worker.core.incarnation import (
    new_incarnation,
)
from worker.core.kafka import make_consumer
from worker.delivery.commits import GroupOffsetsReader
from worker.dev.harness.waiting import wait_for

TP, TP1 = TopicPartition("jobs", 0), TopicPartition("jobs", 1)


def _settings(**values: Any) -> Settings:
    return settings_from(
        {"jobs_topic": "jobs", "results_topic": "results", "engine": "mock", **values}, {}
    )


async def _joined(consumer: AIOKafkaConsumer) -> bool:
    await consumer.getmany(timeout_ms=200)
    return bool(consumer.assignment())


@pytest.mark.broker
async def test_a_joined_worker_is_found_alive_by_its_incarnation_on_the_broker(
    kafka_bootstrap_servers: str, new_topic: Any
) -> None:
    topic = await new_topic(2)
    settings = _settings(
        bootstrap_servers=kafka_bootstrap_servers,
        jobs_topic=topic,
        group_id=f"g-{uuid.uuid4().hex}",
    )
    incarnation = new_incarnation()
    consumer: AIOKafkaConsumer = make_consumer(settings, incarnation=incarnation)
    reader = GroupOffsetsReader(settings)
    consumer.subscribe([topic])
    await consumer.start()
    try:
        await wait_for(lambda: _joined(consumer), 60, "the consumer to join")
        # Joined, and the group Stable: its members' metadata comes back.
        assert incarnation in (await reader.live_incarnations() or set())
    finally:
        await consumer.stop()
        await reader.close()
