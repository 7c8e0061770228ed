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
from collections.abc import Awaitable, Callable
from typing import Final

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    CommitFailedError,
    IllegalStateError,
    KafkaError,
    OffsetMetadataTooLargeError,
)

from worker.core.config import Settings
from worker.core.incarnation import incarnations_of_members, new_incarnation
from worker.core.kafka import client_kwargs, commit_handed_over
from worker.core.metrics import Metrics
from worker.delivery.offset_map import OffsetMap, decode_offset_map
from worker.delivery.offsets import Commit, OffsetTracker, PartitionOffsets, Planned

__all__ = ["CommittedReader", "Committer", "GroupOffsetsReader", "LiveIncarnations"]

logger = logging.getLogger(__name__)

#: Reads the group's committed offsets and metadata of some partitions (`GroupOffsetsReader`).
CommittedReader = Callable[[list[TopicPartition]], Awaitable[dict[TopicPartition, Commit]]]
#: The incarnations the group's live members announce (`GroupOffsetsReader.live_incarnations`).
LiveIncarnations = Callable[[], Awaitable[set[int]]]

# Above this share of `offset_map_max_bytes` for what this owner finished out of order, a
# partition takes no new records until that shrinks: the gap closes instead of the map growing
# past what the broker stores. Inherited offsets and deaths do not count: holding cannot shrink
# them (they leave the map only as they are fetched).
_HOLD_AT: Final = 0.75

# The longest a batch of jobs waits for the commit that names them as running.
_WRITE_AHEAD_WAIT_S: Final = 1.0

# How long a new owner reads again the map of a partition whose last owner is alive but whose
# hand-over has not landed (that owner makes it again as soon as it rejoins), and how often.
_HAND_OVER_WAIT_S: Final = 2.0
_HAND_OVER_POLL_S: Final = 0.1


