"""Record in, answer out: decode, deadline, engine call, size check, dead-letter copies.

No producer and no offsets here. An `Answer` is frozen data: the records to send and the
outcome as a value. Every record is checked against its topic's limit while the answer is built,
so what leaves here fits; the last fallback (a failed result without metadata and with a short
detail) fits any sane limit, so every job record gets an answer the broker takes.
"""

from __future__ import annotations

import enum
import logging
import re
import time
from typing import Final, Literal

import msgspec
from aiokafka import ConsumerRecord, TopicPartition

from schemas import (
    Completed,
    ErrorCode,
    ErrorInfo,
    Failed,
    Job,
    SchemaError,
    Timings,
    decode_job,
    peek_job_id,
)
from worker.answering.encoder import encode_result
from worker.answering.payload_store import open_payload_store
from worker.answering.split import ResultSplitter, SplitRefused
from worker.core.config import Settings
from worker.core.errors import FatalError, JobAbortedError, JobError
from worker.core.limits import RecordLimits, ValueBudgets, record_bytes
from worker.core.metrics import Metrics
from worker.engines.protocol import Engine, EngineOutput

__all__ = ["DLQ_HEADERS", "Answer", "AnswerBuilder", "OutRecord", "Outcome", "RecordKind"]

logger = logging.getLogger(__name__)

#: Headers added to a dead-letter copy; the original key, value and headers are kept as they were.
DLQ_HEADERS: Final = (
    "vkw.error.code",
    "vkw.error.detail",
    "vkw.source.topic",
    "vkw.source.partition",
    "vkw.source.offset",
)

# A dead-letter copy's detail header, and the detail of the last-resort failed result.
_DLQ_DETAIL_BYTES: Final = 4096
_MINIMAL_DETAIL_CHARS: Final = 300

Headers = list[tuple[str, bytes]]


_COMPLETED_LABELS: Final = (("completed", ""),)


class Outcome(enum.Enum):
    """What a job record came to, as the metrics count it."""

    COMPLETED = "completed"
    FAILED = "failed"
    #: Only a dead-letter copy: the record had no readable job_id to answer.
    DEAD_LETTERED = "dead_lettered"


class RecordKind(enum.Enum):
    RESULT = enum.auto()
    DEAD_LETTER = enum.auto()


class OutRecord(msgspec.Struct, frozen=True):
    """One record to produce. `size` is as the producer measures it (`record_bytes`)."""

    kind: RecordKind
    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    size: int
    #: The last fallback already: nothing smaller can be sent in its place.
    minimal: bool = False


class Answer(msgspec.Struct, frozen=True):
    """What one job record turns into: a dead-letter copy, a result, or both (in that order)."""

    job_id: str | None
    records: tuple[OutRecord, ...]
    outcome: Outcome
    #: Why it failed (None when completed).
    code: ErrorCode | None = None

    def metric_labels(self) -> tuple[tuple[str, str], ...]:
        """`vkw_jobs_total` labels: one per record kind this answer holds."""
        if self.outcome is Outcome.COMPLETED:
            return _COMPLETED_LABELS
        code = self.code.value if self.code is not None else ""
        labels = []
        if any(r.kind is RecordKind.DEAD_LETTER for r in self.records):
            labels.append(("dead_lettered", code))
        if self.outcome is not Outcome.DEAD_LETTERED:
            labels.append((self.outcome.value, code))
        return tuple(labels)


