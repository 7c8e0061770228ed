"""Record-size policy in one place: what the worker may produce and fetch, decided once at start.

A record over a limit is refused at the broker (which also breaks an idempotent producer's
sequence) or at the producer; knowing every limit before anything is sent lets each answer be
checked, and shrunk, before it goes out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

import msgspec
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from worker.core.config import MiB, Settings

__all__ = [
    "BATCHED_RECORD_MAX_BYTES",
    "RECORD_OVERHEAD_BYTES",
    "RecordLimits",
    "ValueBudgets",
    "record_bytes",
    "record_size_limit",
]

# Room for the key, headers and batch framing around a result of `max_result_bytes`.
RECORD_OVERHEAD_BYTES: Final = 1 * MiB

# Producer batch sizes (before compression): the default, the most when the topics' limits are
# known, and what is kept free of a limit for the batch's own framing.
DEFAULT_BATCH_BYTES: Final = 1 * MiB
MAX_BATCH_BYTES: Final = 16 * MiB
BATCH_FRAMING_BYTES: Final = 64 * 1024

# Larger records are produced on their own, not in the outbox's batches: a record the broker
# refuses for its size then fails alone, and a batch of small answers is not held up behind it.
BATCHED_RECORD_MAX_BYTES: Final = 256 * 1024

Headers = list[tuple[str, bytes]]


#: A record's size as aiokafka's producer measures it against `max_request_size`: key, value,
#: headers and the batch framing around one record, uncompressed. `record_bytes(key, value,
#: headers)`; aiokafka's own (C) function, called directly on the path every result takes.
record_bytes: Final[Callable[[bytes | None, bytes | None, Headers], int]] = (
    DefaultRecordBatchBuilder.estimate_size_in_bytes
)


def record_size_limit(settings: Settings) -> int:
    """The largest record the worker writes or reads: a result plus its framing."""
    return settings.max_result_bytes + RECORD_OVERHEAD_BYTES


class RecordLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Every size limit that applies to the worker's records, built once (`from_topic_limits`)
    and handed to the client factories and the worker.

    `topic_bytes` is each answer topic's `max.message.bytes` (None where it could not be read);
    the broker checks it on the compressed batch, the worker on the uncompressed record, so a
    record that passes here is never refused for its size by a broker whose limit is known.
    """

    max_result_bytes: int
    request_bytes: int
    topic_bytes: Mapping[str, int | None]
    batch_bytes: int
    batched_record_max_bytes: int = BATCHED_RECORD_MAX_BYTES
    fetch_partition_bytes: int
    fetch_max_bytes: int

    @classmethod
    def from_topic_limits(
        cls, settings: Settings, topic_bytes: Mapping[str, int | None]
    ) -> RecordLimits:
        """The limits for these settings and the answer topics' `max.message.bytes`."""
        request = record_size_limit(settings)
        answer_topics = (settings.results_topic, settings.dead_letter_topic)
        return cls(
            max_result_bytes=settings.max_result_bytes,
            request_bytes=request,
            topic_bytes={t: topic_bytes.get(t) for t in answer_topics},
            batch_bytes=producer_batch_bytes([topic_bytes.get(t) for t in answer_topics]),
            fetch_partition_bytes=request,
            fetch_max_bytes=max(50 * MiB, 2 * request),
        )

    def limit_exceeded(
        self,
        topic: str,
        size: int,
        *,
        result_value_bytes: int | None = None,
        topic_limit: int | None = None,
    ) -> str | None:
        """Why a record of `size` bytes (see `record_bytes`) for `topic` would be refused, naming
        the limit; None when it fits. `result_value_bytes` is a result's encoded size, which
        `max_result_bytes` bounds on its own; `topic_limit` the `max.message.bytes` of a topic
        read after start (a reply topic)."""
        if result_value_bytes is not None and result_value_bytes > self.max_result_bytes:
            return f"the limit is {self.max_result_bytes} (max_result_bytes)"
        if topic_limit is None:
            topic_limit = self.topic_bytes.get(topic)
        if topic_limit is not None and size > topic_limit:
            return f"the limit is {topic_limit} ({topic}'s max.message.bytes ({topic_limit}))"
        if size > self.request_bytes:
            return f"the limit is {self.request_bytes} (the producer's max_request_size)"
        return None


