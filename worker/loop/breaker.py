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

A suspect of two deaths runs once more together with every other suspect of two deaths that
waits, and with nothing else in flight across the whole worker (a commit naming them as running
landed first). Two deaths from outside in a row are common under a rolling restart or a flaky
node, and then the suspects are healthy: together they cost one drain and their longest run,
where one at a time they cost a drain and a run each (simulation seeds 103113 and 103135: long
rollouts run one after another held a worker past the settle period). A record that kills the
process dies again here, and every suspect beside it counts that death: this costs each of them
one death, so it is tried only where the limit leaves two more after it (`--max-crash-attempts`
5 or more: each suspect keeps as many deaths in reserve as one of two deaths running alone
under a limit of 4).

A suspect of three deaths or more (two with a limit below 5) runs alone across the whole
worker (nothing else of any partition in flight, and a commit naming it alone as running landed
first), so a later death while it runs blames it and no one else. Only the record that kills
the process collects those deaths; one in flight at `max_crash_attempts` deaths is answered
instead of run.

Past that one try together, suspects run one at a time rather than bisected further: every
member of a group at a death is merely present at it, so counting more of those deaths would
dead-letter healthy jobs, and not counting them needs a record of each group's history in the
map. Serial runs cost a drain per suspect, paid only after a killer's retry and its try
together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final, NamedTuple, TypeAlias

from aiokafka import ConsumerRecord, TopicPartition

from worker.core.clock import Clock
from worker.core.errors import FatalError
from worker.core.metrics import Metrics
from worker.delivery.offsets import OffsetTracker, PartitionOffsets

__all__ = ["CrashLoopBreaker", "Suspect", "Taken", "stop_blames_running_jobs"]

logger = logging.getLogger(__name__)

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"

#: After the commit that was to name a suspect as running did not land, how long its partition
#: (every partition, for a suspect to run alone) stays held before the suspect is fetched and
#: tried again: a coordinator that refuses commits at once must not turn the loop into a spin
#: of fetches, rewinds and commits.
RETRY_ALONE_S: Final = 0.5

#: Deaths a suspect may have been in flight at and still run beside other jobs: its first.
RETRY_BESIDE_OTHERS: Final = 1

#: Deaths a suspect may have been in flight at and still run together with the other suspects
#: of as many deaths (nothing else in flight): its retry's.
RUN_TOGETHER: Final = 2

#: The least `max_crash_attempts` at which suspects of `RUN_TOGETHER` deaths run together: a
#: death there leaves each of them two short of the limit.
TOGETHER_FROM_LIMIT: Final = RUN_TOGETHER + 3


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


class Suspect(NamedTuple):
    """A suspect chosen to run alone, or together with others of as many deaths."""

    tp: TopicPartition
    partition: PartitionOffsets
    offset: int
    deaths: int


