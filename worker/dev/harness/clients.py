"""Small Kafka clients for tests and benchmarks: produce records, collect them, read committed
offsets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from schemas import Completed, Failed, Job, ResultAssembler, decode_result, encode
from worker.core.clients import AIOKAFKA
from worker.dev.harness.topics import Topics

Record = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]


def job_record(job: Job, key: bytes | None = b"") -> Record:
    """A job as a record, keyed as producers key it (`Job.record_key`) unless `key` says."""
    return (job.record_key if key == b"" else key, encode(job), [])


async def produce(
    bootstrap: str, topic: str, records: Iterable[Record], partition: int | None = None
) -> None:
    await _send(bootstrap, topic, records, lambda _: partition)


async def produce_spread(
    bootstrap: str, topic: str, records: Iterable[Record], partitions: int
) -> None:
    """Produce record i to partition i % partitions: an exactly even load, whatever the keys."""
    await _send(bootstrap, topic, records, lambda i: i % partitions)


async def _send(
    bootstrap: str,
    topic: str,
    records: Iterable[Record],
    partition_of: Callable[[int], int | None],
) -> None:
    """Send every record (record i to `partition_of(i)`) and wait until each is acknowledged."""
    producer = AIOKAFKA.producer(bootstrap_servers=bootstrap, max_request_size=32 * 1024 * 1024)
    await producer.start()
    try:
        futures = [
            await producer.send(
                topic, value=value, key=key, headers=headers, partition=partition_of(i)
            )
            for i, (key, value, headers) in enumerate(records)
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


@contextlib.asynccontextmanager
async def _from_beginning(bootstrap: str, topic: str) -> AsyncIterator[AIOKafkaConsumer]:
    """A consumer of every partition of `topic`, from the beginning, sized for large records."""
    consumer = AIOKAFKA.consumer(
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_partition_fetch_bytes=64 * 1024 * 1024,
        fetch_max_bytes=128 * 1024 * 1024,
    )
    await consumer.start()
    try:
        partitions = await _partitions(consumer, topic)
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        yield consumer
    finally:
        await consumer.stop()


async def collect(
    bootstrap: str, topic: str, count: int, timeout_s: float = 30.0
) -> list[ConsumerRecord[Any, Any]]:
    """Read `count` records from the beginning of `topic` (fail on timeout with what arrived)."""
    async with _from_beginning(bootstrap, topic) as consumer:
        out: list[ConsumerRecord[Any, Any]] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(out)} of {count} records arrived on {topic}")
            for records in (await consumer.getmany(timeout_ms=200)).values():
                out.extend(records)
        return out


async def results(
    bootstrap: str, topic: str, count: int, timeout_s: float = 30.0
) -> dict[str, Completed | Failed]:
    """Results by job_id (the latest one wins when a job was answered twice)."""
    out: dict[str, Completed | Failed] = {}
    for record in await collect(bootstrap, topic, count, timeout_s):
        result = decode_result(record.value)
        assert result.job_id is not None
        assert record.key == result.job_id.encode()
        out[result.job_id] = result
    return out


async def assembled(
    bootstrap: str, topic: str, jobs: int, timeout_s: float = 60.0
) -> tuple[dict[str, Completed | Failed], list[ConsumerRecord[Any, Any]]]:
    """Read `topic` from the beginning until `ResultAssembler` has yielded `jobs` results; those
    results by job_id (each job once, or the test fails) and every record read."""
    assembler = ResultAssembler()
    whole: dict[str, Completed | Failed] = {}
    seen: list[ConsumerRecord[Any, Any]] = []
    async with _from_beginning(bootstrap, topic) as consumer:
        deadline = time.monotonic() + timeout_s
        while len(whole) < jobs:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"only {len(whole)} of {jobs} results assembled from {len(seen)} records "
                    f"on {topic}; incomplete: {assembler.incomplete()}"
                )
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    seen.append(record)
                    result = assembler.add(decode_result(record.value))
                    if result is not None:
                        assert result.job_id is not None and result.job_id not in whole
                        whole[result.job_id] = result
        return whole, seen


async def committed(bootstrap: str, group: str, topic: str) -> dict[int, int | None]:
    consumer = AIOKAFKA.consumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        partitions = await _partitions(consumer, topic)
        return {tp.partition: await consumer.committed(tp) for tp in partitions}
    finally:
        await consumer.stop()


async def committed_is(bootstrap: str, topics: Topics, expected: dict[int, int]) -> bool:
    """Whether the group's committed positions on the jobs topic are `expected`."""
    return await committed(bootstrap, topics.group, topics.jobs) == expected


async def committed_total_is(bootstrap: str, group: str, topic: str, total: int) -> bool:
    """Whether the committed positions, summed over the topic's partitions, reach `total`."""
    return sum(o or 0 for o in (await committed(bootstrap, group, topic)).values()) == total


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> Sequence[TopicPartition]:
    for _ in range(50):
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return [TopicPartition(topic, p) for p in sorted(parts)]
        await consumer._client.force_metadata_update()
        await asyncio.sleep(0.1)
    raise AssertionError(f"topic {topic} has no partitions")
