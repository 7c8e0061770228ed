"""Trace context through the worker: W3C header checks, the headers' way to the engine and onto
every record of a job's answer, OpenTelemetry spans when it records, and the client's side."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from aiokafka import ConsumerRecord, TopicPartition
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from schemas import Completed, ErrorCode, Failed, Job, SamplingSpec, decode_result, encode
from tests.fakes import ScriptedEngine
from tests.hypothesis_profiles import examples
from worker.answering.answers import AnswerBuilder
from worker.answering.records import Answer, RecordKind
from worker.client.rollout import RolloutClient
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import settings_from
from worker.core.limits import RecordLimits, ValueBudgets, record_bytes
from worker.core.metrics import Metrics
from worker.core.tracing import (
    NO_TRACE,
    DroppedHeader,
    DropReason,
    JobSpans,
    TraceContext,
    TraceContextError,
    current_trace_context,
    trace_context,
    trace_context_from_headers,
)
from worker.engines.mock import MockEngineSettings

# The examples of the W3C Trace Context recommendation.
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACESTATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
TRACED = [
    ("traceparent", TRACEPARENT.encode()),
    ("tracestate", TRACESTATE.encode()),
    ("x-request-id", b"req-42"),
]

TP = TopicPartition("jobs", 0)
RESULTS, DLQ = "results", "dlq"
QWEN3_30B = MockEngineSettings(num_layers=48, top_k=8, num_experts=128)


def context_of(*headers: tuple[str, bytes | None]) -> tuple[TraceContext, list[DroppedHeader]]:
    return trace_context_from_headers(list(headers))


def reasons(*headers: tuple[str, bytes | None]) -> dict[str, DropReason]:
    return {d.header: d.reason for d in context_of(*headers)[1]}


# ---- the W3C format ----------------------------------------------------------------------------


def test_a_valid_context_passes_whole_and_goes_on_under_lowercase_names():
    context, dropped = context_of(
        ("Traceparent", TRACEPARENT.encode()),
        ("TRACESTATE", TRACESTATE.encode()),
        ("X-Request-Id", b"req-42"),
        ("other", b"kept out"),
    )
    assert dropped == []
    assert context == TraceContext(TRACEPARENT, TRACESTATE, "req-42")
    assert context.engine_headers == {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    assert context.record_headers() == TRACED


def test_no_trace_headers_is_an_empty_context_with_nothing_for_the_engine():
    assert context_of(("key", b"v")) == (NO_TRACE, [])
    assert trace_context_from_headers(None) == (NO_TRACE, [])
    assert NO_TRACE.engine_headers is None and NO_TRACE.record_headers() == []


@pytest.mark.parametrize(
    "value",
    [
        TRACEPARENT.upper(),  # lowercase hex only
        f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
        f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is invalid
        f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE_ID[:-1]}-{PARENT_ID}-01",  # short trace id
        f"00-{TRACE_ID}-{PARENT_ID}0-01",  # long parent id
        f"00-{TRACE_ID}-{PARENT_ID}-1",  # one-digit flags
        f"00_{TRACE_ID}_{PARENT_ID}_01",
        f"0g-{TRACE_ID}-{PARENT_ID}-01",
        "",
    ],
)
def test_a_malformed_traceparent_is_dropped(value):
    context, dropped = context_of(("traceparent", value.encode()))
    assert context.traceparent is None
    assert dropped == [DroppedHeader("traceparent", DropReason.MALFORMED)]


def test_a_later_version_may_carry_more_fields_and_white_space_around_is_removed():
    future = f"cc-{TRACE_ID}-{PARENT_ID}-01-what-the-future-will-be-like"
    assert context_of(("traceparent", future.encode()))[0].traceparent == future
    padded = f" \t{TRACEPARENT} ".encode()
    assert context_of(("traceparent", padded))[0].traceparent == TRACEPARENT


def test_bad_bytes_repeats_and_lengths_are_dropped_with_their_reason():
    over = f"cc-{TRACE_ID}-{PARENT_ID}-01-{'x' * 500}"
    assert reasons(("traceparent", over.encode())) == {"traceparent": DropReason.TOO_LONG}
    assert reasons(("traceparent", b"\xff" + TRACEPARENT.encode())) == {
        "traceparent": DropReason.MALFORMED
    }
    assert reasons(("traceparent", None)) == {"traceparent": DropReason.MALFORMED}
    twice = reasons(("traceparent", TRACEPARENT.encode()), ("TraceParent", TRACEPARENT.encode()))
    assert twice == {"traceparent": DropReason.REPEATED}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (" rojo=1 ,, congo=2,", "rojo=1,congo=2"),  # white space and empty members go
        ("t@sys=x,a-b_c*d/e=y", "t@sys=x,a-b_c*d/e=y"),  # multi-tenant keys and key chars
        ("rojo=has space", "rojo=has space"),  # a space inside a value is allowed
    ],
)
def test_a_valid_tracestate_is_kept_in_its_list_form(value, expected):
    context, dropped = context_of(
        ("traceparent", TRACEPARENT.encode()), ("tracestate", value.encode())
    )
    assert dropped == [] and context.tracestate == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("Rojo=1", DropReason.MALFORMED),  # keys are lowercase
        ("rojo=1,rojo=2", DropReason.MALFORMED),  # a key appears once
        ("rojo=a=b", DropReason.MALFORMED),  # '=' is not allowed in a value
        ("rojo=", DropReason.MALFORMED),
        ("rojo= ", DropReason.MALFORMED),  # a value ends in a visible character
        (",,", DropReason.MALFORMED),
        (",".join(f"k{i}=v" for i in range(33)), DropReason.TOO_LONG),  # 32 members at most
        ("k=" + "v" * 257, DropReason.MALFORMED),  # a value is 256 characters at most
        (",".join(f"k{i}={'v' * 250}" for i in range(33))[:8200], DropReason.TOO_LONG),
    ],
)
def test_a_bad_tracestate_is_dropped_and_the_traceparent_kept(value, reason):
    context, dropped = context_of(
        ("traceparent", TRACEPARENT.encode()), ("tracestate", value.encode())
    )
    assert context == TraceContext(traceparent=TRACEPARENT)
    assert dropped == [DroppedHeader("tracestate", reason)]


def test_a_tracestate_without_a_valid_traceparent_is_dropped_too():
    """W3C: a vendor that cannot parse traceparent must not use tracestate."""
    assert reasons(("tracestate", TRACESTATE.encode())) == {"tracestate": DropReason.ORPHANED}
    assert reasons(("traceparent", b"junk"), ("tracestate", TRACESTATE.encode())) == {
        "traceparent": DropReason.MALFORMED,
        "tracestate": DropReason.ORPHANED,
    }


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"", DropReason.MALFORMED),
        (b"a b", DropReason.MALFORMED),
        (b"r" * 257, DropReason.TOO_LONG),
    ],
)
def test_a_bad_request_id_is_dropped_and_the_trace_kept(value, reason):
    context, dropped = context_of(("traceparent", TRACEPARENT.encode()), ("x-request-id", value))
    assert context == TraceContext(traceparent=TRACEPARENT)
    assert dropped == [DroppedHeader("x-request-id", reason)]


_HEX = "0123456789abcdefABCDEF"
_field = st.one_of(
    st.sampled_from(["00", "01", "cc", "fe", "ff", "0" * 32, "0" * 16, TRACE_ID, PARENT_ID]),
    st.text(alphabet=_HEX + "-xz", min_size=0, max_size=34),
)


@settings(max_examples=examples(2))
@given(
    fields=st.lists(_field, min_size=1, max_size=6),
    rest=st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20),
    space=st.sampled_from(["", " ", "\t "]),
)
def test_traceparent_verdicts_agree_with_opentelemetrys_extractor(fields, rest, space):
    """The rule is OpenTelemetry's (opentelemetry-api,
    `trace/propagation/tracecontext.py:TraceContextTextMapPropagator.extract`), which follows
    W3C: what it takes as a parent, we pass on; what it ignores, we drop."""
    value = space + "-".join(fields) + (f"-{rest}" if rest else "") + space
    ours = context_of(("traceparent", value.encode()))[0].traceparent is not None
    extracted = TraceContextTextMapPropagator().extract({"traceparent": value})
    theirs = trace.get_current_span(extracted).get_span_context().is_valid
    assert ours == theirs, value


def test_trace_context_from_a_caller_names_what_is_wrong():
    assert trace_context(TRACEPARENT, TRACESTATE, "r") == TraceContext(TRACEPARENT, TRACESTATE, "r")
    assert trace_context() == NO_TRACE
    with pytest.raises(TraceContextError, match="traceparent 'nope' is malformed"):
        trace_context("nope")
    with pytest.raises(TraceContextError, match="tracestate needs a traceparent"):
        trace_context(None, TRACESTATE)
    with pytest.raises(TraceContextError, match=r"x-request-id .* too long"):
        trace_context(TRACEPARENT, None, "r" * 300)


# ---- through the answer builder ----------------------------------------------------------------


def builder(
    topic_bytes: dict[str, int | None] | None = None,
    engine: ScriptedEngine | None = None,
    spans: JobSpans | None = None,
    metrics: Metrics | None = None,
) -> AnswerBuilder:
    settings = settings_from(
        {"results_topic": RESULTS, "dead_letter_topic": DLQ, "engine": "mock", "worker_id": "w"}, {}
    )
    limits = RecordLimits.from_topic_limits(settings, topic_bytes or {})
    return AnswerBuilder(
        settings,
        engine or ScriptedEngine(),
        limits,
        metrics or Metrics(),
        spans=spans,
        clock=SYSTEM_CLOCK,
    )


def record(
    value: bytes | None, headers: list[tuple[str, bytes]], offset: int = 7
) -> ConsumerRecord:
    return ConsumerRecord(
        "jobs", 0, offset, 0, 0, b"k", value, None, 1, len(value or b""), tuple(headers)
    )


def job(job_id: str = "j", **kwargs: Any) -> bytes:
    kwargs.setdefault("sampling", SamplingSpec(max_tokens=4))
    return encode(Job(job_id=job_id, prompt="hello", **kwargs))


def results_of(answer: Answer) -> list[Any]:
    return [r for r in answer.records if r.kind is RecordKind.RESULT]


async def test_a_completed_jobs_trace_reaches_the_engine_and_its_result_record():
    engine = ScriptedEngine()
    answer = await builder(engine=engine).answer(TP, record(job(), TRACED))
    assert engine.trace_headers["j"] == {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    (out,) = answer.records
    assert isinstance(decode_result(out.value or b""), Completed)
    assert out.headers == TRACED
    assert out.size == record_bytes(out.key, out.value, out.headers)


async def test_a_job_without_trace_headers_sends_none_to_the_engine_or_the_result():
    engine = ScriptedEngine()
    answer = await builder(engine=engine).answer(TP, record(job(), [("other", b"x")]))
    assert engine.trace_headers["j"] is None
    assert answer.records[0].headers == []


async def test_every_part_of_a_split_result_carries_the_trace_and_fits_its_topic():
    limit = 256 * 1024
    big_state = ",".join(f"k{i}={'v' * 250}" for i in range(31))  # ~8 KiB: the bound's size
    headers = [("traceparent", TRACEPARENT.encode()), ("tracestate", big_state.encode())]
    group = job(
        "g",
        sampling=SamplingSpec(n=6, max_tokens=300, seed=5),
        return_routed_experts=True,
    )
    answer = await builder({RESULTS: limit}, ScriptedEngine(QWEN3_30B)).answer(
        TP, record(group, headers)
    )
    assert len(answer.records) > 1
    for out in answer.records:
        assert dict(out.headers) == dict(headers)
        assert out.size == record_bytes(out.key, out.value, out.headers) <= limit


def test_a_records_value_budget_leaves_room_for_its_headers():
    settings = settings_from({"results_topic": RESULTS, "engine": "mock"}, {})
    limits = RecordLimits.from_topic_limits(settings, {RESULTS: 256 * 1024})
    budgets = ValueBudgets(limits, RESULTS)
    plain, _ = budgets.of("job", RESULTS)
    traced, _ = budgets.of("job", RESULTS, TRACED)
    assert plain - traced == record_bytes(b"job", b"", TRACED) - record_bytes(b"job", b"", [])


@pytest.mark.parametrize(
    ("metadata", "code"),
    [
        ({"fail": "engine_error"}, ErrorCode.ENGINE_ERROR),
        ({"fail": "invalid"}, ErrorCode.INVALID_JOB),
        ({"fail": "bug"}, ErrorCode.INTERNAL_ERROR),
    ],
)
async def test_a_failed_jobs_result_carries_the_trace(metadata, code):
    engine = ScriptedEngine()
    answer = await builder(engine=engine).answer(TP, record(job(metadata=metadata), TRACED))
    (out,) = answer.records
    failed = decode_result(out.value or b"")
    assert isinstance(failed, Failed) and failed.error.code == code
    assert out.headers == TRACED
    assert engine.trace_headers["j"] == {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}


async def test_an_expired_job_never_runs_and_its_answer_carries_the_trace():
    engine = ScriptedEngine()
    answer = await builder(engine=engine).answer(TP, record(job(deadline=1.0), TRACED))
    assert "j" not in engine.trace_headers
    assert answer.code is ErrorCode.EXPIRED and answer.records[0].headers == TRACED


async def test_an_invalid_record_is_answered_in_its_trace_and_dead_lettered_as_it_came():
    bad = b'{"job_id": "x", "prompt": 5}'
    with_junk = [*TRACED, ("vendor", b"v")]
    answer = await builder().answer(TP, record(bad, with_junk))
    copy, result = answer.records
    assert copy.kind is RecordKind.DEAD_LETTER and result.kind is RecordKind.RESULT
    assert copy.headers[: len(with_junk)] == with_junk  # the original headers, untouched
    assert result.headers == TRACED
    failed = decode_result(result.value or b"")
    assert isinstance(failed, Failed) and failed.error.code == ErrorCode.INVALID_JOB


async def test_a_crash_looped_record_is_answered_in_its_trace():
    answer = await builder().crash_looped(TP, record(job(), TRACED), deaths=3)
    copy, result = answer.records
    assert copy.kind is RecordKind.DEAD_LETTER and result.headers == TRACED


async def test_smaller_answers_keep_the_trace_down_to_the_last_fallback():
    b = builder()
    answer = await b.answer(TP, record(job(metadata={"k": "v" * 1000}), TRACED))
    smaller = b.smaller(answer, 0, "the broker")
    assert smaller is not None and smaller.records[0].minimal
    assert smaller.records[0].headers == TRACED
    copy_answer = await b.answer(TP, record(b"bad" * 100, [*TRACED, ("v", b"x" * 5000)]))
    copy = copy_answer.records[0]
    for _ in range(2):  # without its value, then the last fallback
        shrunk = b.smaller(copy_answer, 0, "the broker")
        assert shrunk is not None
        copy_answer = shrunk
        copy = copy_answer.records[0]
    assert copy.minimal and copy.value is None
    names = [k for k, _ in copy.headers]
    assert ("v", b"x" * 5000) not in copy.headers  # the record's other headers went
    assert set(TRACED) <= set(copy.headers) and "vkw.error.code" in names


async def test_an_answer_moved_off_a_refused_reply_topic_keeps_the_trace():
    b = builder()
    answer = await b.answer(TP, record(job(), TRACED))
    moved_from = on_topic(answer, "reply-here")
    moved = b.unwritable(moved_from, 0, "TopicAuthorizationFailedError")
    assert moved is not None and moved.records[0].topic == RESULTS
    assert moved.records[0].headers == TRACED


def on_topic(answer: Answer, topic: str) -> Answer:
    record = msgspec.structs.replace(answer.records[0], topic=topic)
    return msgspec.structs.replace(answer, records=(record,))


async def test_malformed_headers_are_counted_and_logged_and_the_job_runs_without_them(caplog):
    metrics = Metrics()
    engine = ScriptedEngine()
    headers = [
        ("traceparent", f"00-{'0' * 32}-{PARENT_ID}-01".encode()),
        ("tracestate", TRACESTATE.encode()),
        ("x-request-id", b"req-42"),
    ]
    with caplog.at_level(logging.WARNING, logger="worker.answering.answers"):
        answer = await builder(engine=engine, metrics=metrics).answer(TP, record(job("m"), headers))
    assert isinstance(decode_result(answer.records[0].value or b""), Completed)
    assert engine.trace_headers["m"] is None
    assert answer.records[0].headers == [("x-request-id", b"req-42")]
    assert metrics.trace_headers_dropped.values == {
        ("traceparent", "malformed"): 1,
        ("tracestate", "orphaned"): 1,
    }
    (line,) = [r.getMessage() for r in caplog.records if "trace headers dropped" in r.getMessage()]
    assert "job m at jobs-0@7" in line and "traceparent (malformed)" in line


# ---- OpenTelemetry -----------------------------------------------------------------------------


@pytest.fixture
def recorded() -> Iterator[tuple[JobSpans, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield JobSpans(provider), exporter
    provider.shutdown()


async def test_with_a_recording_tracer_each_traced_job_gets_a_child_span_that_goes_on(recorded):
    spans, exporter = recorded
    engine = ScriptedEngine()
    answer = await builder(engine=engine, spans=spans).answer(TP, record(job(), TRACED))
    (span,) = exporter.get_finished_spans()
    context = span.get_span_context()
    assert span.parent is not None and span.parent.span_id == int(PARENT_ID, 16)
    assert context.trace_id == int(TRACE_ID, 16)
    assert span.name == "process jobs" and span.kind is trace.SpanKind.CONSUMER
    assert span.attributes is not None
    assert dict(span.attributes) == {
        "messaging.system": "kafka",
        "messaging.destination.name": "jobs",
        "messaging.destination.partition.id": "0",
        "messaging.kafka.offset": 7,
        "vkw.job_id": "j",
        "vkw.outcome": "completed",
    }
    child = f"00-{TRACE_ID}-{context.span_id:016x}-01"
    assert engine.trace_headers["j"] == {"traceparent": child, "tracestate": TRACESTATE}
    assert dict(answer.records[0].headers) == {
        "traceparent": child.encode(),
        "tracestate": TRACESTATE.encode(),
        "x-request-id": b"req-42",
    }


async def test_a_job_without_a_traceparent_gets_no_span(recorded):
    spans, exporter = recorded
    await builder(spans=spans).answer(TP, record(job(), [("x-request-id", b"r")]))
    assert exporter.get_finished_spans() == ()


async def test_a_failed_jobs_span_names_its_code(recorded):
    spans, exporter = recorded
    await builder(spans=spans).answer(TP, record(job(metadata={"fail": "engine_error"}), TRACED))
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["vkw.outcome"] == "failed"
    assert span.attributes["vkw.error.code"] == "engine_error"


async def test_a_tracer_that_does_not_record_passes_the_context_through_unchanged():
    provider = TracerProvider(sampler=ALWAYS_OFF)
    engine = ScriptedEngine()
    answer = await builder(engine=engine, spans=JobSpans(provider)).answer(
        TP, record(job(), TRACED)
    )
    assert engine.trace_headers["j"] == {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    assert answer.records[0].headers == TRACED


@pytest.fixture
def without_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if OpenTelemetry were not installed: importing it fails."""
    for name in list(sys.modules):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            monkeypatch.setitem(sys.modules, name, None)


