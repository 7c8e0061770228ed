"""Revoked partitions handed over, parked while their jobs run on, and adopted back when the
next assignment returns them unchanged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from worker.core.metrics import Metrics
from worker.delivery.commit_call import CommitMaker
from worker.delivery.commit_plan import CommitPlanner
from worker.delivery.hand_overs import CommittedReader
from worker.delivery.inheritance import Inheritance
from worker.delivery.offsets import OffsetTracker

__all__ = ["Parking"]

logger = logging.getLogger(__name__)


class Parking:
    """Hands revoked partitions over (`revoked`), parks those whose jobs still run, and adopts
    them back (`adopt`); `forget` forgets a partition everywhere the committer keeps one.
    Without `read_committed` nothing is parked: whether the group still holds this member's
    hand-over could not be read back."""

    def __init__(
        self,
        tracker: OffsetTracker,
        metrics: Metrics,
        *,
        maker: CommitMaker,
        planner: CommitPlanner,
        inheritance: Inheritance,
        read_committed: CommittedReader | None,
        forget: Callable[[set[TopicPartition]], None],
        timeout_s: float,
    ) -> None:
        self._tracker = tracker
        self._metrics = metrics
        self._maker = maker
        self._planner = planner
        self._inheritance = inheritance
        self._read_committed = read_committed
        self._forget = forget
        self._timeout_s = timeout_s

    async def revoked(
        self, partitions: set[TopicPartition], keep: set[TopicPartition] | None = None
    ) -> set[TopicPartition]:
        """Hand `partitions` over and forget them, parking those of `keep` instead
        (`Committer.revoked`); returns those parked."""
        kept: set[TopicPartition] = set()
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._maker.one_at_a_time:
                    maker = self._maker
                    maker.keep_unlanded(await maker.commit_planned(partitions, clean=True))
                    if keep and self._read_committed is not None:
                        # Also where the group refused the hand-over (some brokers end the
                        # generation as the rebalance begins): `adopt` then finds this
                        # member's last commit, which the partition's offsets remember.
                        kept = keep & partitions
                        self._tracker.park(kept)
                    self._forget(partitions - kept)
        except TimeoutError:
            self._metrics.commits.labels("retry").inc()
            logger.warning(
                "hand-over commit did not finish in %.1fs; it is made again after rejoining, "
                "or before this worker stops",
                self._timeout_s,
            )
            # Planned again: should the commit on its way land after all, the group then holds
            # something newer than this member's last landed commit, and this one is not made.
            self._maker.keep_unlanded(self._planner.plan(partitions, clean=True))
        finally:
            self._forget(partitions - kept)
        return kept

    async def adopt(self, assigned: set[TopicPartition]) -> set[TopicPartition]:
        """Of the parked partitions, hold again those `assigned` back whose committed offset
        and map are still this member's hand-over; forget the others (`Committer.adopt`)."""
        parked = dict(self._tracker.parked())
        if not parked:
            return set()
        # Held from here: the others until their maps are read (`assigned`), which the caller
        # does next; fetched meanwhile, their records would start from a position not yet
        # settled.
        self._inheritance.reading |= assigned
        back = {tp for tp in parked if tp in assigned}
        adopted: set[TopicPartition] = set()
        if back and self._read_committed is not None:
            try:
                async with asyncio.timeout(self._timeout_s):
                    committed = await self._read_committed(sorted(back))
            except (KafkaError, TimeoutError) as exc:
                # Unread, another member's commit cannot be ruled out: inherited instead.
                logger.info("cannot read the committed offsets of returned partitions (%r)", exc)
                committed = {}
            for tp in sorted(back):
                if tp in committed and committed[tp] == parked[tp].committed:
                    self._tracker.unpark(tp)
                    adopted.add(tp)
        self._forget(set(parked) - adopted)
        # Forgetting let go of those assigned back that were not adopted: held again.
        self._inheritance.reading = (self._inheritance.reading | assigned) - adopted
        return adopted
