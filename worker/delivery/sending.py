"""One record of an answer sent on its own, again after a refusal or a failure, until the broker
acknowledges it: the way of a record too large for a batch, and of each record of a batch
whose delivery failed.

A record alone in its batch fails alone: refused for its size it is replaced by a smaller
answer, refused for this worker's writes it goes elsewhere (`worker.delivery.refusals`), and a
broken idempotent sequence renews the producer (`worker.delivery.renewal`). Other broker errors
wait and try again, doubling the wait, for up to `publish_timeout_s`; past it, or on an error
no retry mends, a `BrokerError` stops the worker.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
)

from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.errors import BrokerError
from worker.core.limits import RecordLimits
from worker.delivery.outbox import Outbox
from worker.delivery.refusals import RefusedAnswers
from worker.delivery.renewal import RenewableProducer
from worker.delivery.tickets import Member, Ticket, Unacknowledged

__all__ = ["Backoff", "RecordSender"]

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S: Final = 5.0


class RecordSender:
    """Hands records to the producer one per batch (`send`) and sees them acknowledged
    (`resend`). While the producer holds one unacknowledged, it is among `unacknowledged`.

    A producer that is a `RenewableProducer` is renewed when a refusal broke its idempotent
    sequence; any other stops the worker then.
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        outbox: Outbox[Member],
        settings: Settings,
        limits: RecordLimits,
        *,
        refusals: RefusedAnswers,
        unacknowledged: Unacknowledged,
        clock: Clock,
    ) -> None:
        self._outbox = outbox
        self._limits = limits
        self._refusals = refusals
        self._unacknowledged = unacknowledged
        self._clock = clock
        self._publish_timeout_s = settings.publish_timeout_s
        self._renewable = producer if isinstance(producer, RenewableProducer) else None
        # A refused batch broke the idempotent sequence of its partition: renew at once,
        # before the next batch there fails the producer and everything it holds.
        self._renew_on_refusal = settings.enable_idempotence
        self._send_lock = asyncio.Lock()

    async def resend(self, ticket: Ticket, index: int) -> bool:
        """Send record `index` until the broker acknowledges it (True), or until its partition,
        parked, went to another member (False): the next owner answers that job."""
        where = f"{ticket.tp.topic}-{ticket.tp.partition}@{ticket.offset}"
        backoff = Backoff(self._publish_timeout_s, self._clock)
        try:
            while True:
                # Its partition was handed over parked meanwhile: sent now, the answer would
                # go out a second time should the partition move (its next owner runs the
                # job again), so it waits for the verdict.
                if not await ticket.owner.may_send():
                    logger.info("re-send for %s dropped: its partition moved", where)
                    return False
                delivery, generation = await self.send(ticket, index, backoff)
                # aiokafka retries an unreachable broker forever; the loop's watchdog bounds
                # our patience (`oldest_wait_s`).
                self._unacknowledged.add(delivery, [(ticket, index)])
                try:
                    await delivery
                except MessageSizeTooLargeError as exc:
                    self._refusals.shrink(ticket, index, f"the broker ({exc})")
                    await self._after_refusal(generation)
                    continue
                except TopicAuthorizationFailedError as exc:
                    self._refusals.redirect(
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
                    self._unacknowledged.discard(delivery)
                return True
        except asyncio.CancelledError:
            logger.info("re-send for %s cancelled; left uncommitted for redelivery", where)
            raise

    async def send(
        self, ticket: Ticket, index: int, backoff: Backoff | None = None
    ) -> tuple[asyncio.Future[Any], int]:
        """Hand record `index` to the producer in a batch of its own (a refusal for its size is
        then the record's alone), shrinking it while it is over the producer's limit; return
        the future of its acknowledgement, and the generation of the producer it went to."""
        backoff = backoff or Backoff(self._publish_timeout_s, self._clock)
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
                self._refusals.shrink(
                    ticket,
                    index,
                    f"the producer's max_request_size ({self._limits.request_bytes})",
                )
            except OutOfOrderSequenceNumber as exc:
                await self._renew(generation, exc, f"sending to {record.topic}")
            except TopicAuthorizationFailedError as exc:
                # Refused before anything was sent (the topic's metadata): no sequence broke.
                self._refusals.redirect(
                    ticket, index, f"the broker refuses this worker's writes ({exc})"
                )
            except UnknownTopicOrPartitionError as exc:
                if record.topic in self._limits.topic_bytes:
                    await backoff.after(exc, f"sending to {record.topic}")
                else:
                    # A reply topic found when its first job named it, deleted since: the
                    # producer waited out its metadata (request_timeout_ms). Waiting longer
                    # would only stop the worker at publish_timeout_s.
                    self._refusals.redirect(ticket, index, "the broker no longer has this topic")
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


class Backoff:
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
