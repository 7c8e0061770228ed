"""Record in, answer out: the job runner runs it, the splitter encodes its result, the record
shaper shapes whatever it came to. No producer and no offsets here."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

from aiokafka import ConsumerRecord, TopicPartition

from schemas import ErrorCode, Job, peek_job_id, peek_reply_to
from worker.answering.payload_store import open_payload_store
from worker.answering.records import Answer, RecordShaper
from worker.answering.runner import JobRunner, Ran, where
from worker.answering.split import ResultSplitter
from worker.answering.topics import AnswerTopics, TopicLimitLookup, TopicLookup
from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.errors import (
    FatalError,
    InvalidRecordError,
    JobAbortedError,
    JobError,
    ResultTooLargeError,
)
from worker.core.limits import RecordLimits, ValueBudgets
from worker.core.metrics import Metrics
from worker.core.tracing import JobSpan, JobSpans, TraceContext, trace_context_from_headers
from worker.engines.protocol import Engine

__all__ = ["AnswerBuilder"]

logger = logging.getLogger(__name__)


class AnswerBuilder:
    """Turns a job record into its `Answer`, running the engine when the record is a job.

    `answer` returns for every record; only cancellation and `FatalError` (the engine is gone)
    leave it without an answer. `smaller` builds what to send instead of a record the broker
    refused for its size after all (its limit could not be read). `topic_lookup` says whether
    the broker has a job's `reply_to`, `topic_limit_lookup` its `max.message.bytes` (see
    `AnswerTopics`).

    A record's trace headers (`worker.core.tracing`) go with its job to the engine and onto
    every result record of its answer; `spans` starts a span per traced job when
    OpenTelemetry records them.
    """

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        limits: RecordLimits,
        metrics: Metrics,
        topic_lookup: TopicLookup | None = None,
        *,
        topic_limit_lookup: TopicLimitLookup | None = None,
        spans: JobSpans | None = None,
        clock: Clock,
    ) -> None:
        self._spans = spans if spans is not None else JobSpans()
        topics = AnswerTopics(settings, topic_lookup, limit_lookup=topic_limit_lookup, clock=clock)
        self._topics = topics
        self._metrics = metrics
        self._runner = JobRunner(engine, topics, metrics, settings.worker_id, clock=clock)
        self._shaper = RecordShaper(settings, limits, topics)
        self._budgets = ValueBudgets(limits, settings.results_topic, topics.limit_of)
        store = open_payload_store(settings.payload_store) if settings.payload_store else None
        self._splitter = ResultSplitter(store, metrics)

    def reply_topic_limit(self, topic: str) -> int | None:
        """The `max.message.bytes` of reply topic `topic`, where it was found and read."""
        return self._topics.limit_of(topic)

    async def answer(
        self,
        tp: TopicPartition,
        record: ConsumerRecord[bytes, bytes],
        *,
        expired: str | None = None,
    ) -> Answer:
        """The answer to one record; raises only `FatalError` (and cancellation). `expired`:
        the job is not run but answered `expired` with this detail."""
        with self._span(tp, record) as span:
            answer = await self._answer(tp, record, span.context, expired)
            span.answered(answer.job_id, answer.outcome.value, _code(answer))
            return answer

    async def _answer(
        self,
        tp: TopicPartition,
        record: ConsumerRecord[bytes, bytes],
        trace: TraceContext,
        expired: str | None,
    ) -> Answer:
        job: Job | None = None
        try:
            job = self._runner.read(record)
            await self._topics.check(job.reply_to)
            ran = await self._runner.run(tp, record, job, trace, expired=expired)
            return await self._completed(tp, record, job, ran, trace)
        except InvalidRecordError as exc:
            await self._check_peeked_reply_to(record)
            return self._shaper.rejected(
                tp, record, exc.code, exc.detail, dead_letter="always", trace=trace
            )
        except JobError as exc:
            assert job is not None  # noqa: S101 - only reading raises before there is a job
            partial = exc.partial if isinstance(exc, JobAbortedError) else None
            return self._shaper.failed(
                job, exc.code, exc.detail, retryable=exc.retryable, partial=partial, trace=trace
            )
        except FatalError:
            raise
        except Exception as exc:  # The one broad catch: one job's bug must not stop the worker.
            logger.exception("unexpected error answering %s", where(tp, record))
            detail = f"internal error: {type(exc).__name__}: {exc}"
            await self._check_peeked_reply_to(record)
            # A readable job gets a failed result; only an unreadable one needs the copy.
            return self._shaper.rejected(
                tp, record, ErrorCode.INTERNAL_ERROR, detail, dead_letter="if_no_id", trace=trace
            )

    def _span(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]
    ) -> AbstractContextManager[JobSpan]:
        """The record's trace context, checked (what is dropped is counted and logged), in a
        span of the job's when OpenTelemetry records spans."""
        context, dropped = trace_context_from_headers(record.headers)
        if dropped:
            for header in dropped:
                self._metrics.trace_headers_dropped.inc(labels=(header.header, header.reason.value))
            job_id = peek_job_id(record.value) if record.value is not None else None
            logger.warning(
                "job %s at %s: trace headers dropped, the job runs without them: %s",
                job_id,
                where(tp, record),
                ", ".join(f"{h.header} ({h.reason.value})" for h in dropped),
            )
        attributes = {
            "messaging.destination.name": tp.topic,
            "messaging.destination.partition.id": str(tp.partition),
            "messaging.kafka.offset": record.offset,
        }
        return self._spans.job(context, tp.topic, attributes)

    async def crash_looped(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], deaths: int
    ) -> Answer:
        """The answer to a record that was in flight at `deaths` process deaths: it is not run
        again. A failed result (not retryable) when its job_id can be read, and a dead-letter
        copy either way, so it can be looked at and replayed by hand."""
        detail = (
            f"not run again: the job was in flight at {deaths} worker process deaths "
            "(--max-crash-attempts); it may crash the engine"
        )
        with self._span(tp, record) as span:
            await self._check_peeked_reply_to(record)
            answer = self._shaper.rejected(
                tp, record, ErrorCode.ENGINE_ERROR, detail, dead_letter="always", trace=span.context
            )
            span.answered(answer.job_id, answer.outcome.value, _code(answer))
            return answer

    async def _check_peeked_reply_to(self, record: ConsumerRecord[bytes, bytes]) -> None:
        """Check the `reply_to` a record that did not become a job names, so its failed
        result goes there when it is answered on (as a valid job's would)."""
        if record.value is not None:
            await self._topics.check(peek_reply_to(record.value))

    def smaller(self, answer: Answer, index: int, refused_by: str) -> Answer | None:
        """`answer` with record `index` replaced by a smaller one; see `RecordShaper.smaller`."""
        return self._shaper.smaller(answer, index, refused_by)

    def unwritable(self, answer: Answer, index: int, refused_by: str) -> Answer | None:
        """`answer` with record `index`, whose reply topic refuses this worker's writes,
        answered on the results topic; see `RecordShaper.unwritable`."""
        return self._shaper.unwritable(answer, index, refused_by)

    async def _completed(
        self,
        tp: TopicPartition,
        record: ConsumerRecord[bytes, bytes],
        job: Job,
        ran: Ran,
        trace: TraceContext,
    ) -> Answer:
        result = ran.result
        headers = trace.record_headers()
        budget, limit = self._budgets.of(job.job_id, self._topics.of(job), headers)
        try:
            values = await self._splitter.encode(result, budget, limit)
        except ResultTooLargeError as exc:
            logger.warning("job %s at %s: %s", job.job_id, where(tp, record), exc.detail)
            raise
        tokens = routed_bytes = 0
        for c in result.completions:
            tokens += len(c.token_ids)
            if c.routed_experts is not None:
                routed_bytes += len(c.routed_experts.data)
        self._metrics.job_generated(ran.queue_wait_s, ran.engine_s, tokens, routed_bytes)
        if isinstance(result.cached_prompt_tokens, int):
            self._metrics.prompt_prefilled(result.prompt_token_count, result.cached_prompt_tokens)
        return self._shaper.completed(job, values, trace)


def _code(answer: Answer) -> str | None:
    return answer.code.value if answer.code is not None else None
