"""The commit rule: per partition, the highest contiguous answered offset + 1, and above it the
offsets answered out of order (the offset map, carried in the commit's metadata)."""

from __future__ import annotations

import bisect
import heapq
import logging
import sys
from collections import deque
from collections.abc import Mapping
from typing import NamedTuple

from aiokafka import TopicPartition

from worker.core.clock import SYSTEM_CLOCK, Clock
from worker.delivery.offset_map import OffsetMap, Run, encode_bounded_runs, encoded_length
from worker.delivery.parked import ParkedPartitions

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

    What finished above the position is kept as runs of consecutive offsets, merged as each
    offset finishes, and the last plan is kept until something changes: behind one long job at
    the head, a commit costs what the runs and the jobs in flight cost, not what the thousands
    of offsets answered behind it would.
    """

    __slots__ = (
        "_clock",
        "_covered",
        "_finishes",
        "_planned",
        "_run_starts",
        "_run_stops",
        "_running",
        "_running_peak",
        "_started",
        "_uncovered_since",
        "_version",
        "anchor",
        "answered_before",
        "committed",
        "deaths",
        "floor",
        "last_started",
    )

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        #: What the ages of plans and of answers waiting for a commit are read on.
        self._clock = clock
        # Started offsets from the first unfinished one on, in order (starts come in order),
        # and those of them still unfinished.
        self._started: deque[int] = deque()
        self._running: set[int] = set()
        # The most offsets `_running` held since it was last rebuilt: a set keeps the table
        # of its largest size, and iterating it (each plan) walks that whole table.
        self._running_peak = 0
        # Finished offsets above the position, as runs [start, stop), in order.
        self._run_starts: list[int] = []
        self._run_stops: list[int] = []
        # Bumped by every start and finish: the last plan holds until it moves.
        self._version = 0
        # The last plan, with how many finishes it covers and when it was made.
        self._planned: tuple[tuple[object, ...], Planned, int, float] | None = None
        # Finishes so far, those the last landed commit covers, and since when the first one
        # it does not cover has waited (None: none waits).
        self._finishes = 0
        self._covered = 0
        self._uncovered_since: float | None = None
        self.answered_before: set[int] = set()
        #: Offsets that were in flight when a worker process died, and at how many deaths.
        self.deaths: dict[int, int] = {}
        self.last_started: int | None = None
        #: The position and metadata last committed for this partition (None until a commit).
        self.committed: Commit | None = None
        #: The committed offset the inherited map was written for, until the first record is
        #: started: one started below it means the log was reset under the map.
        self.anchor: int | None = None
        #: Records below it were answered by another member, whose commit there landed after
        #: this owner read the partition's map (`overtaken`): they are skipped, never committed
        #: below.
        self.floor = 0

    def start(self, offset: int) -> bool:
        """Mark `offset` started; False when it was answered before and must not run again."""
        if offset < self.floor:
            return False
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
            # Suspects the log no longer holds (compacted, or past a reset) blame nobody. One
            # still in flight (answered as crash-looped, not yet acknowledged) keeps its count
            # until it finishes: a death meanwhile must not count as its first.
            for gone in [o for o in self.deaths if o < offset and o not in self._running]:
                del self.deaths[gone]
        self._started.append(offset)
        self._running.add(offset)
        self._running_peak = max(self._running_peak, len(self._running))
        self.last_started = offset
        self._version += 1
        if self.answered_before and offset in self.answered_before:
            self.answered_before.discard(offset)
            self.finish(offset)
            return False
        return True

    def overtaken(self, position: int, previous: OffsetMap | None) -> int:
        """Another member committed `position` (with `previous`, its map) after this owner read
        the partition's map: a last owner's hand-over that landed after the new owner stopped
        waiting for it. What lies below `position` was answered there; committing below it
        would move the group's position back. Records of this owner's below it that are in
        flight are answered twice; returns how many."""
        self.floor = max(self.floor, position)
        below = {o for o in self._running if o < position}
        self._running -= below
        while self._started and self._started[0] < position:
            self._started.popleft()
        self._drop_finished_below(position)
        if self._run_starts and self._run_starts[0] < position:
            self._run_starts[0] = position
        last = -1 if self.last_started is None else self.last_started
        if previous is not None:
            self.answered_before |= {o for o in previous.answered if o > last}
            for offset, count in previous.deaths.items():
                self.deaths[offset] = max(self.deaths.get(offset, 0), count)
        self.answered_before = {o for o in self.answered_before if o >= position}
        self.deaths = {o: n for o, n in self.deaths.items() if o >= position}
        if self.anchor is not None:
            self.anchor = max(self.anchor, position)
        self._version += 1
        self._drop_finished_head()
        return len(below)

    def unstart(self, offset: int) -> None:
        """Take back the start of `offset`, the last one started: it did not run after all.
        One below the floor is no longer tracked (answered by another member, `overtaken`)."""
        if offset < self.floor:
            return
        if offset != self.last_started or offset not in self._running:
            raise ValueError(f"offset {offset} is not the last one started and unfinished")
        self._running.discard(offset)
        self._started.pop()
        self._version += 1
        # Everything below it is finished or absent: committing at it is right.
        self.last_started = self._started[-1] if self._started else offset - 1
        self._drop_finished_head()

    def finish(self, offset: int) -> None:
        if offset not in self._running:
            return  # finished already (an answer acknowledged twice): nothing left to do
        self._running.discard(offset)
        if len(self._running) * 8 < self._running_peak:
            # Rebuilt at an eighth of its peak: amortised over the finishes that emptied it.
            self._running = set(self._running)
            self._running_peak = len(self._running)
        self._version += 1
        if self._finishes == self._covered:
            self._uncovered_since = self._clock.monotonic()
        self._finishes += 1
        if self.deaths:
            self.deaths.pop(offset, None)
        if offset == self._started[0]:
            self._drop_finished_head()
        else:
            self._add_finished(offset)

    def _drop_finished_head(self) -> None:
        """The finished offsets from the head on are committable now: they leave the map."""
        started, running = self._started, self._running
        while started and started[0] not in running:
            started.popleft()
        if self._run_stops:
            position = self.commit_position()
            if position is not None:
                self._drop_finished_below(position)

    def _add_finished(self, offset: int) -> None:
        """Merge `offset` into the runs of finished offsets above the position."""
        starts, stops = self._run_starts, self._run_stops
        i = bisect.bisect_right(starts, offset)
        if i and stops[i - 1] == offset:
            stops[i - 1] = offset + 1
            if i < len(starts) and starts[i] == offset + 1:
                stops[i - 1] = stops[i]
                del starts[i], stops[i]
        elif i < len(starts) and starts[i] == offset + 1:
            starts[i] = offset
        else:
            starts.insert(i, offset)
            stops.insert(i, offset + 1)

    def _drop_finished_below(self, position: int) -> None:
        """The runs below the position are committable now: they leave the map."""
        stops = self._run_stops
        k = bisect.bisect_right(stops, position)
        if k:
            del self._run_starts[:k], stops[:k]

    @property
    def uncommitted_answers(self) -> tuple[int, float | None]:
        """How many records finished that no landed commit covers yet, and since when the
        first of them waits (None: none does). A death redoes them."""
        return self._finishes - self._covered, self._uncovered_since

    def landed(self, commit: Commit) -> None:
        """`commit` landed. When it is the last plan, the finishes planned in it are covered;
        an older one (planned before a newer plan) counts as covering nothing new."""
        self.committed = commit
        if self._planned is None or self._planned[1].commit != commit:
            return
        _, _, covered, planned_at = self._planned
        if covered <= self._covered:
            return
        self._covered = covered
        self._uncovered_since = None if covered == self._finishes else planned_at

    @property
    def idle(self) -> bool:
        """Every record started is answered and acknowledged."""
        return not self._running

    @property
    def pending(self) -> int:
        """Started offsets not yet committable (unfinished, or finished behind a hole)."""
        return len(self._started)

    def commit_position(self) -> int | None:
        """The offset to commit (the next record to read), or None when nothing was started."""
        if self._started:
            return max(self._started[0], self.floor)
        if self.last_started is None:
            # Nothing started yet: the position it was assigned at, so that its first commit
            # replaces the previous owner's map (whose running jobs are not running here).
            return self.anchor
        return max(self.last_started + 1, self.floor)

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
        first (`encode_bounded`). Built once for each state: asked again before anything
        started or finished, the last plan is returned.
        """
        position = self.commit_position()
        if position is None:
            return None
        # What the plan depends on beyond starts and finishes, which the tracker's readers
        # of committed maps change from outside.
        key = (
            self._version,
            position,
            clean,
            limit,
            writer,
            len(self.answered_before),
            tuple(self.deaths.items()),
        )
        if self._planned is not None and self._planned[0] == key:
            return self._planned[1]
        if limit is not None and limit <= 0:
            planned_at = self._clock.monotonic()
            self._planned = (key, Planned((position, ""), (), 0), self._finishes, planned_at)
            return self._planned[1]
        own = [(a, b, 0) for a, b in zip(self._run_starts, self._run_stops, strict=True)]
        answered = own
        if self.answered_before:
            above = [o for o in self.answered_before if o >= position]
            if above:
                answered = _merged(own, _runs_of(sorted(above)))
        deaths = {o: n for o, n in self.deaths.items() if o >= position}
        bounded = encode_bounded_runs(
            sys.maxsize if limit is None else limit,
            position,
            answered,
            running=self._running,
            deaths=deaths,
            clean=clean,
            writer=writer,
        )
        planned = Planned(
            (position, bounded.metadata), bounded.dropped, encoded_length(position, own)
        )
        self._planned = (key, planned, self._finishes, self._clock.monotonic())
        return planned


