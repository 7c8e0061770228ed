"""The commit rule: per partition, the highest contiguous answered offset + 1, and above it the
offsets answered out of order (the offset map, carried in the commit's metadata)."""

from __future__ import annotations

from collections import deque

from aiokafka import TopicPartition

from worker.delivery.offset_map import OffsetMap, encode_offset_map

__all__ = ["OffsetTracker", "PartitionOffsets"]

#: What a commit sends for one partition: the position and its metadata (the offset map).
Commit = tuple[int, str]


class PartitionOffsets:
    """Offsets of one partition that were started, in fetch order, and which of them finished.

    Records of a partition arrive in offset order, so the commit position is the first started
    offset that has not finished (or one past the last started when all did). Offsets may skip
    (compaction, transaction markers); only started ones count. `answered_before` are offsets a
    previous owner answered (read from the committed offset map): they finish as they start.
    """

    __slots__ = ("_done", "_order", "answered_before", "committed", "deaths", "last_started")

    def __init__(self) -> None:
        self._order: deque[int] = deque()
        self._done: set[int] = set()
        self.answered_before: set[int] = set()
        #: Offsets that were in flight when a worker process died, and at how many deaths.
        self.deaths: dict[int, int] = {}
        self.last_started: int | None = None
        #: The position and metadata last committed for this partition (None until a commit).
        self.committed: Commit | None = None

    def start(self, offset: int) -> bool:
        """Mark `offset` started; False when it was answered before and must not run again."""
        if self.last_started is not None and offset <= self.last_started:
            raise ValueError(
                f"offset {offset} started after {self.last_started}: records must be in order"
            )
        self._order.append(offset)
        self.last_started = offset
        if self.answered_before and offset in self.answered_before:
            self.answered_before.discard(offset)
            self.finish(offset)
            return False
        return True

    def finish(self, offset: int) -> None:
        if self.deaths:
            self.deaths.pop(offset, None)
        self._done.add(offset)
        # Pop the finished prefix now, so memory holds only the window of unfinished jobs.
        while self._order and self._order[0] in self._done:
            self._done.discard(self._order.popleft())

    @property
    def idle(self) -> bool:
        """Every record started is answered and acknowledged."""
        return not self._order

    @property
    def pending(self) -> int:
        """Started offsets not yet committable (unfinished, or finished behind a hole)."""
        return len(self._order)

    def commit_position(self) -> int | None:
        """The offset to commit (the next record to read), or None when nothing was started."""
        if self._order:
            return self._order[0]
        return None if self.last_started is None else self.last_started + 1

    def to_commit(self, *, clean: bool = False) -> Commit | None:
        """Position and offset map, or None when nothing was started.

        The map holds what finished behind an unfinished offset and what a previous owner
        answered that was not fetched yet (the next owner skips both), what is running now and
        the deaths of earlier suspects (for the crash-loop breaker), and whether this is a
        clean hand-over.
        """
        position = self.commit_position()
        if position is None:
            return None
        done = self._done
        above = [o for o in self.answered_before if o >= position]
        running = [o for o in self._order if o not in done]
        metadata = encode_offset_map(
            position, [*done, *above], running=running, deaths=self.deaths, clean=clean
        )
        return position, metadata


class OffsetTracker:
    """`PartitionOffsets` for every partition this worker holds."""

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, PartitionOffsets] = {}

    def assigned(self, tp: TopicPartition, previous: OffsetMap) -> None:
        """A partition was assigned; `previous` is what its last commit said. When that commit
        was not a clean hand-over, its writer died with `previous.running` in flight."""
        partition = self.partition(tp)
        # Offsets started already (only if a fetch raced the assignment) are running anyway.
        last = -1 if partition.last_started is None else partition.last_started
        partition.answered_before |= {o for o in previous.answered if o > last}
        deaths = {o: n for o, n in previous.deaths.items() if o > last}
        if not previous.clean:
            for offset in previous.running - previous.answered:
                if offset > last:
                    deaths[offset] = deaths.get(offset, 0) + 1
        partition.deaths.update(deaths)

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

    def to_commit(
        self, partitions: set[TopicPartition] | None = None, *, clean: bool = False
    ) -> dict[TopicPartition, Commit]:
        """Positions and maps that moved since the last commit, for all held partitions or
        those given."""
        out: dict[TopicPartition, Commit] = {}
        for tp, partition in self._partitions.items():
            if partitions is not None and tp not in partitions:
                continue
            commit = partition.to_commit(clean=clean)
            if commit is not None and commit != partition.committed:
                out[tp] = commit
        return out

    def committed(self, offsets: dict[TopicPartition, Commit]) -> None:
        """Record a successful commit."""
        for tp, commit in offsets.items():
            if (partition := self._partitions.get(tp)) is not None:
                partition.committed = commit

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Drop revoked partitions: their next owner starts from the committed position."""
        for tp in partitions:
            self._partitions.pop(tp, None)

    def committed_position(self, tp: TopicPartition) -> int | None:
        partition = self._partitions.get(tp)
        return None if partition is None or partition.committed is None else partition.committed[0]
