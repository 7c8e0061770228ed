"""The commit rule: per partition, the highest contiguous answered offset + 1, and above it the
offsets answered out of order (the offset map, carried in the commit's metadata)."""

from __future__ import annotations

import logging
import sys
from collections import deque
from typing import NamedTuple

from aiokafka import TopicPartition

from worker.delivery.offset_map import OffsetMap, encode_bounded, encode_offset_map

__all__ = ["Commit", "OffsetTracker", "PartitionOffsets", "Planned", "describe_commits"]

logger = logging.getLogger(__name__)

#: What a commit sends for one partition: the position and its metadata (the offset map).
Commit = tuple[int, str]


def describe_commits(offsets: dict[TopicPartition, Commit]) -> str:
    """`topic-partition@position, ...` of some commits, for the log (their maps left out)."""
    return ", ".join(f"{tp.topic}-{tp.partition}@{o}" for tp, (o, _) in sorted(offsets.items()))


class Planned(NamedTuple):
    """A partition's next commit, and what its map says about this owner."""

    commit: Commit
    #: Sections of the map left out to fit the size limit (see `encode_bounded`).
    dropped: tuple[str, ...]
    #: Size of the map of what this owner finished out of order alone: what holding the
    #: partition can shrink (inherited offsets and deaths leave only as they are fetched).
    own_bytes: int


class PartitionOffsets:
    """Offsets of one partition that were started, in fetch order, and which of them finished.

    Records of a partition arrive in offset order, so the commit position is the first started
    offset that has not finished (or one past the last started when all did). Offsets may skip
    (compaction, transaction markers); only started ones count. `answered_before` are offsets a
    previous owner answered (read from the committed offset map): they finish as they start.
    """

    __slots__ = (
        "_done",
        "_order",
        "anchor",
        "answered_before",
        "committed",
        "deaths",
        "last_started",
    )

    def __init__(self) -> None:
        self._order: deque[int] = deque()
        self._done: set[int] = set()
        self.answered_before: set[int] = set()
        #: Offsets that were in flight when a worker process died, and at how many deaths.
        self.deaths: dict[int, int] = {}
        self.last_started: int | None = None
        #: The position and metadata last committed for this partition (None until a commit).
        self.committed: Commit | None = None
        #: The committed offset the inherited map was written for, until the first record is
        #: started: one started below it means the log was reset under the map.
        self.anchor: int | None = None

    def start(self, offset: int) -> bool:
        """Mark `offset` started; False when it was answered before and must not run again."""
        if self.last_started is not None and offset <= self.last_started:
            raise ValueError(
                f"offset {offset} started after {self.last_started}: records must be in order"
            )
        if self.anchor is not None:
            if offset < self.anchor:
                # Fetched from below the position the map was written for (an out-of-range
                # reset after the log was truncated and refilled): its offsets name other
                # records now.
                logger.warning(
                    "records start at offset %d, below the committed %d the offset map was "
                    "written for; ignoring the map",
                    offset,
                    self.anchor,
                )
                self.answered_before.clear()
                self.deaths.clear()
            self.anchor = None
        if self.deaths:
            # Suspects the log no longer holds (compacted, or past a reset) blame nobody.
            for gone in [o for o in self.deaths if o < offset]:
                del self.deaths[gone]
        self._order.append(offset)
        self.last_started = offset
        if self.answered_before and offset in self.answered_before:
            self.answered_before.discard(offset)
            self.finish(offset)
            return False
        return True

    def unstart(self, offset: int) -> None:
        """Take back the start of `offset`, the last one started: it did not run after all."""
        if not self._order or self._order[-1] != offset or offset in self._done:
            raise ValueError(f"offset {offset} is not the last one started and unfinished")
        self._order.pop()
        # Everything below it is finished or absent: committing at it is right.
        self.last_started = self._order[-1] if self._order else offset - 1

    def finish(self, offset: int) -> None:
        if not self._order or offset < self._order[0] or offset > self._order[-1]:
            return  # finished already (an answer acknowledged twice): nothing left to do
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
        if self.last_started is None:
            # Nothing started yet: the position it was assigned at, so that its first commit
            # replaces the previous owner's map (whose running jobs are not running here).
            return self.anchor
        return self.last_started + 1

    def to_commit(self, *, clean: bool = False, writer: int = 0) -> Commit | None:
        """Position and offset map, or None when nothing was started (see `plan`)."""
        planned = self.plan(clean=clean, writer=writer)
        return None if planned is None else planned.commit

    def plan(
        self, *, clean: bool = False, limit: int | None = None, writer: int = 0
    ) -> Planned | None:
        """Position and offset map of at most `limit` characters (no map at 0), or None when
        nothing was started.

        The map holds what finished behind an unfinished offset and what a previous owner
        answered that was not fetched yet (the next owner skips both), what is running now and
        the deaths of earlier suspects (for the crash-loop breaker), whether this is a clean
        hand-over, and the `writer`'s incarnation. What does not fit is left out, answered runs
        first (`encode_bounded`).
        """
        position = self.commit_position()
        if position is None:
            return None
        done = self._done
        above = [o for o in self.answered_before if o >= position]
        running = [o for o in self._order if o not in done]
        deaths = {o: n for o, n in self.deaths.items() if o >= position}
        if limit is not None and limit <= 0:
            return Planned((position, ""), (), 0)
        bounded = encode_bounded(
            sys.maxsize if limit is None else limit,
            position,
            [*done, *above],
            running=running,
            deaths=deaths,
            clean=clean,
            writer=writer,
        )
        own = len(encode_offset_map(position, done)) if done else 0
        return Planned((position, bounded.metadata), bounded.dropped, own)


