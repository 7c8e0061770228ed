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
from typing import TypeAlias

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from worker.core.metrics import Metrics
from worker.delivery.offsets import PartitionOffsets

__all__ = ["CrashLoopBreaker"]

logger = logging.getLogger(__name__)

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"


class CrashLoopBreaker:
    """Picks what runs of a partition with suspects; `held` partitions stay paused meanwhile."""

    def __init__(
        self, consumer: AIOKafkaConsumer, max_crash_attempts: int, metrics: Metrics
    ) -> None:
        self._consumer = consumer
        self._limit = max_crash_attempts
        self._metrics = metrics
        #: Partitions running a suspect alone, or waiting to: paused until they are idle.
        self.held: set[TopicPartition] = set()

    @property
    def enabled(self) -> bool:
        return self._limit > 0

    def take(
        self, tp: TopicPartition, partition: PartitionOffsets, records: list[Record]
    ) -> tuple[list[Record], list[tuple[Record, int]]]:
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
                self.held.add(tp)
                if run or not partition.idle:
                    self._consumer.seek(tp, record.offset)  # fetched again once idle
                    return run, crash_looped
                logger.info(
                    "%s-%s@%d was in flight at %d worker deaths: running it alone",
                    tp.topic,
                    tp.partition,
                    record.offset,
                    deaths,
                )
                partition.start(record.offset)
                run.append(record)
                self._consumer.seek(tp, record.offset + 1)
                return run, crash_looped
            if partition.start(record.offset):
                run.append(record)
            else:
                self._metrics.skipped.inc()
        return run, crash_looped

    def release_idle(self, partition_of: Callable[[TopicPartition], PartitionOffsets]) -> None:
        """Let partitions whose suspect is answered and acknowledged be fetched again."""
        if self.held:
            self.held = {tp for tp in self.held if not partition_of(tp).idle}

    def forget(self, revoked: set[TopicPartition]) -> None:
        self.held -= revoked
