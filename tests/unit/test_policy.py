"""The control plane's engine semantics (pause, updates in every mode, aborts) on the mock engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from schemas import Abort, Job, SamplingSpec, VersionSpan
from tests.fakes import VirtualClockLoop
from worker.core.clock import SYSTEM_CLOCK
from worker.core.errors import JobAbortedError, JobExpiredError, WeightUpdateError
from worker.dev.harness.waiting import wait_for
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.protocol import EngineOutput
from worker.engines.steerable import SteerableEngine

LATENCY_MS = 2.0  # 100 tokens take 0.2 s, in 20 steps of 5 tokens
PROMPT = [5, 6, 7, 8, 9, 10]


def checkpoint(root: Path, name: str, **config: int) -> str:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"name": name, "num_hidden_layers": 4, **config}))
    return str(path)


def engine(*, in_place: bool = False) -> tuple[SteerableEngine, MockEngine]:
    inner = MockEngine(
        MockEngineSettings(
            per_token_latency_ms=LATENCY_MS,
            num_layers=4,
            top_k=2,
            num_experts=8,
            in_place_updates=in_place,
        )
    )
    return SteerableEngine(inner, clock=SYSTEM_CLOCK), inner


def job(job_id: str = "j", tokens: int = 100, n: int = 1, **kwargs: object) -> Job:
    return Job(
        job_id=job_id,
        prompt_token_ids=PROMPT,
        sampling=SamplingSpec(n=n, max_tokens=tokens, seed=3, logprobs=0),
        return_routed_experts=True,
        routed_experts_prompt_start=2,
        **kwargs,  # type: ignore[arg-type]
    )


async def fresh(path: str | None, j: Job, version: int = 0) -> EngineOutput:
    """The same job on a fresh engine serving `path` (None: the initial weights)."""
    policy, inner = engine()
    if path is not None:
        await inner.load_weights(path, version)
    return await policy.generate(j, "fresh")


def assert_rows_follow_the_rule(output: EngineOutput, j: Job) -> None:
    for c in output.completions:
        assert c.routed_experts is not None
        rows = len(PROMPT) + len(c.token_ids) - 1 - j.routed_experts_prompt_start
        assert c.routed_experts.to_array().shape == (rows, 4, 2)
        assert c.routed_experts.start == j.routed_experts_prompt_start
        # The model's expert count survives a continuation joined onto its first half.
        assert c.routed_experts.num_experts == 8


async def started(
    policy: SteerableEngine, j: Job, inner: MockEngine | None = None
) -> asyncio.Task[EngineOutput]:
    """`j` under way: generating in `inner` when given (the job id is its request id), else
    only handed to the policy (running, or waiting at a closed gate)."""
    task = asyncio.create_task(policy.generate(j, j.job_id))
    if inner is None:
        await asyncio.sleep(0)
    else:
        await wait_for(
            lambda: inner.generated_tokens.get(j.job_id, 0) > 0 or task.done(),
            what=f"{j.job_id} to generate",
        )
        assert not task.done(), f"{j.job_id} finished before the test could act on it"
    return task


async def test_wait_lets_running_jobs_finish_on_the_old_weights_first(tmp_path):
    policy, inner = engine()
    new = checkpoint(tmp_path, "b")
    running = await started(policy, job(), inner)
    await policy.load_checkpoint(new, 1, "wait")
    assert running.done()  # the update waited for it
    old = running.result()
    assert old.completions[0].weight_versions == [VersionSpan(version=0, start=0, end=100)]
    after = await policy.generate(job("k"), "k")
    assert after.weight_version == 1
    assert after.completions[0].weight_versions == [VersionSpan(version=1, start=0, end=100)]
    assert after.completions == (await fresh(new, job("k"), 1)).completions


async def test_restart_runs_the_job_again_from_the_start_on_the_new_weights(tmp_path):
    policy, inner = engine()
    new = checkpoint(tmp_path, "b")
    running = await started(policy, job(), inner)
    await policy.load_checkpoint(new, 1, "restart")
    out = await running
    assert out.weight_version == 1
    assert out.completions == (await fresh(new, job(), 1)).completions


async def test_restart_runs_a_job_continued_by_an_earlier_keep_again_from_its_start(tmp_path):
    """Hostile seed 700004 at five workers (restart_kept_old_weights): a long job continued
    across `keep` updates to 1 was restarted by an update to 2, and its answer still carried
    the tokens of weights 0 and 1: the restart ran only the continuation again."""
    policy, inner = engine()
    j = job(n=2)
    running = await started(policy, j, inner)
    await policy.load_checkpoint(checkpoint(tmp_path, "b"), 1, "keep")
    await wait_for(
        lambda: any("/" in r for r in inner.generated_tokens), what="a continuation to run"
    )
    newest = checkpoint(tmp_path, "c")
    await policy.load_checkpoint(newest, 2, "restart")
    out = await running
    assert out.weight_version == 2
    for c in out.completions:
        assert c.weight_versions == [VersionSpan(version=2, start=0, end=100)]
    assert out.completions == (await fresh(newest, j, 2)).completions
    assert_rows_follow_the_rule(out, j)


async def test_restart_runs_a_job_continued_by_two_keeps_again_from_its_start(tmp_path):
    """A continuation continued again (two `keep` updates) is restarted with its whole job."""
    policy, inner = engine()
    j = job(tokens=200)
    running = await started(policy, j, inner)
    for version, name in ((1, "b"), (2, "c")):
        depth = version
        await policy.load_checkpoint(checkpoint(tmp_path, name), version, "keep")
        await wait_for(
            lambda d=depth: any(r.count("/") == d for r in inner.generated_tokens),
            what=f"a continuation {depth} deep to run",
        )
    newest = checkpoint(tmp_path, "d")
    await policy.load_checkpoint(newest, 3, "restart")
    out = await running
    assert out.completions[0].weight_versions == [VersionSpan(version=3, start=0, end=200)]
    assert out.completions == (await fresh(newest, j, 3)).completions


async def test_abort_answers_with_the_partial_completions_by_the_row_rule(tmp_path):
    policy, inner = engine()
    running = await started(policy, job(n=2), inner)
    await policy.load_checkpoint(checkpoint(tmp_path, "b"), 1, "abort")
    with pytest.raises(JobAbortedError) as info:
        await running
    partial = info.value.partial
    assert partial is not None and info.value.retryable
    whole = await fresh(None, job(n=2))
    for c, full in zip(partial.completions, whole.completions, strict=True):
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 100
        assert c.token_ids == full.token_ids[: len(c.token_ids)]
        assert c.weight_versions == [VersionSpan(version=0, start=0, end=len(c.token_ids))]
    assert_rows_follow_the_rule(partial, job(n=2))


@pytest.mark.parametrize("in_place", [False, True])
async def test_keep_continues_running_jobs_with_two_version_spans(tmp_path, in_place):
    policy, inner = engine(in_place=in_place)
    new = checkpoint(tmp_path, "b")
    j = job(n=2)
    running = await started(policy, j, inner)
    await policy.load_checkpoint(new, 1, "keep")
    out = await running
    old = await fresh(None, j)
    for c, before in zip(out.completions, old.completions, strict=True):
        assert len(c.token_ids) == 100 and c.finish_reason == "length"
        first, second = c.weight_versions  # type: ignore[misc]
        assert (first.version, second.version) == (0, 1)
        assert first.start == 0 and first.end == second.start and second.end == 100
        assert (first.end - first.start) + (second.end - second.start) == len(c.token_ids)
        # The tokens before the update are the old weights' own.
        assert c.token_ids[: first.end] == before.token_ids[: first.end]
        assert c.token_ids[first.end :] != before.token_ids[first.end :]
        assert c.logprobs is not None and len(c.logprobs) == 100
    assert_rows_follow_the_rule(out, j)


async def test_a_bad_checkpoint_is_refused_and_the_old_weights_keep_serving(tmp_path):
    policy, _ = engine()
    for path, message in (
        (str(tmp_path / "missing"), "config.json is missing"),
        (checkpoint(tmp_path, "other", num_hidden_layers=48), "another architecture"),
    ):
        with pytest.raises(WeightUpdateError, match=message):
            await policy.load_checkpoint(path, 5, "wait")
        assert policy.weight_version == 0
        out = await policy.generate(job(tokens=10), "after-bad")
        assert out.weight_version == 0


def test_pause_keep_freezes_running_jobs_until_resume():
    # On a simulated clock the mock engine's tokens take their nominal time exactly, so the
    # waits below outlast the jobs they watch on any machine, and take no real time.
    async def body() -> None:
        policy, inner = engine()
        running = await started(policy, job(), inner)
        await policy.pause("keep")
        await asyncio.sleep(2 * 100 * LATENCY_MS / 1000)  # twice the whole job's time
        assert not running.done()
        waiting = asyncio.create_task(policy.generate(job("later", tokens=5), "later"))
        await asyncio.sleep(2 * 5 * LATENCY_MS / 1000)
        assert not waiting.done() and policy.paused
        await policy.resume()
        assert len((await running).completions[0].token_ids) == 100
        assert len((await waiting).completions[0].token_ids) == 5

    loop = VirtualClockLoop()
    try:
        loop.run_until_complete(body())
    finally:
        loop.close()


async def test_pause_abort_and_pause_wait():
    policy, inner = engine()
    running = await started(policy, job(), inner)
    await policy.pause("abort")
    with pytest.raises(JobAbortedError):
        await running
    await policy.resume()
    running = await started(policy, job("w"), inner)
    await policy.pause("wait")
    assert running.done()  # `wait` returns once the jobs in flight have finished
    await policy.resume()


async def test_abort_by_job_id_or_metadata_running_or_waiting_at_the_gate():
    policy, inner = engine()
    a = await started(policy, job("a", metadata={"step": "3"}), inner)
    b = await started(policy, job("b", metadata={"step": "4"}))
    await policy.pause("keep")
    c = await started(policy, job("c", metadata={"step": "3"}))  # waits at the closed gate
    matched = await policy.abort(Abort(command_id="x", metadata={"step": "3"}))
    assert sorted(matched) == ["a", "c"]
    for aborted in (a, c):
        with pytest.raises(JobAbortedError):
            await asyncio.wait_for(aborted, 1)  # answered at once, though paused
    assert not b.done()
    assert await policy.abort(Abort(command_id="y", job_ids=["b"])) == ["b"]
    await policy.resume()
    with pytest.raises(JobAbortedError):
        await b


async def test_a_deadline_passing_while_paused_expires_the_job():
    policy, _ = engine()
    await policy.pause("wait")
    soon = job("late", deadline=__import__("time").time() + 0.1)
    with pytest.raises(JobExpiredError, match="deadline"):
        await policy.generate(soon, "late")
    await policy.resume()


async def test_an_interrupt_the_control_plane_did_not_ask_for_is_a_retryable_engine_error():
    policy, inner = engine()
    running = await started(policy, job(), inner)
    await inner.interrupt("j")
    with pytest.raises(Exception, match="aborted before it finished") as info:
        await running
    assert getattr(info.value, "retryable", False)


def test_version_spans_round_trip():
    span = VersionSpan(version=3, start=0, end=9)
    assert msgspec.json.decode(msgspec.json.encode(span), type=VersionSpan) == span


@pytest.mark.parametrize("mode", ["restart", "keep"])
async def test_a_rollback_below_a_running_jobs_min_weight_version_answers_it_retryable(
    tmp_path, mode
):
    # Seed 7300090 of the trainer flag set (one worker): a turn asking for version 2 or newer
    # was running when another trainer rolled the fleet back to 1 with `restart`; it ran
    # again on version 1 and its result carried the weights it had refused.
    policy, inner = engine()
    await policy.load_checkpoint(checkpoint(tmp_path, "v2"), 2, "wait")
    running = await started(policy, job(min_weight_version=2), inner)
    await policy.load_checkpoint(checkpoint(tmp_path, "v1"), 1, mode)
    with pytest.raises(JobAbortedError, match="rolled back to version 1") as info:
        await running
    assert info.value.retryable
    assert (await policy.generate(job("k"), "k")).weight_version == 1