def _runs_of(offsets: list[int]) -> list[Run]:
    """The runs of consecutive offsets of a sorted list without repeats."""
    out: list[Run] = []
    for offset in offsets:
        if out and out[-1][1] == offset:
            out[-1] = (out[-1][0], offset + 1, 0)
        else:
            out.append((offset, offset + 1, 0))
    return out


def _merged(one: list[Run], other: list[Run]) -> list[Run]:
    """Two ordered lists of disjoint runs as one, adjacent runs joined."""
    out: list[Run] = []
    for start, stop, _ in heapq.merge(one, other):
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop, 0)
        else:
            out.append((start, stop, 0))
    return out


class OffsetTracker:
    """`PartitionOffsets` for every partition this worker holds; its maps name `writer`, the
    incarnation of the process (`worker.core.incarnation`; 0: none). Each partition's offsets
    read the time on `clock`."""

    def __init__(self, writer: int = 0, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._partitions: dict[TopicPartition, PartitionOffsets] = {}
        #: Revoked partitions whose jobs still run, until the next assignment says whether
        #: they came back (`park`): not held, so nothing starts on them or commits them
        #: meanwhile.
        self.parked_partitions: ParkedPartitions[PartitionOffsets] = ParkedPartitions()
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
        """The offsets of `tp` as held now (or as parked), to start and finish records on.

        Finishing on this object, not by `tp`, keeps an answer acknowledged after its partition
        was revoked (and maybe assigned back) from marking the new assignment's records
        answered.
        """
        partition = self._partitions.get(tp)
        if partition is None:
            partition = self.parked_partitions.offsets().get(tp)
        if partition is None:
            partition = self._partitions[tp] = PartitionOffsets(self._clock)
        return partition

    def deaths(self, tp: TopicPartition) -> Mapping[int, int]:
        """The deaths `tp`'s records were in flight at, as held now (or as parked); none for
        a partition not held. Unlike `partition`, it takes nothing on: a partition just
        assigned must stay unheld until its committed map is read, or the read is skipped as
        for a partition kept through the rebalance, and the records that map names answered
        or suspect run again as new."""
        partition = self._partitions.get(tp)
        if partition is None:
            partition = self.parked_partitions.offsets().get(tp)
        return {} if partition is None else partition.deaths

    def park(self, partitions: set[TopicPartition]) -> None:
        """`partitions` were revoked with jobs still running, and handed over: kept aside,
        neither held nor committed, until the next assignment adopts them (`unpark`) or
        they are forgotten."""
        for tp in partitions:
            if (partition := self._partitions.pop(tp, None)) is not None:
                self.parked_partitions.park(tp, partition)

    def parked(self) -> Mapping[TopicPartition, PartitionOffsets]:
        """The partitions parked now, with their offsets (read-only)."""
        return self.parked_partitions.offsets()

    def unpark(self, tp: TopicPartition) -> PartitionOffsets:
        """Hold the parked `tp` again, as it was when it was revoked."""
        partition = self._partitions[tp] = self.parked_partitions.unpark(tp)
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
            if planned is None:
                continue
            if planned.commit != partition.committed:
                out[tp] = planned
            else:  # what the broker holds says it all already
                partition.landed(planned.commit)
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
                partition.landed(commit)

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Drop revoked partitions: their next owner starts from the committed position."""
        for tp in partitions:
            self._partitions.pop(tp, None)
            self.parked_partitions.drop(tp)

    def last_commit(self, tp: TopicPartition) -> Commit | None:
        """What this worker last committed for `tp` (None: nothing, or not held)."""
        partition = self._partitions.get(tp)
        return None if partition is None else partition.committed

    def committed_position(self, tp: TopicPartition) -> int | None:
        partition = self._partitions.get(tp)
        return None if partition is None or partition.committed is None else partition.committed[0]
