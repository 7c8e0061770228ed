"""Hostile job records against the consume loop (in-memory consumer and producer): a reply
topic that does not exist, answers that must follow `reply_to`, a version no trainer will
publish, and a stream of hostile records mixed with good ones."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from aiokafka.errors import UnknownTopicOrPartitionError
from hypothesis import HealthCheck, given
from hypothesis import settings as settings_
from hypothesis import strategies as st

from schemas import (
    Completed,
    Failed,
    Job,
    Result,
    SamplingSpec,
    decode_result,
    encode,
    peek_job_id,
    peek_reply_to,
)
from tests.fakes import FakeConsumer, MemoryProducer, ScriptedEngine
from tests.hypothesis_profiles import examples
from tests.unit.test_loop import DLQ, P0, RESULTS, committed_as, settings
from worker.answering import topics as answer_topics
from worker.answering.answers import AnswerBuilder
from worker.answering.records import DLQ_REPLY_HEADER
from worker.answering.runner import JobRunner
from worker.core.clock import SYSTEM_CLOCK
from worker.core.errors import InvalidRecordError
from worker.core.limits import RecordLimits
from worker.core.metrics import Metrics
from worker.delivery.commits import CommittedReader
from worker.delivery.offset_map import encode_offset_map
from worker.dev.harness.waiting import wait_for
from worker.loop.version_holds import VersionHolds
from worker.loop.worker import Worker

HERE, GONE = "trainer-here", "trainer-gone"
ALLOWED = "trainer-.*"


class Lookups:
    """The broker's answers to reply-topic lookups: `HERE` exists; `GONE` is never answered
    (as aiokafka waits `request_timeout_ms` on metadata for a topic that does not exist)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def __call__(self, topic: str) -> bool:
        self.asked.append(topic)
        if topic == HERE:
            return True
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class BrokerWithoutGone(MemoryProducer):
    """A producer as aiokafka's behaves on a broker without `GONE` and no auto-creation: its
    metadata wait for `GONE` does not end (aiokafka: `request_timeout_ms`, 40 s), and a send to
    it fails."""

    async def partitions_for(self, topic: str) -> set[int]:
        if topic == GONE:
            await asyncio.Event().wait()
        return await super().partitions_for(topic)

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        if topic == GONE:
            raise UnknownTopicOrPartitionError()
        return await super().send(topic, *args, **kwargs)


@dataclass
class Loop:
    worker: Worker
    consumer: FakeConsumer
    producer: MemoryProducer
    engine: ScriptedEngine
    task: asyncio.Task[int]

    def answers(self, topic: str) -> dict[str, Result]:
        out: dict[str, Result] = {}
        for t, _, value, _ in self.producer.sent:
            if t == topic and value is not None:
                result = decode_result(value)
                out.setdefault(result.job_id or "", result)
        return out

    def copies(self) -> list[dict[str, bytes]]:
        return [dict(h) for t, _, _, h in self.producer.sent if t == DLQ]


StartLoop = Callable[..., Awaitable[Loop]]


@pytest.fixture
async def start_loop() -> AsyncIterator[StartLoop]:
    loops: list[Loop] = []

    async def start(
        consumer: FakeConsumer,
        engine: ScriptedEngine,
        *,
        read_committed: CommittedReader | None = None,
        lookups: Lookups | None = None,
        **overrides: Any,
    ) -> Loop:
        s = settings(reply_topics=ALLOWED, **overrides)
        producer = BrokerWithoutGone({RESULTS: 1, DLQ: 1, HERE: 1})
        worker = Worker(
            s,
            consumer=consumer,
            producer=producer,
            engine=engine,
            limits=RecordLimits.from_topic_limits(s, {}),
            read_committed=read_committed,
            topic_lookup=lookups or Lookups(),
            clock=SYSTEM_CLOCK,
        )
        loop = Loop(worker, consumer, producer, engine, asyncio.create_task(worker.run()))
        loops.append(loop)
        return loop

    yield start
    for loop in loops:
        loop.worker.request_stop()
        assert await asyncio.wait_for(loop.task, 10) == 0, "the worker stopped on a fatal error"


def job(job_id: str, **fields: Any) -> bytes:
    metadata = fields.pop("metadata", {})
    return encode(
        Job(
            job_id=job_id,
            prompt="hi",
            sampling=SamplingSpec(max_tokens=2),
            metadata=metadata,
            **fields,
        )
    )


def consumer_with(*values: bytes) -> FakeConsumer:
    consumer = FakeConsumer()
    for value in values:
        consumer.add(P0, value)
    consumer.assign({P0})
    return consumer


