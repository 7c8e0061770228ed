"""The mock engine: deterministic, shaped like the configured model, honest about bad jobs."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from schemas import Job, SamplingSpec
from worker.core.errors import EngineDeadError, InvalidJobError
from worker.dev.harness.waiting import wait_for
from worker.engines.mock import MockEngine, MockEngineSettings

SETTINGS = MockEngineSettings(num_layers=6, top_k=4, num_experts=40, max_model_len=256)


def job(**fields: Any) -> Job:
    sampling = fields.pop("sampling", SamplingSpec(max_tokens=12))
    fields.setdefault("prompt_token_ids", [5, 6, 7, 8, 9])
    return Job(job_id=fields.pop("job_id", "job-1"), sampling=sampling, **fields)


async def generate(engine: MockEngine, j: Job) -> Any:
    return await engine.generate(j, f"{j.job_id}@test")


async def test_the_same_job_gives_the_same_output_and_other_seeds_differ() -> None:
    engine = MockEngine(SETTINGS)
    seeded = job(sampling=SamplingSpec(max_tokens=12, seed=7, n=3))

    first = await generate(engine, seeded)
    again = await generate(MockEngine(SETTINGS), seeded)
    other = await generate(engine, job(sampling=SamplingSpec(max_tokens=12, seed=8, n=3)))
    by_id = await generate(engine, job(job_id="job-2"))

    assert first == again
    tokens = [c.token_ids for c in first.completions]
    assert len({tuple(t) for t in tokens}) == 3, "the n completions differ from each other"
    assert [c.token_ids for c in other.completions] != tokens
    assert (
        by_id.completions[0].token_ids != (await generate(engine, job())).completions[0].token_ids
    )


@pytest.mark.parametrize("start", [0, 3, 5])
async def test_routed_experts_follow_vllms_row_rule_with_distinct_ids(start: int) -> None:
    engine = MockEngine(SETTINGS)

    output = await generate(
        engine, job(return_routed_experts=True, routed_experts_prompt_start=start)
    )

    completion = output.completions[0]
    routed = completion.routed_experts
    assert routed is not None
    assert routed.start == start
    assert routed.num_experts == 40  # the configured model's, for replay dtypes that follow it
    assert routed.shape == [5 + len(completion.token_ids) - 1 - start, 6, 4]
    ids = routed.to_array()
    assert ids.min() >= 0 and ids.max() < 40
    assert all(len(set(row)) == 4 for row in ids.reshape(-1, 4).tolist())


async def test_text_prompts_tokenise_and_logprobs_come_when_asked() -> None:
    engine = MockEngine(SETTINGS)

    output = await generate(
        engine, job(prompt_token_ids=None, prompt="héllo", sampling=SamplingSpec(logprobs=0))
    )

    assert output.prompt_token_ids == list("héllo".encode())
    completion = output.completions[0]
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)
    assert all(lp is not None and lp <= 0 for lp in completion.logprobs)
    assert completion.cumulative_logprob == pytest.approx(sum(completion.logprobs))
    assert completion.routed_experts is None


async def test_a_stop_token_ends_the_completion_on_it() -> None:
    engine = MockEngine(SETTINGS)
    free = (await generate(engine, job())).completions[0].token_ids
    stop = free[4]

    stopped = (
        await generate(engine, job(sampling=SamplingSpec(max_tokens=12, stop_token_ids=[stop])))
    ).completions[0]

    assert stopped.token_ids == free[: free.index(stop) + 1]
    assert stopped.finish_reason == "stop"


async def test_latency_is_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def record(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", record)
    engine = MockEngine(MockEngineSettings(per_token_latency_ms=25, max_model_len=256))

    await generate(engine, job(sampling=SamplingSpec(max_tokens=8)))

    # In steps of at least one token and about 10 ms: points where it can be interrupted.
    assert sum(slept) == pytest.approx(0.2)
    assert len(slept) == 8


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (job(prompt_token_ids=None, prompt=""), "prompt is empty"),
        (job(prompt_token_ids=list(range(256))), "model's context is 256"),
        (job(routed_experts_prompt_start=6, return_routed_experts=True), "beyond the prompt"),
    ],
)
async def test_bad_jobs_are_invalid_job_errors(bad: Job, message: str) -> None:
    with pytest.raises(InvalidJobError, match=message):
        await generate(MockEngine(SETTINGS), bad)


async def test_a_closed_engine_is_dead() -> None:
    engine = MockEngine(SETTINGS)
    await engine.close()

    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await generate(engine, job())


def test_max_tokens_is_capped_by_the_context() -> None:
    engine = MockEngine(SETTINGS)

    output = asyncio.run(
        generate(engine, job(prompt_token_ids=[1] * 250, sampling=SamplingSpec(max_tokens=100)))
    )

    assert len(output.completions[0].token_ids) == 6
    assert np.all(np.asarray(output.completions[0].token_ids) < SETTINGS.vocab_size)


async def test_a_request_interrupted_in_its_first_step_is_answered_as_aborted() -> None:
    # One token a step, half a second each: the interrupt lands inside the second step, so the
    # request has exactly one chunk (the path kept lean for whole completions) when it ends.
    engine = MockEngine(MockEngineSettings(per_token_latency_ms=500, num_layers=4, top_k=2))
    running = asyncio.create_task(engine.generate(job(sampling=SamplingSpec(max_tokens=50)), "r"))
    await wait_for(lambda: engine.generated_tokens.get("r", 0) > 0, 10, "the first token")
    await engine.interrupt("r")
    out = await asyncio.wait_for(running, 10)
    assert out.interrupted
    (completion,) = out.completions
    assert len(completion.token_ids) == 1
    assert completion.finish_reason == "abort"
