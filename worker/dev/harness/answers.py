"""What a run's workers answered, read back from the results and dead-letter topics, and the
check that nothing was lost."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Self

from aiokafka import AIOKafkaConsumer

from schemas import Failed, decode_result
from worker.core.clients import AIOKAFKA
from worker.dev.harness.background import InBackground
from worker.dev.harness.rss import MiB


class AnswersSeen(InBackground):
    """Every result and dead-letter copy, read from the beginning in the background."""

    def __init__(self, bootstrap: str, results: str, dlq: str) -> None:
        self._bootstrap = bootstrap
        self._results, self._dlq = results, dlq
        self.answers: list[tuple[str, bool]] = []  # (job_id, failed)
        self.times: list[float] = []  # when each answer was read (time.monotonic())
        self.dead_lettered: set[str] = set()

    async def __aenter__(self) -> Self:
        consumer = AIOKAFKA.consumer(
            self._results,
            self._dlq,
            bootstrap_servers=self._bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_bytes=64 * MiB,
            max_partition_fetch_bytes=32 * MiB,
        )
        await consumer.start()
        self._run_in_background(self._run(consumer))
        return self

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while True:
                for tp, batch in (await consumer.getmany(timeout_ms=100)).items():
                    for record in batch:
                        if tp.topic == self._dlq:
                            self.dead_lettered.add((record.key or b"").decode())
                        else:
                            result = decode_result(record.value or b"")
                            self.answers.append((result.job_id or "", isinstance(result, Failed)))
                            self.times.append(time.monotonic())
        finally:
            await consumer.stop()

    def answered(self) -> set[str]:
        return {job_id for job_id, _ in self.answers}

    def failed(self) -> set[str]:
        return {job_id for job_id, is_failed in self.answers if is_failed}

    def history(self, produced: set[str]) -> History:
        return History(
            produced=produced,
            answers=[job_id for job_id, _ in self.answers],
            dead_lettered=set(self.dead_lettered),
        )


@dataclass
class History:
    """What a chaos test did and saw, checked in the manner of Jepsen's Kafka workload.

    `produced` are the job ids written to the jobs topic, `answers` every job id read back from
    the results topic (in order, repeats kept), `dead_lettered` the job ids copied to the
    dead-letter topic, `kills` the worker processes the test killed. A job is lost when it has
    neither a result nor a dead-letter copy; every answer beyond a job's first is a duplicate.
    """

    produced: set[str] = field(default_factory=set)
    answers: list[str] = field(default_factory=list)
    dead_lettered: set[str] = field(default_factory=set)
    kills: int = 0

    @property
    def lost(self) -> set[str]:
        return self.produced - set(self.answers) - self.dead_lettered

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in Counter(self.answers).values())

    @property
    def answered_twice(self) -> int:
        return sum(1 for n in Counter(self.answers).values() if n > 1)

    def check(self) -> int:
        """Assert nothing was lost; return the duplicates."""
        assert not self.lost, f"{len(self.lost)} jobs lost, e.g. {sorted(self.lost)[:5]}"
        return self.duplicates
