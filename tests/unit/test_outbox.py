"""The outbox: records of a loop turn go to the producer as one batch per partition."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, UnknownTopicOrPartitionError
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.producer.message_accumulator import BatchBuilder

from tests.fakes import BatchProducer
from worker.delivery.outbox import Outbox


class Recorder:
    def __init__(self) -> None:
        self.batches: list[tuple[list[str], asyncio.Future[Any]]] = []
        self.crashes: list[BaseException] = []

    def submitted(self, members: list[str], delivery: asyncio.Future[Any]) -> None:
        self.batches.append((members, delivery))

    def crashed(self, exc: BaseException) -> None:
        self.crashes.append(exc)


@pytest.fixture
async def recorder() -> Recorder:
    return Recorder()


async def started(producer: BatchProducer, recorder: Recorder) -> Outbox[str]:
    outbox: Outbox[str] = Outbox(producer, recorder.submitted, recorder.crashed)
    outbox.start()
    return outbox


async def test_records_of_one_turn_become_one_batch_per_partition(recorder: Recorder) -> None:
    producer = BatchProducer({"results": 3, "dlq": 1})
    outbox = await started(producer, recorder)
    keys = [f"job-{i}".encode() for i in range(30)]
    for key in keys:
        outbox.add("results", key, b"value", [], key.decode())
    outbox.add("dlq", None, b"bad record", [("vkw.error.code", b"invalid_job")], "bad")
    await outbox.flush()

    expected: dict[tuple[str, int], list[str]] = {}
    for key in keys:
        partition = DefaultPartitioner()(key, [0, 1, 2], [0, 1, 2])
        expected.setdefault(("results", partition), []).append(key.decode())
    expected[("dlq", 0)] = ["bad"]
    assert len(expected) == 4  # the keys spread over all three partitions
    got: dict[tuple[str, int], list[str]] = {}
    for (topic, partition, count, _), (members, _) in zip(
        producer.submitted, recorder.batches, strict=True
    ):
        assert count == len(members)  # one member per record in the batch
        assert (topic, partition) not in got
        got[(topic, partition)] = members
    assert got == expected
    await outbox.close()


async def test_a_full_batch_is_submitted_and_the_next_one_started(recorder: Recorder) -> None:
    producer = BatchProducer({"results": 1}, batch_bytes=3000)
    outbox = await started(producer, recorder)
    for i in range(5):
        outbox.add("results", f"k{i}".encode(), b"x" * 1000, [], f"k{i}")
    await outbox.flush()
    assert [members for members, _ in recorder.batches] == [["k0", "k1"], ["k2", "k3"], ["k4"]]
    assert [count for _, _, count, _ in producer.submitted] == [2, 2, 1]
    await outbox.close()


async def test_a_record_larger_than_a_batch_gets_a_batch_of_its_own(recorder: Recorder) -> None:
    producer = BatchProducer({"results": 1}, batch_bytes=1000)
    outbox = await started(producer, recorder)
    outbox.add("results", b"small", b"x", [], "small")
    outbox.add("results", b"big", b"x" * 5000, [], "big")
    await outbox.flush()
    assert [members for members, _ in recorder.batches] == [["small"], ["big"]]
    await outbox.close()


async def test_the_delivery_future_is_the_producers(recorder: Recorder) -> None:
    producer = BatchProducer({"results": 1})
    outbox = await started(producer, recorder)
    outbox.add("results", b"a", b"x", [], "a")
    await outbox.flush()
    ((_, _, _, delivery),), ((_, handed),) = producer.submitted, recorder.batches
    assert handed is delivery
    await outbox.close()


@pytest.mark.parametrize(
    ("partitions", "refusal", "error"),
    [
        ({"results": 1}, KafkaTimeoutError(), KafkaTimeoutError),
        ({}, None, UnknownTopicOrPartitionError),
        ({"results": 0}, None, UnknownTopicOrPartitionError),
    ],
    ids=["no-room-in-time", "unknown-topic", "no-partitions"],
)
async def test_a_batch_the_producer_refuses_fails_its_members(
    recorder: Recorder,
    partitions: dict[str, int],
    refusal: BaseException | None,
    error: type[BaseException],
) -> None:
    producer = BatchProducer(partitions)
    producer.refuse = refusal
    outbox = await started(producer, recorder)
    outbox.add("results", b"a", b"x", [], "a")
    outbox.add("results", b"b", b"x", [], "b")
    await outbox.flush()
    ((members, delivery),) = recorder.batches
    assert members == ["a", "b"]
    assert isinstance(delivery.exception(), error)
    # The outbox goes on: later records are submitted.
    producer.partitions, producer.refuse = {"results": 1}, None
    outbox.add("results", b"c", b"x", [], "c")
    await outbox.flush()
    assert recorder.batches[-1][0] == ["c"]
    assert recorder.crashes == []
    await outbox.close()


async def test_an_unexpected_error_is_reported_not_swallowed(recorder: Recorder) -> None:
    producer = BatchProducer({"results": 1})
    producer.refuse = RuntimeError("bug")
    outbox = await started(producer, recorder)
    outbox.add("results", b"a", b"x", [], "a")
    for _ in range(5):
        await asyncio.sleep(0)
    assert [str(exc) for exc in recorder.crashes] == ["bug"]
    await outbox.close()


async def test_flush_waits_for_a_submission_held_by_the_producer(recorder: Recorder) -> None:
    producer = BatchProducer({"results": 1})
    release = asyncio.Event()
    submitting = asyncio.Event()
    inner = producer.send_batch

    async def held(batch: BatchBuilder, topic: str, *, partition: int) -> Any:
        submitting.set()
        await release.wait()  # aiokafka waits so while it still holds the partition's last batch
        return await inner(batch, topic, partition=partition)

    producer.send_batch = held  # type: ignore[method-assign]
    outbox = await started(producer, recorder)
    outbox.add("results", b"a", b"x", [], "a")
    flushed = asyncio.create_task(outbox.flush())
    await asyncio.wait_for(submitting.wait(), 5)
    assert not flushed.done()
    assert outbox.pending == 1  # taken by the submitting task, not yet submitted
    outbox.add("results", b"b", b"x", [], "b")  # arrives meanwhile: goes in the next batch
    assert outbox.pending == 2
    release.set()
    await asyncio.wait_for(flushed, 5)
    assert outbox.pending == 0
    assert [members for members, _ in recorder.batches] == [["a"], ["b"]]
    await outbox.close()


async def test_close_reports_what_was_never_submitted(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    producer = BatchProducer({"results": 1})
    outbox: Outbox[str] = Outbox(producer, recorder.submitted, recorder.crashed)
    # Never started: nothing submits.
    outbox.add("results", b"a", b"x", [], "a")
    await outbox.close()
    assert recorder.batches == []
    assert "1 answers were never handed to the producer" in caplog.text


class _SlowMetadata(BatchProducer):
    """The producer's metadata for "reply" comes only once `known` is set, or fails."""

    def __init__(self) -> None:
        super().__init__({"results": 1, "reply": 1})
        self.known = asyncio.Event()
        self.gone = False

    async def partitions_for(self, topic: str) -> set[int]:
        if topic == "reply":
            await self.known.wait()
            if self.gone:
                raise UnknownTopicOrPartitionError()
        return await super().partitions_for(topic)


