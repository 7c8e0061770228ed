"""Offset commits: when to commit, and the committer that holds a worker's offsets.

What a commit says is planned in `commit_plan`, made in `commit_call`; revoked partitions are
handed over and adopted back in `parking`; `commit_lag` measures what commits leave behind.
Commits on the interval run in a task of their own, so a slow coordinator (aiokafka waits for a
lost one indefinitely) never holds up fetching; a revoke or the shutdown commits at once and
waits, for at most `commit_timeout_s`. Each commit carries the partition's offset map (answered
offsets above it, `worker.delivery.offset_map`) in its metadata; on assignment the map is read back, so
the records it names are not generated again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from worker.core.clients import AIOKAFKA, KafkaClients
from worker.core.clock import SYSTEM_CLOCK, Clock
from worker.core.config import Settings
from worker.core.consumer_port import GroupConsumer
from worker.core.incarnation import incarnations_of_members, new_incarnation
from worker.core.kafka import client_kwargs
from worker.core.metrics import Metrics
from worker.delivery.alive import LiveIncarnations
from worker.delivery.commit_call import CommitMaker
from worker.delivery.commit_lag import CommitLag, StalledCommits
from worker.delivery.commit_plan import CommitPlanner
from worker.delivery.hand_overs import CommittedReader, RefusedHandOvers
from worker.delivery.inheritance import Inheritance
from worker.delivery.offsets import Commit, OffsetTracker, PartitionOffsets
from worker.delivery.parking import Parking

__all__ = ["CommittedReader", "Committer", "GroupOffsetsReader", "LiveIncarnations"]

logger = logging.getLogger(__name__)


# How often a stopping worker tries its hand-over again while the coordinator does not take it.
_HAND_OVER_RETRY_S: Final = 0.5

# The longest a batch of jobs waits for the commit that names them as running.
_WRITE_AHEAD_WAIT_S: Final = 1.0


class GroupOffsetsReader:
    """Reads the group's committed offsets with their metadata (the offset maps) through the
    admin client: aiokafka's consumer returns committed offsets without their metadata."""

    def __init__(self, settings: Settings, kafka_clients: KafkaClients = AIOKAFKA) -> None:
        self._admin = kafka_clients.admin(**client_kwargs(settings))
        self._group_id = settings.group_id
        self._started = False

    async def __call__(self, partitions: list[TopicPartition]) -> dict[TopicPartition, Commit]:
        admin = await self._started_admin()
        committed = await admin.list_consumer_group_offsets(self._group_id, partitions=partitions)
        return {tp: (c.offset, c.metadata or "") for tp, c in committed.items()}

    async def live_incarnations(self) -> set[int] | None:
        """The incarnations the group's live members announce (`worker.core.incarnation`);
        None while the group rebalances (its members' metadata is not returned then)."""
        admin = await self._started_admin()
        described = await admin.describe_consumer_groups([self._group_id])
        return incarnations_of_members(described, self._group_id)

    async def close(self) -> None:
        if self._started:
            await self._admin.close()

    async def _started_admin(self) -> AIOKafkaAdminClient:
        """The admin client, started on first use: a worker that is never assigned a
        partition never connects it."""
        if not self._started:
            await self._admin.start()
            self._started = True
        return self._admin


