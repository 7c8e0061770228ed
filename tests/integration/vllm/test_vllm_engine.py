"""The vLLM engine on the tiny MoE model: routed experts through a real Worker, checked against HF.

The run's capture engine (tests/integration/vllm/conftest.py) serves the whole module: importing
vLLM and starting one costs 35-70 s here.
Capture on CPU runs Model Runner V2's Triton kernels in Triton's interpreter through the
test-support backend in tests/support/triton_cpu_backend, which is why the engine runs eager and
generations stay short.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pytest

from schemas import Completed, Failed, Job, SamplingSpec, WeightReload, decode_result, encode
from tests.vllm_support import CAPTURE_ENV
from worker.build import build_worker
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import settings_from
from worker.core.errors import (
    ConfigError,
    EngineDeadError,
    EngineError,
    InvalidJobError,
    WeightsLostError,
    WeightUpdateError,
)
from worker.dev.harness.clients import assembled, collect, job_record, produce
from worker.dev.harness.waiting import wait_generating
from worker.dev.tiny_model import TINY_MODEL_SPEC, tiny_model_engine_args
from worker.engines.protocol import EngineOutput
from worker.engines.vllm_engine import (
    MoeLayout,
    VllmEngine,
    _sampling_params,
    build_vllm_engine,
    check_capture,
    moe_layout,
)

pytestmark = [
    pytest.mark.vllm,
    # The capture engine lives on the session's event loop.
    pytest.mark.asyncio(loop_scope="session"),
    # Importing vLLM imports torch._inductor, which decorates a class with the deprecated
    # torch.jit.script_method (torch/utils/mkldnn.py); nothing here calls it.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

SPEC: Final = TINY_MODEL_SPEC
LAYOUT: Final = MoeLayout(
    num_layers=SPEC.num_layers,
    top_k=SPEC.top_k,
    num_experts=SPEC.num_experts,
    moe_layers=SPEC.moe_layers,
)
PROMPT: Final = [17, 301, 45, 220, 98, 411, 7, 150, 333, 64, 250, 12]


def engine_args(model_dir: Path, *extra: str) -> list[str]:
    return [*tiny_model_engine_args(model_dir), *extra]


@pytest.fixture
def model_dir(tiny_model: Path) -> Path:
    return tiny_model


@pytest.fixture
def engine(capture_engine: VllmEngine) -> VllmEngine:
    return capture_engine


def greedy_job(job_id: str, max_tokens: int, **kwargs: Any) -> Job:
    sampling = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    kwargs.setdefault("prompt_token_ids", list(PROMPT))
    return Job(job_id=job_id, sampling=sampling, return_routed_experts=True, **kwargs)


def decode_routed(record: dict[str, Any]) -> npt.NDArray[np.integer]:
    """The trainer's decoder, written without `schemas`: base64 + np.frombuffer + reshape."""
    raw = base64.b64decode(record["data"])
    return np.frombuffer(raw, dtype=np.dtype(record["dtype"])).reshape(record["shape"])


def routed(output: EngineOutput, index: int = 0) -> npt.NDArray[np.integer]:
    experts = output.completions[index].routed_experts
    assert experts is not None
    return experts.to_array()


def assert_real_routing(experts: npt.NDArray[np.integer]) -> None:
    """Dense layer all zeros, as vLLM gives it; MoE layers: distinct ids in [0, num_experts)."""
    assert experts.dtype == np.uint8
    assert experts.shape[1:] == (SPEC.num_layers, SPEC.top_k)
    for layer in SPEC.dense_layers:
        assert not experts[:, layer].any()
    moe = experts[:, list(SPEC.moe_layers)]
    assert moe.max() < SPEC.num_experts
    assert (moe[..., 0] != moe[..., 1]).all()


async def serve_jobs(
    engine: VllmEngine,
    bs: str,
    new_topic: Any,
    jobs: list[Job],
    results_configs: dict[str, str] | None = None,
    **overrides: Any,
) -> tuple[dict[str, Completed | Failed], list[Any]]:
    """Produce the jobs, serve them with a real Worker (`overrides` its settings); the
    results, reassembled, by id, and every record of the results topic."""
    jobs_topic, dlq_topic = await new_topic(), await new_topic()
    results_topic = await new_topic(configs=results_configs)
    await produce(bs, jobs_topic, [job_record(j) for j in jobs])
    settings = settings_from(
        {
            "bootstrap_servers": bs,
            "jobs_topic": jobs_topic,
            "results_topic": results_topic,
            "dead_letter_topic": dlq_topic,
            "group_id": f"group-{uuid.uuid4().hex[:8]}",
            "commit_interval_ms": 0,
            "poll_timeout_ms": 50,
            **overrides,
        },
        {},
    )
    worker = await build_worker(settings, engine, steered=False, owns_engine=False)
    task = asyncio.create_task(worker.run())
    try:
        return await assembled(bs, results_topic, len(jobs), timeout_s=120)
    finally:
        worker.request_stop()
        assert await asyncio.wait_for(task, 60) == 0


