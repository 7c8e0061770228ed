"""The crash-loop breaker: after a worker process died, which records run, and when; and which
stops blame the jobs in flight at all.

A record that kills the process would be redelivered to every worker that takes its partition.
The commits name what runs (see `worker.delivery.offset_map`), so a new owner knows how many
deaths each record was in flight at. A record in flight at a death is a suspect.

A suspect of one death runs again beside everything else, once a commit naming it as running
has landed (so another death counts against it). Most deaths are no job's doing (a kill from
outside, an out-of-memory, a lost node), and then every job in flight is a suspect: running
them one at a time after such a death left a worker at one sequence for the sum of their
lengths (simulation seeds 40030, 41021, 41130: long rollouts held every partition past a
minute). A record that kills the process dies again at this retry, beside whatever ran with it.

A suspect of two deaths or more runs alone across the whole worker (nothing else of any
partition in flight, and a commit naming it alone as running landed first), so a later death
while it runs blames it and no one else. Only the record that kills the process collects those
deaths; one in flight at `max_crash_attempts` deaths (at least three: the first, its retry, and
one of its own alone) is answered instead of run. A healthy job beside a killer at both of its
first deaths is dead-lettered only if two more deaths from outside hit it while it runs alone,
as before the retry beside the others was added.

Suspects of two deaths run one at a time rather than bisected: a bisection halves the group at
each death, but every member of a group at a death is merely present at it, so counting those
deaths would dead-letter healthy jobs, and not counting them needs a record of each group's
history in the map. Serial runs cost a drain per suspect, paid only after a killer's retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final, NamedTuple, TypeAlias

from aiokafka import ConsumerRecord, TopicPartition

from worker.core.errors import FatalError
from worker.core.metrics import Metrics
from worker.delivery.offsets import OffsetTracker, PartitionOffsets

__all__ = ["CrashLoopBreaker", "Taken", "stop_blames_running_jobs"]

logger = logging.getLogger(__name__)

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"

#: After the commit that was to name a suspect as running did not land, how long its partition
#: (every partition, for a suspect to run alone) stays held before the suspect is fetched and
#: tried again: a coordinator that refuses commits at once must not turn the loop into a spin
#: of fetches, rewinds and commits.
RETRY_ALONE_S: Final = 0.5

#: Deaths a suspect may have been in flight at and still run beside other jobs: its first.
RETRY_BESIDE_OTHERS: Final = 1


def stop_blames_running_jobs(fatal: FatalError | None) -> bool:
    """Whether a stop on `fatal` (None: asked to stop) may have been caused by a job in flight,
    so its final commit must not be a clean hand-over. The one place that decides what a stop
    blames: a stop asked for (SIGTERM, revoke), a broker that cannot be reached and an engine
    a weight update left dead are no job's doing (`FatalError.blames_jobs`); an engine that
    died under its jobs may be."""
    return fatal is not None and fatal.blames_jobs


class Taken(NamedTuple):
    """What the breaker decided for a fetched run of records."""

    #: To run now.
    run: list[Record]
    #: To answer as having been in flight at that many deaths, without running them.
    crash_looped: list[tuple[Record, int]]
    #: Where to fetch the partition from next (records past it come again later), or None.
    rewind_to: int | None = None


class _Alone(NamedTuple):
    tp: TopicPartition
    partition: PartitionOffsets
    offset: int


class CrashLoopBreaker:
    """Picks what runs of partitions with suspects; holds the others while a suspect runs."""

    def __init__(
        self,
        max_crash_attempts: int,
        metrics: Metrics,
        tracker: OffsetTracker,
        assignment: Callable[[], set[TopicPartition]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limit = max(max_crash_attempts, 3) if max_crash_attempts else 0
        self._metrics = metrics
        self._tracker = tracker
        self._assignment = assignment
        # The suspect running alone, from its start until a commit past it lands.
        self._alone: _Alone | None = None
        # Whether `_alone` was chosen but not yet named alone in a landed commit.
        self._unconfirmed = False
        # Partitions whose next record is a suspect waiting for the worker to be quiet.
        self._waiting: set[TopicPartition] = set()
        self._clock = clock
        # Until then, a suspect whose commit did not land waits with every partition held.
        self._retry_at = 0.0
        # Partitions whose suspect's commit did not land, held until `_retry_beside_at`.
        self._retrying: set[TopicPartition] = set()
        self._retry_beside_at = 0.0

    @property
    def enabled(self) -> bool:
        return self._limit > 0

    def take(self, tp: TopicPartition, partition: PartitionOffsets, records: list[Record]) -> Taken:
        """Of `records` (fetched, in order), those to run now, and those to answer as having
        been in flight at that many deaths. Records past a suspect are fetched again later: one
        of a single death ends the run (it starts once a commit names it running; see
        `retries`), one of more waits unless it can run alone now."""
        run: list[Record] = []
        crash_looped: list[tuple[Record, int]] = []
        for record in records:
            if self._alone is not None:
                return Taken(run, crash_looped, rewind_to=record.offset)
            deaths = partition.deaths.get(record.offset, 0)
            if deaths >= self._limit:
                if partition.start(record.offset):
                    crash_looped.append((record, deaths))
                else:
                    self._metrics.skipped.inc()
                continue
            if deaths and deaths <= RETRY_BESIDE_OTHERS:
                if not partition.start(record.offset):
                    self._metrics.skipped.inc()  # answered before, as the map says: not run
                    continue
                # Last of the run, so that it is its partition's last start: taken back alone
                # when the commit naming it does not land.
                run.append(record)
                return Taken(run, crash_looped, rewind_to=record.offset + 1)
            if deaths:
                if run or not self._quiet():
                    self._waiting.add(tp)
                    return Taken(run, crash_looped, rewind_to=record.offset)  # again once quiet
                if not partition.start(record.offset):
                    self._metrics.skipped.inc()  # answered before, as the map says: not run
                    continue
                logger.info(
                    "%s-%s@%d was in flight at %d worker deaths: running it alone",
                    tp.topic,
                    tp.partition,
                    record.offset,
                    deaths,
                )
                self._waiting.discard(tp)
                self._alone = _Alone(tp, partition, record.offset)
                self._unconfirmed = True
                run.append(record)
                return Taken(run, crash_looped, rewind_to=record.offset + 1)
            if partition.start(record.offset):
                run.append(record)
            else:
                self._metrics.skipped.inc()
        return Taken(run, crash_looped)

    @property
    def engaged(self) -> bool:
        """A suspect runs alone or waits for the worker to be quiet: an acknowledgement or a
        commit may let it go on."""
        return self._alone is not None or bool(self._waiting)

    def blocks(self) -> bool:
        """A suspect runs alone (or was just chosen to): nothing else may start."""
        return self._alone is not None

    def chosen(self) -> _Alone | None:
        """The suspect chosen to run alone whose commit has not landed yet."""
        return self._alone if self._unconfirmed else None

    def confirmed(self, landed: bool) -> None:
        """The commit naming the chosen suspect alone landed (it may start), or did not (it
        was taken back, and waits for the next try)."""
        alone = self._alone
        if alone is None:
            return
        if landed:
            self._unconfirmed = False
        else:
            self._alone = None
            self._unconfirmed = False
            self._waiting.add(alone.tp)
            self._retry_at = self._clock() + RETRY_ALONE_S

    def retries(self, partition: PartitionOffsets, offset: int) -> bool:
        """Whether the record taken to run at `offset` is a suspect retried beside the others:
        it may start only once a commit naming it as running has landed, or its death would
        go uncounted and a record that kills the process at once would do so for ever."""
        return self.enabled and 0 < partition.deaths.get(offset, 0) <= RETRY_BESIDE_OTHERS

    def retry_later(self, tps: set[TopicPartition]) -> None:
        """The commit naming these partitions' retried suspects did not land: they were taken
        back, and their partitions wait `RETRY_ALONE_S` before they are fetched again."""
        self._retrying |= tps
        self._retry_beside_at = self._clock() + RETRY_ALONE_S

    def held(self) -> set[TopicPartition]:
        """Every partition while a suspect runs alone and until a commit past it lands; while
        a suspect waits, every partition until the worker is quiet, and then all but the
        suspect's; and for a while, those whose retried suspect's commit did not land.
        Re-examined on every fetch."""
        if not self.enabled:
            return set()
        if self._running_alone() is not None:
            return self._assignment()
        if self._retrying and self._clock() >= self._retry_beside_at:
            self._retrying = set()
        if self._waiting:
            assigned = self._assignment()
            self._waiting = {
                tp for tp in self._waiting & assigned if self._tracker.partition(tp).deaths
            }
        if not self._waiting:
            return self._retrying & self._assignment()
        if self._quiet() and self._clock() >= self._retry_at:
            return self._assignment() - {min(self._waiting)}
        return self._assignment()

    def suspects(self) -> int:
        """Records in flight at an earlier death still to run or be answered, and the
        one that ran alone until a commit past it lands: a death until then still blames it
        (what a supervisor reads before it kills a worker)."""
        count = sum(len(partition.deaths) for _, partition in self._tracker.items())
        if (
            alone := self._running_alone()
        ) is not None and alone.offset not in alone.partition.deaths:
            count += 1
        return count

    def commit_due(self) -> bool:
        """The suspect that ran alone is answered: commit past it now, not at the interval's
        next tick, since every partition is held until that commit lands."""
        alone = self._running_alone()
        if alone is None or self._unconfirmed:
            return False
        position = alone.partition.commit_position()
        return position is not None and position > alone.offset

    def forget(self, revoked: set[TopicPartition]) -> None:
        self._waiting -= revoked
        self._retrying -= revoked
        if self._alone is not None and self._alone.tp in revoked:
            self._alone = None
            self._unconfirmed = False

    def _running_alone(self) -> _Alone | None:
        """The suspect chosen to run alone, from its choice until a commit past it lands."""
        alone = self._alone
        if alone is None:
            return None
        committed = alone.partition.committed
        if self._unconfirmed or committed is None or committed[0] <= alone.offset:
            return alone
        self._alone = None
        return None

    def _quiet(self) -> bool:
        """Nothing of any partition is in flight (every started record is acknowledged)."""
        return all(partition.idle for _, partition in self._tracker.items())
