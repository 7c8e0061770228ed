"""Answers on their way to the broker, until it acknowledges them: then their owners are told.

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
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition

from worker.answering.records import Answer
from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.errors import BrokerError, FatalError
from worker.core.failpoints import crash_point
from worker.core.limits import RecordLimits, producer_batch_bytes
from worker.core.metrics import Metrics
from worker.delivery.outbox import REPLY_METADATA_WAIT_S, Outbox
from worker.delivery.parked_answers import ParkedAnswers
from worker.delivery.refusals import RefusedAnswers
from worker.delivery.sending import RecordSender
from worker.delivery.tickets import Member, Ticket, Unacknowledged

__all__ = ["Delivery", "Ticket"]

logger = logging.getLogger(__name__)


class Delivery:
    """Owns the outbox, the unacknowledged deliveries and the re-sends.

    `smaller` and `unwritable` replace a refused answer (`RefusedAnswers`); records too large
    for a batch, and those of a failed delivery, go alone (`RecordSender`).
    `topic_limit(topic)` is an answer topic's `max.message.bytes` where known (a reply topic's
    is read after start): batches for it are sized to fit. `on_free` is
    called when records leave the outbox (slots free up); `on_acknowledged` when the broker
    acknowledged answers (their owners were told); `on_fatal` when an answer cannot be
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
        topic_limit: Callable[[str], int | None] | None = None,
        clock: Clock,
    ) -> None:
        self._clock = clock
        self._limits = limits
        self._metrics = metrics
        self._on_free = on_free
        self._on_acknowledged = on_acknowledged
        self._on_fatal = on_fatal
        self._unacknowledged = Unacknowledged(clock)
        self._resends: dict[asyncio.Task[None], Ticket] = {}
        self._topic_limit = topic_limit
        self._outbox: Outbox[Member] = Outbox(
            producer,
            self._watch,
            self._outbox_crashed,
            self._batch_bytes,
            metadata_wait_s=self._metadata_wait_s,
        )
        self._sender = RecordSender(
            producer,
            self._outbox,
            settings,
            limits,
            refusals=RefusedAnswers(smaller, unwritable),
            unacknowledged=self._unacknowledged,
            clock=clock,
        )
        self._parked = ParkedAnswers(self._outbox, follow=self._follow)
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
        return self._unacknowledged.oldest_wait_s()

    def queue(self, ticket: Ticket) -> bool:
        """Queue the answer's records in the outbox, which batches them; False when some are too
        large for a batch and must go through `send_alone`. The job does not wait for the
        acknowledgement: it arrives as a callback and tells the ticket's owner."""
        ticket.started = self._clock.monotonic()
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
                delivery, _ = await self._sender.send(ticket, index)
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
        waiting: list[asyncio.Future[Any]] = self._unacknowledged.carrying(ours)
        waiting += [task for task, ticket in self._resends.items() if ours(ticket.tp)]
        remaining = deadline - self._clock.monotonic()
        if waiting and remaining > 0:
            await asyncio.wait(waiting, timeout=remaining)
        # Failed deliveries may have started re-sends meanwhile; they get the same deadline.
        resends = [task for task, ticket in self._resends.items() if ours(ticket.tp)]
        remaining = deadline - self._clock.monotonic()
        if resends and remaining > 0:
            await asyncio.wait(resends, timeout=remaining)
        await asyncio.sleep(0)  # let the acknowledgements' callbacks tell the answers' owners
        # A revoke's answers still unacknowledged: the hand-over lists them as running and the
        # next owner runs them again. Such a delivery may yet land (a duplicate nobody can
        # prevent), but when it fails, sending it again would only answer the job twice.
        if partitions is not None:
            for ticket, _ in self._unacknowledged.members():
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
        (`AnswerOwner.may_send`). Their answers not yet handed to the producer are taken back until
        then, and a failed delivery of theirs is sent again only then: sent after the hand-over
        and before the verdict, an answer whose partition moved is given twice, here and by the
        next owner, who runs its job again."""
        self._parked.park(partitions)

    async def acknowledged(self, deadline: float) -> bool:
        """Until `deadline` (monotonic), wait for every answer queued so far to be submitted
        and acknowledged (re-sends included), cancelling nothing; whether they all were."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(deadline - self._clock.monotonic(), 0)):
                await self._outbox.flush()
        waiting: list[asyncio.Future[Any]] = [*self._unacknowledged, *self._resends]
        remaining = deadline - self._clock.monotonic()
        if waiting and remaining > 0:
            await asyncio.wait(waiting, timeout=remaining)
        await asyncio.sleep(0)  # let the acknowledgements' callbacks run
        return self._outbox.pending == 0 and not self._unacknowledged and not self._resends

    def _watch(self, members: list[Member], delivery: asyncio.Future[Any]) -> None:
        """Follow the delivery of a batch (or of one large record) holding `members`."""
        self._parked.submitted(members)
        self._unacknowledged.add(delivery, members)
        delivery.add_done_callback(functools.partial(self._on_delivery, members))
        self._on_free()

    def _on_delivery(self, members: list[Member], delivery: asyncio.Future[Any]) -> None:
        self._unacknowledged.discard(delivery)
        if delivery.cancelled():
            return  # the producer closed with it unsent: the jobs stay unanswered
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
            self._follow(self._resend(ticket, index), ticket)

    def _acknowledged(self, ticket: Ticket) -> None:
        ticket.left -= 1
        if ticket.left:
            crash_point("kill-between-parts")
            return
        ticket.owner.acknowledged(ticket.offset)
        self._metrics.job_answered(
            ticket.answer.metric_labels(), self._clock.monotonic() - ticket.started
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
        if await self._sender.resend(ticket, index):
            self._acknowledged(ticket)
            self._on_acknowledged()

    def _follow(self, resend: Coroutine[Any, Any, None], ticket: Ticket) -> None:
        """Run `resend` as a task, counted among the re-sends (`pending`, `settle`) until done."""
        task = asyncio.create_task(resend)
        self._resends[task] = ticket
        task.add_done_callback(self._resend_done)

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