async def run_through_worker(
    engine: VllmEngine, bs: str, new_topic: Any, jobs: list[Job]
) -> dict[str, dict[str, Any]]:
    """The jobs' results through a real Worker, as plain JSON by id."""
    whole, _ = await serve_jobs(engine, bs, new_topic, jobs)
    # As plain JSON, as a trainer without `schemas` reads it (parts reassembled).
    return {job_id: json.loads(encode(result)) for job_id, result in whole.items()}


# ---- the engine as the worker runs it ------------------------------------------------------


async def test_engine_reports_the_models_shape_and_verified_capture(engine, model_dir):
    assert engine.supports_routed_experts
    assert engine.max_concurrency == 8
    assert engine.model_name == str(model_dir)


@pytest.mark.broker
async def test_jobs_through_worker_and_broker_return_vllms_rows_for_each_start(
    engine, kafka_bootstrap_servers, new_topic
):
    bs = kafka_bootstrap_servers
    prompt_len = len(PROMPT)
    middle = prompt_len // 2
    jobs = [
        greedy_job("start-0", 3),
        greedy_job("start-mid", 3, routed_experts_prompt_start=middle),
        greedy_job("start-end", 3, routed_experts_prompt_start=prompt_len),
        greedy_job("beyond", 3, routed_experts_prompt_start=prompt_len + 1),
        Job(
            job_id="text",
            prompt="Kafka keeps records in partitions",
            sampling=SamplingSpec(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0),
            return_routed_experts=True,
        ),
        Job(job_id="plain", prompt_token_ids=list(PROMPT), sampling=SamplingSpec(max_tokens=2)),
        *(
            Job(
                job_id=f"n2-{i}",
                prompt_token_ids=list(PROMPT),
                sampling=SamplingSpec(n=2, max_tokens=3, seed=i, ignore_eos=True),
                return_routed_experts=True,
            )
            for i in range(3)
        ),
    ]
    results = await run_through_worker(engine, bs, new_topic, jobs)
    assert set(results) == {j.job_id for j in jobs}

    def completed(job_id: str) -> dict[str, Any]:
        result = results[job_id]
        assert result["type"] == "completed", result
        return result

    experts: dict[str, npt.NDArray[np.integer]] = {}
    for job_id, start in (("start-0", 0), ("start-mid", middle), ("start-end", prompt_len)):
        result = completed(job_id)
        assert result["prompt_token_count"] == prompt_len
        (completion,) = result["completions"]
        assert len(completion["token_ids"]) == 3
        record = completion["routed_experts"]
        assert record["start"] == start
        experts[job_id] = decode_routed(record)
        assert experts[job_id].shape[0] == prompt_len + 3 - 1 - start
        assert_real_routing(experts[job_id])
    # Greedy runs of one prompt route identically: a later start is a suffix of the full rows.
    np.testing.assert_array_equal(experts["start-mid"], experts["start-0"][middle:])
    np.testing.assert_array_equal(experts["start-end"], experts["start-0"][prompt_len:])

    beyond = results["beyond"]
    assert beyond["type"] == "failed"
    assert beyond["error"]["code"] == "invalid_job"
    assert not beyond["error"]["retryable"]
    assert (
        "routed_experts_prompt_start must be between 0 and the prompt length (12)"
        in (beyond["error"]["detail"])
    )

    text = completed("text")
    (completion,) = text["completions"]
    prompt_ids = text["prompt_token_ids"]
    assert prompt_ids and len(prompt_ids) == text["prompt_token_count"]
    text_experts = decode_routed(completion["routed_experts"])
    assert text_experts.shape[0] == len(prompt_ids) + len(completion["token_ids"]) - 1
    assert_real_routing(text_experts)
    assert len(completion["logprobs"]) == len(completion["token_ids"]) == 3
    assert all(lp is not None and lp <= 0 for lp in completion["logprobs"])
    assert completion["cumulative_logprob"] == pytest.approx(sum(completion["logprobs"]), abs=1e-3)

    plain = completed("plain")
    assert plain["completions"][0].get("routed_experts") is None
    assert plain["prompt_token_ids"] is None  # token prompts are not echoed back

    for i in range(3):
        result = completed(f"n2-{i}")
        assert [c["index"] for c in result["completions"]] == [0, 1]
        for completion in result["completions"]:
            child = decode_routed(completion["routed_experts"])
            assert child.shape[0] == prompt_len + len(completion["token_ids"]) - 1
            assert_real_routing(child)
            # Each child's own rows: its generated tokens' routing, beyond the shared prompt.
            np.testing.assert_array_equal(child[:prompt_len], experts["start-0"][:prompt_len])


