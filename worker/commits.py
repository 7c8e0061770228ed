"""Offset commits: when to commit, what a failed commit means, and the lag they leave.

Commits on the interval run in a task of their own, so a slow coordinator (aiokafka waits for a
lost one indefinitely) never holds up fetching; a revoke or the shutdown commits at once and
waits, for at most `commit_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from worker.config import Settings
from worker.metrics import Metrics
from worker.offsets import OffsetTracker, PartitionOffsets

__all__ = ["Committer"]

logger = logging.getLogger(__name__)


class Committer:
    """Commits, per partition, the highest offset below which every record is answered."""

    def __init__(self, consumer: AIOKafkaConsumer, settings: Settings, metrics: Metrics) -> None:
        self._consumer = consumer
        self._interval_s = settings.commit_interval_ms / 1000
        self._timeout_s = settings.commit_timeout_s
        self._metrics = metrics
        self.tracker = OffsetTracker()
        self._last = 0.0
        self._task: asyncio.Task[None] | None = None

    def partition(self, tp: TopicPartition) -> PartitionOffsets:
        """The offsets of `tp`: `start` each fetched record on it, and finish it there."""
        return self.tracker.partition(tp)

    def tick(self) -> None:
        """Start a commit in the background when the interval has passed and none is running."""
        if self._task is not None:
            return
        now = time.monotonic()
        if now - self._last < self._interval_s:
            return
        self._last = now
        self._task = asyncio.create_task(self._commit(None), name="commit")
        self._task.add_done_callback(self._commit_done)

    async def commit_now(self, partitions: set[TopicPartition] | None = None) -> None:
        """Commit `partitions` (all when None) and wait, after any commit still running; both
        within one `commit_timeout_s`."""
        try:
            async with asyncio.timeout(self._timeout_s):
                if self._task is not None:
                    await asyncio.shield(self._task)
                await self._commit(partitions)
        except TimeoutError:
            self._metrics.commits.labels("retry").inc()
            logger.warning("commit did not finish in %.1fs; going on", self._timeout_s)

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Revoked: their next owner starts from the committed position."""
        self.tracker.forget(partitions)
        for tp in partitions:
            with contextlib.suppress(KeyError):
                self._metrics.consumer_lag.remove(tp.topic, str(tp.partition))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def committed_position(self, tp: TopicPartition) -> int | None:
        return self.tracker.committed_position(tp)

    def _commit_done(self, task: asyncio.Task[None]) -> None:
        self._task = None
        if not task.cancelled() and (exc := task.exception()) is not None:
            # _commit handles every Kafka error; anything else is a bug worth a traceback.
            logger.error("background commit failed", exc_info=exc)

    async def _commit(self, partitions: set[TopicPartition] | None) -> None:
        offsets = self.tracker.to_commit(partitions)
        if not offsets:
            self._update_lag()  # the partitions' ends move without us
            return
        try:
            # aiokafka waits for a lost coordinator indefinitely; bound it and retry later.
            await asyncio.wait_for(self._consumer.commit(offsets), self._timeout_s)
        except TimeoutError:
            self._metrics.commits.labels("retry").inc()
            logger.warning("commit of %s timed out; retrying at the next commit", _fmt(offsets))
            return
        except (CommitFailedError, IllegalStateError) as exc:
            # The group rebalanced under us: these records will be redelivered to the new owner.
            self._metrics.commits.labels("failed").inc()
            logger.warning(
                "commit of %s failed (%s); the records will be redelivered", _fmt(offsets), exc
            )
            return
        except KafkaError as exc:
            self._metrics.commits.labels("retry").inc()
            logger.warning(
                "commit of %s failed (%s); retrying at the next commit", _fmt(offsets), exc
            )
            return
        self.tracker.committed(offsets)
        self._metrics.commits.labels("ok").inc()
        logger.debug("committed %s", _fmt(offsets))
        self._update_lag()

    def _update_lag(self) -> None:
        # Lag is measured from the committed position, so it moves only with commits.
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            position = self.tracker.committed_position(tp)
            if highwater is not None and position is not None:
                self._metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(
                    max(highwater - position, 0)
                )


def _fmt(offsets: dict[TopicPartition, int]) -> str:
    return ", ".join(f"{tp.topic}-{tp.partition}@{o}" for tp, o in sorted(offsets.items()))
