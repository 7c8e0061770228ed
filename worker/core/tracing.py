"""Trace context through Kafka: a job record's W3C `traceparent` / `tracestate` and its
`x-request-id` headers, checked, handed to the engine and copied onto the job's answers.

A header that is not what the W3C Trace Context format says is dropped (and reported), never
the job: tracing is the caller's aid, not part of the job. OpenTelemetry is optional and
imported only when a traced job arrives; without it the headers pass through unchanged, with
it (and a tracer provider that records, such as the one vLLM sets up for
`--otlp-traces-endpoint`) each traced job gets a span of its own, a child of the incoming
context, and what goes on carries that span's context.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

import msgspec

__all__ = [
    "NO_TRACE",
    "REQUEST_ID",
    "TRACEPARENT",
    "TRACESTATE",
    "DropReason",
    "DroppedHeader",
    "JobSpan",
    "JobSpans",
    "TraceContext",
    "TraceContextError",
    "current_trace_context",
    "trace_context",
    "trace_context_from_headers",
]

logger = logging.getLogger(__name__)

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
REQUEST_ID: Final = "x-request-id"
_NAMES: Final = (TRACEPARENT, TRACESTATE, REQUEST_ID)

# The bounds OpenTelemetry's own extractor applies (opentelemetry-api,
# `trace/propagation/tracecontext.py`: `_TRACEPARENT_MAXIMUM_LENGTH`; `trace/span.py`:
# `_TRACECONTEXT_MAXIMUM_TRACESTATE_LENGTH`, `_TRACECONTEXT_MAXIMUM_TRACESTATE_KEYS`), so what a
# trainer's OpenTelemetry sends arrives whole.
TRACEPARENT_MAX_CHARS: Final = 512
TRACESTATE_MAX_CHARS: Final = 8192
TRACESTATE_MAX_MEMBERS: Final = 32
REQUEST_ID_MAX_CHARS: Final = 256

# version "-" trace-id "-" parent-id "-" trace-flags, lowercase hex; a version above 00 may
# carry more fields after a dash (W3C Trace Context, "traceparent Header Field Values").
_TRACEPARENT: Final = re.compile(
    r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[\x21-\x7e]*)?"
)
# A tracestate list member: key "=" value (W3C Trace Context, "tracestate Header Field Values").
_TRACESTATE_MEMBER: Final = re.compile(
    r"(?:[a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
_REQUEST_ID: Final = re.compile(r"[\x21-\x7e]+")
# Optional white space around a header value or a tracestate member (RFC 9110, 5.6.3).
_OWS: Final = " \t"

Headers = list[tuple[str, bytes]]


class TraceContextError(ValueError):
    """A trace header a caller gave is not what the W3C format says (the client's side)."""


class DropReason(enum.Enum):
    """Why a trace header of a job record was dropped (the `reason` label of
    `vkw_trace_headers_dropped_total`)."""

    #: Not the W3C format (or, for x-request-id, not 1-256 visible ASCII characters).
    MALFORMED = "malformed"
    #: Longer than its bound.
    TOO_LONG = "too_long"
    #: The record holds the header more than once: which one counts is not known.
    REPEATED = "repeated"
    #: A tracestate without a valid traceparent, which W3C says to ignore.
    ORPHANED = "orphaned"


class DroppedHeader(msgspec.Struct, frozen=True):
    """A trace header of a record that is not passed on, and why."""

    header: str
    reason: DropReason


class TraceContext(msgspec.Struct, frozen=True):
    """The trace headers of one job, each checked (None: absent or dropped)."""

    traceparent: str | None = None
    tracestate: str | None = None
    request_id: str | None = None

    @property
    def engine_headers(self) -> dict[str, str] | None:
        """What the engine's request carries (vLLM's `trace_headers`): the W3C pair only, as
        vLLM's own servers pass it (`vllm/tracing/utils.py:extract_trace_headers`); None
        without a traceparent."""
        if self.traceparent is None:
            return None
        headers = {TRACEPARENT: self.traceparent}
        if self.tracestate is not None:
            headers[TRACESTATE] = self.tracestate
        return headers

    def record_headers(self) -> Headers:
        """The Kafka headers that carry this context on to a record."""
        out: Headers = []
        for name, value in (
            (TRACEPARENT, self.traceparent),
            (TRACESTATE, self.tracestate),
            (REQUEST_ID, self.request_id),
        ):
            if value is not None:
                out.append((name, value.encode("ascii")))
        return out


#: No trace headers at all.
NO_TRACE: Final = TraceContext()


def trace_context_from_headers(
    headers: Iterable[tuple[str, bytes | None]] | None,
) -> tuple[TraceContext, list[DroppedHeader]]:
    """The trace context of a record's headers, and the trace headers dropped from it.

    Names match case-insensitively (Kafka header names are case-sensitive, HTTP's are not,
    and bridges from HTTP keep either); what goes on uses the lowercase names.
    """
    found: dict[str, list[bytes | None]] = {}
    for name, value in headers or ():
        lowered = name.lower()
        if lowered in _NAMES:
            found.setdefault(lowered, []).append(value)
    if not found:
        return NO_TRACE, []
    dropped: list[DroppedHeader] = []
    values: dict[str, str] = {}
    for name, raw in found.items():
        checked = _check(name, raw)
        if isinstance(checked, DropReason):
            dropped.append(DroppedHeader(name, checked))
        else:
            values[name] = checked
    if TRACESTATE in values and TRACEPARENT not in values:
        del values[TRACESTATE]
        dropped.append(DroppedHeader(TRACESTATE, DropReason.ORPHANED))
    context = TraceContext(
        traceparent=values.get(TRACEPARENT),
        tracestate=values.get(TRACESTATE),
        request_id=values.get(REQUEST_ID),
    )
    return context, dropped


def trace_context(
    traceparent: str | None = None, tracestate: str | None = None, request_id: str | None = None
) -> TraceContext:
    """A trace context from values a caller gives; `TraceContextError` names a bad one."""
    given = {TRACEPARENT: traceparent, TRACESTATE: tracestate, REQUEST_ID: request_id}
    values: dict[str, str] = {}
    for name, value in given.items():
        if value is None:
            continue
        checked = _check_text(name, value)
        if isinstance(checked, DropReason):
            raise TraceContextError(f"{name} {value[:80]!r} is {checked.value.replace('_', ' ')}")
        values[name] = checked
    if TRACESTATE in values and TRACEPARENT not in values:
        raise TraceContextError("a tracestate needs a traceparent")
    return TraceContext(
        traceparent=values.get(TRACEPARENT),
        tracestate=values.get(TRACESTATE),
        request_id=values.get(REQUEST_ID),
    )


def _check(name: str, raw: list[bytes | None]) -> str | DropReason:
    if len(raw) > 1:
        return DropReason.REPEATED
    (value,) = raw
    if value is None:
        return DropReason.MALFORMED
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return DropReason.MALFORMED
    return _check_text(name, text)


def _max_chars(name: str) -> int:
    if name == TRACEPARENT:
        return TRACEPARENT_MAX_CHARS
    if name == TRACESTATE:
        return TRACESTATE_MAX_CHARS
    return REQUEST_ID_MAX_CHARS


def _check_text(name: str, text: str) -> str | DropReason:
    """`text` (its surrounding white space removed) when it is a valid `name` header."""
    text = text.strip(_OWS)
    if len(text) > _max_chars(name):
        return DropReason.TOO_LONG
    if name == TRACEPARENT:
        return text if _valid_traceparent(text) else DropReason.MALFORMED
    if name == TRACESTATE:
        return _checked_tracestate(text)
    return text if _REQUEST_ID.fullmatch(text) else DropReason.MALFORMED


def _valid_traceparent(text: str) -> bool:
    """W3C Trace Context's rules, as OpenTelemetry applies them
    (`TraceContextTextMapPropagator.extract`): version ff is invalid, version 00 has exactly
    four fields, a later version may have more; neither id may be all zeros."""
    match = _TRACEPARENT.fullmatch(text)
    if match is None:
        return False
    version, trace_id, parent_id, _, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return False
    return trace_id != "0" * 32 and parent_id != "0" * 16


def _checked_tracestate(text: str) -> str | DropReason:
    """The tracestate with its list members' white space removed (empty members are allowed
    and left out), or why it is invalid: a bad member, a repeated key or over 32 members
    (opentelemetry-api, `trace/span.py:TraceState.from_header`, drops the whole header then)."""
    members: list[str] = []
    keys: set[str] = set()
    for part in text.split(","):
        member = part.strip(_OWS)
        if not member:
            continue
        if _TRACESTATE_MEMBER.fullmatch(member) is None:
            return DropReason.MALFORMED
        key = member.split("=", 1)[0]
        if key in keys:
            return DropReason.MALFORMED
        keys.add(key)
        members.append(member)
    if len(members) > TRACESTATE_MAX_MEMBERS:
        return DropReason.TOO_LONG
    if not members:
        return DropReason.MALFORMED
    return ",".join(members)


def current_trace_context() -> TraceContext:
    """The current OpenTelemetry span's context as W3C headers; empty when OpenTelemetry is not
    installed or no span is current."""
    otel = _import_otel()
    if otel is None:
        return NO_TRACE
    carrier: dict[str, str] = {}
    otel.propagator.inject(carrier)
    traceparent = carrier.get(TRACEPARENT)
    if traceparent is None:
        return NO_TRACE
    return trace_context(traceparent, carrier.get(TRACESTATE) or None)


class _Otel(msgspec.Struct, frozen=True):
    """The pieces of OpenTelemetry used here, loaded once."""

    trace: Any
    propagator: Any


def _import_otel() -> _Otel | None:
    try:
        trace = importlib.import_module("opentelemetry.trace")
        tracecontext = importlib.import_module("opentelemetry.trace.propagation.tracecontext")
    except ImportError:
        return None
    return _Otel(trace, tracecontext.TraceContextTextMapPropagator())


class JobSpan:
    """A job's span while its answer is built: the context to pass on, and its outcome."""

    __slots__ = ("_span", "context")

    def __init__(self, context: TraceContext, span: Any = None) -> None:
        #: What the engine's request and the job's answers carry: the span's context when it
        #: records, else the incoming context unchanged.
        self.context = context
        self._span = span

    def answered(self, job_id: str | None, outcome: str, code: str | None) -> None:
        """What the job came to (`vkw_jobs_total`'s outcome and code), on the span."""
        if self._span is not None:
            if job_id is not None:
                self._span.set_attribute("vkw.job_id", job_id)
            self._span.set_attribute("vkw.outcome", outcome)
            if code is not None:
                self._span.set_attribute("vkw.error.code", code)


class JobSpans:
    """Starts a span per traced job when OpenTelemetry is installed and `tracer_provider` (by
    default the global one) records; otherwise each job's context passes through as it came.

    OpenTelemetry is imported on the first job with a traceparent: a fleet that receives none
    never loads it.
    """

    def __init__(self, tracer_provider: Any = None) -> None:
        self._provider = tracer_provider
        self._tracer: Any = None
        self._otel: _Otel | None = None
        self._loaded = False

    @contextlib.contextmanager
    def job(
        self, context: TraceContext, topic: str, attributes: Mapping[str, str | int]
    ) -> Iterator[JobSpan]:
        """A span named after `topic` for one job (none without a traceparent, or without
        OpenTelemetry); it ends when the block does, recording an exception that leaves it."""
        if context.traceparent is None:
            yield JobSpan(context)
            return
        otel = self._load()
        if otel is None:
            yield JobSpan(context)
            return
        parent = otel.propagator.extract(context.engine_headers or {})
        span = self._tracer.start_span(
            f"process {topic}",
            context=parent,
            kind=otel.trace.SpanKind.CONSUMER,
            attributes={"messaging.system": "kafka", **attributes},
        )
        if not span.is_recording():
            yield JobSpan(context)
            return
        carrier: dict[str, str] = {}
        otel.propagator.inject(carrier, context=otel.trace.set_span_in_context(span))
        child = msgspec.structs.replace(
            context,
            traceparent=carrier[TRACEPARENT],
            tracestate=carrier.get(TRACESTATE) or None,
        )
        with otel.trace.use_span(span, end_on_exit=True):
            yield JobSpan(child, span)

    def _load(self) -> _Otel | None:
        if not self._loaded:
            self._loaded = True
            self._otel = _import_otel()
            if self._otel is None:
                logger.info("jobs carry trace context; OpenTelemetry is not installed: no spans")
            else:
                provider = self._provider or self._otel.trace.get_tracer_provider()
                self._tracer = provider.get_tracer("vllm_kafka_worker")
        return self._otel
