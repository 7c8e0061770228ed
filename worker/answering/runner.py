"""A job record run: read it, check it can run (deadline, answer topic, capture), run it on the
engine. Every way a job fails is a `JobError`; what a failure is answered with is
`worker.answering.records`' business."""

from __future__ import annotations

import logging
import time

import msgspec
from aiokafka import ConsumerRecord, TopicPartition
from msgspec import UNSET

from schemas import Completed, Job, SchemaError, Timings, decode_job
from worker.answering.topics import AnswerTopics
from worker.core.clock import Clock
from worker.core.errors import (
    InvalidJobError,
    InvalidRecordError,
    JobError,
    JobExpiredError,
)
from worker.core.metrics import Metrics
from worker.core.tracing import TraceContext
from worker.engines.protocol import Engine

__all__ = ["JobRunner", "Ran", "where"]

logger = logging.getLogger(__name__)


class Ran(msgspec.Struct, frozen=True):
    """A job that ran to completion: its result and how long it waited and ran."""

    result: Completed
    queue_wait_s: float
    engine_s: float


class JobRunner:
    """Runs job records on the engine."""

    def __init__(
        self,
        engine: Engine,
        topics: AnswerTopics,
        metrics: Metrics,
        worker_id: str,
        *,
        clock: Clock,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._topics = topics
        self._metrics = metrics
        self._worker_id = worker_id

    @staticmethod
    def read(record: ConsumerRecord[bytes, bytes]) -> Job:
        """The job a record holds; `InvalidRecordError` names what is wrong with it."""
        if record.value is None:
            raise InvalidRecordError("invalid job: the record has no value (a tombstone)")
        try:
            return decode_job(record.value)
        except SchemaError as exc:
            where = f" at {exc.path}" if exc.path else ""
            raise InvalidRecordError(f"invalid job{where}: {exc.message}") from None

    async def run(
        self,
        tp: TopicPartition,
        record: ConsumerRecord[bytes, bytes],
        job: Job,
        trace: TraceContext,
        *,
        expired: str | None = None,
    ) -> Ran:
        """Run `job` (read from `record`) to completion, its engine request in `trace`; any
        `JobError` is its answer. `expired`: it is not run but answered `expired` with this
        detail (its hold for a weight version ran out)."""
        started = self._clock.wall()
        if expired is not None:
            raise JobExpiredError(expired)
        self._check_runnable(job, started, where(tp, record))
        queue_wait = max(started - record.timestamp / 1000, 0.0)
        t0 = time.perf_counter()
        try:
            output = await self._engine.generate(
                job, f"{job.job_id}@{where(tp, record)}", trace_headers=trace.engine_headers
            )
        except JobError as exc:
            self._metrics.queue_wait.observe(queue_wait)
            logger.info(
                "job %s at %s failed: %s %s", job.job_id, where(tp, record), exc.code, exc.detail
            )
            raise
        engine_s = time.perf_counter() - t0
        result = Completed(
            job_id=job.job_id,
            completions=output.completions,
            prompt_token_count=len(output.prompt_token_ids),
            prompt_token_ids=output.prompt_token_ids if job.prompt is not None else None,
            metadata=job.metadata,
            model=self._engine.model_name,
            worker=self._worker_id,
            timings=Timings(queue_wait_s=queue_wait, engine_s=engine_s),
            weight_version=output.weight_version,
            cached_prompt_tokens=(
                UNSET if output.cached_prompt_tokens is None else output.cached_prompt_tokens
            ),
            submission_id=UNSET if job.submission_id is None else job.submission_id,
        )
        return Ran(result, queue_wait, engine_s)

    def _check_runnable(self, job: Job, now: float, where: str) -> None:
        if job.deadline is not None and job.deadline < now:
            logger.info("job %s at %s expired before it started", job.job_id, where)
            raise JobExpiredError(
                f"deadline {job.deadline:.3f} passed before the job started ({now:.3f})"
            )
        if job.reply_to is not None and (refused := self._topics.refusal(job.reply_to)):
            # Answered on the results topic: its producer named a topic it cannot have.
            raise InvalidJobError(refused)
        if job.return_routed_experts and not self._engine.supports_routed_experts:
            raise InvalidJobError(f"engine {self._engine.model_name} cannot return routed experts")


def where(tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> str:
    """A record's place, as logs and request ids name it: `topic-partition@offset`."""
    return f"{tp.topic}-{tp.partition}@{record.offset}"
