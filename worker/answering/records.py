"""The records that answer a job record: results, failed results, dead-letter copies, and the
smaller ones sent instead of a record too large for its topic.

An `Answer` is frozen data: the records to send and the outcome as a value. Every record is
checked against its topic's limit as it is shaped, so what leaves here fits; the last fallback
(a failed result without metadata and with a short detail) fits any sane limit, so every job
record gets an answer the broker takes.
"""

from __future__ import annotations

import enum
import logging
from typing import Final, Literal

import msgspec
from aiokafka import ConsumerRecord, TopicPartition
from msgspec import UNSET

from schemas import ErrorCode, ErrorInfo, Failed, Job, peek_job_id, peek_reply_to
from schemas.results import SubmissionId
from worker.answering.encoder import encode_result
from worker.answering.topics import AnswerTopics
from worker.core.config import Settings
from worker.core.limits import RecordLimits, record_bytes
from worker.core.tracing import NO_TRACE, TraceContext, trace_context_from_headers
from worker.engines.protocol import EngineOutput

__all__ = [
    "DLQ_HEADERS",
    "DLQ_REPLY_HEADER",
    "Answer",
    "OutRecord",
    "Outcome",
    "RecordKind",
    "RecordShaper",
]

logger = logging.getLogger(__name__)

#: Headers added to a dead-letter copy; the original key, value and headers are kept as they were.
DLQ_HEADERS: Final = (
    "vkw.error.code",
    "vkw.error.detail",
    "vkw.source.topic",
    "vkw.source.partition",
    "vkw.source.offset",
)
#: Added to a dead-letter copy whose job's answer went to its `reply_to`: that topic.
DLQ_REPLY_HEADER: Final = "vkw.reply.topic"

# A dead-letter copy's detail header, and the detail of the last-resort failed result.
_DLQ_DETAIL_BYTES: Final = 4096
_MINIMAL_DETAIL_CHARS: Final = 300
# The longest original key a last-resort dead-letter copy keeps.
_MINIMAL_KEY_BYTES: Final = 1024

Headers = list[tuple[str, bytes]]

_COMPLETED_LABELS: Final = (("completed", ""),)


class _SubmissionIdOnly(msgspec.Struct):
    submission_id: SubmissionId | None = None


# Decodes the one field and checks it as a result's `submission_id` is checked where it is read.
_SUBMISSION_ID_DECODER: Final = msgspec.json.Decoder(_SubmissionIdOnly)


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
    #: The `submission_id` of the record answered, when it named a valid one: every failed
    #: result that replaces one of these records echoes it, so its sender can tell which
    #: sending of the job id it answers.
    submission_id: str | None = None

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


