"""This member's own hand-overs of revoked partitions that did not land, landed again.

The group may refuse a hand-over made during a rebalance, or not answer it in time (a
coordinator that is away); the member commits it again in its new generation as soon as it
has rejoined (`Inheritance` does that first on every assignment), and a stopping worker does
within its grace. `Committer` makes the hand-overs; this keeps and lands the ones that failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from worker.core.consumer_port import GroupConsumer
from worker.core.metrics import Metrics
from worker.delivery.offset_map import OffsetMap, decode_offset_map
from worker.delivery.offsets import Commit, describe_commits

__all__ = ["CommittedReader", "RefusedHandOvers", "awaits_hand_over"]

logger = logging.getLogger(__name__)

#: Reads the group's committed offsets and metadata of some partitions (`GroupOffsetsReader`).
CommittedReader = Callable[[list[TopicPartition]], Awaitable[dict[TopicPartition, Commit]]]

# The group's answer that this member's generation is over: a hand-over refused with it is
# not tried again.
_REFUSED: Final = (CommitFailedError, IllegalStateError)


class RefusedHandOvers:
    """The hand-overs the group refused this member (`refused`), until they land (`land`).
    `on_landed(offsets)` is told what landed: a partition adopted back meanwhile must know the
    group now holds its hand-over, not the commit it last saw land."""

    def __init__(
        self,
        consumer: GroupConsumer,
        metrics: Metrics,
        *,
        timeout_s: float,
        read_committed: CommittedReader | None = None,
        on_landed: Callable[[dict[TopicPartition, Commit]], None] = lambda _: None,
    ) -> None:
        self._consumer = consumer
        self._on_landed = on_landed
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._read_committed = read_committed
        # The hand-over commits still to land, and what this member had committed there
        # before (None: nothing).
        self._unlanded: dict[TopicPartition, Commit] = {}
        self._before: dict[TopicPartition, Commit | None] = {}
        # One landing at a time: a stopping worker waits for the one its assignment callback
        # has on its way instead of finding nothing left to land.
        self._landing = asyncio.Lock()

    def refused(
        self, offsets: dict[TopicPartition, Commit], before: dict[TopicPartition, Commit | None]
    ) -> None:
        """The group refused this hand-over, or did not answer it in time: land it later
        (`land`), unless someone committed there since `before` (this member's last
        commit landed there).

        Kept only where the next owner waits for it: where `before` names jobs as running and
        is not a clean hand-over (`Inheritance._await_hand_overs`). Over any other map the next
        owner fetches at once, and a hand-over landing after it read would have that owner's
        first commit move the position back; what was answered since `before` runs again
        instead."""
        for tp, commit in offsets.items():
            mine = before.get(tp)
            if mine is not None and _waited_for(mine):
                self._unlanded[tp], self._before[tp] = commit, mine

    @property
    def unlanded(self) -> bool:
        """Whether a hand-over of revoked partitions is still to be landed, or on its way
        (`land`)."""
        return bool(self._unlanded) or self._landing.locked()

    async def land(self) -> None:
        """Commit again, in the member's current generation, the hand-overs of revoked
        partitions that did not land: refused by the group in the old generation, or not
        answered in time (a coordinator that is away). Made on rejoining, before anything
        else, and by a stopping worker within its grace.

        A broker may refuse the old generation's commits from the moment another member asks
        to join, before this member even hears of the rebalance (noida-db does; Apache Kafka
        takes them until the rebalance completes). The group takes a commit of the current
        generation for any partition, so the hand-over lands now: the new owners, assigned in
        this same round, read it unless they read first (they then run again what was answered
        and not committed, blaming nobody: the map names a live writer). Made before this
        member starts anything, it cannot move back a position a new owner committed since.

        Refused again in a generation of its own, it is dropped: the member's generation is
        over, and the new owners run again what was answered and not committed. Refused while
        the member has no generation (its join under way: a stopping worker tries before
        aiokafka has rejoined), or not answered in time, it is kept for the next try: the join
        may have completed by then, or the coordinator be back.

        A call made while another lands waits for it (seed 94081 of `--flavour noida
        --static --weight-update-every-s 4 --engine-killing-updates 0.3`: an update left no
        engine just as the member rejoined; the stopping worker found nothing to land, as the
        assignment callback had taken the refused hand-over on its way, left the group, and
        that landing failed with it).
        """
        async with self._landing:
            await self._land()

    async def _land(self) -> None:
        if not self._unlanded:
            return
        offsets, self._unlanded = self._unlanded, {}
        before, self._before = self._before, {}
        try:
            offsets = await self._not_overtaken(offsets, before)
            if not offsets:
                return
            async with asyncio.timeout(self._timeout_s):
                await self._consumer.commit_hand_over(offsets)
        except (KafkaError, TimeoutError) as exc:
            self._metrics.commits.labels("failed").inc()
            if isinstance(exc, _REFUSED) and not self._consumer.rejoining():
                logger.warning(
                    "the hand-over of %s was refused again (%r); the records answered and not "
                    "committed will run again",
                    describe_commits(offsets),
                    exc,
                )
                return
            logger.info(
                "the hand-over of %s did not land (%r); it is tried again",
                describe_commits(offsets),
                exc,
            )
            for tp, commit in offsets.items():  # a newer hand-over of tp wins
                if tp not in self._unlanded:
                    self._unlanded[tp], self._before[tp] = commit, before.get(tp)
            return
        self._metrics.commits.labels("ok").inc()
        logger.info("hand-over of %s landed after all", describe_commits(offsets))
        self._on_landed(offsets)

    async def _not_overtaken(
        self, offsets: dict[TopicPartition, Commit], before: dict[TopicPartition, Commit | None]
    ) -> dict[TopicPartition, Commit]:
        """Of the hand-overs to land, those whose partition nobody committed since this member
        did (`before`): the new owner may have read the map without it and committed already,
        and landing it then would move that owner's position back and replace its map (the
        records it runs would not count a death if it died). Read without a lock, so a commit
        racing this read can still be overwritten; the window is one round trip, not the
        whole rejoin. When the group cannot be read, nothing lands now (raises)."""
        if self._read_committed is None:
            return offsets
        async with asyncio.timeout(self._timeout_s):
            now = await self._read_committed(sorted(offsets))
        kept: dict[TopicPartition, Commit] = {}
        for tp, commit in offsets.items():
            current = now.get(tp)
            mine = before.get(tp)
            unchanged = current is None or current == mine
            if mine is None and current is not None:
                unchanged = current[0] < commit[0]  # nothing of ours: an older position only
            if unchanged:
                kept[tp] = commit
            else:
                logger.info(
                    "%s-%s: committed at %d by another member since; the hand-over at %d is "
                    "not landed over it",
                    tp.topic,
                    tp.partition,
                    current[0] if current is not None else -1,
                    commit[0],
                )
        return kept


def _waited_for(commit: Commit) -> bool:
    """Whether a next owner that reads `commit` waits for its writer's hand-over: a map naming
    jobs as running that is not a clean hand-over (`Inheritance._await_hand_overs`)."""
    position, metadata = commit
    try:
        written = decode_offset_map(position, metadata)
    except Exception:  # noqa: BLE001 - what cannot be read is not waited for
        return False
    return awaits_hand_over(written)


def awaits_hand_over(written: OffsetMap) -> bool:
    """A map naming jobs as running that is not a clean hand-over: its writer, when alive, is
    expected to land a hand-over over it, and a next owner waits for one."""
    return not written.clean and bool(written.running - written.answered)
