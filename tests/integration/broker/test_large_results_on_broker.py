"""Results of any size on a real broker: split by completion and payload references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from schemas import (
    Completed,
    ErrorCode,
    Failed,
    Job,
    Part,
    PayloadError,
    SamplingSpec,
    decode_result,
)
from tests.fakes import ScriptedEngine
from worker.core.config import MiB
from worker.dev.harness.clients import assembled, collect, committed_is, job_record, produce
from worker.dev.harness.topics import make_topics
from worker.dev.harness.waiting import wait_for
from worker.engines.mock import MockEngineSettings

pytestmark = pytest.mark.broker

ONE_MIB = {"max.message.bytes": str(1 * MiB)}
QWEN3_30B = MockEngineSettings(num_layers=48, top_k=8, num_experts=128)


def group_job(job_id: str, n: int, tokens: int) -> Job:
    return Job(
        job_id=job_id,
        prompt_token_ids=[11, 12, 13, 14, 15],
        sampling=SamplingSpec(n=n, max_tokens=tokens, seed=3),
        return_routed_experts=True,
        routed_experts_prompt_start=5,
        metadata={"step": "4"},
    )


def part_of(result: Completed | Failed) -> Part:
    assert isinstance(result, Completed) and isinstance(result.part, Part), result
    return result.part


def without_timings(result: Completed | Failed) -> Completed:
    assert isinstance(result, Completed)
    return msgspec.structs.replace(result, timings=None, worker="")


@pytest.mark.parametrize(
    "case",
    [
        # 1536 tokens: a completion is 0.75 MiB of base64 routing, so 16 of them need 16 parts.
        (1536, False),
        # 2048 tokens: 2047 rows x 384 B is 1 MiB of base64 on its own, which no 1 MiB record
        # holds with its tokens: every completion's routing goes to the store.
        (2048, True),
    ],
)
async def test_a_grpo_group_over_a_1_mib_topic_arrives_whole_and_equal_to_one_record(
    kafka_bootstrap_servers, new_topic, start_worker, tmp_path, case
):
    tokens, store = case
    bs = kafka_bootstrap_servers
    small = await make_topics(new_topic, results_configs=ONE_MIB)
    roomy = await make_topics(new_topic, results_configs={"max.message.bytes": str(64 * MiB)})
    job = group_job("group", 16, tokens)
    for topics in (small, roomy):
        await produce(bs, topics.jobs, [job_record(job)])
    options: dict[str, Any] = {"compression_type": "none"}
    if store:
        options["payload_store"] = (tmp_path / "store").as_uri()
    split_run = await start_worker(small, ScriptedEngine(QWEN3_30B), **options)
    whole_run = await start_worker(
        roomy, ScriptedEngine(QWEN3_30B), max_result_bytes=64 * MiB, compression_type="none"
    )
    got, records = await assembled(bs, small.results, 1)
    (one,) = await collect(bs, roomy.results, 1, timeout_s=60)
    # The broker took each record under its 1 MiB limit (uncompressed, so it checked them all).
    assert all(len(r.value) + len(r.key) <= 1 * MiB and r.key == b"group" for r in records)
    if store:
        # With every completion's routing by reference, the rest fits one record: no parts.
        assert len(records) == 1 and not decode_result(records[0].value).is_part  # type: ignore[union-attr]
    else:
        assert len(records) == 16
        assert len({r.partition for r in records}) == 1
        labels = [part_of(decode_result(r.value)) for r in records]
        assert sorted(p.index for p in labels) == list(range(16))
    expected = decode_result(one.value)
    result = got["group"]
    assert isinstance(result, Completed) and isinstance(expected, Completed)
    assert len(result.completions) == 16
    if not store:
        assert result.completions == expected.completions
        assert without_timings(result) == without_timings(expected)
    else:
        for mine, theirs in zip(result.completions, expected.completions, strict=True):
            assert mine.routed_experts is not None and theirs.routed_experts is not None
            assert mine.routed_experts.is_reference
            np.testing.assert_array_equal(
                mine.routed_experts.to_array(), theirs.routed_experts.to_array()
            )
            assert msgspec.structs.replace(mine, routed_experts=None) == msgspec.structs.replace(
                theirs, routed_experts=None
            )
    await wait_for(lambda: committed_is(bs, small, {0: 1}), what="commit after every part")
    assert await split_run.stop() == 0
    assert await whole_run.stop() == 0


async def test_a_long_completion_goes_by_reference_and_a_broken_store_is_retryable(
    kafka_bootstrap_servers, new_topic, start_worker, tmp_path
):
    bs = kafka_bootstrap_servers
    topics = await make_topics(new_topic, results_configs=ONE_MIB)
    store = tmp_path / "store"
    # An 8k-token completion of a 48-layer top-8 model: 3 MiB of routing, raw.
    await produce(bs, topics.jobs, [job_record(group_job("long", 1, 8192))])
    run = await start_worker(topics, ScriptedEngine(QWEN3_30B), payload_store=store.as_uri())
    got, records = await assembled(bs, topics.results, 1)
    assert len(records) == 1 and len(records[0].value) <= 1 * MiB
    result = got["long"]
    assert isinstance(result, Completed) and not result.is_part
    routed = result.completions[0].routed_experts
    assert routed is not None and routed.is_reference
    # vLLM's row rule: the 5 prompt rows are trimmed (start 5) and the last token has none.
    assert routed.nbytes == 8191 * 48 * 8 and routed.shape == [8191, 48, 8]
    array = routed.to_array()  # resolves and verifies sha256
    assert array.shape == (8191, 48, 8) and (array[:, :, 0] != array[:, :, 1]).all()
    assert isinstance(routed.uri, str)
    path = Path(routed.uri.removeprefix("file://"))
    original = path.read_bytes()
    path.write_bytes(original[:100] + bytes([original[100] ^ 0xFF]) + original[101:])
    with pytest.raises(PayloadError, match="was altered"):
        routed.to_array()
    path.unlink()
    with pytest.raises(PayloadError, match="is missing"):
        routed.to_array()
    assert await run.stop() == 0

    # The same job against a store that cannot be written (its directory is a file): a
    # retryable failed answer naming the store, and the worker goes on serving.
    broken = tmp_path / "broken"
    broken.write_bytes(b"not a directory")
    topics = await make_topics(new_topic, results_configs=ONE_MIB)
    await produce(
        bs,
        topics.jobs,
        [job_record(group_job("long", 1, 8192)), job_record(group_job("next", 2, 16))],
    )
    run = await start_worker(topics, ScriptedEngine(QWEN3_30B), payload_store=broken.as_uri())
    got, _ = await assembled(bs, topics.results, 2)
    failed = got["long"]
    assert isinstance(failed, Failed)
    assert failed.error.code is ErrorCode.RESULT_TOO_LARGE and failed.error.retryable
    assert broken.as_uri() in failed.error.detail
    assert isinstance(got["next"], Completed)
    await wait_for(lambda: committed_is(bs, topics, {0: 2}), what="both answered and committed")
    assert await run.stop() == 0
