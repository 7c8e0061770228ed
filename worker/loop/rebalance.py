"""What the group's rebalances do to the partitions the loop holds.

aiokafka's (eager) protocol revokes every partition at every rebalance, though most come
straight back. A revoked partition's jobs get `--revoke-grace-s` to finish; those still
running then are handed over named as running and parked: neither held nor committed, nothing
new starts on them, and their jobs go on. The next assignment decides: a partition given back
while the group still holds this member's last commit of it is adopted (its jobs finish and
commit here, as if nothing happened); any other moved, and its jobs are cancelled, answers
finished meanwhile dropped unsent (its next owner runs them). The loop asks this class which
partitions may start records and whether a finished answer may go out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from aiokafka import ConsumerRecord, TopicPartition

from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.metrics import Metrics
from worker.delivery.commits import Committer
from worker.delivery.offsets import PartitionOffsets
from worker.delivery.publish import Delivery
from worker.loop.gate import PartitionGate
from worker.loop.inflight import InFlight
from worker.loop.partition_states import PartitionStates

__all__ = ["Rebalances"]

logger = logging.getLogger(__name__)

#: How often the committed maps that could not be read at an assignment are read again.
_UNREAD_RETRY_S: Final = 0.5


class Rebalances:
    """The worker's side of the group's rebalances (see the module's text). `has_room` says
    whether the loop may fetch more (below its in-flight cap): assigned partitions resume
    only then."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        jobs: InFlight,
        delivery: Delivery,
        committer: Committer,
        states: PartitionStates,
        gate: PartitionGate,
        has_room: Callable[[], bool],
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._metrics = metrics
        self._jobs = jobs
        self._delivery = delivery
        self._committer = committer
        self._states = states
        self._gate = gate
        self._has_room = has_room
        # Partitions whose revoke callback is running: none of their records starts.
        self._revoking: set[TopicPartition] = set()
        # Revoked partitions whose jobs go on running until the next assignment says whether
        # the partition came back (True: they are answered and committed here as if nothing
        # happened) or moved (False: they are cancelled, their answers dropped unsent): the
        # tracker's record, which also keeps their offsets aside.
        self._parked = committer.tracker.parked_partitions
        # Partitions being revoked with a record started that will not run (`not_run`).
        self._not_to_keep: set[TopicPartition] = set()
        # Partitions adopted since they were assigned: aiokafka may still position one at its
        # committed offset after the rewind past its last start (its lookup of the committed
        # offsets lands later), and the records up to that start were started here already.
        self._adopted: set[TopicPartition] = set()
        # Reads again the committed maps of assigned partitions that could not be read.
        self._rereading: asyncio.Task[None] | None = None

    def may_start(self, tp: TopicPartition) -> bool:
        """Whether records of `tp`, an assigned partition, may start: not while it is being
        revoked (a record started then would run after the hand-over, and again at the next
        owner), nor while it is parked."""
        return tp not in self._revoking and self._parked.verdict(tp) is None

    def revoking(self, tp: TopicPartition) -> bool:
        return tp in self._revoking

    def not_started(
        self, tp: TopicPartition, fetched: list[ConsumerRecord[bytes, bytes]]
    ) -> list[ConsumerRecord[bytes, bytes]]:
        """Of `tp`'s fetched records, those not started here before: on an adopted partition,
        those past its last start (refetched from the committed position otherwise)."""
        if tp not in self._adopted:
            return fetched
        last = self._committer.partition(tp).last_started
        return fetched if last is None else [r for r in fetched if r.offset > last]

    def not_run(self, tp: TopicPartition, partition: PartitionOffsets) -> None:
        """A record started on `partition` will not run, and its start cannot be taken back:
        the partition is revoked, or being revoked. Parked, it would count that record as
        running for ever, and its commits would wait for it: it is not kept."""
        if tp in self._revoking:
            self._not_to_keep.add(tp)
        elif self._committer.parked(tp) is partition:
            self._states.drop_parked(tp)

    async def answer_stays(self, tp: TopicPartition, partition: PartitionOffsets) -> bool:
        """Whether an answer finished on `partition` may be sent: False when it was parked
        meanwhile and the next assignment gave it to another member (waits for that verdict)."""
        parked = self._parked.verdict(tp)
        if parked is None or not (
            self._committer.parked(tp) is partition or self._committer.holds(tp, partition)
        ):
            return True
        return await asyncio.shield(parked)

    async def revoked(self, revoked: set[TopicPartition]) -> None:
        """Let the revoked partitions' jobs finish for a bounded time, hand them over, and park
        those with jobs still running until the next assignment (`assigned`)."""
        # The maps still unread are read again after the next assignment: read now, one could
        # be taken for a partition this revoke is forgetting.
        await self.close()
        # Parked at an earlier revoke and not assigned since: decided at the next assignment.
        revoked = revoked - self._parked.awaiting()
        # The callback runs beside the loop, and the partitions stay assigned until it returns:
        # nothing of theirs may start meanwhile, or it would run after the hand-over, and
        # again at the next owner.
        self._revoking |= revoked
        # Held no longer: a supervisor (or a chaos harness) reading the gauge during the
        # rebalance must not take this worker for one serving them.
        self._metrics.assigned_partitions.set(len(self._gate.assignment() - revoked))
        try:
            grace = self._settings.revoke_grace_s
            if busy := self._jobs.busy(revoked):
                logger.info(
                    "rebalance: %d jobs of %s get %.1fs", busy, sorted(map(str, revoked)), grace
                )
            deadline = self._clock.monotonic() + grace
            await self._jobs.settle(revoked, grace)
            # A rebalance moves few partitions, or none (a member restarting, joining or
            # leaving elsewhere), but the group's protocol revokes them all: cancelling every
            # job past the grace left a job longer than the time between rebalances never
            # finishing anywhere (simulation seed 500003: a member crash-looping on a killer
            # record rebalanced the group every 7 s; a 20 s suspect running alone restarted
            # at each and held its worker for 150 s). Partitions with jobs running are handed
            # over as running and parked: their jobs and answers on their way go on, and an
            # answer finished meanwhile waits for the verdict rather than being sent.
            running = {tp for tp in revoked if self._jobs.busy({tp})} - self._not_to_keep
            self._parked.await_verdicts(running)
            await self._delivery.settle(revoked - running, deadline)
            # Their answers still on their way go out only once the next assignment gives
            # them back: the hand-over names those jobs as running, so sent meanwhile, an
            # answer is given again by the next owner should the partition move.
            self._delivery.park(running)
            kept: set[TopicPartition] = set()
            try:
                kept = await self._committer.revoked(revoked, keep=running)
                # Not kept after all: a record started meanwhile that will not run
                # (`not_run`), or a stop began meanwhile and decided its jobs already.
                for tp in kept.copy():
                    decision = self._parked.verdict(tp)
                    if tp in self._not_to_keep or decision is None or decision.done():
                        self._states.drop_parked(tp)
                        kept.discard(tp)
            finally:
                # Not kept (the hand-over timed out): cancelled, as the grace's end does.
                for tp in running - kept:
                    self._parked.decide(tp, stays=False)
            await self._jobs.abort(revoked - kept)
            await self._delivery.settle(running - kept, self._clock.monotonic())
            self._states.forget(revoked - kept)
            if kept:
                logger.info(
                    "%d jobs of %s run on through the rebalance",
                    self._jobs.busy(kept),
                    sorted(map(str, kept)),
                )
        finally:
            self._revoking -= revoked
            self._not_to_keep -= revoked
            self._adopted -= revoked

    async def assigned(self, assigned: set[TopicPartition]) -> None:
        # aiokafka builds fresh, unpaused state for every assigned partition, positioned at
        # the committed offset: paused before anything is awaited, until the offset maps are
        # read (or a parked partition's own state taken back), and paused again after that
        # while at the cap.
        self._gate.pause(assigned)
        # Parked partitions assigned back unchanged go on where they were; the rest moved.
        adopted = await self._committer.adopt(assigned)
        for tp in adopted:
            # Past the last record started: below it, every record runs or was answered here.
            last = self._committer.partition(tp).last_started
            if last is not None:
                self._gate.rewind(tp, last + 1)
        self._adopted |= adopted
        await self._decide_parked(adopted)
        self._gate.joined()
        for tp, position in (await self._committer.assigned(assigned)).items():
            self._gate.rewind(tp, position)
        if adopted:
            logger.info(
                "%s came back unchanged: %d jobs running on",
                sorted(map(str, adopted)),
                self._jobs.busy(adopted),
            )
            # The hand-over named them running but blamed nothing: a death now must.
            self._committer.tick(due=True)
        if self._committer.unread and self._rereading is None:
            self._rereading = asyncio.create_task(self._read_unread(), name="read unread maps")
        if assigned and self._has_room():
            self._gate.resume(assigned)
        self._metrics.assigned_partitions.set(len(self._gate.assignment()))
        logger.info("assigned %s", sorted(map(str, assigned)))

    async def _read_unread(self) -> None:
        """Until every assigned partition's committed map is read: read the unread ones again
        (held meanwhile: the crash counts of their records are in those maps, and a suspect
        run beside others would take them down with it) and fetch each from its committed
        position once read; the loop's next fetch resumes them."""
        try:
            while self._committer.unread:
                await asyncio.sleep(_UNREAD_RETRY_S)
                for tp, position in (await self._committer.read_unread()).items():
                    self._gate.rewind(tp, position)
        finally:
            self._rereading = None

    async def close(self) -> None:
        """Stop reading unread maps again (at a revoke, and at the worker's close)."""
        if self._rereading is not None:
            self._rereading.cancel()
            await asyncio.gather(self._rereading, return_exceptions=True)

    async def stopping(self) -> None:
        """A stop began: partitions revoked and never assigned back are the next owner's, and
        their jobs are cancelled."""
        await self._committer.adopt(set())
        await self._decide_parked(set())

    async def _decide_parked(self, adopted: set[TopicPartition]) -> None:
        """The parked partitions not `adopted` moved: their jobs are cancelled (those answered
        meanwhile drop their answers), and whatever held them is forgotten."""
        moved = self._parked.decide_all(adopted)
        if moved:
            # Cancelled before anything is awaited: none may send an answer meanwhile.
            if cancelled := await self._jobs.cancel(moved):
                logger.info(
                    "%s moved to another member: %d jobs still running cancelled",
                    sorted(map(str, moved)),
                    cancelled,
                )
            # Answers on their way are the new owner's to give (`Delivery.settle`).
            await self._delivery.settle(moved, self._clock.monotonic())
            # One whose revoke is still under way (a stop began meanwhile) is forgotten there,
            # after its hand-over: forgotten now, it would not be handed over at all.
            self._states.forget(moved - self._revoking)