async def test_n2_returns_every_child_with_its_own_routed_experts_each_time(engine):
    # NOTES §2: with a warm prefix cache the two children often start a step apart.
    for attempt in range(3):
        job = Job(
            job_id=f"n2-direct-{attempt}",
            prompt_token_ids=list(PROMPT),
            sampling=SamplingSpec(
                n=2, max_tokens=4, temperature=1.0, seed=attempt, ignore_eos=True
            ),
            return_routed_experts=True,
        )
        output = await engine.generate(job, job.job_id)
        assert [c.index for c in output.completions] == [0, 1]
        for completion in output.completions:
            assert len(completion.token_ids) == 4
            experts = routed(output, completion.index)
            assert experts.shape == (len(PROMPT) + 4 - 1, SPEC.num_layers, SPEC.top_k)
            assert_real_routing(experts)


@pytest.mark.broker
async def test_an_n4_result_forced_to_split_reassembles_to_what_one_record_holds(
    engine, kafka_bootstrap_servers, new_topic
):
    """A 5000-byte results topic forces the 4 completions of one job (about 3 KB each, with
    logprobs and routing) into parts; reassembled, they equal the engine's own output for the
    same seed."""
    bs = kafka_bootstrap_servers
    job = Job(
        job_id="split-n4",
        prompt_token_ids=list(PROMPT),
        sampling=SamplingSpec(n=4, max_tokens=48, seed=7, ignore_eos=True, logprobs=0),
        return_routed_experts=True,
        routed_experts_prompt_start=4,
    )
    direct = await engine.generate(job, "split-n4-direct")
    whole, records = await serve_jobs(
        engine,
        bs,
        new_topic,
        [job],
        results_configs={"max.message.bytes": "5000"},
        compression_type="none",
    )
    assert len(records) >= 2, "the result should not have fitted one 5000-byte record"
    assert all(len(r.value) <= 5000 for r in records)
    parts = [decode_result(r.value) for r in records]
    assert all(isinstance(p, Completed) and p.is_part for p in parts)
    result = whole["split-n4"]
    assert isinstance(result, Completed) and not result.is_part
    assert result.completions == direct.completions
    for completion in result.completions:
        experts = completion.routed_experts
        assert experts is not None and experts.start == 4
        assert experts.shape[0] == len(PROMPT) + 48 - 1 - 4
        assert_real_routing(experts.to_array())


async def test_stop_string_and_max_tokens_1_follow_vllms_row_rule(engine):
    full = await engine.generate(greedy_job("full", 8), "full")
    tokens = full.completions[0].token_ids
    text = full.completions[0].text
    one = await engine.generate(greedy_job("max1", 1), "max1")
    # A short stop string that first appears after the first token's text.
    stop = next(
        text[i : i + 2]
        for i in range(len(one.completions[0].text), len(text) - 1)
        if text[i : i + 2].isalnum() and text.find(text[i : i + 2]) == i
    )
    job = Job(
        job_id="stop",
        prompt_token_ids=list(PROMPT),
        sampling=SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True, stop=stop),
        return_routed_experts=True,
    )
    stopped = (await engine.generate(job, "stop")).completions[0]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    assert 1 <= len(stopped.token_ids) < len(tokens)
    assert stopped.token_ids == tokens[: len(stopped.token_ids)]
    assert stopped.routed_experts is not None
    assert stopped.routed_experts.rows == len(PROMPT) + len(stopped.token_ids) - 1

    (completion,) = one.completions
    assert completion.token_ids == tokens[:1]
    assert completion.finish_reason == "length"
    # The only generated token is never fed forward: rows cover the prompt alone.
    np.testing.assert_array_equal(routed(one), routed(full)[: len(PROMPT)])


