"""An idle consumer's fetches on the test broker, paced on the client (`PacedConsumer`)."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from worker.core.paced_consumer import EMPTY_FETCH_FLOOR_S, PacedConsumer

IDLE_S = 1.0


@pytest.mark.broker
async def test_an_idle_consumer_fetches_at_most_once_per_floor_and_still_gets_each_record(
    kafka_bootstrap_servers: str, new_topic: Any
) -> None:
    # aiokafka's fetch routine sends a broker its next request once the last one's task ended
    # (aiokafka/consumer/fetcher.py, Fetcher._fetch_requests_routine and
    # _get_actions_per_node); noida-db answers an empty fetch at once, so unpaced an idle
    # consumer sent thousands a second here.
    topic = await new_topic(2)
    consumer = PacedConsumer(bootstrap_servers=kafka_bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap_servers)
    await producer.start()
    try:
        consumer.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
        await consumer.seek_to_beginning()
        fetcher = consumer._fetcher
        paced = fetcher._proc_fetch_request
        sent: list[int] = []

        async def counted(assignment: Any, node_id: int, request: Any) -> bool:
            sent.append(node_id)
            has_records: bool = await paced(assignment, node_id, request)
            return has_records

        fetcher._proc_fetch_request = counted
        assert await consumer.getmany(timeout_ms=int(IDLE_S * 1000)) == {}
        # One broker, so one request in flight at a time, each empty one held for the floor
        # (Kafka itself would hold each for fetch.max.wait.ms, 500 ms: about two).
        assert 1 <= len(sent) <= IDLE_S / EMPTY_FETCH_FLOOR_S + 2
        await producer.send_and_wait(topic, b"after the idle second", partition=1)
        got = await consumer.getmany(timeout_ms=10_000)
        assert [r.value for records in got.values() for r in records] == [b"after the idle second"]
    finally:
        await producer.stop()
        await consumer.stop()
