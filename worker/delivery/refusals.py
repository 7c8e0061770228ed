"""What becomes of an answer whose record a topic refuses: a smaller answer in its place, or the
same answer sent elsewhere; where neither exists, the worker stops (`BrokerError`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from worker.answering.records import Answer, OutRecord
from worker.core.errors import BrokerError
from worker.delivery.tickets import Ticket

__all__ = ["RefusedAnswers"]

logger = logging.getLogger(__name__)


class RefusedAnswers:
    """Replaces a ticket's answer when one of its records is refused.

    `smaller(answer, index, refused_by)` gives the answer with that record shrunk, or None when
    it cannot shrink; `unwritable(answer, index, refused_by)` the answer with that record sent
    elsewhere, its topic refusing this worker's writes, or None when there is nowhere else.
    """

    def __init__(
        self,
        smaller: Callable[[Answer, int, str], Answer | None],
        unwritable: Callable[[Answer, int, str], Answer | None],
    ) -> None:
        self._smaller = smaller
        self._unwritable = unwritable

    def redirect(self, ticket: Ticket, index: int, refused_by: str) -> None:
        """Record `index`'s topic refuses this worker's writes: answer elsewhere."""
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

    def shrink(self, ticket: Ticket, index: int, refused_by: str) -> None:
        """Record `index` was refused for its size: answer with a smaller one."""
        record: OutRecord = ticket.answer.records[index]
        smaller = self._smaller(ticket.answer, index, refused_by)
        if smaller is None:
            # A job's reply topic too small for any answer is the job's fault, not the
            # worker's: its answer goes to the results topic (and the topic's later jobs too).
            # Only the results or dead-letter topic being that small stops the worker.
            self.redirect(
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
