"""The state this worker keeps per partition, held back and forgotten in one place.

Each part decides over its own state: the committer over the offsets (held, parked, their maps
read and near their cap), the crash-loop breaker over the suspects of a crash, the version
holds over the records waiting for newer weights. A partition revoked for good is forgotten by
all of them at once (`forget`); the gate asks all of them, before every fetch, which partitions
to hold back (`held`).
"""

from __future__ import annotations

from aiokafka import TopicPartition

from worker.delivery.commits import Committer
from worker.loop.breaker import CrashLoopBreaker
from worker.loop.version_holds import VersionHolds

__all__ = ["PartitionStates"]


class PartitionStates:
    """The one owner the rebalance side tells what happened to a partition: a `HoldReason`
    (`worker.loop.gate`) for the gate, made of the committer's, the breaker's and the version
    holds' reasons."""

    def __init__(
        self, committer: Committer, breaker: CrashLoopBreaker, holds: VersionHolds
    ) -> None:
        self._committer = committer
        self._parts = (committer, breaker, holds)

    def held(self) -> set[TopicPartition]:
        """The partitions any part holds back now (each re-examines its reason)."""
        held: set[TopicPartition] = set()
        for part in self._parts:
            held |= part.held()
        return held

    def forget(self, partitions: set[TopicPartition]) -> None:
        """`partitions` were revoked, or parked and moved: whatever any part kept of them is
        their next owner's business."""
        for part in self._parts:
            part.forget(partitions)

    def drop_parked(self, tp: TopicPartition) -> None:
        """The parked `tp` is not to be adopted: its offsets and what was read of it are
        forgotten now; its suspects and holds go when the verdict that it moved comes
        (`forget`)."""
        self._committer.drop_parked(tp)
