"""What commits leave behind: the records not yet committed, the lag from the committed
positions, and a hold on fetching while answers wait for commits that do not land."""

from __future__ import annotations

import contextlib
import logging
from typing import Final

from aiokafka import TopicPartition

from worker.core.clock import Clock
from worker.core.consumer_port import GroupConsumer
from worker.core.metrics import Metrics
from worker.delivery.offsets import OffsetTracker

__all__ = ["CommitLag", "StalledCommits"]

logger = logging.getLogger(__name__)

# Commits normally land within an interval of the answers they cover: answers that waited this
# many intervals (and at least this long) mean commits stopped landing.
_COMMITS_STALLED_AFTER: Final = 4
_COMMITS_STALLED_MIN_S: Final = 2.0


class CommitLag:
    """The records of the `tracker`'s partitions behind their committed positions."""

    def __init__(self, consumer: GroupConsumer, tracker: OffsetTracker, metrics: Metrics) -> None:
        self._consumer = consumer
        self._tracker = tracker
        self._metrics = metrics

    def uncommitted(self) -> int:
        """Records started and not yet below the committed position of their partition."""
        total = 0
        for _, partition in self._tracker.items():
            position = partition.commit_position()
            committed = partition.committed
            total += partition.pending
            if position is not None and committed is not None:
                total += max(position - committed[0] - partition.pending, 0)
        return total

    def lag(self) -> int | None:
        """Records behind the ends of the assigned partitions, from the committed positions;
        None before anything is known."""
        total, known = 0, False
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            position = self._tracker.committed_position(tp)
            if highwater is not None and position is not None:
                total += max(highwater - position, 0)
                known = True
        return total if known else None

    def update(self) -> None:
        """Set the lag gauges: measured from the committed position, they move only with
        commits."""
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            position = self._tracker.committed_position(tp)
            if highwater is not None and position is not None:
                self._metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(
                    max(highwater - position, 0)
                )

    def forget(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            with contextlib.suppress(KeyError):
                self._metrics.consumer_lag.remove(tp.topic, str(tp.partition))


class StalledCommits:
    """Holds every partition while more answers than `limit` wait for a commit and the oldest
    has waited long (commits land every `interval_s` otherwise): a coordinator that is away
    takes no commit, and a worker that went on answering would leave ever more work for a
    death to redo. The jobs in flight finish; the next landed commit lifts the hold. No hold
    without a `limit`."""

    def __init__(
        self, tracker: OffsetTracker, *, interval_s: float, limit: int | None, clock: Clock
    ) -> None:
        self._tracker = tracker
        self._clock = clock
        self._limit = limit
        self._stalled_after_s = max(_COMMITS_STALLED_AFTER * interval_s, _COMMITS_STALLED_MIN_S)
        self._stalled = False

    def held(self) -> set[TopicPartition]:
        """Every partition held, while commits stall; none otherwise."""
        limit = self._limit
        if limit is None:
            return set()
        held = self._tracker.items()
        waiting, oldest = 0, None
        for _, partition in held:
            count, since = partition.uncommitted_answers
            waiting += count
            if since is not None and (oldest is None or since < oldest):
                oldest = since
        stalled = (
            waiting > limit
            and oldest is not None
            and self._clock.monotonic() - oldest >= self._stalled_after_s
        )
        if stalled != self._stalled:
            self._stalled = stalled
            if stalled:
                logger.warning(
                    "%d answers wait for commits that have not landed for %.1fs; fetching "
                    "no new records until one lands",
                    waiting,
                    self._clock.monotonic() - (oldest or 0.0),
                )
            else:
                logger.info("commits land again; fetching records")
        return {tp for tp, _ in held} if stalled else set()
