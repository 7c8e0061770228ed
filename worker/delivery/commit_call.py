"""One commit at a time: planned once the previous one ended, sent within `commit_timeout_s`,
and what the broker's answer means for what is made again."""

from __future__ import annotations

import asyncio
import logging

from aiokafka import TopicPartition
from aiokafka.errors import (
    CommitFailedError,
    IllegalStateError,
    KafkaError,
    OffsetMetadataTooLargeError,
)

from worker.core.consumer_port import GroupConsumer
from worker.core.metrics import Metrics
from worker.delivery.commit_lag import CommitLag
from worker.delivery.commit_plan import CommitPlanner
from worker.delivery.hand_overs import RefusedHandOvers
from worker.delivery.inheritance import Inheritance
from worker.delivery.offsets import Commit, OffsetTracker, describe_commits

__all__ = ["CommitMaker"]

logger = logging.getLogger(__name__)


class CommitMaker:
    """Makes the commits the `planner` plans, one at a time (`one_at_a_time`), and keeps a
    hand-over the group refused or did not answer for `hand_overs` to land later."""

    def __init__(
        self,
        consumer: GroupConsumer,
        metrics: Metrics,
        *,
        tracker: OffsetTracker,
        planner: CommitPlanner,
        inheritance: Inheritance,
        hand_overs: RefusedHandOvers,
        lag: CommitLag,
        timeout_s: float,
    ) -> None:
        self._consumer = consumer
        self._metrics = metrics
        self._tracker = tracker
        self._planner = planner
        self._inheritance = inheritance
        self._hand_overs = hand_overs
        self._lag = lag
        self._timeout_s = timeout_s
        #: Held by whoever plans and makes a commit: a commit planned while another is on its
        #: way could land after a revoke forgot the partition (the hand-over waits on a slow
        #: coordinator while the interval's commit goes out beside it), and the new owner,
        #: maybe this member again, would read the older position and commit behind it.
        self.one_at_a_time = asyncio.Lock()
        #: From the stop on, every commit is a clean hand-over (`Committer.hand_over`).
        self.handing_over = False

    async def commit(self, partitions: set[TopicPartition] | None, *, clean: bool = False) -> None:
        """Plan and make one commit of `partitions` (all when None), after any other."""
        async with self.one_at_a_time:
            await self.commit_planned(partitions, clean=clean)

    async def commit_planned(
        self, partitions: set[TopicPartition] | None, *, clean: bool = False
    ) -> dict[TopicPartition, Commit]:
        """Plan and make one commit (holding `one_at_a_time`); what it committed that the group
        did not answer in time (or answered with a transient error), to be made again: nothing
        when it landed or was refused."""
        offsets = self._planner.plan(partitions, clean=clean or self.handing_over)
        if offsets:
            offsets = await self._inheritance.first_commits(offsets)
        if not offsets:
            self._lag.update()  # the partitions' ends move without us
            return {}
        try:
            # aiokafka waits for a lost coordinator indefinitely; bound it and retry later.
            async with asyncio.timeout(self._timeout_s):
                await self._consumer.commit(offsets)
        except TimeoutError:
            self._metrics.commits.labels("retry").inc()
            logger.warning(
                "commit of %s timed out; retrying at the next commit", describe_commits(offsets)
            )
            return offsets
        except OffsetMetadataTooLargeError:
            # The broker's offset.metadata.max.bytes is below offset_map_max_bytes: commit the
            # positions alone, now and from now on (answered records may then run again).
            self._metrics.commits.labels("retry").inc()
            logger.warning(
                "the broker refuses offset maps this large; committing positions only "
                "(set --offset-map-max-bytes below the broker's offset.metadata.max.bytes)"
            )
            self._planner.refuse_maps()
            return await self.commit_planned(partitions, clean=clean)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group rebalanced under us: these records will be redelivered to the new owner,
            # unless this was the hand-over, which is made again once this member rejoins.
            self._metrics.commits.labels("failed").inc()
            if clean and partitions is not None:
                self.keep_unlanded(offsets)
                logger.info(
                    "hand-over commit of %s refused during the rebalance (%s); it is made "
                    "again after rejoining",
                    describe_commits(offsets),
                    exc,
                )
                return {}
            logger.warning(
                "commit of %s failed (%s); the records will be redelivered",
                describe_commits(offsets),
                exc,
            )
            return {}
        except KafkaError as exc:
            self._metrics.commits.labels("retry").inc()
            logger.warning(
                "commit of %s failed (%s); retrying at the next commit",
                describe_commits(offsets),
                exc,
            )
            return offsets
        self._tracker.committed(offsets)
        self._inheritance.landed(offsets)
        self._metrics.commits.labels("ok").inc()
        logger.debug("committed %s", describe_commits(offsets))
        self._lag.update()
        return {}

    def keep_unlanded(self, offsets: dict[TopicPartition, Commit]) -> None:
        """A hand-over the group refused or did not answer in time: made again later
        (`RefusedHandOvers.land`), after rejoining or by a stopping worker, rather than
        dropped. The next owner, finding a live writer's map that names jobs as running, waits
        a little for it; once this worker stopped, it would count a death against each.

        Only a hand-over that did not land: one that landed while more jobs were answered is
        what the next owner reads, and does not wait past (a later commit could land after
        it read, and its own commit then move the position back)."""
        if offsets:
            self._hand_overs.refused(offsets, {tp: self._tracker.last_commit(tp) for tp in offsets})