class AnswerBuilder:
    """Turns a job record into its `Answer`, running the engine when the record is a job.

    `answer` returns for every record; only cancellation and `FatalError` (the engine is gone)
    leave it without an answer. `smaller` builds what to send instead of a record the broker
    refused for its size after all (its limit could not be read).
    """

    def __init__(
        self, settings: Settings, engine: Engine, limits: RecordLimits, metrics: Metrics
    ) -> None:
        self._engine = engine
        self._limits = limits
        self._metrics = metrics
        self._worker_id = settings.worker_id
        self._results_topic = settings.results_topic
        self._dead_letter_topic = settings.dead_letter_topic
        self._budgets = ValueBudgets(limits, self._results_topic)
        self._reply_topics = (
            re.compile(settings.reply_topics) if settings.reply_topics is not None else None
        )
        store = open_payload_store(settings.payload_store) if settings.payload_store else None
        self._splitter = ResultSplitter(store, metrics)

    async def answer(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> Answer:
        """The answer to one record; raises only `FatalError` (and cancellation)."""
        try:
            started = time.time()
            raw = record.value
            if raw is None:
                return self._invalid(
                    tp, record, SchemaError("the record has no value (a tombstone)")
                )
            try:
                job = decode_job(raw)
            except SchemaError as exc:
                return self._invalid(tp, record, exc)
            if job.deadline is not None and job.deadline < started:
                logger.info(
                    "job %s at %s expired before it started", job.job_id, _where(tp, record)
                )
                return self._failed(
                    job,
                    ErrorCode.EXPIRED,
                    f"deadline {job.deadline:.3f} passed before the job started ({started:.3f})",
                )
            if job.reply_to is not None and self._topic_for(job) != job.reply_to:
                allowed = self._reply_topics.pattern if self._reply_topics else "unset"
                return self._failed(
                    job,
                    ErrorCode.INVALID_JOB,
                    f"reply_to {job.reply_to!r} is not a topic this worker answers to "
                    f"(--reply-topics {allowed})",
                )
            if job.return_routed_experts and not self._engine.supports_routed_experts:
                return self._failed(
                    job,
                    ErrorCode.INVALID_JOB,
                    f"engine {self._engine.model_name} cannot return routed experts",
                )
            queue_wait = max(started - record.timestamp / 1000, 0.0)
            t0 = time.perf_counter()
            try:
                output = await self._engine.generate(
                    job, f"{job.job_id}@{tp.topic}-{tp.partition}@{record.offset}"
                )
            except JobError as exc:
                self._metrics.queue_wait.observe(queue_wait)
                logger.info(
                    "job %s at %s failed: %s %s",
                    job.job_id,
                    _where(tp, record),
                    exc.code,
                    exc.detail,
                )
                partial = exc.partial if isinstance(exc, JobAbortedError) else None
                return self._failed(
                    job, exc.code, exc.detail, retryable=exc.retryable, partial=partial
                )
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
            )
            topic = self._topic_for(job)
            try:
                values = await self._splitter.encode(result, *self._budgets.of(job.job_id, topic))
            except SplitRefused as exc:
                logger.warning("job %s at %s: %s", job.job_id, _where(tp, record), exc.detail)
                return self._failed(
                    job, ErrorCode.RESULT_TOO_LARGE, exc.detail, retryable=exc.retryable
                )
            records = tuple(self._result_record(job.job_id, value, topic) for value in values)
            tokens = routed_bytes = 0
            for c in output.completions:
                tokens += len(c.token_ids)
                if c.routed_experts is not None:
                    routed_bytes += len(c.routed_experts.data)
            self._metrics.job_generated(queue_wait, engine_s, tokens, routed_bytes)
            return Answer(job.job_id, records, Outcome.COMPLETED)
        except FatalError:
            raise
        except Exception as exc:  # The one broad catch: one job's bug must not stop the worker.
            logger.exception("unexpected error answering %s", _where(tp, record))
            detail = f"internal error: {type(exc).__name__}: {exc}"
            # A readable job gets a failed result; only an unreadable one needs the copy.
            return self._reject(
                tp, record, ErrorCode.INTERNAL_ERROR, detail, dead_letter="if_no_id"
            )

    def crash_looped(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], deaths: int
    ) -> Answer:
        """The answer to a record that was in flight at `deaths` process deaths: it is not run
        again. A failed result (not retryable) when its job_id can be read, and a dead-letter
        copy either way, so it can be looked at and replayed by hand."""
        detail = (
            f"not run again: the job was in flight at {deaths} worker process deaths "
            "(--max-crash-attempts); it may crash the engine"
        )
        return self._reject(tp, record, ErrorCode.ENGINE_ERROR, detail, dead_letter="always")

    def smaller(self, answer: Answer, index: int, refused_by: str) -> Answer | None:
        """`answer` with record `index` replaced by a smaller one, after `refused_by` refused
        it for its size; None when it was minimal already."""
        record = answer.records[index]
        if record.minimal:
            return None
        if record.kind is RecordKind.DEAD_LETTER:
            smaller = self._smaller_copy(record, force=True)
            return _replace(answer, index, smaller)
        detail = f"result is {len(record.value or b'')} bytes; {refused_by} refused it"
        failed = self._minimal_failed(
            answer.job_id, ErrorCode.RESULT_TOO_LARGE, detail, topic=record.topic
        )
        updated = _replace(answer, index, failed)
        return Answer(updated.job_id, updated.records, Outcome.FAILED, ErrorCode.RESULT_TOO_LARGE)

    def _topic_for(self, job: Job) -> str:
        """Where the job's answer goes: its `reply_to` when allowed, else the results topic."""
        reply_to = job.reply_to
        if reply_to is None or self._reply_topics is None:
            return self._results_topic
        return reply_to if self._reply_topics.fullmatch(reply_to) else self._results_topic

    def _failed(
        self,
        job: Job,
        code: ErrorCode,
        detail: str,
        *,
        retryable: bool = False,
        partial: EngineOutput | None = None,
    ) -> Answer:
        """A failed result that echoes the job's metadata (and an aborted job's partial
        completions), or the minimal one when that does not fit (metadata of up to 64 x 64 KiB
        can outgrow a topic's limit on its own)."""
        failed = Failed(
            job_id=job.job_id,
            error=ErrorInfo(code=code, detail=detail, retryable=retryable),
            metadata=job.metadata,
            worker=self._worker_id,
        )
        if partial is not None:
            failed = msgspec.structs.replace(
                failed,
                partial=partial.completions,
                prompt_token_count=len(partial.prompt_token_ids),
                weight_version=partial.weight_version,
            )
        value = encode_result(failed)
        topic = self._topic_for(job)
        out = self._result_record(job.job_id, value, topic)
        if self._limits.refusal(out.topic, out.size) is not None:
            out = self._minimal_failed(job.job_id, code, detail, retryable=retryable, topic=topic)
        return Answer(job.job_id, (out,), Outcome.FAILED, code)

    def _minimal_failed(
        self,
        job_id: str | None,
        code: ErrorCode,
        detail: str,
        *,
        retryable: bool = False,
        topic: str | None = None,
    ) -> OutRecord:
        if len(detail) > _MINIMAL_DETAIL_CHARS:
            detail = detail[: _MINIMAL_DETAIL_CHARS - 3] + "..."
        failed = Failed(
            job_id=job_id,
            error=ErrorInfo(code=code, detail=detail, retryable=retryable),
            worker=self._worker_id,
        )
        return self._result_record(job_id, encode_result(failed), topic, minimal=True)

    def _result_record(
        self, job_id: str | None, value: bytes, topic: str | None = None, *, minimal: bool = False
    ) -> OutRecord:
        key = job_id.encode() if job_id is not None else None
        return OutRecord(
            RecordKind.RESULT,
            topic or self._results_topic,
            key,
            value,
            [],
            record_bytes(key, value, []),
            minimal,
        )

    def _invalid(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], exc: SchemaError
    ) -> Answer:
        detail = (
            f"invalid job at {exc.path}: {exc.message}"
            if exc.path
            else f"invalid job: {exc.message}"
        )
        return self._reject(tp, record, ErrorCode.INVALID_JOB, detail, dead_letter="always")

    def _reject(
        self,
        tp: TopicPartition,
        record: ConsumerRecord[bytes, bytes],
        code: ErrorCode,
        detail: str,
        *,
        dead_letter: Literal["always", "if_no_id"],
    ) -> Answer:
        """Answer a record that did not become a job: a failed result when its job_id can be
        read, and a dead-letter copy of the original record as `dead_letter` says."""
        job_id = peek_job_id(record.value) if record.value is not None else None
        logger.warning(
            "record %s-%s@%s (job_id %s): %s", tp.topic, tp.partition, record.offset, job_id, detail
        )
        records: list[OutRecord] = []
        if dead_letter == "always" or job_id is None:
            records.append(self._dead_letter(tp, record, code, detail))
        if job_id is None:
            return Answer(None, tuple(records), Outcome.DEAD_LETTERED, code)
        failed = Failed(
            job_id=job_id, error=ErrorInfo(code=code, detail=detail), worker=self._worker_id
        )
        out = self._result_record(job_id, encode_result(failed))
        if self._limits.refusal(out.topic, out.size) is not None:
            out = self._minimal_failed(job_id, code, detail)
        records.append(out)
        return Answer(job_id, tuple(records), Outcome.FAILED, code)

    def _dead_letter(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], code: ErrorCode, detail: str
    ) -> OutRecord:
        """A copy of the record, key, value and headers untouched, plus where it came from and
        why; without its value when the dead-letter topic would refuse it."""
        headers: Headers = [(k, v) for k, v in record.headers or ()]
        headers += [
            ("vkw.error.code", code.value.encode()),
            ("vkw.error.detail", detail.encode()[:_DLQ_DETAIL_BYTES]),
            ("vkw.source.topic", tp.topic.encode()),
            ("vkw.source.partition", str(tp.partition).encode()),
            ("vkw.source.offset", str(record.offset).encode()),
        ]
        topic = self._dead_letter_topic
        copy = OutRecord(
            RecordKind.DEAD_LETTER,
            topic,
            record.key,
            record.value,
            headers,
            record_bytes(record.key, record.value, headers),
        )
        return self._smaller_copy(copy, force=False)

    def _smaller_copy(self, copy: OutRecord, *, force: bool) -> OutRecord:
        """The copy without its value (the original stays in its topic at the offset the headers
        name) when it does not fit or `force`; then without the original headers too."""
        if not force and self._limits.refusal(copy.topic, copy.size) is None:
            return copy
        headers = copy.headers
        if copy.value is not None:
            headers = [*headers, ("vkw.value.dropped", str(len(copy.value)).encode())]
            smaller = OutRecord(
                RecordKind.DEAD_LETTER,
                copy.topic,
                copy.key,
                None,
                headers,
                record_bytes(copy.key, None, headers),
            )
            if self._limits.refusal(smaller.topic, smaller.size) is None:
                return smaller
        ours = [(k, v) for k, v in headers if k.startswith("vkw.")]
        ours = [(k, v[:_MINIMAL_DETAIL_CHARS]) for k, v in ours]
        key = copy.key if copy.key is None or len(copy.key) <= 1024 else copy.key[:1024]
        return OutRecord(
            RecordKind.DEAD_LETTER, copy.topic, key, None, ours, record_bytes(key, None, ours), True
        )


def _where(tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> str:
    return f"{tp.topic}-{tp.partition}@{record.offset}"


def _replace(answer: Answer, index: int, record: OutRecord) -> Answer:
    records = list(answer.records)
    records[index] = record
    return Answer(answer.job_id, tuple(records), answer.outcome, answer.code)