class Committer:
    """Commits, per partition, the highest offset below which every record is answered.

    Its parts: a `CommitPlanner` says what each commit holds, a `CommitMaker` makes them one
    at a time, `Parking` hands revoked partitions over and adopts them back, `Inheritance`
    reads what the previous owners committed, `CommitLag` and `StalledCommits` watch what the
    commits leave behind. This class decides when to commit, and forgets revoked partitions
    in all of them."""

    def __init__(
        self,
        consumer: GroupConsumer,
        settings: Settings,
        metrics: Metrics,
        read_committed: CommittedReader | None = None,
        *,
        live_incarnations: LiveIncarnations | None = None,
        incarnation: int | None = None,
        on_background_done: Callable[[], None] = lambda: None,
        uncommitted_answers_max: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._clock = clock
        #: Called when a commit in the background ended (and another may start): what waits
        #: for one to land (the breaker) may go on.
        self._on_background_done = on_background_done
        self._interval_s = settings.commit_interval_ms / 1000
        self._timeout_s = timeout_s = settings.commit_timeout_s
        self._metrics = metrics
        #: Named in every map this process commits: the next owner of a partition whose
        #: hand-over did not land asks the group whether this process is still a member.
        self.incarnation = incarnation or new_incarnation()
        self.tracker = tracker = OffsetTracker(writer=self.incarnation, clock=clock)
        self._planner = CommitPlanner(tracker, metrics, map_max_bytes=settings.offset_map_max_bytes)
        #: Answers a death would make run again: past `uncommitted_answers_max`, while commits
        #: do not land, no record is fetched (see `held`).
        self._stalled = StalledCommits(
            tracker, interval_s=self._interval_s, limit=uncommitted_answers_max, clock=clock
        )
        self._lag = CommitLag(consumer, tracker, metrics)
        self._hand_overs = RefusedHandOvers(
            consumer,
            metrics,
            timeout_s=timeout_s,
            read_committed=read_committed,
            # Adopted back before it landed, a partition still takes its last landed commit
            # for what the group holds: planning that again, it would commit nothing, and the
            # group keep a clean hand-over over the jobs it runs (a death then blames none).
            on_landed=tracker.committed,
        )
        self._inheritance = Inheritance(
            consumer,
            tracker,
            self._hand_overs,
            incarnation=self.incarnation,
            timeout_s=timeout_s,
            read_committed=read_committed,
            live_incarnations=live_incarnations,
            clock=clock,
        )
        self._maker = CommitMaker(
            consumer,
            metrics,
            tracker=tracker,
            planner=self._planner,
            inheritance=self._inheritance,
            hand_overs=self._hand_overs,
            lag=self._lag,
            timeout_s=timeout_s,
        )
        self._parking = Parking(
            tracker,
            metrics,
            maker=self._maker,
            planner=self._planner,
            inheritance=self._inheritance,
            read_committed=read_committed,
            forget=self.forget,
            timeout_s=timeout_s,
        )
        self._last = 0.0
        self._task: asyncio.Task[None] | None = None
        self._slow_commits_warned = False
        self._stuck: asyncio.Task[None] | None = None

    @property
    def maps_on(self) -> bool:
        """Commits carry offset maps (configured, and the broker takes them)."""
        return self._planner.maps_on

    def held(self) -> set[TopicPartition]:
        """Partitions not to fetch now: their committed map is still being read after the
        assignment, or what this owner finished out of order nears the map's cap while records
        of theirs are in flight (until the gap closes), or answers wait for commits that stall
        (`StalledCommits`). Re-examined at every commit and on every fetch."""
        inheritance = self._inheritance
        return (
            inheritance.reading
            | inheritance.unread
            | self._planner.near_cap()
            | self._stalled.held()
        )

    def partition(self, tp: TopicPartition) -> PartitionOffsets:
        """The offsets of `tp`: `start` each fetched record on it, and finish it there."""
        return self.tracker.partition(tp)

    def parked(self, tp: TopicPartition) -> PartitionOffsets | None:
        """The offsets of `tp` while it is parked (`revoked` with `keep`), else None."""
        return self.tracker.parked().get(tp)

    def drop_parked(self, tp: TopicPartition) -> None:
        """The parked `tp` is not to be adopted: forgotten now, as a revoke forgets, its next
        owner (maybe this member again) reads it from the committed map."""
        self.forget({tp})

    def holds(self, tp: TopicPartition, partition: PartitionOffsets) -> bool:
        """Whether `partition` is still the offsets of `tp` as held now: not revoked since."""
        return self.tracker.holds(tp) and self.tracker.partition(tp) is partition

    def tick(self, *, due: bool = False) -> None:
        """Start a commit in the background when the interval has passed (or the commit is
        `due` now) and none is running."""
        if self._task is not None:
            return
        now = self._clock.monotonic()
        if not due and now - self._last < self._interval_s:
            return
        self._last = now
        self._task = asyncio.create_task(self._commit(None), name="commit")
        self._task.add_done_callback(self._commit_done)

    async def write_ahead(self) -> None:
        """Commit what runs now before jobs start, so that if one kills the process the next
        owner knows it was in flight (the crash-loop breaker).

        Waits at most `_WRITE_AHEAD_WAIT_S` in all, for a commit already on its way and then for
        this one: a slow coordinator delays the breaker's record, not the jobs for long. No wait
        when commits carry no map: nothing would record what runs.
        """
        if not self.maps_on:
            return
        started = self._clock.monotonic()
        if self._task is not None and self._task is not self._stuck:
            # The commit on its way may be quick: wait for it first.
            await asyncio.wait([self._task], timeout=_WRITE_AHEAD_WAIT_S)
            await asyncio.sleep(0)  # its done-callback clears `_task`
        if self._task is not None:
            self._stuck = self._task  # not waited for again
            if not self._slow_commits_warned:
                self._slow_commits_warned = True
                logger.warning(
                    "commits are slow; jobs start before the commit that names them lands, so "
                    "the crash-loop breaker may not see a job that kills the process"
                )
            return
        # Every partition, not only those starting jobs: one whose map still names as running
        # what a previous owner ran would blame those records again if this process dies.
        # It commits all that is answered too, so it counts as the interval's commit: under a
        # steady stream of starts, the interval adds no request of its own.
        self._last = self._clock.monotonic()
        self._task = asyncio.create_task(self._commit(None), name="write-ahead commit")
        self._task.add_done_callback(self._commit_done)
        remaining = _WRITE_AHEAD_WAIT_S - (self._clock.monotonic() - started)
        await asyncio.wait([self._task], timeout=max(remaining, 0.01))

    async def write_ahead_exact(self) -> bool:
        """Commit every partition and wait (at most `commit_timeout_s`): True when the broker
        holds exactly what would be committed now. A suspect of a crash starts only then, so
        a death while it runs blames it and no job that ran before it.

        Once the broker refuses maps, what it holds is positions alone: a death then goes
        uncounted whatever runs, so a suspect starts once those landed, rather than never
        (which held every partition for good)."""
        await self.commit_now()
        return self._planner.settled()

    async def hand_over(self) -> None:
        """The worker is stopping: commit a clean hand-over now, so a supervisor's kill during
        the drain blames no job; every later commit says the same."""
        self._maker.handing_over = True
        await self.commit_now(clean=True)

    async def hand_over_until(self, deadline: float) -> bool:
        """Commit the clean hand-over, again and again, until the group holds it or
        `deadline` (a reading of its clock's `monotonic`) passes; whether it landed.

        A stopping worker whose hand-over never lands leaves a map that names its jobs as
        running: the next owner, finding the writer gone, counts a death against each and
        runs them again as suspects of a crash. A coordinator that is away for a few seconds
        is common (a broker restart, a coordinator moving); the shutdown grace is the time to
        wait it out.
        """
        self._maker.handing_over = True
        while True:
            await self.commit_now(clean=True)
            # Also the partitions revoked meanwhile whose hand-over did not land: the member,
            # not yet gone, may still commit them in its generation.
            await self._hand_overs.land()
            # Judged by the maps as they can be committed now: once the broker refused them,
            # a landed position says it all.
            if self._planner.settled(clean=True) and not self._hand_overs.unlanded:
                return True
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(_HAND_OVER_RETRY_S, remaining))

    async def commit_now(
        self, partitions: set[TopicPartition] | None = None, *, clean: bool = False
    ) -> None:
        """Commit `partitions` (all when None) and wait, after any commit still running; both
        within one `commit_timeout_s`. `clean`: the partitions are being handed over, so what
        runs now is not suspected of killing the process."""
        try:
            async with asyncio.timeout(self._timeout_s):
                if self._task is not None:
                    await asyncio.shield(self._task)
                await self._commit(partitions, clean=clean)
        except TimeoutError:
            self._metrics.commits.labels("retry").inc()
            logger.warning("commit did not finish in %.1fs; going on", self._timeout_s)

    async def revoked(
        self, partitions: set[TopicPartition], keep: set[TopicPartition] | None = None
    ) -> set[TopicPartition]:
        """Hand `partitions` over (a clean commit, within `commit_timeout_s`) and forget them,
        with no commit of this member's planned in between: one planned while they were still
        held would otherwise go out after the hand-over, and aiokafka retries a commit through
        a coordinator outage in whatever generation the member holds by then, so it can land
        after this member rejoined, over what the partitions' new owner read.

        Those of `keep` (partitions with jobs still running) are parked instead of forgotten
        (`OffsetTracker.park`), for `adopt` to take back should the next assignment give them
        back unchanged; returns them (none when the hand-over timed out)."""
        return await self._parking.revoked(partitions, keep)

    async def adopt(self, assigned: set[TopicPartition]) -> set[TopicPartition]:
        """Of the parked partitions, hold again those `assigned` back whose committed offset
        and map are still this member's hand-over: nobody answered or committed anything of
        theirs meanwhile, so their jobs still running go on, as if no rebalance had happened.
        The others are forgotten (their jobs are for their owner now to run). Returns the
        partitions adopted. The rest of `assigned` stays held until `assigned` reads them."""
        return await self._parking.adopt(assigned)

    async def assigned(self, partitions: set[TopicPartition]) -> dict[TopicPartition, int]:
        """Read what the previous owners of `partitions` committed into the tracker, after
        landing this member's own refused hand-overs; where to fetch each partition read from
        (`Inheritance.assigned`)."""
        return await self._inheritance.assigned(partitions)

    @property
    def unread(self) -> set[TopicPartition]:
        """Assigned partitions held because their committed maps could not be read yet."""
        return self._inheritance.unread

    async def read_unread(self) -> dict[TopicPartition, int]:
        """Read again the maps of the `unread` partitions (`Inheritance.read_unread`)."""
        return await self._inheritance.read_unread()

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Revoked: their next owner starts from the committed position."""
        self.tracker.forget(partitions)
        self._planner.forget(partitions)
        self._inheritance.forget(partitions)
        self._lag.forget(partitions)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def committed_position(self, tp: TopicPartition) -> int | None:
        return self.tracker.committed_position(tp)

    def uncommitted(self) -> int:
        """Records started and not yet below the committed position of their partition."""
        return self._lag.uncommitted()

    def lag(self) -> int | None:
        """Records behind the ends of the assigned partitions, from the committed positions;
        None before anything is known."""
        return self._lag.lag()

    def _commit_done(self, task: asyncio.Task[None]) -> None:
        self._task = None
        if not task.cancelled() and (exc := task.exception()) is not None:
            # _commit handles every Kafka error; anything else is a bug worth a traceback.
            logger.error("background commit failed", exc_info=exc)
        self._on_background_done()

    async def _commit(self, partitions: set[TopicPartition] | None, *, clean: bool = False) -> None:
        await self._maker.commit(partitions, clean=clean)