async def test_multi_turn_rows_concatenate_to_a_fresh_full_run(engine):
    turn1 = await engine.generate(greedy_job("turn-1", 4), "turn-1")
    out1 = turn1.completions[0].token_ids
    user2 = [88, 199, 5]
    history = [*PROMPT, *out1]
    turn2_job = greedy_job(
        "turn-2",
        4,
        prompt_token_ids=[*history, *user2],
        routed_experts_prompt_start=len(history) - 1,
    )
    turn2 = await engine.generate(turn2_job, "turn-2")
    fresh = await engine.generate(
        greedy_job("fresh", 4, prompt_token_ids=[*history, *user2]), "fresh"
    )
    assert turn2.completions[0].token_ids == fresh.completions[0].token_ids
    stitched = np.concatenate([routed(turn1), routed(turn2)])
    np.testing.assert_array_equal(stitched, routed(fresh))
    assert stitched.shape[0] == len(history) + len(user2) + 4 - 1


async def test_captured_ids_equal_hf_router_top_k_for_every_token_and_layer(engine, model_dir):
    from tests.hf_reference import hf_reference  # noqa: PLC0415 - imports torch and transformers

    output = await engine.generate(greedy_job("hf", 8), "hf")
    tokens = output.completions[0].token_ids
    experts = routed(output)
    # Rows are every position that was fed forward: the prompt and all tokens but the last.
    fed = [*PROMPT, *tokens[:-1]]
    reference = await asyncio.to_thread(
        hf_reference, model_dir, fed, SPEC.moe_layers, SPEC.num_layers, SPEC.top_k
    )
    assert experts.shape == reference.experts.shape
    np.testing.assert_array_equal(experts.astype(np.int64), reference.experts)
    # Same weights, same fp32 maths: greedy decoding agrees with HF token for token.
    assert tokens == reference.greedy[len(PROMPT) - 1 :]


async def test_cancelling_generate_and_abort_both_stop_the_request(engine):
    long_job = Job(
        job_id="long",
        prompt_token_ids=list(PROMPT),
        sampling=SamplingSpec(max_tokens=400, ignore_eos=True),
    )
    task = asyncio.create_task(engine.generate(long_job, "long-cancelled"))
    await wait_generating(engine)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    task = asyncio.create_task(engine.generate(long_job, "long-aborted"))
    await wait_generating(engine)
    await engine.abort("long-aborted")
    with pytest.raises(EngineError, match="aborted") as caught:
        await asyncio.wait_for(task, 10)
    assert caught.value.retryable
    await engine.abort("long-aborted")  # already finished: a no-op
    await engine.check_health()
    # The engine keeps serving after both.
    after = await engine.generate(greedy_job("after-abort", 1), "after-abort")
    assert len(after.completions[0].token_ids) == 1


async def test_a_jobs_trace_headers_reach_vllms_generate_and_its_request(engine, monkeypatch):
    """The job's W3C context goes to `AsyncLLM.generate(trace_headers=...)` (vLLM 0.32,
    `v1/engine/async_llm.py`), which hands it to `add_request`: with `--otlp-traces-endpoint`
    vLLM's request span continues it; without, vLLM drops it there (logging once)."""
    llm = engine.async_llm
    generate, add_request = llm.generate, llm.add_request
    seen: dict[str, list[Any]] = {"generate": [], "add_request": []}

    def spy_generate(*args: Any, **kwargs: Any) -> Any:
        seen["generate"].append(kwargs.get("trace_headers"))
        return generate(*args, **kwargs)

    async def spy_add_request(*args: Any, **kwargs: Any) -> Any:
        seen["add_request"].append(kwargs.get("trace_headers"))
        return await add_request(*args, **kwargs)

    monkeypatch.setattr(llm, "generate", spy_generate)
    monkeypatch.setattr(llm, "add_request", spy_add_request)
    headers = {
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "tracestate": "rojo=00f067aa0ba902b7",
    }
    traced = await engine.generate(greedy_job("traced", 3), "traced", trace_headers=headers)
    untraced = await engine.generate(greedy_job("untraced", 3), "untraced")
    assert seen == {"generate": [headers, None], "add_request": [headers, None]}
    # The trace changes nothing of the generation.
    assert traced.completions[0].token_ids == untraced.completions[0].token_ids
    assert_real_routing(routed(traced))


