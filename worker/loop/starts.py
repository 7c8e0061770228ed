"""Which fetched records start now, and each job's way from its record to its answer.

A fetched record starts unless its partition is being revoked or parked, a version hold or the
crash-loop breaker keeps it back (it is fetched again later), or the committed map says it was
answered before; a record in flight at too many deaths is answered without running. A job's
answer goes to `Delivery` unless its partition moved meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from aiokafka import ConsumerRecord, TopicPartition

from worker.answering.answers import AnswerBuilder
from worker.core.errors import FatalError
from worker.core.metrics import Metrics
from worker.delivery.commits import Committer
from worker.delivery.offsets import PartitionOffsets
from worker.delivery.publish import Delivery, Ticket
from worker.loop.breaker import CrashLoopBreaker, Suspect
from worker.loop.gate import Batch, PartitionGate
from worker.loop.inflight import InFlight
from worker.loop.rebalance import Rebalances
from worker.loop.version_holds import VersionHolds

__all__ = ["JobStarts", "PartitionAnswerOwner"]

logger = logging.getLogger(__name__)

Runnable = tuple[TopicPartition, PartitionOffsets, ConsumerRecord[bytes, bytes]]


class JobStarts:
    """Starts the jobs of fetched batches (`start`) on `jobs`; `fail` stops the worker on a
    fatal error of a job."""

    def __init__(
        self,
        *,
        answers: AnswerBuilder,
        committer: Committer,
        breaker: CrashLoopBreaker,
        holds: VersionHolds,
        gate: PartitionGate,
        rebalances: Rebalances,
        jobs: InFlight,
        delivery: Delivery,
        metrics: Metrics,
        fail: Callable[[FatalError, str], None],
    ) -> None:
        self._answers = answers
        self._committer = committer
        self._breaker = breaker
        self._holds = holds
        self._gate = gate
        self._rebalances = rebalances
        self._jobs = jobs
        self._delivery = delivery
        self._metrics = metrics
        self._fail = fail

    async def start(self, batch: Batch) -> None:
        """Start the jobs of `batch` that may start now (see the module's text)."""
        if not batch:
            return
        assigned = self._gate.assignment()
        runnable: list[Runnable] = []
        for tp, fetched in batch.items():
            # Else revoked (or being revoked) since the fetch: the next owner reads it.
            if tp in assigned and self._rebalances.may_start(tp):
                runnable += self._runnable(tp, fetched)
        if chosen := self._breaker.chosen():
            runnable = await self._confirm_chosen(chosen, runnable)
        elif retried := [r for r in runnable if self._breaker.retries(r[1], r[2].offset)]:
            # A suspect of one death runs again beside the others once a commit names it
            # running: a death then counts against it, and a record that kills the process at
            # once reaches the breaker's limit instead of dying unseen for ever.
            if not await self._committer.write_ahead_exact():
                logger.warning(
                    "the commit before retrying %d suspects of a crash did not land; they wait",
                    len(retried),
                )
                # Each is the last start of its partition (`CrashLoopBreaker.take`).
                waiting: set[TopicPartition] = set()
                for tp, partition, record in retried:
                    if self._take_back(tp, partition, record.offset):
                        waiting.add(tp)
                self._breaker.retry_later(waiting)
                taken_back = {id(r) for r in retried}
                runnable = [r for r in runnable if id(r) not in taken_back]
        elif self._breaker.enabled and runnable:
            # Written ahead: the commit names these as running before any of them runs, so if
            # one kills the process, the next owner knows which records were in flight.
            await self._committer.write_ahead()
        for tp, partition, record in runnable:
            if (
                self._rebalances.revoking(tp)
                or not self._committer.holds(tp, partition)
                or record.offset < partition.floor
            ):
                # Revoked while the commit above was awaited (and maybe assigned back, from
                # the committed position): its next owner runs it, and only once. Or answered
                # by the last owner, whose hand-over that commit found landed after all.
                self._rebalances.not_run(tp, partition)
                continue
            self._jobs.start(tp, functools.partial(self._job, tp, partition, record))

    async def _confirm_chosen(
        self,
        chosen: list[Suspect],
        runnable: list[Runnable],
    ) -> list[Runnable]:
        """`runnable`, less the `chosen` suspects when the commit naming them as running did
        not land. They run alone (or together) only once one does: a death then blames them,
        and none of the jobs that ran before them."""
        landed = await self._committer.write_ahead_exact()
        if not landed:
            logger.warning(
                "the commit before running %d suspects of a crash alone or together did not "
                "land; they wait: %s",
                len(chosen),
                ", ".join(f"{s.tp.topic}-{s.tp.partition}@{s.offset}" for s in chosen),
            )
            # Last started first: each is taken back as its partition's last start.
            for suspect in reversed(chosen):
                self._take_back(suspect.tp, suspect.partition, suspect.offset)
            waits = {(s.tp, s.offset) for s in chosen}
            runnable = [r for r in runnable if (r[0], r[2].offset) not in waits]
        self._breaker.confirmed(landed)
        return runnable

    def _take_back(self, tp: TopicPartition, partition: PartitionOffsets, offset: int) -> bool:
        """`offset` of `tp` does not start now: fetch it again later. False when `tp` moved
        while the commit before it was awaited (aiokafka runs a whole rebalance beside the
        loop meanwhile): its owner now, maybe this member again, reads it from the committed
        position, and seeking a partition no longer assigned raises."""
        if not self._committer.holds(tp, partition):
            self._rebalances.not_run(tp, partition)
            return False
        partition.unstart(offset)
        self._gate.rewind(tp, offset)
        return True

    def _runnable(
        self, tp: TopicPartition, fetched: list[ConsumerRecord[bytes, bytes]]
    ) -> list[Runnable]:
        """Of one partition's fetched records, those to run now. Those that wait (for newer
        weights, or behind a suspect of a crash) are fetched again later; those answered
        before a crash or rebalance are skipped; those in flight at too many crashes are
        answered at once, without running."""
        fetched = self._rebalances.not_started(tp, fetched)
        if not fetched:
            return []
        if self._breaker.blocks(tp):
            # Suspects of a crash run alone: nothing of any partition starts beside them.
            self._gate.rewind(tp, fetched[0].offset)
            return []
        records, rewind_to = self._holds.runnable(tp, fetched)
        if rewind_to is not None:
            self._gate.rewind(tp, rewind_to)
        if not records:
            return []
        partition = self._committer.partition(tp)
        if self._breaker.enabled and partition.deaths:
            taken = self._breaker.take(tp, partition, records)
            if taken.rewind_to is not None:
                self._gate.rewind(tp, taken.rewind_to)
            for record, deaths in taken.crash_looped:
                self._jobs.start(
                    tp, functools.partial(self._job, tp, partition, record, deaths=deaths)
                )
            return [(tp, partition, record) for record in taken.run]
        runnable = []
        for record in records:
            if partition.start(record.offset):
                runnable.append((tp, partition, record))
            else:  # answered before a crash or rebalance, as the committed map says
                self._metrics.skipped.inc()
        return runnable

    async def _job(
        self,
        tp: TopicPartition,
        partition: PartitionOffsets,
        record: ConsumerRecord[bytes, bytes],
        slot: int,
        *,
        deaths: int = 0,
    ) -> None:
        """Answer one record and hand the answer on. Only cancellation and fatal errors leave
        without an answer; both leave the offset unfinished, so the record is redelivered.
        `deaths`: the record is not run but answered as having been in flight at that many
        process deaths."""
        try:
            if deaths:
                answer = await self._answers.crash_looped(tp, record, deaths)
            else:
                expired = self._holds.gave_up(tp, record.offset)
                answer = await self._answers.answer(tp, record, expired=expired)
            # Answered while its partition was revoked: sent only if it comes back here, or
            # its next owner, running it again, would send a second answer.
            if not await self._rebalances.answer_stays(tp, partition):
                logger.info(
                    "job at %s-%s@%s answered after its partition moved; its answer is "
                    "dropped, the new owner runs it",
                    tp.topic,
                    tp.partition,
                    record.offset,
                )
                return
            owner = PartitionAnswerOwner(tp, partition, self._rebalances.answer_stays)
            ticket = Ticket(tp, owner, record.offset, answer)
            if not self._delivery.queue(ticket):
                await self._delivery.send_alone(ticket)
            # The answer is counted in the outbox now; counted here too, it would count twice.
            self._jobs.release(slot)
        except asyncio.CancelledError:
            logger.info(
                "job at %s-%s@%s cancelled; left uncommitted for redelivery",
                tp.topic,
                tp.partition,
                record.offset,
            )
            raise
        except FatalError as exc:
            self._fail(exc, f"{tp.topic}-{tp.partition}@{record.offset}")


class PartitionAnswerOwner:
    """The consumer side of an answer on its way (`worker.delivery.tickets.AnswerOwner`): the
    offsets of the partition its job came from, the very ones it started on, whose offset
    its acknowledgement finishes; and `stays(tp, partition)`, which says whether an answer of
    that partition may still go out after a revoke parked it (`Rebalances.answer_stays`)."""

    __slots__ = ("_partition", "_stays", "_tp")

    def __init__(
        self,
        tp: TopicPartition,
        partition: PartitionOffsets,
        stays: Callable[[TopicPartition, PartitionOffsets], Awaitable[bool]],
    ) -> None:
        self._tp = tp
        self._partition = partition
        self._stays = stays

    def acknowledged(self, offset: int) -> None:
        self._partition.finish(offset)

    async def may_send(self) -> bool:
        return await self._stays(self._tp, self._partition)
