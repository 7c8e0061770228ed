"""The answer builder against a scripted engine: outcomes, sizes and the fallbacks that fit."""

from __future__ import annotations

import os
from typing import Any

import pytest
from aiokafka import ConsumerRecord, TopicPartition

from schemas import Completed, ErrorCode, Failed, Job, SamplingSpec, decode_result, encode
from tests.fakes import ScriptedEngine
from worker.answering.answers import AnswerBuilder
from worker.answering.records import Outcome, OutRecord, RecordKind
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import settings_from
from worker.core.limits import RecordLimits
from worker.core.metrics import Metrics
from worker.engines.mock import MockEngineSettings

TP = TopicPartition("jobs", 0)
RESULTS, DLQ = "results", "dlq"


def builder(topic_bytes: dict[str, int | None] | None = None, **engine: Any) -> AnswerBuilder:
    settings = settings_from(
        {"results_topic": RESULTS, "dead_letter_topic": DLQ, "engine": "mock", "worker_id": "w"}, {}
    )
    limits = RecordLimits.from_topic_limits(settings, topic_bytes or {})
    scripted = ScriptedEngine(MockEngineSettings(**engine) if engine else None)
    return AnswerBuilder(settings, scripted, limits, Metrics(), clock=SYSTEM_CLOCK)


def record(value: bytes | None, key: bytes | None = b"k", offset: int = 7) -> ConsumerRecord:
    return ConsumerRecord(
        "jobs", 0, offset, 0, 0, key, value, None, len(key or b""), len(value or b""), ()
    )


def value_of(out: OutRecord) -> bytes:
    assert out.value is not None
    return out.value


def job(**kwargs: Any) -> bytes:
    kwargs.setdefault("sampling", SamplingSpec(max_tokens=4))
    return encode(Job(job_id="j", prompt="hello", **kwargs))


def incompressible_metadata(total_bytes: int) -> dict[str, str]:
    """Metadata within the schema's limits that no codec shrinks (random hex)."""
    per_entry = 8_000  # the schema allows 8192 chars a value, 64 entries
    return {f"m{i}": os.urandom(per_entry // 2).hex() for i in range(total_bytes // per_entry + 1)}


async def test_a_completed_job_is_one_result_record_keyed_by_job_id():
    answer = await builder().answer(TP, record(job()))
    assert answer.outcome is Outcome.COMPLETED and answer.code is None
    (out,) = answer.records
    assert (out.kind, out.topic, out.key) == (RecordKind.RESULT, RESULTS, b"j")
    assert isinstance(decode_result(value_of(out)), Completed)
    assert answer.metric_labels() == (("completed", ""),)


async def test_an_unreadable_record_is_dead_lettered_and_a_readable_id_is_answered_too():
    only_copy = await builder().answer(TP, record(b"not json"))
    assert only_copy.outcome is Outcome.DEAD_LETTERED
    assert [r.kind for r in only_copy.records] == [RecordKind.DEAD_LETTER]
    headers = dict(only_copy.records[0].headers)
    assert headers["vkw.source.offset"] == b"7" and headers["vkw.error.code"] == b"invalid_job"
    both = await builder().answer(TP, record(b'{"job_id": "x", "prompt": 5}'))
    assert [r.kind for r in both.records] == [RecordKind.DEAD_LETTER, RecordKind.RESULT]
    assert both.metric_labels() == (("dead_lettered", "invalid_job"), ("failed", "invalid_job"))


async def test_too_large_result_with_huge_metadata_falls_back_to_a_minimal_failed_answer():
    limit = 64 * 1024
    b = builder({RESULTS: limit}, num_layers=48, top_k=8, num_experts=128)
    value = job(
        metadata=incompressible_metadata(120_000),
        return_routed_experts=True,
        sampling=SamplingSpec(max_tokens=500),
    )
    answer = await b.answer(TP, record(value))
    (out,) = answer.records
    assert out.size <= limit and out.minimal
    failed = decode_result(value_of(out))
    assert isinstance(failed, Failed)
    assert failed.error.code == ErrorCode.RESULT_TOO_LARGE
    assert failed.metadata == {}
    assert f"{RESULTS}'s max.message.bytes ({limit})" in failed.error.detail


async def test_a_failed_answer_keeps_its_metadata_when_it_fits():
    b = builder({RESULTS: 64 * 1024}, num_layers=48, top_k=8, num_experts=128)
    value = job(
        metadata={"step": "3"}, return_routed_experts=True, sampling=SamplingSpec(max_tokens=500)
    )
    answer = await b.answer(TP, record(value))
    failed = decode_result(value_of(answer.records[0]))
    assert isinstance(failed, Failed)
    assert failed.error.code == ErrorCode.RESULT_TOO_LARGE and failed.metadata == {"step": "3"}
    assert not answer.records[0].minimal


async def test_a_dead_letter_copy_over_the_topics_limit_goes_without_its_value():
    b = builder({DLQ: 10_000})
    answer = await b.answer(TP, record(b"x" * 50_000, key=None))
    (copy,) = answer.records
    assert copy.value is None and copy.size <= 10_000
    assert dict(copy.headers)["vkw.value.dropped"] == b"50000"


@pytest.mark.parametrize(("kind", "steps"), [(RecordKind.RESULT, 1), (RecordKind.DEAD_LETTER, 2)])
async def test_smaller_shrinks_a_refused_record_to_the_minimal_one_then_gives_up(kind, steps):
    b = builder()
    value = job(metadata={"k": "v" * 1000}) if kind is RecordKind.RESULT else b"bad" * 100
    answer = await b.answer(TP, record(value))
    index = next(i for i, r in enumerate(answer.records) if r.kind is kind)
    sizes = [answer.records[index].size]
    for _ in range(steps):
        smaller = b.smaller(answer, index, "the broker (RecordTooLarge)")
        assert smaller is not None
        answer = smaller
        sizes.append(answer.records[index].size)
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]
    assert answer.records[index].minimal
    assert b.smaller(answer, index, "the broker") is None
    if kind is RecordKind.RESULT:
        failed = decode_result(value_of(answer.records[index]))
        assert isinstance(failed, Failed) and failed.error.code == ErrorCode.RESULT_TOO_LARGE
        assert "the broker (RecordTooLarge) refused it" in failed.error.detail
        assert answer.outcome is Outcome.FAILED
    else:
        assert answer.records[index].value is None
        assert {k for k, _ in answer.records[index].headers} <= {
            "vkw.error.code",
            "vkw.error.detail",
            "vkw.source.topic",
            "vkw.source.partition",
            "vkw.source.offset",
            "vkw.value.dropped",
        }


async def test_every_answer_of_a_job_echoes_its_submission_and_none_without_one():
    completed = await builder().answer(TP, record(job(submission_id="s-1")))
    b = builder({RESULTS: 64 * 1024}, num_layers=48, top_k=8, num_experts=128)
    failed = await b.answer(
        TP,
        record(
            job(
                submission_id="s-2",
                return_routed_experts=True,
                sampling=SamplingSpec(max_tokens=500),
            )
        ),
    )
    unnamed = await builder().answer(TP, record(job()))

    assert decode_result(value_of(completed.records[0])).submission_id == "s-1"
    failure = decode_result(value_of(failed.records[0]))
    assert isinstance(failure, Failed) and failure.submission_id == "s-2"
    assert b"submission_id" not in value_of(unnamed.records[0])  # as before submissions