async def test_prompt_longer_than_the_context_is_an_invalid_job(engine):
    job = Job(job_id="too-long", prompt_token_ids=[5] * 600, sampling=SamplingSpec(max_tokens=1))
    with pytest.raises(InvalidJobError, match="maximum context length is 512 tokens"):
        await engine.generate(job, "too-long")


@pytest.mark.broker
async def test_cli_serves_the_fast_path_without_capture_and_refuses_routed_experts(
    model_dir, kafka_bootstrap_servers, new_topic, tmp_path
):
    # The plain CPU path (no Triton shim, no interpreter, no capture) runs in its own process:
    # this one lists the shim's Triton backend since the capture engine started, and vLLM's
    # choice of Triton kernels must agree between a parent and the engine it spawns.
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic, dlq_topic = await new_topic(), await new_topic(), await new_topic()
    jobs = [
        Job(job_id="plain", prompt_token_ids=list(PROMPT), sampling=SamplingSpec(max_tokens=4)),
        greedy_job("wants-experts", 4),
    ]
    await produce(bs, jobs_topic, [job_record(j) for j in jobs])
    env = {k: v for k, v in os.environ.items() if k not in CAPTURE_ENV}
    command = [
        sys.executable,
        "-m",
        "worker",
        "serve",
        *("--bootstrap-servers", bs, "--jobs-topic", jobs_topic),
        *("--results-topic", results_topic, "--dead-letter-topic", dlq_topic),
        *("--group-id", f"group-{uuid.uuid4().hex[:8]}", "--shutdown-grace-s", "5"),
        "--",
        *engine_args(model_dir, "--no-enable-return-routed-experts"),
    ]
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        serve = await asyncio.create_subprocess_exec(
            *command, env=env, stdout=log, stderr=asyncio.subprocess.STDOUT
        )
        try:
            records = await collect(bs, results_topic, len(jobs), timeout_s=150)
        finally:
            if serve.returncode is None:
                serve.send_signal(signal.SIGTERM)
            returncode = await asyncio.wait_for(serve.wait(), 60)
    log_tail = log_path.read_text(errors="replace")[-3000:]
    assert returncode == 0, log_tail
    results = {r["job_id"]: r for r in (json.loads(record.value) for record in records)}
    assert results["plain"]["type"] == "completed", results["plain"]
    (completion,) = results["plain"]["completions"]
    assert len(completion["token_ids"]) == 4
    assert completion.get("routed_experts") is None
    assert results["plain"]["model"] == str(model_dir)
    refused = results["wants-experts"]
    assert refused["type"] == "failed"
    assert refused["error"]["code"] == "invalid_job"
    assert "cannot return routed experts" in refused["error"]["detail"]


async def test_token_outside_the_vocabulary_is_an_invalid_job(engine):
    job = Job(job_id="oov", prompt_token_ids=[5, SPEC.vocab_size + 7], sampling=SamplingSpec())
    with pytest.raises(
        InvalidJobError, match=f"Token id {SPEC.vocab_size + 7} is out of vocabulary"
    ):
        await engine.generate(job, "oov")


# ---- checks that need no running engine ----------------------------------------------------


async def test_jobs_asking_for_the_same_sampling_share_one_set_of_vllm_params():
    # vLLM clones the parameters it is given before it changes them, so sharing is safe.
    spec = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = _sampling_params(Job(job_id="a", prompt="x", sampling=spec))
    equal = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True)  # another object
    same = _sampling_params(Job(job_id="b", prompt="y", sampling=equal))
    assert same is first
    assert (first.max_tokens, first.temperature, first.ignore_eos) == (8, 0.0, True)
    seeded = _sampling_params(Job(job_id="c", prompt="x", sampling=SamplingSpec(seed=5)))
    assert seeded is not first and seeded.seed == 5
    later_start = _sampling_params(
        Job(job_id="d", prompt="x", sampling=spec, routed_experts_prompt_start=3)
    )
    assert later_start is not first and later_start.routed_experts_prompt_start == 3
    # A list of stop strings cannot be a key: built for the job alone, every time.
    stops = SamplingSpec(stop=["x", "y"], stop_token_ids=[5])
    one, two = (_sampling_params(Job(job_id=i, prompt="x", sampling=stops)) for i in "ef")
    assert one is not two
    assert (one.stop, one.stop_token_ids) == (["x", "y"], [5])


