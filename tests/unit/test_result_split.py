"""Splitting by completion and the payload store, through the answer builder (scripted engine)."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from aiokafka import ConsumerRecord, TopicPartition

from schemas import (
    Completed,
    ErrorCode,
    Failed,
    Job,
    Part,
    PayloadError,
    ResultAssembler,
    SamplingSpec,
    decode_result,
    encode,
)
from tests.fakes import ScriptedEngine
from worker.answering.answers import AnswerBuilder
from worker.answering.payload_store import FilePayloadStore, open_payload_store, parse_duration
from worker.answering.records import Outcome
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import MiB, settings_from
from worker.core.errors import ConfigError
from worker.core.limits import RecordLimits, record_bytes
from worker.core.metrics import Metrics
from worker.engines.mock import MockEngineSettings

TP = TopicPartition("jobs", 0)
RESULTS = "results"


def builder(
    topic_limit: int | None, store: Path | None = None, **overrides: Any
) -> tuple[AnswerBuilder, Metrics]:
    values: dict[str, Any] = {
        "results_topic": RESULTS,
        "engine": "mock",
        "worker_id": "w",
        **overrides,
    }
    if store is not None:
        values["payload_store"] = store.as_uri()
    settings = settings_from(values, {})
    limits = RecordLimits.from_topic_limits(settings, {RESULTS: topic_limit})
    metrics = Metrics()
    engine = ScriptedEngine(MockEngineSettings(num_layers=48, top_k=8, num_experts=128))
    return AnswerBuilder(settings, engine, limits, metrics, clock=SYSTEM_CLOCK), metrics


def record(job: Job, offset: int = 3) -> ConsumerRecord:
    value = encode(job)
    return ConsumerRecord("jobs", 0, offset, 0, 0, b"k", value, None, 1, len(value), ())


def group_job(n: int, tokens: int, job_id: str = "g") -> Job:
    return Job(
        job_id=job_id,
        prompt_token_ids=[1, 2, 3, 4],
        sampling=SamplingSpec(n=n, max_tokens=tokens, seed=5),
        return_routed_experts=True,
        routed_experts_prompt_start=3,
        metadata={"step": "7"},
    )


async def test_a_result_that_fits_is_one_record_without_part_exactly_as_before():
    unlimited, _ = builder(None)
    answer = await unlimited.answer(TP, record(group_job(4, 64)))
    (out,) = answer.records
    assert out.value is not None and b'"part"' not in out.value
    result = decode_result(out.value)
    assert isinstance(result, Completed) and not result.is_part
    assert encode(result) == out.value  # the worker's fast encoding is schemas' encoding


async def test_a_group_over_the_topics_limit_splits_into_parts_that_each_fit():
    limit = 1 * MiB
    split, metrics = builder(limit)
    whole, _ = builder(None)
    job = group_job(16, 1536)
    answer = await split.answer(TP, record(job))
    reference = await whole.answer(TP, record(job))
    assert answer.outcome is Outcome.COMPLETED
    assert len(answer.records) > 1
    assert all(out.size <= limit and out.key == b"g" for out in answer.records)
    parts = [decode_result(out.value or b"") for out in answer.records]
    assert all(isinstance(p, Completed) and p.is_part for p in parts)
    labels = [p.part for p in parts if isinstance(p, Completed) and isinstance(p.part, Part)]
    assert len({label.attempt for label in labels}) == 1
    indexes = [label.index for label in labels]
    assert indexes == list(range(len(parts)))
    assembled = ResultAssembler().add_all(parts)
    (expected,) = [decode_result(out.value or b"") for out in reference.records]
    assert len(assembled) == 1
    got = assembled[0]
    assert isinstance(got, Completed) and isinstance(expected, Completed)
    # Completion by completion, what one record would have held (timings are per run).
    assert got.completions == expected.completions
    assert msgspec.structs.replace(got, timings=None) == msgspec.structs.replace(
        expected, timings=None
    )
    assert metrics.result_parts.values[()] == len(parts)


async def test_parts_are_byte_for_byte_schemas_encoding():
    split, _ = builder(256 * 1024)
    answer = await split.answer(TP, record(group_job(6, 300)))
    assert len(answer.records) > 1
    for out in answer.records:
        assert out.value is not None
        assert encode(decode_result(out.value)) == out.value


async def test_a_completion_too_large_alone_without_a_store_is_refused_naming_the_option():
    split, _ = builder(1 * MiB)
    answer = await split.answer(TP, record(group_job(1, 8192)))
    (out,) = answer.records
    failed = decode_result(out.value or b"")
    assert isinstance(failed, Failed)
    assert failed.error.code is ErrorCode.RESULT_TOO_LARGE and not failed.error.retryable
    assert "--payload-store" in failed.error.detail
    assert "max.message.bytes" in failed.error.detail


async def test_a_completion_too_large_alone_goes_to_the_store_by_reference(tmp_path: Path):
    store = tmp_path / "payloads"
    split, metrics = builder(1 * MiB, store)
    whole, _ = builder(None)
    job = group_job(1, 8192)
    answer = await split.answer(TP, record(job))
    (out,) = answer.records
    assert out.size <= 1 * MiB
    result = decode_result(out.value or b"")
    assert isinstance(result, Completed) and not result.is_part
    routed = result.completions[0].routed_experts
    assert routed is not None and routed.is_reference and routed.data == b""
    assert isinstance(routed.uri, str) and routed.uri.startswith(store.as_uri())
    (expected_out,) = (await whole.answer(TP, record(job))).records
    expected = decode_result(expected_out.value or b"")
    assert isinstance(expected, Completed)
    expected_routed = expected.completions[0].routed_experts
    assert expected_routed is not None
    # Rows follow vLLM's rule: prompt (4) + tokens - 1 - start (3); 3 MiB raw.
    assert routed.nbytes == len(expected_routed.data) == (4 + 8192 - 1 - 3) * 48 * 8
    np.testing.assert_array_equal(routed.to_array(), expected_routed.to_array())
    assert (routed.shape, routed.dtype, routed.start) == (
        expected_routed.shape,
        expected_routed.dtype,
        expected_routed.start,
    )
    assert metrics.payload_bytes.values[()] == routed.nbytes
    # Nothing but the finished payload is left in the store (no temporary file).
    assert [p.name for p in store.iterdir()] == [Path(routed.uri).name]


async def test_a_tampered_or_missing_payload_is_a_clear_error(tmp_path: Path):
    split, _ = builder(1 * MiB, tmp_path)
    (out,) = (await split.answer(TP, record(group_job(1, 8192)))).records
    result = decode_result(out.value or b"")
    assert isinstance(result, Completed)
    routed = result.completions[0].routed_experts
    assert routed is not None and isinstance(routed.uri, str)
    (path,) = tmp_path.iterdir()
    original = path.read_bytes()
    path.write_bytes(bytes([original[0] ^ 1]) + original[1:])
    with pytest.raises(PayloadError, match="altered: its sha256 is"):
        routed.to_array()
    path.write_bytes(original[:-1])
    with pytest.raises(PayloadError, match="altered: its size is not the record's"):
        routed.to_array()
    path.unlink()
    with pytest.raises(PayloadError, match="is missing"):
        routed.to_array()


async def test_a_full_store_answers_failed_retryable_naming_the_store(tmp_path: Path):
    """A file-size limit makes the store's writes fail as a full disk does (for root too)."""
    store = tmp_path / "full"
    split, _ = builder(1 * MiB, store)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 * MiB, previous_limit[1]))
    try:
        answer = await split.answer(TP, record(group_job(1, 8192)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
        signal.signal(signal.SIGXFSZ, previous_handler)
    (out,) = answer.records
    failed = decode_result(out.value or b"")
    assert isinstance(failed, Failed)
    assert failed.error.retryable is True
    assert failed.error.code is ErrorCode.RESULT_TOO_LARGE
    assert store.as_uri() in failed.error.detail and "File too large" in failed.error.detail
    assert list(store.iterdir()) == []  # the partial temporary file is gone


async def test_a_store_that_is_a_file_answers_failed_retryable(tmp_path: Path):
    # Unwritable for root too: the store's directory path is an existing file.
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")
    split, _ = builder(1 * MiB, blocker)
    (out,) = (await split.answer(TP, record(group_job(1, 8192)))).records
    failed = decode_result(out.value or b"")
    assert isinstance(failed, Failed) and failed.error.retryable
    assert blocker.as_uri() in failed.error.detail


async def test_max_result_bytes_alone_also_splits():
    split, _ = builder(None, max_result_bytes=256 * 1024)
    answer = await split.answer(TP, record(group_job(8, 300)))
    assert len(answer.records) > 1
    assert all(len(out.value or b"") <= 256 * 1024 for out in answer.records)


def test_store_gc_removes_only_old_payloads_and_temporaries(tmp_path: Path):
    store = FilePayloadStore(tmp_path)
    old_uri, _ = store.put("ab12", 0, b"old")
    new_uri, _ = store.put("ab12", 1, b"new")
    orphan = tmp_path / ".vkw-ab12-c2-0000000000000000.bin.123.tmp"
    orphan.write_bytes(b"half")
    unrelated = tmp_path / "checkpoint.safetensors"
    unrelated.write_bytes(b"keep me")
    hour_ago = tmp_path.stat().st_mtime - 3600
    for path in (Path(old_uri.removeprefix("file://")), orphan, unrelated):
        os.utime(path, (hour_ago, hour_ago))
    removed, freed = store.gc(older_than_s=600)
    assert (removed, freed) == (2, len(b"old") + len(b"half"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(new_uri).name, "checkpoint.safetensors"]
    )


def test_store_uris_and_durations_refuse_bad_input():
    with pytest.raises(ConfigError, match="only file:///"):
        open_payload_store("s3://bucket/x")
    with pytest.raises(ConfigError, match="not a host"):
        open_payload_store("file://host/dir")
    assert parse_duration("90s") == 90 and parse_duration("2h") == 7200
    assert parse_duration("1.5d") == 1.5 * 86400
    for bad in ("", "10", "h", "-1h", "3w"):
        with pytest.raises(ConfigError, match="duration"):
            parse_duration(bad)


def test_record_budget_includes_the_framing():
    # The budget leaves room for the key and batch framing around the value.
    assert record_bytes(b"g", b"x" * 100, []) > 100
