"""What the next commit says for each partition: positions and offset maps within their cap,
and what a map left out, or nearly did.

The maps' cap is `offset_map_max_bytes`, or nothing once the broker refused maps (its
`offset.metadata.max.bytes` is lower): positions alone from then on.
"""

from __future__ import annotations

import logging
from typing import Final

from aiokafka import TopicPartition

from worker.core.metrics import Metrics
from worker.delivery.offsets import Commit, OffsetTracker, Planned

__all__ = ["CommitPlanner"]

logger = logging.getLogger(__name__)

# Above this share of `offset_map_max_bytes` for what this owner finished out of order, a
# partition takes no new records until that shrinks: the gap closes instead of the map growing
# past what the broker stores. Inherited offsets and deaths do not count: holding cannot shrink
# them (they leave the map only as they are fetched).
_HOLD_AT: Final = 0.75

# What a map's left-out section costs, for the warning.
_CONSEQUENCES: Final = {
    "answered": "records answered out of order may run again",
    "running": "a death now would go uncounted by the crash-loop breaker",
    "deaths": "some earlier deaths are forgotten",
}


class CommitPlanner:
    """Plans the commits of the `tracker`'s partitions, maps within `map_max_bytes`; keeps which
    partitions' own out-of-order answers near that cap (`near_cap`) and warns once per change
    when a map leaves sections out."""

    def __init__(self, tracker: OffsetTracker, metrics: Metrics, *, map_max_bytes: int) -> None:
        self._tracker = tracker
        self._metrics = metrics
        self._map_max_bytes = map_max_bytes
        self._maps_refused = False
        # Partitions whose offset map was near its cap at their last commit.
        self._near_cap: set[TopicPartition] = set()
        # Partitions warned about, by the sections their map left out to fit.
        self._degraded: dict[TopicPartition, tuple[str, ...]] = {}

    @property
    def maps_on(self) -> bool:
        """Commits carry offset maps (configured, and the broker takes them)."""
        return self._map_max_bytes > 0 and not self._maps_refused

    def settled(self, *, clean: bool = False) -> bool:
        """Whether the group holds what a commit of every partition would say now, with maps
        as they can be committed now (none once the broker refused them)."""
        limit = self._map_max_bytes if self.maps_on else 0
        return not self._tracker.plan(None, clean=clean, limit=limit)

    def refuse_maps(self) -> None:
        """The broker refused a map this large: positions alone from now on."""
        self._maps_refused = True

    def near_cap(self) -> set[TopicPartition]:
        """Partitions whose own out-of-order answers neared the map's cap at their last plan,
        while records of theirs are in flight: with nothing in flight nothing is finished out
        of order, so none is held for it."""
        return {tp for tp in self._near_cap if not self._tracker.partition(tp).idle}

    def plan(
        self, partitions: set[TopicPartition] | None, *, clean: bool
    ) -> dict[TopicPartition, Commit]:
        """The commits to make, maps within their cap; note partitions whose own out-of-order
        answers near it. Never raises: a bug in building a map costs the map, not the commit."""
        limit = 0 if self._maps_refused else self._map_max_bytes
        try:
            planned = self._tracker.plan(partitions, clean=clean, limit=limit)
        except Exception:
            logger.exception("cannot build the offset maps; committing positions alone")
            return self._positions_alone(partitions)
        offsets: dict[TopicPartition, Commit] = {}
        for tp, plan in planned.items():
            offsets[tp] = plan.commit
            self._note_degraded(tp, plan, limit)
            if limit and plan.own_bytes >= _HOLD_AT * limit:
                self._near_cap.add(tp)
            else:
                self._near_cap.discard(tp)
        return offsets

    def forget(self, partitions: set[TopicPartition]) -> None:
        self._near_cap -= partitions
        for tp in partitions:
            self._degraded.pop(tp, None)

    def _positions_alone(
        self, partitions: set[TopicPartition] | None
    ) -> dict[TopicPartition, Commit]:
        offsets: dict[TopicPartition, Commit] = {}
        for tp, partition in self._tracker.items():
            position = partition.commit_position()
            if (partitions is None or tp in partitions) and position is not None:
                offsets[tp] = (position, "")
        return offsets

    def _note_degraded(self, tp: TopicPartition, plan: Planned, limit: int) -> None:
        """Warn (once per change) and count when a map left sections out to fit."""
        if plan.dropped == self._degraded.get(tp, ()):
            return
        if not plan.dropped:
            del self._degraded[tp]
            return
        self._degraded[tp] = plan.dropped
        for section in plan.dropped:
            self._metrics.offset_map_degraded.labels(section).inc()
        logger.warning(
            "%s-%s@%d: the offset map is over --offset-map-max-bytes (%d); left out: %s",
            tp.topic,
            tp.partition,
            plan.commit[0],
            limit,
            "; ".join(f"{s} ({_CONSEQUENCES[s]})" for s in plan.dropped),
        )
