"""PartitionGate at the in-flight cap: everything paused, polled only as often as the group needs.

aiokafka drops the records it has fetched for a partition when asked for records while that
partition is paused, and fetches them again after the resume; a poll on every wake at the cap
fetched the same records again and again.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from worker.core.config import settings_from
from worker.core.kafka import FETCHER_FALLBACK_WAKE_MS, make_consumer

P0 = TopicPartition("jobs", 0)
P1 = TopicPartition("jobs", 1)
KEEPALIVE_S = 3.0


@pytest.mark.broker
async def test_a_resumed_partition_is_fetched_at_once_not_at_the_fetchers_fallback_wake(
    kafka_bootstrap_servers: str, new_topic: Any
) -> None:
    # The worker's consumers wake their fetcher task only every FETCHER_FALLBACK_WAKE_MS when
    # nothing happens. That is safe only because aiokafka's fetcher also waits on each paused
    # partition's resume (aiokafka/consumer/fetcher.py, Fetcher._get_actions_per_node and
    # _fetch_requests_routine): a gate that resumes after the cap must not wait for the timeout.
    topic = await new_topic(1)
    settings = settings_from(
        {"bootstrap_servers": kafka_bootstrap_servers, "jobs_topic": topic, "engine": "mock"}, {}
    )
    consumer = make_consumer(settings, group_id=None, group_instance_id=None)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap_servers)
    await consumer.start()
    await producer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        consumer.pause(tp)
        await producer.send_and_wait(topic, b"job", partition=0)
        assert await consumer.getmany(timeout_ms=300) == {}  # all paused: the fetcher waits
        consumer.resume(tp)
        started = time.monotonic()
        batch = await consumer.getmany(timeout_ms=4 * FETCHER_FALLBACK_WAKE_MS)
        waited = time.monotonic() - started
        assert [r.value for r in batch.get(tp, [])] == [b"job"]
        assert waited < FETCHER_FALLBACK_WAKE_MS / 1000 / 2, f"fetched after {waited:.2f}s"
    finally:
        await producer.stop()
        await consumer.stop()