async def test_a_reply_topic_that_does_not_exist_is_answered_invalid_and_holds_up_nothing(
    start_loop: StartLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(answer_topics, "REPLY_TOPIC_CHECK_S", 0.5)
    lookups = Lookups()
    consumer = consumer_with(
        job("gone-1", reply_to=GONE),
        *(job(f"plain-{i}") for i in range(5)),
        job("mine", reply_to=HERE),
    )
    loop = await start_loop(consumer, ScriptedEngine(), lookups=lookups)
    # Every other job is answered while the missing topic's lookup is still waiting.
    await wait_for(
        lambda: len(loop.answers(RESULTS)) >= 5 and "mine" in loop.answers(HERE),
        what="the other jobs' answers",
    )
    assert "gone-1" not in loop.answers(RESULTS)
    await wait_for(lambda: "gone-1" in loop.answers(RESULTS), what="the refused job's answer")
    refused = loop.answers(RESULTS)["gone-1"]
    assert isinstance(refused, Failed) and refused.error.code == "invalid_job"
    assert f"reply_to '{GONE}' cannot be answered on" in refused.error.detail
    assert "no metadata for it within" in refused.error.detail
    # The outcome is kept: a second job naming it is answered at once, without a lookup.
    consumer.add(P0, job("gone-2", reply_to=GONE))
    await wait_for(lambda: "gone-2" in loop.answers(RESULTS), what="the second refused job")
    assert lookups.asked.count(GONE) == 1 and lookups.asked.count(HERE) == 1
    assert isinstance(loop.answers(HERE)["mine"], Completed)
    assert GONE not in {t for t, *_ in loop.producer.sent}
    await wait_for(lambda: consumer.commits[-1] == {P0: 8}, what="the commit past all")


async def test_every_answer_of_a_reply_to_job_goes_to_its_topic(start_loop: StartLoop) -> None:
    bad_field = json.dumps(
        {"job_id": "unreadable", "reply_to": HERE, "prompt": 5, "sampling": {"max_tokens": 2}}
    ).encode()
    consumer = consumer_with(
        bad_field,  # dead-lettered: not a valid job
        job("buggy", reply_to=HERE, metadata={"fail": "bug"}),  # internal_error
        job("killer", reply_to=HERE),  # in flight at too many deaths: crash_looped
        job("fine", reply_to=HERE),
    )
    died = committed_as((0, encode_offset_map(0, [], running={2}, deaths={2: 2})))
    loop = await start_loop(consumer, ScriptedEngine(), read_committed=died, max_crash_attempts=3)
    await wait_for(lambda: len(loop.answers(HERE)) == 4, what="four answers on the reply topic")
    answers = loop.answers(HERE)
    assert loop.answers(RESULTS) == {}
    codes = {job_id: r.error.code for job_id, r in answers.items() if isinstance(r, Failed)}
    assert codes == {
        "unreadable": "invalid_job",
        "buggy": "internal_error",
        "killer": "engine_error",
    }
    assert isinstance(answers["fine"], Completed)
    # The dead-letter copies name the topic their job's answer went to.
    copies = {c["vkw.source.offset"]: c for c in loop.copies()}
    assert set(copies) == {b"0", b"2"}
    assert all(c[DLQ_REPLY_HEADER] == HERE.encode() for c in copies.values())


async def test_a_version_no_trainer_publishes_holds_the_partition_at_most_the_bound(
    start_loop: StartLoop,
) -> None:
    consumer = consumer_with(job("first"), job("needs-huge", min_weight_version=10**15))
    consumer.add(P0, job("behind"))
    loop = await start_loop(consumer, ScriptedEngine(), max_version_hold_s=0.3)
    await wait_for(lambda: loop.worker.held_partitions == 1, what="the hold")
    assert set(loop.answers(RESULTS)) == {"first"}
    await wait_for(lambda: len(loop.answers(RESULTS)) == 3, what="the hold to run out")
    expired = loop.answers(RESULTS)["needs-huge"]
    assert isinstance(expired, Failed) and expired.error.code == "expired"
    assert f"weights >= {10**15}" in expired.error.detail
    assert "--max-version-hold-s 0.3" in expired.error.detail
    assert "needs-huge" not in loop.engine.started
    assert isinstance(loop.answers(RESULTS)["behind"], Completed)
    assert loop.worker.held_partitions == 0
    await wait_for(lambda: consumer.commits[-1] == {P0: 3}, what="the commit past all")


# Records anyone who can write to the jobs topic can write. Each must be answered (failed, or
# dead-lettered when it has no readable job_id) and none may stop or stall the worker.
HOSTILE: list[bytes] = [
    b"",
    b"\x00\xff\xfe not json",
    b"[" * 100_000,
    b'{"job_id": ' + b"[" * 50_000,
    b'{"job_id": "' + b"x" * 200_000 + b'", "prompt": "hi", "sampling": {"max_tokens": 2}}',
    b'{"job_id": "num", "prompt": "hi", "sampling": {"max_tokens": 1e400}}',
    b'{"job_id": "neg", "prompt": "hi", "sampling": {"max_tokens": -1}}',
    b'{"job_id": "n-huge", "prompt": "hi", "sampling": {"max_tokens": 2, "n": 1000000000}}',
    b'{"job_id": "ids", "prompt_token_ids": [99999999999999999999], "sampling": {"max_tokens": 2}}',
    b'{"job_id": "both", "prompt": "a", "prompt_token_ids": [1], "sampling": {"max_tokens": 2}}',
    b'{"job_id": "\xff\xfe", "prompt": "hi", "sampling": {"max_tokens": 2}}',
    b'{"job_id": "dup", "job_id": 5, "prompt": "hi", "sampling": {"max_tokens": 2}}',
    b'{"job_id": "reply", "reply_to": "../../etc", "prompt": "hi", "sampling": {"max_tokens": 2}}',
    b'{"job_id": "meta", "prompt": "hi", "sampling": {"max_tokens": 2}, "metadata": {"k": 5}}',
    b'{"job_id": "deadline", "prompt": "hi", "sampling": {"max_tokens": 2}, "deadline": 1}',
    b'{"job_id": "version", "prompt": "hi", "sampling": {"max_tokens": 2}, '
    b'"min_weight_version": "soon"}',
    b'{"min_weight_version": 99999999999999999999999, "job_id": "v-big"}',
    job("gone", reply_to=GONE),
    job("elsewhere", reply_to="not-allowed"),
    job("bug", metadata={"fail": "bug"}),
    job("needs-huge", min_weight_version=2**62),
]


async def test_a_stream_of_hostile_records_leaves_every_good_one_answered(
    start_loop: StartLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(answer_topics, "REPLY_TOPIC_CHECK_S", 0.2)
    values: list[bytes] = []
    for i, hostile in enumerate(HOSTILE):
        values += [hostile, job(f"good-{i}")]
    loop = await start_loop(consumer_with(*values), ScriptedEngine(), max_version_hold_s=0.2)
    total = len(values)
    await wait_for(
        lambda: loop.consumer.commits and loop.consumer.commits[-1] == {P0: total},
        what=lambda: f"every record answered (answers: {sorted(loop.answers(RESULTS))})",
    )
    answers = loop.answers(RESULTS)
    good = {f"good-{i}" for i in range(len(HOSTILE))}
    assert good <= set(answers)
    assert all(isinstance(answers[g], Completed) for g in good)
    failed = {k: r for k, r in answers.items() if k not in good}
    assert all(isinstance(r, Failed) for r in failed.values())
    # Each hostile record was answered: a failed result, or a dead-letter copy, or both.
    copies = {c["vkw.source.offset"] for c in loop.copies()}
    answered = {int(o) for o in copies} | {
        i * 2 for i, v in enumerate(HOSTILE) if peek_job_id(v) in failed
    }
    assert answered == {i * 2 for i in range(len(HOSTILE))}


# ---- fuzzing the job decoders --------------------------------------------------------------

_SMALL_INTS = st.integers(-3, 40) | st.sampled_from([2**31, 2**63, 2**70, -(2**70)])
_json = st.recursive(
    st.none() | st.booleans() | _SMALL_INTS | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_FIELDS = [
    "job_id",
    "prompt",
    "prompt_token_ids",
    "sampling",
    "return_routed_experts",
    "routed_experts_prompt_start",
    "metadata",
    "deadline",
    "min_weight_version",
    "reply_to",
    "unknown",
]


@st.composite
def _job_values(draw: st.DrawFn) -> bytes:
    """A valid job with a few fields replaced, removed or added; or bytes at random."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=200))
    value: dict[str, Any] = {
        "job_id": "fuzzed",
        "prompt": "hi",
        "sampling": {"max_tokens": 2},
        "reply_to": HERE,
    }
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from(_FIELDS))
        if draw(st.booleans()):
            value.pop(field, None)
        else:
            value[field] = draw(_json)
    if draw(st.booleans()):
        sampling = value.get("sampling")
        if isinstance(sampling, dict):
            key = draw(st.sampled_from(["n", "max_tokens", "temperature", "stop", "seed"]))
            sampling[key] = draw(_json)
    return json.dumps(value).encode()


def _record(value: bytes, offset: int = 0) -> Any:
    return ConsumerRecord(RESULTS, 0, offset, 0, 0, b"k", value, None, 1, len(value), ())


def test_fuzzed_job_records_are_each_answered_and_decoding_stays_within_the_record_size() -> None:
    s = settings(reply_topics=ALLOWED)
    lookups = Lookups()
    builder = AnswerBuilder(
        s,
        ScriptedEngine(),
        RecordLimits.from_topic_limits(s, {}),
        Metrics(),
        lookups,
        clock=SYSTEM_CLOCK,
    )
    holds = VersionHolds(lambda: 3, max_hold_s=600, clock=SYSTEM_CLOCK)

    @settings_(max_examples=examples(2.5), suppress_health_check=[HealthCheck.too_slow])
    @given(_job_values())
    def check(value: bytes) -> None:
        record = _record(value)
        tracemalloc.start()
        try:
            with contextlib.suppress(InvalidRecordError):
                JobRunner.read(record)
            peek_job_id(value)
            peek_reply_to(value)
            holds.runnable(P0, [record])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        holds.forget({P0})
        assert peak < 100 * len(value) + (1 << 20), peak
        answer = asyncio.run(builder.answer(P0, record))
        assert answer.records, "every record gets an answer"
        for out in answer.records:
            assert out.topic in (RESULTS, DLQ, HERE)
            if out.topic != DLQ and out.value is not None:
                decode_result(out.value)

    check()
