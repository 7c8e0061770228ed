"""Answers on their way to the broker, handed to the producer a record batch at a time.

aiokafka's `send()` does per record what a batch needs once: a metadata wait, a partitioner
call, a future and, on acknowledgement, a `RecordMetadata` and a callback. Here it cost ~30 us a
record, most of what a job costs when the engine is fast. The outbox collects the records of a
loop turn, appends them to batches it builds itself (`create_batch`, `send_batch`: aiokafka's
public batch API) and gets one delivery future per batch.

Records are partitioned as `send()` partitions them (aiokafka's default partitioner, the Java
client's murmur2 of the key), so a record lands where it would have landed before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, UnknownTopicOrPartitionError
from aiokafka.partitioner import DefaultPartitioner

__all__ = ["Outbox"]

logger = logging.getLogger(__name__)

M = TypeVar("M")

Headers = list[tuple[str, bytes]]


class Outbox(Generic[M]):
    """Collects records, each with a member `M` that says whose it is, and submits them in
    batches. For each submitted batch, `on_submitted(members, delivery)` is called with the
    batch's members and the future of its acknowledgement (failed with the error when the batch
    could not be submitted at all).

    One task submits; while aiokafka still holds an unsent batch for a partition, submitting the
    next one waits, and what arrives meanwhile goes into the batch after it. That is the same
    back-pressure `send()` applies.
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        on_submitted: Callable[[list[M], asyncio.Future[Any]], None],
        on_crash: Callable[[BaseException], None],
    ) -> None:
        self._producer = producer
        self._on_submitted = on_submitted
        self._on_crash = on_crash
        self._queued: list[tuple[str, bytes | None, bytes | None, Headers, M]] = []
        self._pending = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._partitioner = DefaultPartitioner()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="outbox")
        self._task.add_done_callback(self._task_done)

    async def close(self) -> None:
        """Stop submitting. Records still queued are dropped: their offsets stay unanswered."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._pending:
            logger.warning("%d answers were never handed to the producer", self._pending)

    def add(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Headers, member: M
    ) -> None:
        """Queue one record; it is submitted within the next turns of the event loop."""
        queued = self._queued
        queued.append((topic, key, value, headers, member))
        self._pending += 1
        if len(queued) == 1:
            # The first since the task took the last lot: wake it. Later ones it finds itself
            # (it takes what is queued until nothing is), so they cost no event calls.
            self._idle.clear()
            self._wake.set()

    def drop(self, whose: Callable[[M], bool]) -> int:
        """Take back the queued records whose member `whose` picks, before they are handed to
        the producer; how many. Records already taken into batches are not taken back."""
        kept = [record for record in self._queued if not whose(record[4])]
        dropped = len(self._queued) - len(kept)
        self._queued = kept
        self._pending -= dropped
        return dropped

    async def flush(self) -> None:
        """Wait until everything queued so far has been submitted (not acknowledged)."""
        await self._idle.wait()

    @property
    def pending(self) -> int:
        """Records added and not yet submitted: what the outbox holds."""
        return self._pending

    def _task_done(self, task: asyncio.Task[None]) -> None:
        # Anything but a KafkaError is a bug here; the worker must stop rather than go silent.
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._on_crash(exc)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queued:
                records, self._queued = self._queued, []
                await self._submit(records)
            self._idle.set()

    async def _submit(
        self, records: Sequence[tuple[str, bytes | None, bytes | None, Headers, M]]
    ) -> None:
        producer = self._producer
        partitions: dict[str, list[int]] = {}
        open_batches: dict[tuple[str, int], tuple[Any, list[M]]] = {}
        for topic, key, value, headers, member in records:
            all_partitions = partitions.get(topic)
            if all_partitions is None:
                try:
                    all_partitions = sorted(await producer.partitions_for(topic))
                    if not all_partitions:
                        raise UnknownTopicOrPartitionError(f"{topic} has no partitions")
                except KafkaError as exc:
                    # An unknown topic or no metadata: every record for it fails the same way.
                    self._fail([r[4] for r in records if r[0] == topic], exc)
                    all_partitions = []
                partitions[topic] = all_partitions
            if not all_partitions:
                continue  # failed above
            partition = (
                all_partitions[0]
                if len(all_partitions) == 1
                else self._partitioner(key, all_partitions, all_partitions)
            )
            slot = (topic, partition)
            batch = open_batches.get(slot)
            if batch is None:
                batch = open_batches[slot] = (producer.create_batch(), [])
            if batch[0].append(timestamp=None, key=key, value=value, headers=headers) is None:
                # Full: submit it and start the next (a batch always takes its first record).
                await self._send(slot, *open_batches.pop(slot))
                batch = open_batches[slot] = (producer.create_batch(), [])
                batch[0].append(timestamp=None, key=key, value=value, headers=headers)
            batch[1].append(member)
        for slot, (builder, members) in open_batches.items():
            await self._send(slot, builder, members)

    async def _send(self, slot: tuple[str, int], builder: Any, members: list[M]) -> None:
        topic, partition = slot
        builder.close()
        try:
            delivery = await self._producer.send_batch(builder, topic, partition=partition)
        except KafkaError as exc:
            self._fail(members, exc)
            return
        self._handed(members, delivery)

    def _fail(self, members: list[M], exc: BaseException) -> None:
        failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        failed.set_exception(exc)
        self._handed(members, failed)

    def _handed(self, members: list[M], delivery: asyncio.Future[Any]) -> None:
        self._pending -= len(members)
        self._on_submitted(members, delivery)
