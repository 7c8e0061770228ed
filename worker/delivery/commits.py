"""Offset commits: when to commit, what a failed commit means, and the lag they leave.

Commits on the interval run in a task of their own, so a slow coordinator (aiokafka waits for a
lost one indefinitely) never holds up fetching; a revoke or the shutdown commits at once and
waits, for at most `commit_timeout_s`. Each commit carries the partition's offset map (answered
offsets above it, `worker.delivery.offset_map`) in its metadata; on assignment the map is read back, so
the records it names are not generated again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Final

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    CommitFailedError,
    IllegalStateError,
    KafkaError,
    OffsetMetadataTooLargeError,
)

from worker.core.clients import AIOKAFKA, KafkaClients
from worker.core.config import Settings
from worker.core.incarnation import incarnations_of_members, new_incarnation
from worker.core.kafka import client_kwargs
from worker.core.metrics import Metrics
from worker.delivery.alive import LiveIncarnations
from worker.delivery.hand_overs import CommittedReader, RefusedHandOvers
from worker.delivery.inheritance import Inheritance
from worker.delivery.offsets import (
    Commit,
    OffsetTracker,
    PartitionOffsets,
    Planned,
    describe_commits,
)

__all__ = ["CommittedReader", "Committer", "GroupOffsetsReader", "LiveIncarnations"]

logger = logging.getLogger(__name__)


# Above this share of `offset_map_max_bytes` for what this owner finished out of order, a
# partition takes no new records until that shrinks: the gap closes instead of the map growing
# past what the broker stores. Inherited offsets and deaths do not count: holding cannot shrink
# them (they leave the map only as they are fetched).
_HOLD_AT: Final = 0.75

# How often a stopping worker tries its hand-over again while the coordinator does not take it.
_HAND_OVER_RETRY_S: Final = 0.5

# Commits normally land within an interval of the answers they cover: answers that waited this
# many intervals (and at least this long) mean commits stopped landing.
_COMMITS_STALLED_AFTER: Final = 4
_COMMITS_STALLED_MIN_S: Final = 2.0

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
    """Commits, per partition, the highest offset below which every record is answered."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        settings: Settings,
        metrics: Metrics,
        read_committed: CommittedReader | None = None,
        *,
        live_incarnations: LiveIncarnations | None = None,
        incarnation: int | None = None,
        on_background_done: Callable[[], None] = lambda: None,
        uncommitted_answers_max: int | None = None,
    ) -> None:
        self._consumer = consumer
        #: Called when a commit in the background ended (and another may start): what waits
        #: for one to land (the breaker) may go on.
        self._on_background_done = on_background_done
        self._interval_s = settings.commit_interval_ms / 1000
        #: Answers a death would make run again: past this many, while commits do not land
        #: (`_COMMITS_STALLED_AFTER`), no record is fetched (see `held`).
        self._uncommitted_answers_max = uncommitted_answers_max
        self._stalled_after_s = max(
            _COMMITS_STALLED_AFTER * self._interval_s, _COMMITS_STALLED_MIN_S
        )
        self._held_for_commits = False
        self._timeout_s = settings.commit_timeout_s
        self._map_max_bytes = settings.offset_map_max_bytes
        self._metrics = metrics
        #: Named in every map this process commits: the next owner of a partition whose
        #: hand-over did not land asks the group whether this process is still a member.
        self.incarnation = incarnation or new_incarnation()
        self.tracker = OffsetTracker(writer=self.incarnation)
        self._read_committed = read_committed
        self._hand_overs = RefusedHandOvers(
            consumer,
            metrics,
            timeout_s=self._timeout_s,
            read_committed=read_committed,
            # Adopted back before it landed, a partition still takes its last landed commit
            # for what the group holds: planning that again, it would commit nothing, and the
            # group keep a clean hand-over over the jobs it runs (a death then blames none).
            on_landed=self.tracker.committed,
        )
        self._inheritance = Inheritance(
            consumer,
            self.tracker,
            self._hand_overs,
            incarnation=self.incarnation,
            timeout_s=self._timeout_s,
            read_committed=read_committed,
            live_incarnations=live_incarnations,
        )
        self._last = 0.0
        self._task: asyncio.Task[None] | None = None
        self._one_at_a_time = asyncio.Lock()
        # Partitions whose offset map was near its cap at their last commit.
        self._near_cap: set[TopicPartition] = set()
        self._maps_refused = False
        self._slow_commits_warned = False
        self._stuck: asyncio.Task[None] | None = None
        # Partitions warned about, by the sections their map left out to fit.
        self._degraded: dict[TopicPartition, tuple[str, ...]] = {}
        # From the stop on, every commit is a clean hand-over (see `hand_over`).
        self._handing_over = False

    @property
    def maps_on(self) -> bool:
        """Commits carry offset maps (configured, and the broker takes them)."""
        return self._map_max_bytes > 0 and not self._maps_refused

    def held(self) -> set[TopicPartition]:
        """Partitions not to fetch now: their committed map is still being read after the
        assignment, or what this owner finished out of order nears the map's cap while records
        of theirs are in flight (until the gap closes). With nothing in flight nothing is
        finished out of order, so no partition is held for it: the reason is re-examined at
        every commit and on every fetch."""
        near_cap = {tp for tp in self._near_cap if not self.tracker.partition(tp).idle}
        inheritance = self._inheritance
        return inheritance.reading | inheritance.unread | near_cap | self._held_until_commits_land()

    def _held_until_commits_land(self) -> set[TopicPartition]:
        """Every partition, while more answers than `uncommitted_answers_max` wait for a
        commit and the oldest has waited `_stalled_after_s` (commits land every interval
        otherwise): a coordinator that is away takes no commit, and a worker that went on
        answering would leave ever more work for a death to redo. The jobs in flight finish;
        the next landed commit lifts the hold."""
        limit = self._uncommitted_answers_max
        if limit is None:
            return set()
        held = self.tracker.items()
        waiting, oldest = 0, None
        for _, partition in held:
            count, since = partition.uncommitted_answers
            waiting += count
            if since is not None and (oldest is None or since < oldest):
                oldest = since
        stalled = (
            waiting > limit
            and oldest is not None
            and time.monotonic() - oldest >= self._stalled_after_s
        )
        if stalled != self._held_for_commits:
            self._held_for_commits = stalled
            if stalled:
                logger.warning(
                    "%d answers wait for commits that have not landed for %.1fs; fetching "
                    "no new records until one lands",
                    waiting,
                    time.monotonic() - (oldest or 0.0),
                )
            else:
                logger.info("commits land again; fetching records")
        return {tp for tp, _ in held} if stalled else set()

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
        now = time.monotonic()
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
        started = time.monotonic()
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
        self._last = time.monotonic()
        self._task = asyncio.create_task(self._commit(None), name="write-ahead commit")
        self._task.add_done_callback(self._commit_done)
        remaining = _WRITE_AHEAD_WAIT_S - (time.monotonic() - started)
        await asyncio.wait([self._task], timeout=max(remaining, 0.01))

    async def write_ahead_exact(self) -> bool:
        """Commit every partition and wait (at most `commit_timeout_s`): True when the broker
        holds exactly what would be committed now. A suspect of a crash starts only then, so
        a death while it runs blames it and no job that ran before it.

        Once the broker refuses maps, what it holds is positions alone: a death then goes
        uncounted whatever runs, so a suspect starts once those landed, rather than never
        (which held every partition for good)."""
        await self.commit_now()
        limit = self._map_max_bytes if self.maps_on else 0
        return not self.tracker.plan(None, limit=limit)

    async def hand_over(self) -> None:
        """The worker is stopping: commit a clean hand-over now, so a supervisor's kill during
        the drain blames no job; every later commit says the same."""
        self._handing_over = True
        await self.commit_now(clean=True)

    async def hand_over_until(self, deadline: float) -> bool:
        """Commit the clean hand-over, again and again, until the group holds it or
        `deadline` (a `time.monotonic()` reading) passes; whether it landed.

        A stopping worker whose hand-over never lands leaves a map that names its jobs as
        running: the next owner, finding the writer gone, counts a death against each and
        runs them again as suspects of a crash. A coordinator that is away for a few seconds
        is common (a broker restart, a coordinator moving); the shutdown grace is the time to
        wait it out.
        """
        self._handing_over = True
        limit = self._map_max_bytes if self.maps_on else 0
        while True:
            await self.commit_now(clean=True)
            # Also the partitions revoked meanwhile whose hand-over did not land: the member,
            # not yet gone, may still commit them in its generation.
            await self._hand_overs.land()
            if (
                not self.tracker.plan(None, clean=True, limit=limit)
                and not self._hand_overs.unlanded
            ):
                return True
            remaining = deadline - time.monotonic()
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
        kept: set[TopicPartition] = set()
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._one_at_a_time:
                    self._keep_unlanded(await self._commit_planned(partitions, clean=True))
                    if keep and self._read_committed is not None:
                        # Also where the group refused the hand-over (some brokers end the
                        # generation as the rebalance begins): `adopt` then finds this
                        # member's last commit, which the partition's offsets remember.
                        kept = keep & partitions
                        self.tracker.park(kept)
                    self.forget(partitions - kept)
        except TimeoutError:
            self._metrics.commits.labels("retry").inc()
            logger.warning(
                "hand-over commit did not finish in %.1fs; it is made again after rejoining, "
                "or before this worker stops",
                self._timeout_s,
            )
            # Planned again: should the commit on its way land after all, the group then holds
            # something newer than this member's last landed commit, and this one is not made.
            self._keep_unlanded(self._plan(partitions, clean=True))
        finally:
            self.forget(partitions - kept)
        return kept

    async def adopt(self, assigned: set[TopicPartition]) -> set[TopicPartition]:
        """Of the parked partitions, hold again those `assigned` back whose committed offset
        and map are still this member's hand-over: nobody answered or committed anything of
        theirs meanwhile, so their jobs still running go on, as if no rebalance had happened.
        The others are forgotten (their jobs are for their owner now to run). Returns the
        partitions adopted. The rest of `assigned` stays held until `assigned` reads them."""
        parked = dict(self.tracker.parked())
        if not parked:
            return set()
        # Held from here: the others until their maps are read (`assigned`), which the caller
        # does next; fetched meanwhile, their records would start from a position not yet
        # settled.
        self._inheritance.reading |= assigned
        back = {tp for tp in parked if tp in assigned}
        adopted: set[TopicPartition] = set()
        if back and self._read_committed is not None:
            try:
                async with asyncio.timeout(self._timeout_s):
                    committed = await self._read_committed(sorted(back))
            except (KafkaError, TimeoutError) as exc:
                # Unread, another member's commit cannot be ruled out: inherited instead.
                logger.info("cannot read the committed offsets of returned partitions (%r)", exc)
                committed = {}
            for tp in sorted(back):
                if tp in committed and committed[tp] == parked[tp].committed:
                    self.tracker.unpark(tp)
                    adopted.add(tp)
        self.forget(set(parked) - adopted)
        # Forgetting let go of those assigned back that were not adopted: held again.
        self._inheritance.reading = (self._inheritance.reading | assigned) - adopted
        return adopted

    def _keep_unlanded(self, offsets: dict[TopicPartition, Commit]) -> None:
        """A hand-over the group refused or did not answer in time: made again later
        (`RefusedHandOvers.land`), after rejoining or by a stopping worker, rather than
        dropped. The next owner, finding a live writer's map that names jobs as running, waits
        a little for it; once this worker stopped, it would count a death against each.

        Only a hand-over that did not land: one that landed while more jobs were answered is
        what the next owner reads, and does not wait past (a later commit could land after
        it read, and its own commit then move the position back)."""
        if offsets:
            self._hand_overs.refused(offsets, {tp: self.tracker.last_commit(tp) for tp in offsets})

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
        self._near_cap -= partitions
        self._inheritance.forget(partitions)
        for tp in partitions:
            self._degraded.pop(tp, None)
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
        self._on_background_done()

    async def _commit(self, partitions: set[TopicPartition] | None, *, clean: bool = False) -> None:
        # One commit at a time, planned once the previous one ended: a commit planned while
        # another is on its way could land after a revoke forgot the partition (the hand-over
        # waits on a slow coordinator while the interval's commit goes out beside it), and the
        # new owner, maybe this member again, would read the older position and commit
        # behind it.
        async with self._one_at_a_time:
            await self._commit_planned(partitions, clean=clean)

    async def _commit_planned(
        self, partitions: set[TopicPartition] | None, *, clean: bool = False
    ) -> dict[TopicPartition, Commit]:
        """Plan and make one commit; what it committed that the group did not answer in time
        (or answered with a transient error), to be made again: nothing when it landed or was
        refused."""
        offsets = self._plan(partitions, clean=clean or self._handing_over)
        if offsets:
            offsets = await self._inheritance.first_commits(offsets)
        if not offsets:
            self._update_lag()  # the partitions' ends move without us
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
            self._maps_refused = True
            return await self._commit_planned(partitions, clean=clean)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group rebalanced under us: these records will be redelivered to the new owner,
            # unless this was the hand-over, which is made again once this member rejoins.
            self._metrics.commits.labels("failed").inc()
            if clean and partitions is not None:
                self._keep_unlanded(offsets)
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
        self.tracker.committed(offsets)
        self._inheritance.landed(offsets)
        self._metrics.commits.labels("ok").inc()
        logger.debug("committed %s", describe_commits(offsets))
        self._update_lag()
        return {}

    def _plan(
        self, partitions: set[TopicPartition] | None, *, clean: bool
    ) -> dict[TopicPartition, Commit]:
        """The commits to make, maps within their cap; hold partitions whose own out-of-order
        answers near it. Never raises: a bug in building a map costs the map, not the commit."""
        limit = 0 if self._maps_refused else self._map_max_bytes
        try:
            planned = self.tracker.plan(partitions, clean=clean, limit=limit)
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

    def _positions_alone(
        self, partitions: set[TopicPartition] | None
    ) -> dict[TopicPartition, Commit]:
        offsets: dict[TopicPartition, Commit] = {}
        for tp, partition in self.tracker.items():
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
        consequence = {
            "answered": "records answered out of order may run again",
            "running": "a death now would go uncounted by the crash-loop breaker",
            "deaths": "some earlier deaths are forgotten",
        }
        logger.warning(
            "%s-%s@%d: the offset map is over --offset-map-max-bytes (%d); left out: %s",
            tp.topic,
            tp.partition,
            plan.commit[0],
            limit,
            "; ".join(f"{s} ({consequence[s]})" for s in plan.dropped),
        )

    def uncommitted(self) -> int:
        """Records started and not yet below the committed position of their partition."""
        total = 0
        for _, partition in self.tracker.items():
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
            position = self.tracker.committed_position(tp)
            if highwater is not None and position is not None:
                total += max(highwater - position, 0)
                known = True
        return total if known else None

    def _update_lag(self) -> None:
        # Lag is measured from the committed position, so it moves only with commits.
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            position = self.tracker.committed_position(tp)
            if highwater is not None and position is not None:
                self._metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(
                    max(highwater - position, 0)
                )
