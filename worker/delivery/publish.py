"""Answers on their way to the broker, until it acknowledges them: then their offsets finish.

Small records go through the outbox (a record batch per partition and loop turn); large ones
are produced on their own. A delivery that fails is sent again record by record; a record the
broker or producer refuses for its size is replaced by the smaller one the answer builder makes,
so every answer is eventually acknowledged or the worker stops. Only `FatalError` leaves here,
through `on_fatal`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
)

from worker.answering.records import Answer, OutRecord
from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.errors import BrokerError, FatalError
from worker.core.failpoints import crash_point
from worker.core.limits import RecordLimits, producer_batch_bytes
from worker.core.metrics import Metrics
from worker.delivery.offsets import PartitionOffsets
from worker.delivery.outbox import REPLY_METADATA_WAIT_S, Outbox
from worker.delivery.renewal import RenewableProducer

__all__ = ["Delivery", "Ticket"]

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S: Final = 5.0


class Ticket:
    """One answer being delivered, and the offset it answers once every record is acknowledged."""

    __slots__ = ("answer", "handed_over", "left", "offset", "partition", "started", "tp")

    def __init__(
        self, tp: TopicPartition, partition: PartitionOffsets, offset: int, answer: Answer
    ) -> None:
        self.tp = tp
        self.partition = partition
        self.offset = offset
        self.answer = answer
        self.started = time.perf_counter()
        self.left = len(answer.records)
        #: Its partition was handed over with this answer unacknowledged: the next owner runs
        #: the job again, so a failed delivery is not sent again.
        self.handed_over = False


# One record of one answer: what a delivery acknowledges.
_Member = tuple[Ticket, int]


class Delivery:
    """Owns the outbox, the unacknowledged deliveries, re-sends and the send lock.

    `smaller(answer, index, refused_by)` gives the answer with that record shrunk, or None when
    it cannot shrink; `unwritable(answer, index, refused_by)` the answer with that record sent
    elsewhere, its topic refusing this worker's writes, or None when there is nowhere else.
    A producer that is a `RenewableProducer` is renewed when a refusal broke its idempotent
    sequence (`worker.delivery.renewal`); any other stops the worker then.
    `answer_stays(tp, partition)` says, once a rebalance has decided, whether an answer of a
    partition handed over as running (parked) may still go out (see `park`).
    `topic_limit(topic)` is an answer topic's `max.message.bytes` where known (a reply topic's
    is read after start): batches for it are sized to fit. `on_free` is
    called when records leave the outbox (slots free up); `on_acknowledged` when the broker
    acknowledged answers (their offsets are finished); `on_fatal` when an answer cannot be
    delivered at all.
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        settings: Settings,
        limits: RecordLimits,
        metrics: Metrics,
        *,
        smaller: Callable[[Answer, int, str], Answer | None],
        unwritable: Callable[[Answer, int, str], Answer | None] = lambda *_: None,
        on_free: Callable[[], None],
        on_fatal: Callable[[FatalError], None],
        on_acknowledged: Callable[[], None] = lambda: None,
        answer_stays: Callable[[TopicPartition, PartitionOffsets], Awaitable[bool]] | None = None,
        topic_limit: Callable[[str], int | None] | None = None,
        clock: Clock,
    ) -> None:
        self._producer = producer
        self._clock = clock
        self._publish_timeout_s = settings.publish_timeout_s
        self._limits = limits
        self._metrics = metrics
        self._smaller = smaller
        self._unwritable = unwritable
        self._renewable = producer if isinstance(producer, RenewableProducer) else None
        # A refused batch broke the idempotent sequence of its partition: renew at once,
        # before the next batch there fails the producer and everything it holds.
        self._renew_on_refusal = settings.enable_idempotence
        self._on_free = on_free
        self._on_acknowledged = on_acknowledged
        self._on_fatal = on_fatal
        self._answer_stays = answer_stays
        self._send_lock = asyncio.Lock()
        # Unacknowledged deliveries: when each was sent (oldest first) and whose records it has.
        self._deliveries: dict[asyncio.Future[Any], tuple[float, list[_Member]]] = {}
        self._resends: dict[asyncio.Task[None], Ticket] = {}
        self._topic_limit = topic_limit
        self._outbox: Outbox[_Member] = Outbox(
            producer,
            self._watch,
            self._outbox_crashed,
            self._batch_bytes,
            metadata_wait_s=self._metadata_wait_s,
        )
        # Records taken back from the outbox when their partition was parked, until the verdict
        # (`park`); one the producer took after all is struck off as it is submitted.
        self._taken_back: set[_Member] = set()
        self._resending = True

    def start(self) -> None:
        self._outbox.start()

    async def close(self) -> None:
        """Stop: re-sends are cancelled, what the outbox still holds is dropped (unanswered)."""
        self._resending = False
        for task in self._resends:
            task.cancel()
        await asyncio.gather(*self._resends, return_exceptions=True)
        await self._outbox.close()

    def stop_resending(self) -> None:
        """From now on a failed delivery is left to redelivery: the producer is closing."""
        self._resending = False

    @property
    def pending(self) -> int:
        """Answers not yet handed to the producer: the outbox's, and those being sent again."""
        return self._outbox.pending + len(self._resends)

    def oldest_wait_s(self) -> float:
        """How long the oldest unacknowledged delivery has waited (0 when none)."""
        if not self._deliveries:
            return 0.0
        return self._clock.monotonic() - next(iter(self._deliveries.values()))[0]

    def queue(self, ticket: Ticket) -> bool:
        """Queue the answer's records in the outbox, which batches them; False when some are too
        large for a batch and must go through `send_alone`. The job does not wait for the
        acknowledgement: it arrives as a callback and finishes the offset."""
        alone = False
        max_batched = self._limits.batched_record_max_bytes
        for index, record in enumerate(ticket.answer.records):
            if record.size <= max_batched:
                self._outbox.add(
                    record.topic, record.key, record.value, record.headers, (ticket, index)
                )
            else:
                alone = True
        return alone is False

    async def send_alone(self, ticket: Ticket) -> None:
        """Hand the records `queue` left out to the producer one by one."""
        max_batched = self._limits.batched_record_max_bytes
        for index in range(len(ticket.answer.records)):
            if ticket.answer.records[index].size > max_batched:
                delivery, _ = await self._enqueue_fitting(ticket, index)
                self._watch([(ticket, index)], delivery)

    async def settle(self, partitions: set[TopicPartition] | None, deadline: float) -> None:
        """Until `deadline` (monotonic), wait for the answers of `partitions` (all when None) to
        be submitted and acknowledged; then cancel their re-sends still running. For a revoke
        (`partitions` given), what the producer was not handed yet is taken back, and what it
        holds unacknowledged is not sent again if its delivery fails: the next owner answers
        those jobs."""

        def ours(tp: TopicPartition) -> bool:
            return partitions is None or tp in partitions

        remaining = deadline - self._clock.monotonic()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(remaining, 0)):
                await self._outbox.flush()
        # A revoke's answers still queued at the deadline (the producer is not taking batches:
        # a broker away) are the next owner's to give; sent later, they would answer their
        # jobs twice. (A stopping worker keeps its own: its final commit comes after a flush.)
        if partitions is not None and (
            dropped := self._outbox.drop(lambda member: ours(member[0].tp))
        ):
            logger.info(
                "%d answers not handed to the producer in time are left to the next owner",
                len(dropped),
            )
            self._on_free()
        waiting: list[asyncio.Future[Any]] = [
            d for d, (_, members) in self._deliveries.items() if any(ours(t.tp) for t, _ in members)
        ]
        waiting += [task for task, ticket in self._resends.items() if ours(ticket.tp)]
        remaining = deadline - self._clock.monotonic()
        if waiting and remaining > 0:
            await asyncio.wait(waiting, timeout=remaining)
        # Failed deliveries may have started re-sends meanwhile; they get the same deadline.
        resends = [task for task, ticket in self._resends.items() if ours(ticket.tp)]
        remaining = deadline - self._clock.monotonic()
        if resends and remaining > 0:
            await asyncio.wait(resends, timeout=remaining)
        await asyncio.sleep(0)  # let the acknowledgements' callbacks mark their offsets
        # A revoke's answers still unacknowledged: the hand-over lists them as running and the
        # next owner runs them again. Such a delivery may yet land (a duplicate nobody can
        # prevent), but when it fails, sending it again would only answer the job twice.
        if partitions is not None:
            for _, members in self._deliveries.values():
                for ticket, _ in members:
                    if ours(ticket.tp):
                        ticket.handed_over = True
        pending = [t for t, ticket in self._resends.items() if ours(ticket.tp) and not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            logger.info("cancelled %d re-sends; their jobs will be redelivered", len(pending))
            await asyncio.gather(*pending, return_exceptions=True)

    def park(self, partitions: set[TopicPartition]) -> None:
        """`partitions` are handed over with their jobs named as running, the rest of their
        answers with them, and parked until the next assignment says whether they come back
        (`answer_stays`). Their answers not yet handed to the producer are taken back until
        then, and a failed delivery of theirs is sent again only then: sent after the hand-over
        and before the verdict, an answer whose partition moved is given twice, here and by the
        next owner, who runs its job again."""
        taken = self._outbox.drop(lambda member: member[0].tp in partitions)
        by_ticket: dict[Ticket, list[int]] = {}
        for *_, (ticket, index) in taken:
            self._taken_back.add((ticket, index))
            by_ticket.setdefault(ticket, []).append(index)
        for ticket, indexes in by_ticket.items():
            task = asyncio.create_task(self._queue_after_verdict(ticket, indexes))
            self._resends[task] = ticket
            task.add_done_callback(self._resend_done)
        if taken:
            logger.info(
                "%d answers of %s wait for the next assignment to be sent or dropped",
                len(taken),
                sorted(map(str, partitions)),
            )

    async def _queue_after_verdict(self, ticket: Ticket, indexes: list[int]) -> None:
        stays = await self._stays(ticket)
        records = ticket.answer.records
        for index in indexes:
            # Not struck off: the producer has not taken it after all.
            if (ticket, index) in self._taken_back:
                self._taken_back.discard((ticket, index))
                if stays:
                    record = records[index]
                    self._outbox.add(
                        record.topic, record.key, record.value, record.headers, (ticket, index)
                    )

    async def _stays(self, ticket: Ticket) -> bool:
        if self._answer_stays is None:
            return True
        return await self._answer_stays(ticket.tp, ticket.partition)

    async def acknowledged(self, deadline: float) -> bool:
        """Until `deadline` (monotonic), wait for every answer queued so far to be submitted
        and acknowledged (re-sends included), cancelling nothing; whether they all were."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(deadline - self._clock.monotonic(), 0)):
                await self._outbox.flush()
        waiting: list[asyncio.Future[Any]] = [*self._deliveries, *self._resends]
        remaining = deadline - self._clock.monotonic()
        if waiting and remaining > 0:
            await asyncio.wait(waiting, timeout=remaining)
        await asyncio.sleep(0)  # let the acknowledgements' callbacks run
        return self._outbox.pending == 0 and not self._deliveries and not self._resends

    def _watch(self, members: list[_Member], delivery: asyncio.Future[Any]) -> None:
        """Follow the delivery of a batch (or of one large record) holding `members`."""
        if self._taken_back:
            self._taken_back.difference_update(members)
        self._deliveries[delivery] = (self._clock.monotonic(), members)
        delivery.add_done_callback(functools.partial(self._on_delivery, members))
        self._on_free()

    def _on_delivery(self, members: list[_Member], delivery: asyncio.Future[Any]) -> None:
        self._deliveries.pop(delivery, None)
        if delivery.cancelled():
            return  # the producer closed with it unsent: the offsets stay unfinished
        error = delivery.exception()
        if error is None:
            for ticket, _ in members:
                self._acknowledged(ticket)
            self._on_acknowledged()
            return
        if not self._resending:
            return
        ours = [member for member in members if not member[0].handed_over]
        if len(ours) < len(members):
            logger.info(
                "delivery of %d records failed after their partitions were handed over; "
                "their next owners answer them",
                len(members) - len(ours),
            )
            members = ours
            if not members:
                return
        logger.warning(
            "delivery of %d records failed (%r); sending each again on its own", len(members), error
        )
        # Rare: each record is sent again alone, so one refused for its size fails alone.
        for ticket, index in members:
            task = asyncio.create_task(self._resend(ticket, index))
            self._resends[task] = ticket
            task.add_done_callback(self._resend_done)

    def _acknowledged(self, ticket: Ticket) -> None:
        ticket.left -= 1
        if ticket.left:
            crash_point("kill-between-parts")
            return
        ticket.partition.finish(ticket.offset)
        self._metrics.job_answered(
            ticket.answer.metric_labels(), time.perf_counter() - ticket.started
        )

    def _batch_bytes(self, topic: str) -> int | None:
        """The most a batch of `topic` may hold: a reply topic may take less than the results
        topic, which the producer's batch size was chosen for."""
        limit = self._limits.topic_bytes.get(topic)
        if limit is None and self._topic_limit is not None:
            limit = self._topic_limit(topic)
        return None if limit is None else producer_batch_bytes([limit])

    def _metadata_wait_s(self, topic: str) -> float | None:
        """The longest a lot of answers waits for `topic`'s metadata: a reply topic, named by
        jobs and maybe deleted since its check, `REPLY_METADATA_WAIT_S`; the worker's own
        topics as long as the producer waits."""
        return None if topic in self._limits.topic_bytes else REPLY_METADATA_WAIT_S

    def _outbox_crashed(self, exc: BaseException) -> None:
        self._on_fatal(BrokerError(f"answers could not be handed to the producer: {exc!r}"))

    async def _resend(self, ticket: Ticket, index: int) -> None:
        where = f"{ticket.tp.topic}-{ticket.tp.partition}@{ticket.offset}"
        backoff = _Backoff(self._publish_timeout_s, self._clock)
        try:
            while True:
                # Its partition was handed over parked meanwhile: sent now, the answer would
                # go out a second time should the partition move (its next owner runs the
                # job again), so it waits for the verdict.
                if not await self._stays(ticket):
                    logger.info("re-send for %s dropped: its partition moved", where)
                    return
                delivery, generation = await self._enqueue_fitting(ticket, index, backoff)
                # aiokafka retries an unreachable broker forever; the loop's watchdog bounds
                # our patience (`oldest_wait_s`).
                self._deliveries[delivery] = (self._clock.monotonic(), [(ticket, index)])
                try:
                    await delivery
                except MessageSizeTooLargeError as exc:
                    self._shrink(ticket, index, f"the broker ({exc})")
                    await self._after_refusal(generation)
                    continue
                except TopicAuthorizationFailedError as exc:
                    self._redirect(
                        ticket, index, f"the broker refuses this worker's writes ({exc})"
                    )
                    await self._after_refusal(generation)
                    continue
                except OutOfOrderSequenceNumber as exc:
                    await self._renew(generation, exc, where)
                    continue
                except KafkaTimeoutError as exc:
                    # The batch expired unacknowledged (a lost acknowledgement, a broker or a
                    # leader away): aiokafka marks that not retriable, but the next attempt may
                    # well land; publish_timeout_s bounds the patience as for other errors.
                    await backoff.after(exc, f"delivery to {where}", transient=True)
                    continue
                except KafkaError as exc:
                    await backoff.after(exc, f"delivery to {where}")
                    continue
                finally:
                    self._deliveries.pop(delivery, None)
                break
        except asyncio.CancelledError:
            logger.info("re-send for %s cancelled; left uncommitted for redelivery", where)
            raise
        self._acknowledged(ticket)
        self._on_acknowledged()

    def _resend_done(self, task: asyncio.Task[None]) -> None:
        self._resends.pop(task, None)
        self._on_free()
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, FatalError):
            self._on_fatal(exc)
        elif exc is not None:
            logger.error("re-send failed unexpectedly", exc_info=exc)
            self._on_fatal(BrokerError(f"a re-send failed unexpectedly: {exc!r}"))

    async def _enqueue_fitting(
        self, ticket: Ticket, index: int, backoff: _Backoff | None = None
    ) -> tuple[asyncio.Future[Any], int]:
        """Hand record `index` to the producer in a batch of its own (a refusal for its size is
        then the record's alone), shrinking it while it is over the producer's limit; return
        the future of its acknowledgement, and the generation of the producer it went to."""
        backoff = backoff or _Backoff(self._publish_timeout_s, self._clock)
        while True:
            record = ticket.answer.records[index]
            generation = self._generation()
            try:
                if record.size > self._limits.request_bytes:
                    # What `send()` checks on the record; a batch of one is not checked.
                    raise MessageSizeTooLargeError(record.size)  # noqa: TRY301
                # One task at a time hands records to the producer: with hundreds of jobs
                # finishing together, unserialised sends thrash waiting for their partition.
                async with self._send_lock:
                    delivery: asyncio.Future[Any] = await self._outbox.send_alone(
                        record.topic, record.key, record.value, record.headers
                    )
            except MessageSizeTooLargeError:
                self._shrink(
                    ticket,
                    index,
                    f"the producer's max_request_size ({self._limits.request_bytes})",
                )
            except OutOfOrderSequenceNumber as exc:
                await self._renew(generation, exc, f"sending to {record.topic}")
            except TopicAuthorizationFailedError as exc:
                # Refused before anything was sent (the topic's metadata): no sequence broke.
                self._redirect(ticket, index, f"the broker refuses this worker's writes ({exc})")
            except UnknownTopicOrPartitionError as exc:
                if record.topic in self._limits.topic_bytes:
                    await backoff.after(exc, f"sending to {record.topic}")
                else:
                    # A reply topic found when its first job named it, deleted since: the
                    # producer waited out its metadata (request_timeout_ms). Waiting longer
                    # would only stop the worker at publish_timeout_s.
                    self._redirect(ticket, index, "the broker no longer has this topic")
            except KafkaTimeoutError as exc:
                # Its partition's previous batch did not drain in request_timeout_ms (a broker
                # or a leader away): publish_timeout_s bounds the patience, as for a delivery.
                await backoff.after(exc, f"sending to {record.topic}", transient=True)
            except KafkaError as exc:
                await backoff.after(exc, f"sending to {record.topic}")
            else:
                return delivery, generation

    def _generation(self) -> int:
        return self._renewable.generation if self._renewable is not None else 0

    async def _renew(self, generation: int, exc: KafkaError, what: str) -> None:
        """The producer of `generation` lost its sequence: renew it, or stop the worker when
        it cannot be renewed."""
        if self._renewable is None:
            raise BrokerError(f"{what} failed: {exc!r}") from exc
        await self._renewable.renew(generation)

    async def _after_refusal(self, generation: int) -> None:
        """The broker refused a record: its partition's idempotent sequence is broken."""
        if self._renew_on_refusal and self._renewable is not None:
            await self._renewable.renew(generation)

    def _redirect(self, ticket: Ticket, index: int, refused_by: str) -> None:
        record: OutRecord = ticket.answer.records[index]
        elsewhere = self._unwritable(ticket.answer, index, refused_by)
        if elsewhere is None:
            raise BrokerError(f"{refused_by} on {record.topic}")
        logger.warning(
            "%s on %s; answering job %s on %s instead",
            refused_by,
            record.topic,
            ticket.answer.job_id,
            elsewhere.records[index].topic,
        )
        ticket.answer = elsewhere

    def _shrink(self, ticket: Ticket, index: int, refused_by: str) -> None:
        record: OutRecord = ticket.answer.records[index]
        smaller = self._smaller(ticket.answer, index, refused_by)
        if smaller is None:
            # A job's reply topic too small for any answer is the job's fault, not the
            # worker's: its answer goes to the results topic (and the topic's later jobs too).
            # Only the results or dead-letter topic being that small stops the worker.
            self._redirect(
                ticket,
                index,
                f"{refused_by} refused even the smallest answer ({record.size} bytes); its "
                "max.message.bytes is too small to answer jobs",
            )
            return
        logger.warning(
            "%s refused a %d-byte record for %s; sending a smaller answer",
            refused_by,
            record.size,
            record.topic,
        )
        ticket.answer = smaller


class _Backoff:
    """Retries of one delivery: transient broker errors wait and retry, doubling the wait, until
    `timeout_s` has passed; anything else, or later, is a BrokerError."""

    def __init__(self, timeout_s: float, clock: Clock) -> None:
        self._clock = clock
        self._deadline = clock.monotonic() + timeout_s
        self._delay = 0.1

    async def after(self, exc: KafkaError, what: str, *, transient: bool = False) -> None:
        if not (exc.retriable or transient) or self._clock.monotonic() > self._deadline:
            raise BrokerError(f"{what} failed: {exc!r}") from exc
        logger.warning("%s failed (%r); retrying in %.1fs", what, exc, self._delay)
        await asyncio.sleep(self._delay)
        self._delay = min(self._delay * 2, _MAX_BACKOFF_S)
