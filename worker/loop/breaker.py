"""The crash-loop breaker: after a worker process died, which records of a partition run, and when.

A record that kills the process would be redelivered to every worker that takes its partition.
The commits name what runs (see `worker.delivery.offset_map`), so a new owner knows how many deaths each
record was in flight at. Here each suspect runs alone, once everything before it in its
partition is acknowledged, so the one that kills the process is the only one blamed again; one
in flight at `max_crash_attempts` deaths is answered instead of run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, TypeAlias

from aiokafka import ConsumerRecord, TopicPartition

from worker.core.metrics import Metrics
from worker.delivery.offsets import PartitionOffsets

__all__ = ["CrashLoopBreaker", "Taken"]

logger = logging.getLogger(__name__)

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"


class Taken(NamedTuple):
    """What the breaker decided for a fetched run of records."""

    #: To run now.
    run: list[Record]
    #: To answer as having been in flight at that many deaths, without running them.
    crash_looped: list[tuple[Record, int]]
    #: Where to fetch the partition from next (records past it come again later), or None.
    rewind_to: int | None = None


class CrashLoopBreaker:
    """Picks what runs of a partition with suspects; the partition is held meanwhile."""

    def __init__(
        self,
        max_crash_attempts: int,
        metrics: Metrics,
        partition_of: Callable[[TopicPartition], PartitionOffsets],
    ) -> None:
        self._limit = max_crash_attempts
        self._metrics = metrics
        self._partition_of = partition_of
        # Partitions running a suspect alone, or waiting to: held until they are idle.
        self._suspected: set[TopicPartition] = set()

    @property
    def enabled(self) -> bool:
        return self._limit > 0

    def take(self, tp: TopicPartition, partition: PartitionOffsets, records: list[Record]) -> Taken:
        """Of `records` (fetched, in order), those to run now, and those to answer as having
        been in flight at that many deaths. Records after a suspect are fetched again later."""
        run: list[Record] = []
        crash_looped: list[tuple[Record, int]] = []
        for record in records:
            deaths = partition.deaths.get(record.offset, 0)
            if deaths >= self._limit:
                if partition.start(record.offset):
                    crash_looped.append((record, deaths))
                continue
            if deaths:
                self._suspected.add(tp)
                if run or not partition.idle:
                    return Taken(run, crash_looped, rewind_to=record.offset)  # again once idle
                logger.info(
                    "%s-%s@%d was in flight at %d worker deaths: running it alone",
                    tp.topic,
                    tp.partition,
                    record.offset,
                    deaths,
                )
                partition.start(record.offset)
                run.append(record)
                return Taken(run, crash_looped, rewind_to=record.offset + 1)
            if partition.start(record.offset):
                run.append(record)
            else:
                self._metrics.skipped.inc()
        return Taken(run, crash_looped)

    def held(self) -> set[TopicPartition]:
        """Partitions running a suspect alone or waiting to; one whose suspect is answered and
        acknowledged is released here."""
        if self._suspected:
            self._suspected = {tp for tp in self._suspected if not self._partition_of(tp).idle}
        return set(self._suspected)

    def forget(self, revoked: set[TopicPartition]) -> None:
        self._suspected -= revoked