async def test_self_check_refuses_all_zero_capture_and_names_enforce_eager():
    zeros = np.zeros((11, SPEC.num_layers, SPEC.top_k), dtype=np.uint8)
    with pytest.raises(EngineDeadError, match="all-zero routed experts") as caught:
        check_capture(zeros, rows=11, layout=LAYOUT)
    assert "--enforce-eager" in str(caught.value)
    assert "--no-enable-return-routed-experts" in str(caught.value)


async def test_self_check_refuses_wrong_shape_missing_array_and_repeated_ids():
    good = np.zeros((11, SPEC.num_layers, SPEC.top_k), dtype=np.uint8)
    for layer in SPEC.moe_layers:
        good[:, layer] = [3, 5]
    check_capture(good, rows=11, layout=LAYOUT)
    with pytest.raises(EngineDeadError, match=r"shape \(10, 4, 2\), expected \(11, 4, 2\)"):
        check_capture(good[:10], rows=11, layout=LAYOUT)
    with pytest.raises(EngineDeadError, match="no routed experts"):
        check_capture(None, rows=11, layout=LAYOUT)
    repeated = good.copy()
    repeated[4, SPEC.moe_layers[-1]] = [6, 6]
    with pytest.raises(EngineDeadError, match=f"layer {SPEC.moe_layers[-1]} row 4"):
        check_capture(repeated, rows=11, layout=LAYOUT)
    out_of_range = good.copy()
    out_of_range[0, 0] = [9, 1]
    with pytest.raises(EngineDeadError, match=r"outside \[0, 8\)"):
        check_capture(out_of_range, rows=11, layout=LAYOUT)


async def test_moe_layers_follow_the_architectures_config():
    qwen = SimpleNamespace(mlp_only_layers=[1], decoder_sparse_step=1)
    assert moe_layout(qwen, 4, 2, 8).moe_layers == (0, 2, 3)
    sparse_step = SimpleNamespace(mlp_only_layers=[], decoder_sparse_step=2)
    assert moe_layout(sparse_step, 4, 2, 8).moe_layers == (1, 3)
    deepseek = SimpleNamespace(first_k_dense_replace=3, moe_layer_freq=1)
    assert moe_layout(deepseek, 6, 8, 256).moe_layers == (3, 4, 5)
    assert moe_layout(SimpleNamespace(), 4, 2, 8).moe_layers is None


async def test_bad_engine_argument_is_a_config_error_with_vllms_message(model_dir):
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        build_vllm_engine(engine_args(model_dir, "--no-such-flag"))
    with pytest.raises(ConfigError, match="--max-num-seqs: invalid int value: 'many'"):
        build_vllm_engine(engine_args(model_dir, "--max-num-seqs", "many"))


async def test_vllm_errors_map_to_the_workers_by_kind_and_origin():
    from vllm.exceptions import VLLMValidationError  # noqa: PLC0415
    from vllm.v1.engine.exceptions import EngineDeadError as VllmDead  # noqa: PLC0415
    from vllm.v1.engine.exceptions import EngineGenerateError  # noqa: PLC0415

    from worker.engines.vllm_engine import _map_error  # noqa: PLC0415 - the seam's one mapping

    def wrapped(cause: Exception) -> EngineGenerateError:
        # What `raise EngineGenerateError() from cause` in AsyncLLM.generate produces.
        exc = EngineGenerateError()
        exc.__cause__ = cause
        return exc

    # A ValueError raised under AsyncLLM.add_request is this request's input; compiled under
    # vLLM's file name so the mapping sees the frame it looks for.
    scope: dict[str, Any] = {}
    source = "def add_request():\n    raise ValueError('bad value for this model')\n"
    exec(compile(source, "/site-packages/vllm/v1/engine/async_llm.py", "exec"), scope)  # noqa: S102
    try:
        scope["add_request"]()
    except ValueError as exc:
        from_input = exc
    mapped = _map_error(wrapped(from_input))
    assert isinstance(mapped, InvalidJobError)
    assert mapped.detail == "bad value for this model"
    # The same type raised anywhere else (the output handler, a bug) is the engine's failure.
    later = _map_error(wrapped(ValueError("detokenizer broke")))
    assert type(later) is EngineError
    assert later.retryable
    assert "detokenizer broke" in later.detail
    validation = _map_error(VLLMValidationError("bad start", parameter="x", value=3))
    assert isinstance(validation, InvalidJobError)
    assert validation.detail == "bad start (parameter=x, value=3)"
    assert isinstance(_map_error(VllmDead()), EngineDeadError)