class RecordShaper:
    """Shapes the records of answers, each within its topic's limit."""

    def __init__(self, settings: Settings, limits: RecordLimits, topics: AnswerTopics) -> None:
        self._limits = limits
        self._topics = topics
        self._worker_id = settings.worker_id

    def completed(self, job: Job, values: list[bytes], trace: TraceContext = NO_TRACE) -> Answer:
        """The answer of a completed job: its result records (one, or its parts in order),
        each carrying the job's `trace` headers."""
        topic = self._topics.of(job)
        headers = trace.record_headers()
        records = tuple(self._result_record(job.job_id, value, topic, headers) for value in values)
        return Answer(job.job_id, records, Outcome.COMPLETED, submission_id=job.submission_id)

    def failed(
        self,
        job: Job,
        code: ErrorCode,
        detail: str,
        *,
        retryable: bool = False,
        partial: EngineOutput | None = None,
        trace: TraceContext = NO_TRACE,
    ) -> Answer:
        """A failed result that echoes the job's metadata (and an aborted job's partial
        completions), on the job's answer topic, carrying its `trace` headers."""
        failed = Failed(
            job_id=job.job_id,
            error=ErrorInfo(code=code, detail=detail, retryable=retryable),
            metadata=job.metadata,
            worker=self._worker_id,
            submission_id=UNSET if job.submission_id is None else job.submission_id,
        )
        if partial is not None:
            failed = msgspec.structs.replace(
                failed,
                partial=partial.completions,
                prompt_token_count=len(partial.prompt_token_ids),
                weight_version=partial.weight_version,
            )
        out = self._failed_record(failed, self._topics.of(job), trace.record_headers())
        return Answer(job.job_id, (out,), Outcome.FAILED, code, job.submission_id)

    def rejected(
        self,
        tp: TopicPartition,
        record: ConsumerRecord[bytes, bytes],
        code: ErrorCode,
        detail: str,
        *,
        dead_letter: Literal["always", "if_no_id"],
        trace: TraceContext = NO_TRACE,
    ) -> Answer:
        """Answer a record that did not become a job: a failed result when its job_id can be
        read (on its `reply_to` when that is answered on: `AnswerTopics.check` it first),
        echoing its `submission_id` when that can be read and is valid, carrying the record's
        `trace` headers, and a dead-letter copy of the original record (its headers, trace
        headers among them, as they came) as `dead_letter` says."""
        job_id = peek_job_id(record.value) if record.value is not None else None
        logger.warning(
            "record %s-%s@%s (job_id %s): %s", tp.topic, tp.partition, record.offset, job_id, detail
        )
        topic = self._topics.results
        if job_id is not None and record.value is not None:
            topic = self._topics.answer_topic(peek_reply_to(record.value))
        records: list[OutRecord] = []
        if dead_letter == "always" or job_id is None:
            reply = topic if topic != self._topics.results else None
            records.append(self._dead_letter(tp, record, code, detail, reply))
        if job_id is None:
            return Answer(None, tuple(records), Outcome.DEAD_LETTERED, code)
        submission = _peek_submission_id(record.value)
        failed = Failed(
            job_id=job_id,
            error=ErrorInfo(code=code, detail=detail),
            worker=self._worker_id,
            submission_id=UNSET if submission is None else submission,
        )
        records.append(self._failed_record(failed, topic, trace.record_headers()))
        return Answer(job_id, tuple(records), Outcome.FAILED, code, submission)

    def smaller(self, answer: Answer, index: int, refused_by: str) -> Answer | None:
        """`answer` with record `index` replaced by a smaller one, after `refused_by` refused
        it for its size; None when it was minimal already."""
        record = answer.records[index]
        if record.minimal:
            return None
        if record.kind is RecordKind.DEAD_LETTER:
            return _replace(answer, index, self._smaller_copy(record, force=True))
        detail = f"result is {len(record.value or b'')} bytes; {refused_by} refused it"
        code = ErrorCode.RESULT_TOO_LARGE
        failed = self._minimal_failed(
            answer.job_id,
            answer.submission_id,
            ErrorInfo(code=code, detail=detail),
            record.topic,
            headers=record.headers,
        )
        updated = _replace(answer, index, failed)
        return msgspec.structs.replace(updated, outcome=Outcome.FAILED, code=code)

    def unwritable(self, answer: Answer, index: int, refused_by: str) -> Answer | None:
        """`answer` with record `index`, on a reply topic that refuses this worker's writes,
        replaced by the failed result a job naming a refused reply topic gets, on the results
        topic (the topic is refused from now on: `AnswerTopics.refuse_writes`); None when the
        record is on the results or dead-letter topic, which leave nowhere else to answer."""
        record = answer.records[index]
        if record.topic in (self._topics.results, self._topics.dead_letter):
            return None
        self._topics.refuse_writes(record.topic, refused_by)
        detail = f"reply_to {record.topic!r} cannot be answered on: {refused_by}"
        code = ErrorCode.INVALID_JOB
        failed = self._minimal_failed(
            answer.job_id,
            answer.submission_id,
            ErrorInfo(code=code, detail=detail),
            self._topics.results,
            headers=record.headers,
        )
        updated = _replace(answer, index, failed)
        return msgspec.structs.replace(updated, outcome=Outcome.FAILED, code=code)

    def _failed_record(self, failed: Failed, topic: str, headers: Headers) -> OutRecord:
        """`failed` as a record, or the minimal failed result when that does not fit (metadata
        of up to 64 x 64 KiB can outgrow a topic's limit on its own)."""
        out = self._result_record(failed.job_id, encode_result(failed), topic, headers)
        if self._refusal_for_size(out) is None:
            return out
        submission = failed.submission_id
        return self._minimal_failed(
            failed.job_id,
            None if isinstance(submission, msgspec.UnsetType) else submission,
            failed.error,
            topic,
            headers=headers,
        )

    def _refusal_for_size(self, record: OutRecord) -> str | None:
        """Why `record` would be refused for its size (None: it fits)."""
        return self._limits.limit_exceeded(
            record.topic, record.size, topic_limit=self._topics.limit_of(record.topic)
        )

    def _minimal_failed(
        self,
        job_id: str | None,
        submission_id: str | None,
        error: ErrorInfo,
        topic: str,
        *,
        headers: Headers,
    ) -> OutRecord:
        """The last fallback: a failed result with a short detail and nothing else of the job
        but its submission and trace headers (bounded: under 9 KiB together)."""
        detail = error.detail
        if len(detail) > _MINIMAL_DETAIL_CHARS:
            detail = detail[: _MINIMAL_DETAIL_CHARS - 3] + "..."
        failed = Failed(
            job_id=job_id,
            error=ErrorInfo(code=error.code, detail=detail, retryable=error.retryable),
            worker=self._worker_id,
            submission_id=UNSET if submission_id is None else submission_id,
        )
        return self._result_record(job_id, encode_result(failed), topic, headers, minimal=True)

    def _result_record(
        self,
        job_id: str | None,
        value: bytes,
        topic: str,
        headers: Headers,
        *,
        minimal: bool = False,
    ) -> OutRecord:
        key = job_id.encode() if job_id is not None else None
        size = record_bytes(key, value, headers)
        return OutRecord(RecordKind.RESULT, topic, key, value, headers, size, minimal)

    def _dead_letter(
        self,
        tp: TopicPartition,
        record: ConsumerRecord[bytes, bytes],
        code: ErrorCode,
        detail: str,
        reply_topic: str | None,
    ) -> OutRecord:
        """A copy of the record, key, value and headers untouched, plus where it came from and
        why (and the reply topic its failed result went to); without its value when the
        dead-letter topic would refuse it."""
        headers: Headers = [(k, v) for k, v in record.headers or ()]
        headers += [
            ("vkw.error.code", code.value.encode()),
            ("vkw.error.detail", detail.encode()[:_DLQ_DETAIL_BYTES]),
            ("vkw.source.topic", tp.topic.encode()),
            ("vkw.source.partition", str(tp.partition).encode()),
            ("vkw.source.offset", str(record.offset).encode()),
        ]
        if reply_topic is not None:
            headers.append((DLQ_REPLY_HEADER, reply_topic.encode()))
        size = record_bytes(record.key, record.value, headers)
        copy = OutRecord(
            RecordKind.DEAD_LETTER,
            self._topics.dead_letter,
            record.key,
            record.value,
            headers,
            size,
        )
        return self._smaller_copy(copy, force=False)

    def _smaller_copy(self, copy: OutRecord, *, force: bool) -> OutRecord:
        """The copy without its value (the original stays in its topic at the offset the headers
        name) when it does not fit or `force`; then without the original headers too."""
        if not force and self._refusal_for_size(copy) is None:
            return copy
        headers = copy.headers
        if copy.value is not None:
            headers = [*headers, ("vkw.value.dropped", str(len(copy.value)).encode())]
            size = record_bytes(copy.key, None, headers)
            smaller = OutRecord(RecordKind.DEAD_LETTER, copy.topic, copy.key, None, headers, size)
            if self._refusal_for_size(smaller) is None:
                return smaller
        ours = [(k, v[:_MINIMAL_DETAIL_CHARS]) for k, v in headers if k.startswith("vkw.")]
        # The record's trace headers that are valid, so the copy stays in its trace.
        ours += trace_context_from_headers(headers)[0].record_headers()
        key = copy.key if copy.key is None else copy.key[:_MINIMAL_KEY_BYTES]
        size = record_bytes(key, None, ours)
        return OutRecord(RecordKind.DEAD_LETTER, copy.topic, key, None, ours, size, True)


def _replace(answer: Answer, index: int, record: OutRecord) -> Answer:
    records = list(answer.records)
    records[index] = record
    return msgspec.structs.replace(answer, records=tuple(records))


def _peek_submission_id(value: bytes | None) -> str | None:
    """The `submission_id` of a record that did not become a job, if it is a map naming a
    valid one; an invalid one (not a string, empty, too long) is not echoed, as a reader of
    results would refuse the whole answer that carried it."""
    if value is None:
        return None
    try:
        return _SUBMISSION_ID_DECODER.decode(value).submission_id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
