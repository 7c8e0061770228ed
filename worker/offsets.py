"""The commit rule: per partition, the highest contiguous answered offset + 1."""

from __future__ import annotations

from collections import deque

from aiokafka import TopicPartition

__all__ = ["OffsetTracker", "PartitionOffsets"]


class PartitionOffsets:
    """Offsets of one partition that were started, in fetch order, and which of them finished.

    Records of a partition arrive in offset order, so the commit position is the first started
    offset that has not finished (or one past the last started when all did). Offsets may skip
    (compaction, transaction markers); only started ones count.
    """

    __slots__ = ("_done", "_order", "committed", "last_started")

    def __init__(self) -> None:
        self._order: deque[int] = deque()
        self._done: set[int] = set()
        self.last_started: int | None = None
        #: The position last committed for this partition (None until a commit).
        self.committed: int | None = None

    def start(self, offset: int) -> None:
        if self.last_started is not None and offset <= self.last_started:
            raise ValueError(
                f"offset {offset} started after {self.last_started}: records must be in order"
            )
        self._order.append(offset)
        self.last_started = offset

    def finish(self, offset: int) -> None:
        self._done.add(offset)
        # Pop the finished prefix now, so memory holds only the window of unfinished jobs.
        while self._order and self._order[0] in self._done:
            self._done.discard(self._order.popleft())

    @property
    def pending(self) -> int:
        """Started offsets not yet committable (unfinished, or finished behind a hole)."""
        return len(self._order)

    def commit_position(self) -> int | None:
        """The offset to commit (the next record to read), or None when nothing was started."""
        if self._order:
            return self._order[0]
        return None if self.last_started is None else self.last_started + 1


class OffsetTracker:
    """`PartitionOffsets` for every partition this worker holds."""

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, PartitionOffsets] = {}

    def start(self, tp: TopicPartition, offset: int) -> PartitionOffsets:
        """Mark `offset` started; return the partition's offsets, to finish it on later."""
        partition = self.partition(tp)
        partition.start(offset)
        return partition

    def partition(self, tp: TopicPartition) -> PartitionOffsets:
        """The offsets of `tp` as held now, to start and finish records on.

        Finishing on this object, not by `tp`, keeps an answer acknowledged after its partition
        was revoked (and maybe assigned back) from marking the new assignment's records
        answered.
        """
        partition = self._partitions.get(tp)
        if partition is None:
            partition = self._partitions[tp] = PartitionOffsets()
        return partition

    def to_commit(self, partitions: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Positions that moved since the last commit, for all held partitions or those given."""
        out: dict[TopicPartition, int] = {}
        for tp, partition in self._partitions.items():
            if partitions is not None and tp not in partitions:
                continue
            position = partition.commit_position()
            if position is not None and position != partition.committed:
                out[tp] = position
        return out

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        """Record a successful commit."""
        for tp, position in offsets.items():
            if (partition := self._partitions.get(tp)) is not None:
                partition.committed = position

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Drop revoked partitions: their next owner starts from the committed position."""
        for tp in partitions:
            self._partitions.pop(tp, None)

    def committed_position(self, tp: TopicPartition) -> int | None:
        partition = self._partitions.get(tp)
        return None if partition is None else partition.committed