# ---- the control seam, with a stand-in for AsyncLLM ------------------------------------------


class RecordingLLM:
    """The AsyncLLM calls a weight update makes, recorded; `fail` makes one of them raise (the
    first `fail_times` calls; `collective_rpc:METHOD` names one RPC), `reset_prefix_cache`
    answers from `cache_resets` (True when it runs out), and the check after a load finds
    every parameter finite."""

    def __init__(
        self, fail: str | None = None, fail_times: int = 1_000, cache_resets: Sequence[bool] = ()
    ) -> None:
        self.calls: list[tuple[str, Any]] = []
        self._fail = fail
        self._fail_times = fail_times
        self._cache_resets = list(cache_resets)

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            what = args[0] if args else kwargs
            self.calls.append((name, what))
            if self._fail in (name, f"{name}:{what}") and self._fail_times > 0:
                self._fail_times -= 1
                raise RuntimeError(f"{name} failed (scripted)")
            if name == "reset_prefix_cache":
                return self._cache_resets.pop(0) if self._cache_resets else True
            if (name, what) == ("collective_rpc", "vkw_nonfinite_parameters"):
                return [[]]  # one worker, no parameter holding NaN or infinity
            if (name, what) == ("collective_rpc", "vkw_reload_checkpoint"):
                return [{"path": "direct", "moe_layers": 2, "why": ""}]
            return None

        return call


def seam_engine(model_dir: Path, llm: RecordingLLM, **kwargs: Any) -> VllmEngine:
    config = json.loads((model_dir / "config.json").read_text())
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(**config), model=str(model_dir))
    )
    engine = VllmEngine(vllm_config, capture=False, layout=None, model_name="seam", **kwargs)
    engine._llm = llm

    async def probe_passes() -> None:
        return None  # the probe generates: there is no model behind this stand-in

    engine.weights_problem = probe_passes  # type: ignore[method-assign]
    return engine


#: What a load or a transfer asks after it, to check the weights it left (the probe aside).
CHECKED = ("collective_rpc", "vkw_nonfinite_parameters")


async def test_weight_transfer_passes_the_trainers_info_through_to_vllm(model_dir):
    from worker.engines.steerable import SteerableEngine  # noqa: PLC0415

    llm = RecordingLLM()
    engine = seam_engine(model_dir, llm)
    policy = SteerableEngine(engine, clock=SYSTEM_CLOCK)
    init, update = (
        {"master_address": "10.0.0.1", "world_size": 2},
        {"names": ["w"], "shapes": [[2]]},
    )
    await policy.transfer("nccl", init, update, 7, "wait")
    assert [name for name, _ in llm.calls] == [
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
        "collective_rpc",
    ]
    assert llm.calls[0][1].init_info == init
    assert llm.calls[2][1].update_info == update
    assert llm.calls[3][1] == {"weight_version": "7"}
    assert llm.calls[5] == CHECKED
    assert engine.weight_version == 7
    # The next update reuses the initialised transfer engine.
    llm.calls.clear()
    await policy.transfer("nccl", None, update, 8, "wait")
    assert [name for name, _ in llm.calls] == [
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
        "collective_rpc",
    ]
    failing = seam_engine(model_dir, RecordingLLM(fail="update_weights"))
    with pytest.raises(WeightUpdateError, match="nccl weight transfer failed"):
        await SteerableEngine(failing, clock=SYSTEM_CLOCK).transfer("nccl", init, update, 9, "wait")
    assert failing.weight_version == 0


async def test_in_place_reload_runs_our_extension_once_then_stamps_the_version(model_dir, tmp_path):
    llm = RecordingLLM()
    engine = seam_engine(model_dir, llm, weight_reload="in-place")
    assert engine.weight_reload.mode == "in-place"
    other = tmp_path / "b"
    shutil.copytree(model_dir, other)
    await engine.load_weights(str(other), 3)
    # One RPC per update: our method clears the MoE kernels and reloads together (preparing
    # the weights twice is as wrong as not at all, ../NOTES §6). The rule is vLLM's:
    # UnquantizedFusedMoEMethod.process_weights_after_loading (layers/fused_moe/
    # unquantized_fused_moe_method.py) prepares the kernel only when `moe_kernel` is None.
    # The version is stamped before the cache reset, so no request in between keys its KV
    # with the old version.
    # Then the check of what the load left, before any job runs on it.
    assert llm.calls == [
        ("collective_rpc", "vkw_reload_checkpoint"),
        ("update_weight_version", "3"),
        ("reset_prefix_cache", {}),
        CHECKED,
    ]
    assert engine.weight_version == 3