class GroupOffsetsReader:
    """Reads the group's committed offsets with their metadata (the offset maps) through the
    admin client: aiokafka's consumer returns committed offsets without their metadata."""

    def __init__(self, settings: Settings) -> None:
        self._admin = AIOKafkaAdminClient(**client_kwargs(settings))
        self._group_id = settings.group_id
        self._started = False

    async def __call__(self, partitions: list[TopicPartition]) -> dict[TopicPartition, Commit]:
        admin = await self._started_admin()
        committed = await admin.list_consumer_group_offsets(self._group_id, partitions=partitions)
        return {tp: (c.offset, c.metadata or "") for tp, c in committed.items()}

    async def live_incarnations(self) -> set[int]:
        """The incarnations the group's live members announce (`worker.core.incarnation`)."""
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
    ) -> None:
        self._consumer = consumer
        self._interval_s = settings.commit_interval_ms / 1000
        self._timeout_s = settings.commit_timeout_s
        self._map_max_bytes = settings.offset_map_max_bytes
        self._metrics = metrics
        self._read_committed = read_committed
        self._live_incarnations = live_incarnations
        #: Named in every map this process commits: the next owner of a partition whose
        #: hand-over did not land asks the group whether this process is still a member.
        self.incarnation = incarnation or new_incarnation()
        self.tracker = OffsetTracker(writer=self.incarnation)
        self._last = 0.0
        self._task: asyncio.Task[None] | None = None
        # Partitions whose offset map was near its cap at their last commit, and those whose
        # committed map is being read after the assignment.
        self._near_cap: set[TopicPartition] = set()
        self._reading: set[TopicPartition] = set()
        self._maps_refused = False
        self._slow_commits_warned = False
        self._stuck: asyncio.Task[None] | None = None
        # Partitions warned about, by the sections their map left out to fit.
        self._degraded: dict[TopicPartition, tuple[str, ...]] = {}
        # From the stop on, every commit is a clean hand-over (see `hand_over`).
        self._handing_over = False
        # Hand-over commits of revoked partitions that the group refused during the rebalance,
        # made again once this member has rejoined (see `assigned`).
        self._unlanded: dict[TopicPartition, Commit] = {}

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
        return self._reading | near_cap

    def partition(self, tp: TopicPartition) -> PartitionOffsets:
        """The offsets of `tp`: `start` each fetched record on it, and finish it there."""
        return self.tracker.partition(tp)

    def holds(self, tp: TopicPartition, partition: PartitionOffsets) -> bool:
        """Whether `partition` is still the offsets of `tp` as held now: not revoked since."""
        return self.tracker.holds(tp) and self.tracker.partition(tp) is partition

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
        holds exactly what runs now. A suspect of a crash starts only then, so a death while it
        runs blames it and no job that ran before it."""
        if not self.maps_on:
            return False
        await self.commit_now()
        return self.maps_on and not self.tracker.plan(None, limit=self._map_max_bytes)

    async def hand_over(self) -> None:
        """The worker is stopping: commit a clean hand-over now, so a supervisor's kill during
        the drain blames no job; every later commit says the same."""
        self._handing_over = True
        await self.commit_now(clean=True)

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

    async def assigned(self, partitions: set[TopicPartition]) -> dict[TopicPartition, int]:
        """Read the assigned partitions' offset maps, so what they name is skipped. A map that
        cannot be read or decoded is ignored with a warning: plain at-least-once.

        Returns the partitions whose committed position moved while this member joined: its
        own refused hand-over, made again (`_land_hand_over`), or the last owner's, awaited
        (`_await_hand_overs`). The consumer looked its positions up before, and would fetch
        from below, so the loop fetches them from the position returned. Any other position
        stays the consumer's (which may be a reset past a truncated log)."""
        landed = await self._land_hand_over()
        # Partitions kept through the rebalance (an incremental one) are known here already:
        # their committed map is this worker's own, and reading it back would blame its own
        # jobs in flight for a death that did not happen.
        partitions = {tp for tp in partitions if not self.tracker.holds(tp)}
        if self._read_committed is None or not partitions:
            return {}
        moved: dict[TopicPartition, int] = {}
        # Held (paused by the loop) while the maps are read: aiokafka starts fetching the new
        # assignment meanwhile, and a record started before its map is known would run again.
        self._reading |= partitions
        alive = _AliveWriters(self.incarnation, self._live_incarnations, self._timeout_s)
        try:
            maps = await self._read_maps(partitions)
            if maps is None:
                return {}
            moved = await self._await_hand_overs(maps, alive)
        finally:
            self._reading -= partitions
        for tp, (position, previous) in sorted(maps.items()):
            if previous is None:
                self.tracker.assigned(tp, OffsetMap(), anchor=position)  # replaced at once
                continue
            if previous.answered:
                logger.info(
                    "%s-%s: %d records past offset %d were answered before; skipping them",
                    tp.topic,
                    tp.partition,
                    len(previous.answered),
                    position,
                )
            writer_alive = False
            in_flight = len(previous.running - previous.answered)
            if in_flight and not previous.clean:
                writer_alive = await alive(previous.writer)
                if writer_alive:
                    logger.info(
                        "%s-%s: the last owner is still a member of the group; its hand-over "
                        "did not land, so the %d records it had in flight run again, blaming "
                        "nobody",
                        tp.topic,
                        tp.partition,
                        in_flight,
                    )
                else:
                    logger.warning(
                        "%s-%s: the last owner died with %d records in flight; they run one at "
                        "a time now",
                        tp.topic,
                        tp.partition,
                        in_flight,
                    )
            self.tracker.assigned(tp, previous, anchor=position, writer_alive=writer_alive)
        for tp, position in landed.items():
            if tp in maps and maps[tp][0] == position:
                moved[tp] = position
        return moved

    async def _read_maps(
        self, partitions: set[TopicPartition]
    ) -> dict[TopicPartition, tuple[int, OffsetMap | None]] | None:
        """The committed position and offset map of each of `partitions` that has a commit
        (None for a map that cannot be decoded); None when they cannot be read at all."""
        if self._read_committed is None:
            return {}
        try:
            async with asyncio.timeout(self._timeout_s):
                committed = await self._read_committed(sorted(partitions))
            ends = await self._end_offsets(partitions)
        except (KafkaError, TimeoutError) as exc:
            logger.warning(
                "cannot read the committed offset maps (%r); answered records may run again", exc
            )
            return None
        maps: dict[TopicPartition, tuple[int, OffsetMap | None]] = {}
        for tp, (position, metadata) in committed.items():
            if tp not in partitions or position < 0:
                continue
            try:
                maps[tp] = (position, decode_offset_map(position, metadata, end=ends.get(tp)))
            except Exception as exc:  # noqa: BLE001 - any unreadable map: plain at-least-once
                logger.warning(
                    "%s-%s@%d: ignoring the committed metadata (%s); records past the committed "
                    "offset will run again",
                    tp.topic,
                    tp.partition,
                    position,
                    exc,
                )
                maps[tp] = (position, None)
        return maps

    async def _await_hand_overs(
        self, maps: dict[TopicPartition, tuple[int, OffsetMap | None]], alive: _AliveWriters
    ) -> dict[TopicPartition, int]:
        """Read again, for a little while, the maps of partitions whose last owner is alive but
        whose hand-over has not landed: that owner commits it again as soon as it rejoins
        (`_land_hand_over`), in the same round that assigned them here. Waiting for it saves
        running again what it answered; past `_HAND_OVER_WAIT_S` the records run again,
        blaming nobody. Returns the partitions whose position moved, and where to."""
        waiting = set()
        moved: dict[TopicPartition, int] = {}
        for tp, (_, previous) in maps.items():
            if (
                previous is not None
                and not previous.clean
                and previous.running - previous.answered
                and previous.writer != self.incarnation
                and await alive(previous.writer)
            ):
                waiting.add(tp)
        deadline = time.monotonic() + _HAND_OVER_WAIT_S
        while waiting and time.monotonic() < deadline:
            await asyncio.sleep(_HAND_OVER_POLL_S)
            again = await self._read_maps(waiting)
            for tp, (position, latest) in (again or {}).items():
                if latest is not None and (latest.clean or position != maps[tp][0]):
                    if position != maps[tp][0]:
                        moved[tp] = position
                    maps[tp] = (position, latest)
                    waiting.discard(tp)
        if waiting:
            logger.info(
                "the hand-over of %s by a live member did not land in %.1fs",
                ", ".join(f"{tp.topic}-{tp.partition}" for tp in sorted(waiting)),
                _HAND_OVER_WAIT_S,
            )
        return moved

    async def _land_hand_over(self) -> dict[TopicPartition, int]:
        """Commit again, in the new generation, the hand-over of revoked partitions that the
        group refused in the old one, before anything else on rejoining.

        A broker may refuse the old generation's commits from the moment another member asks
        to join, before this member even hears of the rebalance (noida-db does; Apache Kafka
        takes them until the rebalance completes). The group takes a commit of the current
        generation for any partition, so the hand-over lands now: the new owners, assigned in
        this same round, read it unless they read first (they then run again what was answered
        and not committed, blaming nobody: the map names a live writer). Made before this
        member starts anything, it cannot move back a position a new owner committed since.
        """
        if not self._unlanded:
            return {}
        offsets, self._unlanded = self._unlanded, {}
        try:
            async with asyncio.timeout(self._timeout_s):
                await commit_handed_over(self._consumer, offsets)
        except (KafkaError, TimeoutError) as exc:
            self._metrics.commits.labels("failed").inc()
            logger.warning(
                "the hand-over of %s did not land after rejoining either (%r); the records "
                "answered and not committed will run again",
                _fmt(offsets),
                exc,
            )
            return {}
        self._metrics.commits.labels("ok").inc()
        logger.info("hand-over of %s landed after rejoining", _fmt(offsets))
        return {tp: position for tp, (position, _) in offsets.items()}

    async def _end_offsets(self, partitions: set[TopicPartition]) -> dict[TopicPartition, int]:
        """The partitions' end offsets, or none when they cannot be read: map offsets at or
        past the end name no record (the log was truncated under them)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                ends: dict[TopicPartition, int] = await self._consumer.end_offsets(
                    sorted(partitions)
                )
        except (KafkaError, TimeoutError) as exc:
            logger.warning("cannot read the partitions' end offsets (%r)", exc)
            return {}
        return ends

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Revoked: their next owner starts from the committed position."""
        self.tracker.forget(partitions)
        self._near_cap -= partitions
        self._reading -= partitions
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

    async def _commit(self, partitions: set[TopicPartition] | None, *, clean: bool = False) -> None:
        offsets = self._plan(partitions, clean=clean or self._handing_over)
        if not offsets:
            self._update_lag()  # the partitions' ends move without us
            return
        try:
            # aiokafka waits for a lost coordinator indefinitely; bound it and retry later.
            async with asyncio.timeout(self._timeout_s):
                await self._consumer.commit(offsets)
        except TimeoutError:
            self._metrics.commits.labels("retry").inc()
            logger.warning("commit of %s timed out; retrying at the next commit", _fmt(offsets))
            return
        except OffsetMetadataTooLargeError:
            # The broker's offset.metadata.max.bytes is below offset_map_max_bytes: commit the
            # positions alone, now and from now on (answered records may then run again).
            self._metrics.commits.labels("retry").inc()
            logger.warning(
                "the broker refuses offset maps this large; committing positions only "
                "(set --offset-map-max-bytes below the broker's offset.metadata.max.bytes)"
            )
            self._maps_refused = True
            await self._commit(partitions, clean=clean)
            return
        except (CommitFailedError, IllegalStateError) as exc:
            # The group rebalanced under us: these records will be redelivered to the new owner,
            # unless this was the hand-over, which is made again once this member rejoins.
            self._metrics.commits.labels("failed").inc()
            if clean and partitions is not None:
                self._unlanded.update(offsets)
                logger.info(
                    "hand-over commit of %s refused during the rebalance (%s); it is made "
                    "again after rejoining",
                    _fmt(offsets),
                    exc,
                )
                return
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


class _AliveWriters:
    """Whether the writer of a map is a live member of the group: this process itself, or an
    incarnation a live member announces. The group is asked once per assignment, and only
    about a map that was not a clean hand-over; a writer that names no incarnation, or a
    group that cannot be asked, counts as dead (the breaker's counts stay on the safe side)."""

    def __init__(self, own: int, ask: LiveIncarnations | None, timeout_s: float) -> None:
        self._own = own
        self._ask = ask
        self._timeout_s = timeout_s
        self._live: set[int] | None = None

    async def __call__(self, writer: int) -> bool:
        if not writer:
            return False
        if writer == self._own:
            return True
        if self._live is None:
            self._live = set()
            if self._ask is not None:
                try:
                    async with asyncio.timeout(self._timeout_s):
                        self._live = await self._ask()
                except (KafkaError, TimeoutError) as exc:
                    logger.warning(
                        "cannot ask the group which members are alive (%r); a previous owner "
                        "that did not hand over counts as dead",
                        exc,
                    )
        return writer in self._live


def _fmt(offsets: dict[TopicPartition, Commit]) -> str:
    return ", ".join(f"{tp.topic}-{tp.partition}@{o}" for tp, (o, _) in sorted(offsets.items()))