class CrashLoopBreaker:
    """Picks what runs of partitions with suspects; holds the others while suspects run alone
    or together."""

    def __init__(
        self,
        max_crash_attempts: int,
        metrics: Metrics,
        tracker: OffsetTracker,
        assignment: Callable[[], set[TopicPartition]],
        *,
        clock: Clock,
    ) -> None:
        self._limit = max(max_crash_attempts, 3) if max_crash_attempts else 0
        self._metrics = metrics
        self._tracker = tracker
        self._assignment = assignment
        # The suspects running alone (one) or together, from their start until a commit past
        # each lands. Suspects of as many deaths may join those running together while they
        # run: the batch that started the first of them may not hold every partition's.
        self._chosen: list[Suspect] = []
        # Those of `_chosen` not yet named as running in a landed commit (they do not start
        # until one is).
        self._unconfirmed: list[Suspect] = []
        # Partitions fetched while suspects run together whose next record cannot join them:
        # held until those end, or the loop would spin fetching and rewinding them.
        self._passed: set[TopicPartition] = set()
        # Partitions whose next record is a suspect waiting for the worker to be quiet, and
        # that suspect's deaths.
        self._waiting: dict[TopicPartition, int] = {}
        self._clock = clock
        # Until then, a suspect whose commit did not land waits with every partition held.
        self._retry_at = 0.0
        # Partitions whose suspect's commit did not land, held until `_retry_beside_at`.
        self._retrying: set[TopicPartition] = set()
        self._retry_beside_at = 0.0

    @property
    def enabled(self) -> bool:
        return self._limit > 0

    def runs_together(self, deaths: int) -> bool:
        """Whether a suspect of `deaths` runs together with the others of as many."""
        return deaths == RUN_TOGETHER and self._limit >= TOGETHER_FROM_LIMIT

    def take(self, tp: TopicPartition, partition: PartitionOffsets, records: list[Record]) -> Taken:
        """Of `records` (fetched, in order), those to run now, and those to answer as having
        been in flight at that many deaths. Records past a suspect are fetched again later: one
        of a single death ends the run (it starts once a commit names it running; see
        `retries`), one of more waits unless it can run alone (or together) now."""
        run: list[Record] = []
        crash_looped: list[tuple[Record, int]] = []
        for i, record in enumerate(records):
            if self._chosen:
                return self._join(tp, partition, records[i:], Taken(run, crash_looped))
            deaths = partition.deaths.get(record.offset, 0)
            if deaths >= self._limit:
                if self._start(partition, record.offset):
                    crash_looped.append((record, deaths))
                continue
            if deaths and deaths <= RETRY_BESIDE_OTHERS:
                if not self._start(partition, record.offset):
                    continue
                # Last of the run, so that it is its partition's last start: taken back alone
                # when the commit naming it does not land.
                run.append(record)
                return Taken(run, crash_looped, rewind_to=record.offset + 1)
            if deaths:
                if run or not self._quiet():
                    self._waiting[tp] = deaths
                    return Taken(run, crash_looped, rewind_to=record.offset)  # again once quiet
                if not self._start(partition, record.offset):
                    continue
                logger.info(
                    "%s-%s@%d was in flight at %d worker deaths: running it %s",
                    tp.topic,
                    tp.partition,
                    record.offset,
                    deaths,
                    "together with the others of as many"
                    if self.runs_together(deaths)
                    else "alone",
                )
                self._waiting.pop(tp, None)
                self._choose(Suspect(tp, partition, record.offset, deaths))
                run.append(record)
                if not self.runs_together(deaths):
                    return Taken(run, crash_looped, rewind_to=record.offset + 1)
                return self._join(tp, partition, records[i + 1 :], Taken(run, crash_looped))
            if self._start(partition, record.offset):
                run.append(record)
        return Taken(run, crash_looped)

    def _join(
        self, tp: TopicPartition, partition: PartitionOffsets, records: list[Record], taken: Taken
    ) -> Taken:
        """`taken`, and of `records` (the rest of the fetch) those that join the suspects
        chosen to run; the partition is fetched again from the first that cannot."""
        for record in records:
            deaths = partition.deaths.get(record.offset, 0)
            if not self._joins(deaths):
                self._passed.add(tp)
                return taken._replace(rewind_to=record.offset)
            if self._start(partition, record.offset):
                self._waiting.pop(tp, None)
                self._choose(Suspect(tp, partition, record.offset, deaths))
                taken.run.append(record)
        return taken

    def _start(self, partition: PartitionOffsets, offset: int) -> bool:
        """Mark `offset` started; False (and counted skipped) when it was answered before, as
        the map says: it does not run again."""
        if partition.start(offset):
            return True
        self._metrics.skipped.inc()
        return False

    def _choose(self, suspect: Suspect) -> None:
        self._chosen.append(suspect)
        self._unconfirmed.append(suspect)

    def _together(self) -> bool:
        """The suspects chosen to run, run together: others of as many deaths may join."""
        return bool(self._chosen) and self.runs_together(self._chosen[0].deaths)

    def _joins(self, deaths: int) -> bool:
        """Whether a record of `deaths` joins the suspects chosen to run: they run together,
        and it is a suspect of as many deaths (the partition's other records wait)."""
        return self._together() and self.runs_together(deaths)

    @property
    def engaged(self) -> bool:
        """Suspects run alone or together, or wait for the worker to be quiet: an
        acknowledgement or a commit may let them go on."""
        return bool(self._chosen) or bool(self._waiting)

    def blocks(self, tp: TopicPartition) -> bool:
        """Nothing of `tp` may start: suspects run alone or together (or were just chosen to),
        and `tp` has no suspect that might join them (`take` decides for one that has)."""
        if not self._chosen:
            return False
        return not (self._together() and self._tracker.deaths(tp))

    def chosen(self) -> list[Suspect]:
        """The suspects chosen to run alone or together whose commit has not landed yet, in
        the order they started."""
        return list(self._unconfirmed)

    def confirmed(self, landed: bool) -> None:
        """The commit naming the chosen suspects as running landed (they may start), or did
        not (they were taken back, and wait for the next try)."""
        unconfirmed, self._unconfirmed = self._unconfirmed, []
        if landed or not unconfirmed:
            return
        for suspect in unconfirmed:
            self._waiting[suspect.tp] = suspect.deaths
        self._chosen = [suspect for suspect in self._chosen if suspect not in unconfirmed]
        self._retry_at = self._clock.monotonic() + RETRY_ALONE_S
        self._running_chosen()

    def retries(self, partition: PartitionOffsets, offset: int) -> bool:
        """Whether the record taken to run at `offset` is a suspect retried beside the others:
        it may start only once a commit naming it as running has landed, or its death would
        go uncounted and a record that kills the process at once would do so for ever."""
        return self.enabled and 0 < partition.deaths.get(offset, 0) <= RETRY_BESIDE_OTHERS

    def retry_later(self, tps: set[TopicPartition]) -> None:
        """The commit naming these partitions' retried suspects did not land: they were taken
        back, and their partitions wait `RETRY_ALONE_S` before they are fetched again."""
        self._retrying |= tps
        self._retry_beside_at = self._clock.monotonic() + RETRY_ALONE_S

    def held(self) -> set[TopicPartition]:
        """Every partition while suspects run alone or together and until a commit past each
        lands, but those with suspects that may join the ones running together (each fetched
        until its next record cannot); while suspects wait, every partition until the worker
        is quiet, and then all but those whose suspects run together (or the first one's, to
        run alone); and for a while, those whose retried suspect's commit did not land.
        Re-examined on every fetch."""
        if not self.enabled:
            return set()
        if self._running_chosen():
            if not self._together() or self._clock.monotonic() < self._retry_at:
                return self._assignment()
            # Those whose suspects may join the ones running together.
            assigned = self._assignment()
            return assigned - {
                tp
                for tp in assigned - self._passed
                if any(map(self.runs_together, self._tracker.deaths(tp).values()))
            }
        if self._retrying and self._clock.monotonic() >= self._retry_beside_at:
            self._retrying = set()
        if self._waiting:
            assigned = self._assignment()
            self._waiting = {
                tp: deaths
                for tp, deaths in self._waiting.items()
                if tp in assigned and self._tracker.deaths(tp)
            }
        if not self._waiting:
            return self._retrying & self._assignment()
        if self._quiet() and self._clock.monotonic() >= self._retry_at:
            together = {tp for tp, deaths in self._waiting.items() if self.runs_together(deaths)}
            return self._assignment() - (together or {min(self._waiting)})
        return self._assignment()

    def suspects(self) -> int:
        """Records in flight at an earlier death still to run or be answered, and those that
        ran alone or together until a commit past each lands: a death until then still blames
        them (what a supervisor reads before it kills a worker)."""
        count = sum(len(partition.deaths) for _, partition in self._tracker.items())
        return count + sum(
            1
            for suspect in self._running_chosen()
            if suspect.offset not in suspect.partition.deaths
        )

    def commit_due(self) -> bool:
        """Every suspect that ran alone or together is answered: commit past them now, not at
        the interval's next tick, since every partition is held until that commit lands."""
        chosen = self._running_chosen()
        if not chosen or self._unconfirmed:
            return False
        for suspect in chosen:
            position = suspect.partition.commit_position()
            if position is None or position <= suspect.offset:
                return False
        return True

    def forget(self, revoked: set[TopicPartition]) -> None:
        for tp in revoked:
            self._waiting.pop(tp, None)
        self._retrying -= revoked
        self._chosen = [suspect for suspect in self._chosen if suspect.tp not in revoked]
        self._unconfirmed = [suspect for suspect in self._unconfirmed if suspect.tp not in revoked]
        self._running_chosen()

    def _running_chosen(self) -> list[Suspect]:
        """The suspects chosen to run alone or together, from their choice until a commit past
        each lands."""
        self._chosen = [
            suspect
            for suspect in self._chosen
            if suspect in self._unconfirmed
            or (committed := suspect.partition.committed) is None
            or committed[0] <= suspect.offset
        ]
        if not self._chosen:
            self._passed = set()
        return self._chosen

    def _quiet(self) -> bool:
        """Nothing of any partition is in flight (every started record is acknowledged)."""
        return all(partition.idle for _, partition in self._tracker.items())