async def test_a_failed_in_place_reload_loads_the_old_checkpoint_again_in_place(
    model_dir, tmp_path
):
    llm = RecordingLLM(fail="collective_rpc:vkw_reload_checkpoint", fail_times=1)
    engine = seam_engine(model_dir, llm, weight_reload="in-place")
    other = tmp_path / "b"
    shutil.copytree(model_dir, other)
    with pytest.raises(WeightUpdateError, match=r"rolled back in place to .* \(version 0\)"):
        await engine.load_weights(str(other), 3)
    # The reload may have loaded part of B: A (what served before) is loaded again in place
    # (our extension puts back the storage a failed layerwise reload left on the meta
    # device), stamped with its version and checked; no new engine is built.
    assert llm.calls == [
        ("collective_rpc", "vkw_reload_checkpoint"),
        ("collective_rpc", "vkw_reload_checkpoint"),
        ("update_weight_version", "0"),
        ("reset_prefix_cache", {}),
        CHECKED,
    ]
    assert engine.weight_version == 0 and not engine._rebuilding


async def test_a_checkpoint_whose_tensors_have_other_shapes_is_refused_before_loading(
    model_dir, tmp_path
):
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    llm = RecordingLLM()
    engine = seam_engine(model_dir, llm, weight_reload="in-place")
    other = tmp_path / "narrow"
    shutil.copytree(model_dir, other)
    for shard in other.glob("*.safetensors"):
        tensors = load_file(shard)
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:, :-1]
        save_file({k: v.contiguous() for k, v in tensors.items()}, shard)
    with pytest.raises(WeightUpdateError, match=r"model.embed_tokens.weight has shape"):
        await engine.load_weights(str(other), 3)
    assert llm.calls == [] and engine.weight_version == 0


async def test_a_failed_reload_after_a_transfer_leaves_the_worker_needing_weights(
    model_dir, tmp_path
):
    llm = RecordingLLM(fail="collective_rpc:vkw_reload_checkpoint")
    engine = seam_engine(model_dir, llm, weight_reload="in-place")
    await engine.transfer_weights("nccl", {}, {"names": []}, 1)
    # What serves came from the trainer's memory: nothing on disk to go back to.
    with pytest.raises(WeightsLostError, match="came from a transfer"):
        await engine.load_weights(str(model_dir), 2)
    assert engine.weight_version == 1


async def test_a_refused_prefix_cache_reset_is_tried_again(model_dir, caplog):
    # vLLM refuses while requests hold blocks (frozen across a `keep` update): the engine says
    # so and resets again later (after the last running request, in `generate`).
    llm = RecordingLLM(cache_resets=[False, True])
    engine = seam_engine(model_dir, llm, weight_reload="in-place")
    with caplog.at_level(logging.INFO, logger="worker.engines.vllm_loads"):
        await engine.reset_prefix_cache()
    assert engine.prefix_cache_reset_pending
    assert "running requests still hold blocks" in caplog.text
    await engine.reset_prefix_cache()
    assert not engine.prefix_cache_reset_pending


async def test_weight_reload_modes_say_why(model_dir):
    assert seam_engine(model_dir, RecordingLLM(), weight_reload="rebuild").weight_reload == (
        WeightReload(mode="rebuild", reason="--weight-reload rebuild")
    )
    auto = seam_engine(model_dir, RecordingLLM())
    assert auto.weight_reload.mode == "rebuild"
    assert "not chosen yet" in auto.weight_reload.reason


async def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_torn_down(
    model_dir, tmp_path
):
    llm = RecordingLLM()
    engine = seam_engine(model_dir, llm)
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = config["num_hidden_layers"] + 1
    (other / "config.json").write_text(json.dumps(config))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(model_dir, corrupt)
    (next(corrupt.glob("*.safetensors"))).write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((model_dir / "config.json").read_text())
    for path, message in (
        (tmp_path / "missing", "config.json is missing"),
        (other, "another architecture: num_hidden_layers"),
        (corrupt, "unreadable"),
        (no_weights, "no \\*.safetensors"),
    ):
        with pytest.raises(WeightUpdateError, match=message):
            await engine.load_weights(str(path), 5)
    assert llm.calls == [] and engine.weight_version == 0