class OffsetTracker:
    """`PartitionOffsets` for every partition this worker holds; its maps name `writer`, the
    incarnation of the process (`worker.core.incarnation`; 0: none)."""

    def __init__(self, writer: int = 0) -> None:
        self._partitions: dict[TopicPartition, PartitionOffsets] = {}
        self.writer = writer

    def assigned(
        self,
        tp: TopicPartition,
        previous: OffsetMap,
        anchor: int | None = None,
        *,
        writer_alive: bool = False,
    ) -> None:
        """A partition was assigned; `previous` is what its last commit, at `anchor`, said.
        When that commit was not a clean hand-over and its writer is not `writer_alive` (a
        member of the group still, whose hand-over commit did not land), the writer died with
        `previous.running` in flight."""
        partition = self.partition(tp)
        # Offsets started already (only if a fetch raced the assignment) are running anyway.
        last = -1 if partition.last_started is None else partition.last_started
        if anchor is not None and partition.last_started is None:
            partition.anchor = anchor
        partition.answered_before |= {o for o in previous.answered if o > last}
        deaths = {o: n for o, n in previous.deaths.items() if o > last}
        if not previous.clean and not writer_alive:
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
        return {tp: p.commit for tp, p in self.plan(partitions, clean=clean).items()}

    def plan(
        self,
        partitions: set[TopicPartition] | None = None,
        *,
        clean: bool = False,
        limit: int | None = None,
    ) -> dict[TopicPartition, Planned]:
        """The commits of `to_commit`, with maps of at most `limit` characters."""
        out: dict[TopicPartition, Planned] = {}
        for tp, partition in self._partitions.items():
            if partitions is not None and tp not in partitions:
                continue
            planned = partition.plan(clean=clean, limit=limit, writer=self.writer)
            if planned is not None and planned.commit != partition.committed:
                out[tp] = planned
        return out

    def holds(self, tp: TopicPartition) -> bool:
        """Whether `tp` is held already (kept through a rebalance)."""
        return tp in self._partitions

    def items(self) -> list[tuple[TopicPartition, PartitionOffsets]]:
        """Every partition held, with its offsets."""
        return list(self._partitions.items())

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