async def _aside(recorder: Recorder) -> tuple[_SlowMetadata, Outbox[str]]:
    """An outbox whose "reply" record waits aside for its metadata, behind which a "results"
    record went out."""
    producer = _SlowMetadata()
    outbox: Outbox[str] = Outbox(
        producer, recorder.submitted, recorder.crashed, metadata_wait_s=lambda _: 0.05
    )
    outbox.start()
    outbox.add("reply", None, b"answer", [], "to-reply")
    await asyncio.sleep(0.1)
    outbox.add("results", None, b"answer", [], "to-results")
    await asyncio.sleep(0.01)
    assert [members for members, _ in recorder.batches] == [["to-results"]]
    assert outbox.pending == 1
    return producer, outbox


async def test_a_record_set_aside_for_its_topics_metadata_goes_out_once_it_comes(
    recorder: Recorder,
) -> None:
    producer, outbox = await _aside(recorder)
    outbox.add("reply", None, b"later", [], "to-reply-later")
    producer.known.set()
    await outbox.flush()
    assert [members for members, _ in recorder.batches][1:] == [["to-reply", "to-reply-later"]]
    assert outbox.pending == 0
    await outbox.close()


async def test_a_record_set_aside_fails_with_its_topics_metadata(recorder: Recorder) -> None:
    producer, outbox = await _aside(recorder)
    producer.gone = True
    producer.known.set()
    await outbox.flush()
    members, delivery = recorder.batches[1]
    assert members == ["to-reply"]
    assert isinstance(delivery.exception(), UnknownTopicOrPartitionError)
    assert outbox.pending == 0
    await outbox.close()


async def test_a_record_set_aside_can_be_taken_back(recorder: Recorder) -> None:
    producer, outbox = await _aside(recorder)
    taken = outbox.drop(lambda member: member == "to-reply")
    assert [record[4] for record in taken] == ["to-reply"]
    assert outbox.pending == 0
    producer.known.set()
    await outbox.flush()
    assert [members for members, _ in recorder.batches] == [["to-results"]]
    await outbox.close()
