"""Answers on their way to the broker, handed to the producer a record batch at a time.

aiokafka's `send()` does per record what a batch needs once: a metadata wait, a partitioner
call, a future and, on acknowledgement, a `RecordMetadata` and a callback. Here it cost ~30 us a
record, most of what a job costs when the engine is fast. The outbox collects the records of a
loop turn, appends them to batches it builds itself (`create_batch`, `send_batch`: aiokafka's
public batch API) and gets one delivery future per batch.

Records are partitioned as `send()` partitions them (aiokafka's default partitioner, the Java
client's murmur2 of the key), so a record lands where it would have landed before.

A batch is sized for its topic: the producer's `max_batch_size` fits the results and
dead-letter topics, but a reply topic may take less (`max.message.bytes`, which the broker
checks on the whole batch), and aiokafka never splits a batch the broker refuses.

A reply topic deleted after its check leaves the producer waiting `request_timeout_ms` for its
metadata. A lot waits for a topic's metadata at most `metadata_wait_s(topic)`; past it, that
topic's records wait aside for the producer's answer while every other answer goes on, and
go out (or fail) with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final, Generic, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, UnknownTopicOrPartitionError
from aiokafka.partitioner import DefaultPartitioner

from worker.core.limits import record_bytes

__all__ = ["Outbox", "Record"]

logger = logging.getLogger(__name__)

M = TypeVar("M")

Headers = list[tuple[str, bytes]]
#: One queued record: topic, key, value, headers and its member.
Record = tuple[str, bytes | None, bytes | None, Headers, M]

#: The longest a lot waits for a reply topic's metadata before its records wait aside: the
#: producer has it at hand, or one metadata request away.
REPLY_METADATA_WAIT_S: Final = 0.5


class Outbox(Generic[M]):
    """Collects records, each with a member `M` that says whose it is, and submits them in
    batches. For each submitted batch, `on_submitted(members, delivery)` is called with the
    batch's members and the future of its acknowledgement (failed with the error when the batch
    could not be submitted at all).

    One task submits; while aiokafka still holds an unsent batch for a partition, submitting the
    next one waits, and what arrives meanwhile goes into the batch after it. That is the same
    back-pressure `send()` applies.

    `batch_bytes(topic)` is the most a batch for `topic` may hold (its records as aiokafka
    measures them), or None where the producer's batch size fits it. `metadata_wait_s(topic)`
    is the longest a lot waits for `topic`'s metadata (None: as long as the producer does).
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        on_submitted: Callable[[list[M], asyncio.Future[Any]], None],
        on_crash: Callable[[BaseException], None],
        batch_bytes: Callable[[str], int | None] = lambda _: None,
        metadata_wait_s: Callable[[str], float | None] = lambda _: None,
    ) -> None:
        self._producer = producer
        self._batch_bytes = batch_bytes
        self._metadata_wait_s = metadata_wait_s
        self._on_submitted = on_submitted
        self._on_crash = on_crash
        self._queued: list[Record[M]] = []
        self._pending = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._partitioner = DefaultPartitioner()
        self._task: asyncio.Task[None] | None = None
        # The lot being submitted: its members neither handed to the producer nor taken back
        # yet (by id), and the batch waiting in `send_batch` with its members.
        self._in_lot: dict[int, M] = {}
        self._lot_records: dict[int, Record[M]] = {}
        self._waiting: tuple[asyncio.Future[Any], list[M]] | None = None
        # Records of topics whose metadata a lot did not get in time, each topic's in order,
        # and the producer's wait for that metadata.
        self._aside: dict[str, list[Record[M]]] = {}
        self._lookups: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="outbox")
        self._task.add_done_callback(self._task_done)

    async def close(self) -> None:
        """Stop submitting. Records still queued are dropped: their jobs stay unanswered."""
        tasks = [t for t in (self._task, *self._lookups.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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

    def drop(self, whose: Callable[[M], bool]) -> list[Record[M]]:
        """Take back the records whose member `whose` picks, before they are handed to the
        producer; those taken back. That includes those of a batch still waiting in
        `send_batch` (a previous batch of its partition not yet sent: a broker away): aiokafka
        has not taken it, so it is withdrawn and built again without them. Records the producer
        holds are not taken back; one taken back as the producer takes its batch after all is
        still submitted (`on_submitted` names it)."""
        taken = [record for record in self._queued if whose(record[4])]
        self._queued = [record for record in self._queued if not whose(record[4])]
        for topic, aside in self._aside.items():
            taken += [record for record in aside if whose(record[4])]
            self._aside[topic] = [record for record in aside if not whose(record[4])]
        in_lot = [key for key, member in self._in_lot.items() if whose(member)]
        taken += [self._lot_records[key] for key in in_lot]
        for key in in_lot:
            del self._in_lot[key]
        if in_lot and self._waiting is not None:
            send, members = self._waiting
            if any(id(member) not in self._in_lot for member in members):
                # At once, so that a producer taking batches again right after cannot send it.
                send.cancel()
        self._pending -= len(taken)
        return taken

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
            if not self._lookups:
                self._idle.set()

    async def _submit(self, records: Sequence[Record[M]]) -> None:
        self._in_lot = {id(record[4]): record[4] for record in records}
        self._lot_records = {id(record[4]): record for record in records}
        try:
            await self._submit_lot(records)
        finally:
            self._in_lot = {}
            self._lot_records = {}

    async def _submit_lot(self, records: Sequence[Record[M]]) -> None:
        producer = self._producer
        partitions: dict[str, list[int]] = {}
        slots: dict[tuple[str, int], list[Record[M]]]
        slots = {}
        for record in records:
            topic, key = record[0], record[1]
            all_partitions = partitions.get(topic)
            if all_partitions is None and topic not in self._lookups:
                try:
                    async with asyncio.timeout(self._metadata_wait_s(topic)):
                        all_partitions = sorted(await producer.partitions_for(topic))
                    if not all_partitions:
                        raise UnknownTopicOrPartitionError(f"{topic} has no partitions")
                except TimeoutError:
                    self._await_aside(topic)
                except KafkaError as exc:
                    # An unknown topic or no metadata: every record for it fails the same way.
                    self._fail([r[4] for r in records if r[0] == topic], exc)
                    partitions[topic] = []
                else:
                    partitions[topic] = all_partitions
            if topic in self._lookups:
                # Its metadata is awaited aside: it goes out (or fails) with the others there,
                # unless it was taken back meanwhile.
                if self._in_lot.pop(id(record[4]), None) is not None:
                    self._aside[topic].append(record)
                continue
            if not all_partitions:
                continue  # failed above
            partition = (
                all_partitions[0]
                if len(all_partitions) == 1
                else self._partitioner(key, all_partitions, all_partitions)
            )
            slots.setdefault((topic, partition), []).append(record)
        for slot, slot_records in slots.items():
            await self._send(slot, slot_records)

    async def _send(
        self,
        slot: tuple[str, int],
        records: list[Record[M]],
    ) -> None:
        """Hand `records` (one partition's, in order) to the producer in as many batches as
        they fill, leaving out those taken back meanwhile."""
        room = self._batch_bytes(slot[0])
        # What is not handed yet is in `_in_lot` unless it was taken back.
        while records := [r for r in records if id(r[4]) in self._in_lot]:
            builder = self._producer.create_batch()
            count = filled = 0
            for _, key, value, headers, _ in records:
                if room is not None:
                    size = record_bytes(key, value, headers)
                    if count and filled + size > room:
                        break
                    filled += size
                # A batch always takes its first record.
                if builder.append(timestamp=None, key=key, value=value, headers=headers) is None:
                    break
                count += 1
            batch, records = records[:count], records[count:]
            builder.close()
            if not await self._hand(slot, builder, [r[4] for r in batch]):
                records = batch + records  # withdrawn: built again without what was taken back

    async def _hand(self, slot: tuple[str, int], builder: Any, members: list[M]) -> bool:
        """Submit one batch; False when it was withdrawn unsent (`drop` took some of its records
        back while it waited for the producer)."""
        topic, partition = slot
        send = asyncio.ensure_future(self._producer.send_batch(builder, topic, partition=partition))
        self._waiting = (send, members)
        try:
            await asyncio.wait({send})
        finally:
            self._waiting = None
            if not send.done():
                send.cancel()  # the outbox is closing
        if send.cancelled():
            return False
        try:
            delivery = send.result()
        except KafkaError as exc:
            self._fail(members, exc)
            return True
        self._handed(members, delivery)
        return True

    def _await_aside(self, topic: str) -> None:
        """`topic`'s metadata did not come in time: its records wait aside for the producer's
        answer, and the lot goes on without them."""
        self._aside[topic] = []
        self._lookups[topic] = asyncio.create_task(
            self._await_metadata(topic), name=f"metadata {topic}"
        )
        self._lookups[topic].add_done_callback(self._task_done)

    async def _await_metadata(self, topic: str) -> None:
        """Wait as long as the producer does for `topic`'s metadata, then queue its records
        set aside again, ahead of the rest; or fail them as a lot fails an unknown topic."""
        failure: KafkaError | None = None
        try:
            if not await self._producer.partitions_for(topic):
                failure = UnknownTopicOrPartitionError(f"{topic} has no partitions")
        except KafkaError as exc:
            failure = exc
        del self._lookups[topic]
        records = self._aside.pop(topic, [])
        if failure is not None:
            self._pending -= len(records)
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(failure)
            self._on_submitted([r[4] for r in records], failed)
        else:
            self._queued[:0] = records
        self._idle.clear()
        self._wake.set()

    async def send_alone(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Headers
    ) -> asyncio.Future[Any]:
        """Hand one record to the producer in a batch of its own, partitioned as `send()`
        partitions it; the future of its acknowledgement. `send()` would append it to
        whatever batch of its partition still lingers, so a refusal of that batch for its
        size would not say the record is too large; alone, it does."""
        all_partitions = sorted(await self._producer.partitions_for(topic))
        if not all_partitions:
            raise UnknownTopicOrPartitionError(f"{topic} has no partitions")
        partition = (
            all_partitions[0]
            if len(all_partitions) == 1
            else self._partitioner(key, all_partitions, all_partitions)
        )
        builder = self._producer.create_batch()
        builder.append(timestamp=None, key=key, value=value, headers=headers)
        builder.close()
        delivery: asyncio.Future[Any] = await self._producer.send_batch(
            builder, topic, partition=partition
        )
        return delivery

    def _fail(self, members: list[M], exc: BaseException) -> None:
        failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        failed.set_exception(exc)
        self._handed(members, failed)

    def _handed(self, members: list[M], delivery: asyncio.Future[Any]) -> None:
        # One taken back as the producer took it anyway was counted off by `drop` already.
        self._pending -= sum(self._in_lot.pop(id(m), None) is not None for m in members)
        self._on_submitted(members, delivery)
