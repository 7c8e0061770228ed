"""Answers of partitions parked at a revoke, held back from the producer until the next
assignment says whether their partitions come back."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import TopicPartition

from worker.delivery.outbox import Outbox
from worker.delivery.tickets import Member, Ticket

__all__ = ["ParkedAnswers"]

logger = logging.getLogger(__name__)


class ParkedAnswers:
    """Takes a parked partition's answers back from `outbox` and queues each again once its
    owner gives the verdict (`AnswerOwner.may_send`), dropping those whose partition moved.
    `follow(wait, ticket)` runs each ticket's wait for the verdict as a task of its own."""

    def __init__(
        self,
        outbox: Outbox[Member],
        *,
        follow: Callable[[Coroutine[Any, Any, None], Ticket], None],
    ) -> None:
        self._outbox = outbox
        self._follow = follow
        # Records taken back until the verdict; one the producer took after all is struck off
        # as it is submitted (`submitted`).
        self._taken_back: set[Member] = set()

    def park(self, partitions: set[TopicPartition]) -> None:
        """Take back the answers of `partitions` not yet handed to the producer."""
        taken = self._outbox.drop(lambda member: member[0].tp in partitions)
        by_ticket: dict[Ticket, list[int]] = {}
        for *_, (ticket, index) in taken:
            self._taken_back.add((ticket, index))
            by_ticket.setdefault(ticket, []).append(index)
        for ticket, indexes in by_ticket.items():
            self._follow(self._queue_after_verdict(ticket, indexes), ticket)
        if taken:
            logger.info(
                "%d answers of %s wait for the next assignment to be sent or dropped",
                len(taken),
                sorted(map(str, partitions)),
            )

    def submitted(self, members: list[Member]) -> None:
        """The producer took `members`: none of them is held back any more."""
        if self._taken_back:
            self._taken_back.difference_update(members)

    async def _queue_after_verdict(self, ticket: Ticket, indexes: list[int]) -> None:
        stays = await ticket.owner.may_send()
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
