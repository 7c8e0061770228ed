"""A local broker restarted or killed keeps what it committed and serves again on its port."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition

from worker.dev.broker import LocalBroker, wait_until_ready

pytestmark = pytest.mark.broker

# The `new_topic` fixture (tests/conftest.py: TopicFactory).
NewTopic = Callable[..., Awaitable[str]]

_RECORD_WAIT_S = 10.0


async def _next_record(consumer: AIOKafkaConsumer) -> ConsumerRecord:
    # A bounded wait turns a broker that serves nothing into a quick failure, not a suite timeout.
    record: ConsumerRecord = await asyncio.wait_for(consumer.getone(), _RECORD_WAIT_S)
    return record


@pytest.mark.chaos
async def test_local_broker_restart_keeps_committed_offset(
    restartable_broker: LocalBroker, new_topic: NewTopic
) -> None:
    servers = restartable_broker.bootstrap_servers
    topic = await new_topic(bootstrap_servers=servers)
    tp = TopicPartition(topic, 0)
    group_id = f"group-{uuid.uuid4().hex}"
    async with AIOKafkaProducer(bootstrap_servers=servers) as producer:
        for index in range(5):
            await producer.send_and_wait(topic, f"r{index}".encode(), partition=0)

    async with AIOKafkaConsumer(
        topic,
        bootstrap_servers=servers,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    ) as consumer:
        first = [await _next_record(consumer) for _ in range(3)]
        assert [record.value for record in first] == [b"r0", b"r1", b"r2"]
        await consumer.commit({tp: first[-1].offset + 1})
        assert await consumer.committed(tp) == 3

    pid = restartable_broker.pid
    await asyncio.to_thread(restartable_broker.restart)
    assert restartable_broker.bootstrap_servers == servers
    assert restartable_broker.pid == pid  # noida-db restarts the service inside its process

    async with AIOKafkaConsumer(
        topic,
        bootstrap_servers=servers,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    ) as consumer:
        resumed = await _next_record(consumer)
        assert await consumer.committed(tp) == 3
    assert (resumed.offset, resumed.value) == (3, b"r3")


@pytest.mark.chaos
async def test_local_broker_kill_stops_serving_and_start_brings_it_back_on_same_port(
    restartable_broker: LocalBroker,
) -> None:
    servers = restartable_broker.bootstrap_servers
    killed_pid = restartable_broker.pid

    await asyncio.to_thread(restartable_broker.kill)
    assert restartable_broker.pid is None
    with pytest.raises(TimeoutError):
        await wait_until_ready(servers, timeout_s=0.5)

    await asyncio.to_thread(restartable_broker.start)
    assert restartable_broker.bootstrap_servers == servers
    assert restartable_broker.pid not in (None, killed_pid)
    await wait_until_ready(servers, timeout_s=5.0)