# A record's value length is a varint: up to this many bytes more than for an empty value.
_VALUE_LENGTH_VARINT_BYTES: Final = 5
# Fits remembered at once: as many as AnswerTopics remembers reply topics found, twice over.
_MAX_FITS: Final = 2048


class ValueBudgets:
    """The largest result value a record may carry on each answer topic, and the limit that
    sets it: `max_result_bytes`, or the topic's (or the producer's) limit less the key, the
    headers and the framing. The fit is worked out once per topic and limit (a reply topic's
    limit may be read again later, and differ); the framing is measured per record (aiokafka's
    own C function)."""

    def __init__(
        self,
        limits: RecordLimits,
        results_topic: str,
        reply_limit: Callable[[str], int | None] = lambda _: None,
    ) -> None:
        self._limits = limits
        self._results_topic = results_topic
        # A reply topic's max.message.bytes, read when a job first names it.
        self._reply_limit = reply_limit
        # A results record this size or smaller fits every limit.
        self._results_fit = min(
            limit
            for limit in (limits.topic_bytes.get(results_topic), limits.request_bytes)
            if limit is not None
        )
        # Per topic and its limit as read (None for the results topic, whose limits are
        # known from the start): the largest record that fits, and the limit that sets it.
        self._fits: dict[tuple[str, int | None], tuple[int, str]] = {}

    def of(self, job_id: str, topic: str, headers: Headers | None = None) -> tuple[int, str]:
        """(bytes, what sets them) for a value keyed `job_id` on `topic`, with `headers`."""
        framing = record_bytes(job_id.encode(), b"", headers or []) + _VALUE_LENGTH_VARINT_BYTES
        # A reply topic's limit as read now: read again after AnswerTopics forgot the topic
        # (unknown at first, or the topic made anew), it replaces the one first read.
        topic_limit = None if topic == self._results_topic else self._reply_limit(topic)
        fit = self._fits.get((topic, topic_limit))
        if fit is None:
            if len(self._fits) >= _MAX_FITS:
                self._fits.clear()  # reply topics come and go; the fits are cheap to find again
            fit = self._fits[topic, topic_limit] = self._fit(topic, topic_limit)
        budget = self._limits.max_result_bytes
        if fit[0] - framing >= budget:
            return budget, f"max_result_bytes ({budget})"
        return fit[0] - framing, fit[1]

    def _fit(self, topic: str, topic_limit: int | None) -> tuple[int, str]:
        fit = self._results_fit
        if topic != self._results_topic:
            # A reply topic's limit is read when a job first names it; where it cannot be,
            # the producer's bounds it, and a broker refusal is answered after all.
            fit = self._limits.request_bytes
            if topic_limit is not None:
                fit = min(fit, topic_limit)
        reason = self._limits.limit_exceeded(topic, fit + 1, topic_limit=topic_limit) or ""
        return fit, reason.removeprefix("the limit is ")


def producer_batch_bytes(topic_limits: list[int | None]) -> int:
    """The producer's batch size for topics with these `max.message.bytes` (None: unknown).

    Larger batches mean fewer produce round trips: with small batches and jobs finishing by the
    hundred, each job waits for a full batch to drain. But aiokafka sizes a batch before
    compression and, unlike the Java client, does not split one the broker refuses as too
    large: every record in it would fail. So a batch
    never exceeds the smallest limit; when a limit is unknown, it stays at 1 MiB.
    """
    known = [limit for limit in topic_limits if limit is not None]
    if not known or len(known) < len(topic_limits):
        return DEFAULT_BATCH_BYTES
    smallest = min(known)
    # Room for the batch's own framing: 64 KiB, or half of a small limit.
    return min(max(smallest - BATCH_FRAMING_BYTES, smallest // 2), MAX_BATCH_BYTES)
