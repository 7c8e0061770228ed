"""What the previous owners of newly assigned partitions left behind.

On assignment their committed offset maps are read back (the records they name were answered,
or were in flight at a death), waiting briefly for the hand-over of a previous owner that is
still alive; this member's own hand-overs that the group refused during the rebalance are
landed first (`RefusedHandOvers`). `Committer` owns the commits; this reads what they left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Final

from aiokafka import TopicPartition

from worker.core.clock import Clock
from worker.core.consumer_port import GroupConsumer
from worker.delivery.alive import AliveWriters, LiveIncarnations
from worker.delivery.committed_maps import CommittedMaps
from worker.delivery.hand_overs import CommittedReader, RefusedHandOvers, awaits_hand_over
from worker.delivery.offset_map import OffsetMap
from worker.delivery.offsets import Commit, OffsetTracker

__all__ = ["Inheritance"]

logger = logging.getLogger(__name__)

# How long a new owner reads again the map of a partition whose last owner is alive but whose
# hand-over has not landed (that owner makes it again as soon as it rejoins), and how often.
_HAND_OVER_WAIT_S: Final = 2.0
_HAND_OVER_POLL_S: Final = 0.1


class Inheritance:
    """Reads the offset maps of the partitions assigned to this member into its `tracker`,
    after landing this member's own refused `hand_overs`."""

    def __init__(
        self,
        consumer: GroupConsumer,
        tracker: OffsetTracker,
        hand_overs: RefusedHandOvers,
        *,
        incarnation: int,
        timeout_s: float,
        read_committed: CommittedReader | None = None,
        live_incarnations: LiveIncarnations | None = None,
        clock: Clock,
    ) -> None:
        self._consumer = consumer
        self._clock = clock
        self._tracker = tracker
        self._hand_overs = hand_overs
        self._incarnation = incarnation
        self._timeout_s = timeout_s
        self._read_committed = read_committed
        self._maps = CommittedMaps(consumer, read_committed, timeout_s)
        self._live_incarnations = live_incarnations
        #: Partitions whose committed map is being read: none of their records may start yet.
        self.reading: set[TopicPartition] = set()
        #: Partitions whose committed map could not be read as they were assigned (the
        #: coordinator away): none of their records may start until it is (`read_unread`),
        #: as the crash counts of their records are in it.
        self.unread: set[TopicPartition] = set()
        # Partitions whose last owner's hand-over may still land after this member read them
        # (their map could not be read, or a live owner's hand-over was waited for in vain),
        # with the committed position as read here (None: unread), until this member's first
        # commit of each lands (`first_commits`).
        self._read_at: dict[TopicPartition, int | None] = {}

    def forget(self, partitions: set[TopicPartition]) -> None:
        self.reading -= partitions
        self.unread -= partitions
        for tp in partitions:
            self._read_at.pop(tp, None)

    def landed(self, partitions: Iterable[TopicPartition]) -> None:
        """This member's commit of `partitions` landed: later ones need no check."""
        for tp in partitions:
            self._read_at.pop(tp, None)

    async def first_commits(
        self, offsets: dict[TopicPartition, Commit]
    ) -> dict[TopicPartition, Commit]:
        """Of `offsets`, those to commit now. A partition this member has not committed since
        it was assigned, and whose last owner's hand-over may still land (its map could not be
        read, or that hand-over was waited for in vain), is read again first: another member's
        commit that landed after the map was read (a last owner's hand-over past the new
        owner's bounded waits, through a coordinator outage) must not be committed behind.
        There the partition takes it over (`PartitionOffsets.overtaken`: what it answered is
        skipped) and commits at the next turn. While the committed offsets cannot be read,
        such a partition is not committed: its commit could land behind one that did unseen
        (seed 89102 of `--flavour noida --static`). Read without a lock, so a commit racing
        this read can still land first; the window is one round trip, not the whole outage."""
        unconfirmed = {tp for tp in offsets if tp in self._read_at}
        if not unconfirmed:
            return offsets
        kept = {tp: c for tp, c in offsets.items() if tp not in unconfirmed}
        read = await self._maps.read_with_ends(unconfirmed)
        if read is None:
            logger.info(
                "cannot read the committed offsets of %s before their first commit; it waits",
                ", ".join(f"{tp.topic}-{tp.partition}" for tp in sorted(unconfirmed)),
            )
            return kept
        now, ends = read
        for tp in sorted(unconfirmed):
            position, latest = now.get(tp, (-1, None))
            if position == self._read_at[tp] or position <= offsets[tp][0]:
                kept[tp] = offsets[tp]  # unchanged since it was read, or behind this commit
            elif tp not in ends:
                pass  # a hand-over or a truncated log: cannot tell yet, so it waits
            elif position > ends[tp]:
                kept[tp] = offsets[tp]  # past the log's end: truncated, the reset stands
            else:
                self._read_at[tp] = position
                twice = self._tracker.partition(tp).overtaken(position, latest)
                logger.warning(
                    "%s-%s: another member committed %d after this owner read the partition, "
                    "ahead of its commit at %d; taking that over (%d records in flight below "
                    "it are answered twice)",
                    tp.topic,
                    tp.partition,
                    position,
                    offsets[tp][0],
                    twice,
                )
        return kept

    async def assigned(self, partitions: set[TopicPartition]) -> dict[TopicPartition, int]:
        """Read the assigned partitions' offset maps, so what they name is skipped. A map that
        cannot be decoded is ignored with a warning: plain at-least-once. Maps that cannot be
        read (the coordinator away) hold their partitions until they are (`read_unread`).

        Returns where to fetch each partition read from: its committed position as read here,
        where that lies within the log.
        The consumer looked its positions up as it joined, and they may have moved since: this
        member's own refused hand-over, made again (`RefusedHandOvers.land`), the last owner's,
        awaited (`_await_hand_overs`) or landed as this member joined. Fetched from below, a
        record would run again and its commit move the position back. A partition that could
        not be read keeps the consumer's position.

        The partitions are held from the first wait to the end: aiokafka fetches the new
        assignment meanwhile, and the loop resumes every paused partition that nothing holds.
        """
        # Partitions kept through the rebalance (an incremental one) are known here already:
        # their committed map is this worker's own, and reading it back would blame its own
        # jobs in flight for a death that did not happen.
        unread = {tp for tp in partitions if not self._tracker.holds(tp)}
        self.reading |= unread
        try:
            return await self._inherit(unread)
        finally:
            # Every one assigned: `Committer.adopt` holds them all until they are read here.
            self.reading -= partitions

    async def _inherit(self, partitions: set[TopicPartition]) -> dict[TopicPartition, int]:
        await self._hand_overs.land()
        if self._read_committed is None or not partitions:
            return {}
        maps = await self._first_read(partitions)
        if maps is None:
            self._read_at.update(dict.fromkeys(partitions))
            self.unread |= partitions
            return {}
        return await self._take(maps)

    async def read_unread(self) -> dict[TopicPartition, int]:
        """Read again the maps of the `unread` partitions still assigned; where to fetch each
        partition read from (as `assigned`). Nothing while they still cannot be read."""
        if not self.unread or self._read_committed is None:
            return {}
        asked = set(self.unread)
        maps = await self._maps.read(asked)
        if maps is None:
            return {}
        # Those revoked meanwhile are for their next owner to read; any assigned meanwhile
        # were not asked for.
        read = asked & self.unread
        maps = {tp: entry for tp, entry in maps.items() if tp in read}
        # Held until taken, as at an assignment: let go as the read lands, a partition is
        # fetched from the position the consumer looked up as it joined while the live last
        # owner's hand-over is awaited here, and its records run, and commit, behind it.
        self.unread -= read
        self.reading |= read
        for tp in read:
            self._read_at.pop(tp, None)
        try:
            taken = await self._take(maps)
        finally:
            self.reading -= read
        logger.info(
            "read the committed offset maps of %s; their records start",
            ", ".join(f"{tp.topic}-{tp.partition}" for tp in sorted(read)),
        )
        return taken

    async def _take(
        self, maps: dict[TopicPartition, tuple[int, OffsetMap | None]]
    ) -> dict[TopicPartition, int]:
        """Take the maps read into the tracker (waiting a little for live owners'
        hand-overs); where to fetch each partition from."""
        alive = AliveWriters(
            self._incarnation, self._live_incarnations, self._timeout_s, clock=self._clock
        )
        for tp in await self._await_hand_overs(maps, alive):
            self._read_at[tp] = maps[tp][0]
        alive.waited()
        for tp, (position, previous) in sorted(maps.items()):
            if previous is None:
                self._tracker.assigned(tp, OffsetMap(), anchor=position)  # replaced at once
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
                # Unknown (the group was rebalancing) and its hand-over never landed: dead,
                # as a live member lands it as soon as it rejoins (`_await_hand_overs`).
                writer_alive = bool(await alive(previous.writer))
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
                        "%s-%s: the last owner died with %d records in flight; they run again "
                        "(those in flight at an earlier death too: together, then one at a time)",
                        tp.topic,
                        tp.partition,
                        in_flight,
                    )
            self._tracker.assigned(tp, previous, anchor=position, writer_alive=writer_alive)
        # Within the log, where aiokafka itself fetches from once it looks the position up.
        # Past its end, the log was truncated under the commit: the consumer's reset stands.
        ends = await self._maps.ends(set(maps))
        return {
            tp: position
            for tp, (position, _) in maps.items()
            if tp in ends and position <= ends[tp]
        }

    async def _first_read(
        self, partitions: set[TopicPartition]
    ) -> dict[TopicPartition, tuple[int, OffsetMap | None]] | None:
        """The maps of the partitions just assigned, read again every `_HAND_OVER_POLL_S` while
        the committed offsets cannot be read, up to `timeout_s`. Without them the consumer
        fetches from the position aiokafka looked up as it joined, which may be older than a
        hand-over the last owner landed since, and this owner's first commit would move the
        position back (seed 88476 of `--flavour noida --static`: a broker outage began as the
        group formed)."""
        deadline = self._clock.monotonic() + self._timeout_s
        while True:
            maps = await self._maps.read(partitions)
            if maps is not None or self._clock.monotonic() >= deadline:
                break
            await asyncio.sleep(_HAND_OVER_POLL_S)
        if maps is None:
            logger.warning(
                "cannot read the committed offset maps of %d assigned partitions; their records "
                "wait until they can be read (the crash-loop breaker's counts are there)",
                len(partitions),
            )
        return maps

    async def _await_hand_overs(
        self, maps: dict[TopicPartition, tuple[int, OffsetMap | None]], alive: AliveWriters
    ) -> set[TopicPartition]:
        """Read again, for a little while, the maps of partitions whose last owner is alive but
        whose hand-over has not landed: that owner commits it again as soon as it rejoins
        (`RefusedHandOvers.land`), in the same round that assigned them here. Waiting for it saves
        running again what it answered; past `_HAND_OVER_WAIT_S` the records run again,
        blaming nobody. What lands replaces the partition's entry in `maps`. Returns the
        partitions whose hand-over did not land: it may still land later (`first_commits`)."""
        waiting = set()
        for tp, (_, previous) in maps.items():
            if (
                previous is not None
                and awaits_hand_over(previous)
                and previous.writer != self._incarnation
                and await alive(previous.writer) is not False
            ):
                # Alive, or not known to be dead (the group was rebalancing): a live writer
                # lands its hand-over as soon as it rejoins.
                waiting.add(tp)
        deadline = self._clock.monotonic() + _HAND_OVER_WAIT_S
        latest_deadline = deadline + self._timeout_s
        while waiting and self._clock.monotonic() < deadline:
            await asyncio.sleep(_HAND_OVER_POLL_S)
            again = await self._maps.read(waiting)
            if again is None:
                # The coordinator cannot be read: the hand-over may land (or have landed)
                # unseen, and fetching from the position read before would have this owner
                # commit behind it (seed 81012 of `--workers 16 --flavour noida --static`).
                # Waited for while that lasts, up to --commit-timeout-s more.
                deadline = min(
                    max(deadline, self._clock.monotonic() + _HAND_OVER_POLL_S), latest_deadline
                )
                continue
            for tp, (position, latest) in again.items():
                if latest is not None and (latest.clean or position != maps[tp][0]):
                    maps[tp] = (position, latest)
                    waiting.discard(tp)
        if waiting:
            logger.info(
                "the hand-over of %s by a live member did not land in %.1fs",
                ", ".join(f"{tp.topic}-{tp.partition}" for tp in sorted(waiting)),
                _HAND_OVER_WAIT_S,
            )
        return waiting
