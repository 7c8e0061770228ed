"""Answers on their way to the broker (`Ticket`), the deliveries that carry them until the broker
acknowledges them (`Unacknowledged`), and the one way back to the consumer side (`AnswerOwner`).

The producer side keeps no offset state and changes none: it tells each answer's owner when the
answer is acknowledged, and asks it whether the answer may still go out. Finished work goes
back to the owner of the partition's state the same way in Confluent's parallel-consumer
(`WorkManager.onSuccessResult` hands the work container to `PartitionStateManager`), and
aiokafka keeps its `producer/` apart from its `consumer/` likewise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from aiokafka import TopicPartition

from worker.answering.records import Answer
from worker.core.clock import Clock

__all__ = ["AnswerOwner", "Member", "Ticket", "Unacknowledged"]


class AnswerOwner(Protocol):
    """The consumer side of the partition an answer's job came from, as the producer side sees
    it (`worker.loop.starts.PartitionAnswerOwner` over the partition's offsets)."""

    def acknowledged(self, offset: int) -> None:
        """The broker acknowledged every record of the answer to `offset`: its job is done.
        Called in the acknowledgement's callback, before anything else runs, so a commit made
        after the acknowledgement covers the offset."""
        ...

    async def may_send(self) -> bool:
        """Whether an answer may go out now: False once its partition, parked at a revoke, went
        to another member, who runs its jobs again (waits for that verdict)."""
        ...


class Ticket:
    """One answer being delivered, and the offset it answers once every record is acknowledged."""

    __slots__ = ("answer", "handed_over", "left", "offset", "owner", "started", "tp")

    def __init__(self, tp: TopicPartition, owner: AnswerOwner, offset: int, answer: Answer) -> None:
        self.tp = tp
        self.owner = owner
        self.offset = offset
        self.answer = answer
        #: When `Delivery` took it, on the worker's clock: its publish time counts from there.
        self.started = 0.0
        self.left = len(answer.records)
        #: Its partition was handed over with this answer unacknowledged: the next owner runs
        #: the job again, so a failed delivery is not sent again.
        self.handed_over = False


#: One record of one answer: what a delivery acknowledges.
Member = tuple[Ticket, int]


class Unacknowledged:
    """The deliveries (of a batch, or of one record alone) the producer holds and has not
    settled yet: when each was handed over, oldest first, and whose records it carries."""

    __slots__ = ("_clock", "_sent")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._sent: dict[asyncio.Future[Any], tuple[float, list[Member]]] = {}

    def add(self, delivery: asyncio.Future[Any], members: list[Member]) -> None:
        self._sent[delivery] = (self._clock.monotonic(), members)

    def discard(self, delivery: asyncio.Future[Any]) -> None:
        self._sent.pop(delivery, None)

    def __iter__(self) -> Iterator[asyncio.Future[Any]]:
        return iter(self._sent)

    def __bool__(self) -> bool:
        return bool(self._sent)

    def oldest_wait_s(self) -> float:
        """How long the oldest of them has waited (0 when none)."""
        if not self._sent:
            return 0.0
        return self._clock.monotonic() - next(iter(self._sent.values()))[0]

    def carrying(self, ours: Callable[[TopicPartition], bool]) -> list[asyncio.Future[Any]]:
        """Those carrying a record of a partition that is `ours`."""
        return [
            delivery
            for delivery, (_, members) in self._sent.items()
            if any(ours(ticket.tp) for ticket, _ in members)
        ]

    def members(self) -> Iterator[Member]:
        """The records they carry."""
        for _, members in self._sent.values():
            yield from members
