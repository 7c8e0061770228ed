"""The broker fixtures and dev brokers serve real records, offsets, large records and restarts."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import MessageSizeTooLargeError

from worker.dev.broker import TansuBroker

pytestmark = pytest.mark.broker

# The `new_topic` fixture (tests/conftest.py: TopicFactory).
NewTopic = Callable[..., Awaitable[str]]

_RECORD_WAIT_S = 10.0


async def _next_record(consumer: AIOKafkaConsumer) -> ConsumerRecord:
    # A bounded wait turns a broker that serves nothing into a quick failure, not a suite timeout.
    record: ConsumerRecord = await asyncio.wait_for(consumer.getone(), _RECORD_WAIT_S)
    return record


async def test_record_round_trips_through_shared_broker(
    kafka_bootstrap_servers: str, new_topic: NewTopic
) -> None:
    topic = await new_topic(partitions=2)
    async with AIOKafkaProducer(bootstrap_servers=kafka_bootstrap_servers) as producer:
        sent = await producer.send_and_wait(
            topic, b"payload", key=b"job-1", partition=1, headers=[("kind", b"job")]
        )
    assert (sent.topic, sent.partition, sent.offset) == (topic, 1, 0)

    async with AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap_servers,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    ) as consumer:
        consumer.assign([TopicPartition(topic, 1)])
        record = await _next_record(consumer)
    assert (record.topic, record.partition, record.offset) == (topic, 1, 0)
    assert (record.key, record.value) == (b"job-1", b"payload")
    assert list(record.headers) == [("kind", b"job")]


async def test_topic_max_message_bytes_admits_a_3mb_record(
    kafka_bootstrap_servers: str, new_topic: NewTopic
) -> None:
    record_bytes = 3 * 1024 * 1024
    topic_limit = 4 * 1024 * 1024
    payload = os.urandom(record_bytes)
    big_topic = await new_topic(configs={"max.message.bytes": str(topic_limit)})
    # An explicit 1 MiB limit, not the broker default, so the contrast holds on any broker.
    small_topic = await new_topic(configs={"max.message.bytes": str(1024 * 1024)})

    async with AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap_servers, max_request_size=topic_limit
    ) as producer:
        with pytest.raises(MessageSizeTooLargeError):
            await producer.send_and_wait(small_topic, payload)
        sent = await producer.send_and_wait(big_topic, payload)
    assert (sent.partition, sent.offset) == (0, 0)

    async with AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap_servers,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=topic_limit,
        fetch_max_bytes=2 * topic_limit,
    ) as consumer:
        consumer.assign([TopicPartition(big_topic, 0)])
        record = await _next_record(consumer)
    assert record.offset == 0
    assert len(record.value) == record_bytes
    assert record.value == payload


async def test_tansu_broker_round_trips_a_record_without_idempotence(
    tansu_broker: TansuBroker, new_topic: NewTopic
) -> None:
    servers = tansu_broker.bootstrap_servers
    topic = await new_topic(partitions=1, bootstrap_servers=servers)
    # tansu 0.6.0 rejects aiokafka's InitProducerId, so idempotence (and transactions) stay off.
    async with AIOKafkaProducer(bootstrap_servers=servers, enable_idempotence=False) as producer:
        sent = await producer.send_and_wait(topic, b"on tansu", key=b"job-2")
    assert (sent.partition, sent.offset) == (0, 0)

    async with AIOKafkaConsumer(
        bootstrap_servers=servers, enable_auto_commit=False, auto_offset_reset="earliest"
    ) as consumer:
        consumer.assign([TopicPartition(topic, 0)])
        record = await _next_record(consumer)
    assert (record.offset, record.key, record.value) == (0, b"job-2", b"on tansu")