async def test_without_opentelemetry_the_headers_pass_through(without_opentelemetry):
    engine = ScriptedEngine()
    answer = await builder(engine=engine, spans=JobSpans()).answer(TP, record(job(), TRACED))
    assert engine.trace_headers["j"] == {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    assert answer.records[0].headers == TRACED
    assert current_trace_context() == NO_TRACE


def test_the_worker_and_the_client_import_opentelemetry_only_when_a_trace_needs_it():
    code = (
        "import sys, worker.answering.answers, worker.client, worker.core.tracing; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


# ---- the client --------------------------------------------------------------------------------


class RecordingProducer:
    """The producer calls `RolloutClient` makes, kept."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, list[tuple[str, bytes]]]] = []

    async def send(
        self, topic: str, *, value: bytes, key: bytes, headers: list[tuple[str, bytes]]
    ) -> asyncio.Future[None]:
        self.sent.append((topic, key, headers))
        delivered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        delivered.set_result(None)
        return delivered

    async def stop(self) -> None:
        pass


async def sent_headers(submit: Any) -> list[tuple[str, bytes]]:
    """The headers of the one record `submit(client)` sends."""
    client = RolloutClient(bootstrap_servers="unused:9092")
    producer = RecordingProducer()
    client._producer = producer
    try:
        future = submit(client)
        for _ in range(100):  # the send is a task of its own: let it run
            if producer.sent:
                break
            await asyncio.sleep(0)
        future.cancel()
        ((_, _, headers),) = producer.sent
        return headers
    finally:
        await client.close()


def client_job(job_id: str = "c") -> Job:
    return Job(job_id=job_id, prompt="hi")


async def test_submit_sends_the_trace_context_it_is_given():
    headers = await sent_headers(
        lambda c: c.submit(
            client_job(), traceparent=TRACEPARENT, tracestate=TRACESTATE, request_id="req-42"
        )
    )
    assert headers == TRACED


async def test_submit_takes_the_current_opentelemetry_span_when_given_none():
    span_context = trace.SpanContext(
        int(TRACE_ID, 16), int(PARENT_ID, 16), is_remote=False, trace_flags=trace.TraceFlags(1)
    )
    with trace.use_span(trace.NonRecordingSpan(span_context)):
        headers = await sent_headers(lambda c: c.submit(client_job(), request_id="req-42"))
    assert headers == [("traceparent", TRACEPARENT.encode()), ("x-request-id", b"req-42")]
    assert await sent_headers(lambda c: c.submit(client_job())) == []


async def test_submit_without_opentelemetry_sends_only_what_it_is_given(without_opentelemetry):
    assert await sent_headers(lambda c: c.submit(client_job())) == []
    given = await sent_headers(lambda c: c.submit(client_job(), traceparent=TRACEPARENT))
    assert given == [("traceparent", TRACEPARENT.encode())]


async def test_submit_refuses_a_malformed_traceparent_and_sends_nothing():
    client = RolloutClient(bootstrap_servers="unused:9092")
    producer = RecordingProducer()
    client._producer = producer
    try:
        with pytest.raises(TraceContextError, match="traceparent"):
            client.submit(client_job(), traceparent=TRACEPARENT.upper())
        with pytest.raises(TraceContextError, match="traceparent"):
            await client.generate([client_job()], traceparent="00-x")
        await asyncio.sleep(0)
        assert producer.sent == [] and client.in_flight == 0
    finally:
        await client.close()
