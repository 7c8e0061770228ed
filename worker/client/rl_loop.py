"""A GRPO-shaped RL loop on the rollout fleet: generate groups, score, "train", update, repeat.

This is the whole trainer side a real loop needs from the fleet: `RolloutClient.generate` for
groups of `n` samples with routed experts, replay arrays in the trainer's layout, and
`update_weights` to move the fleet to the next policy. Scoring and training are toys here (a
reward for even token ids; training writes the next checkpoint by nudging the weights).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import numpy as np

from schemas import Completion, Failed, Job, ReplayLayout, ReplaySample, SamplingSpec, replay_arrays
from schemas.replay import PRIME_RL
from worker.client.rollout import RolloutClient, RolloutError

__all__ = ["SampleReport", "StepReport", "rl_loop"]

# Writes checkpoint `step` from the previous one and the step's mean |advantage|.
Train = Callable[[Path, int, float], Awaitable[Path]]


class SampleReport(msgspec.Struct, frozen=True):
    job_id: str
    index: int
    weight_version: int
    prompt_len: int
    tokens: int
    replay_shape: tuple[int, ...]
    reward: float


class StepReport(msgspec.Struct, frozen=True):
    step: int
    seconds: float
    samples_per_s: float
    tokens_per_s: float
    samples: list[SampleReport]
    #: Seconds the fleet took to move to this step's weights (the `update_weights` call);
    #: None on the first step, which runs on the weights the fleet started with.
    update_seconds: float | None = None


async def rl_loop(
    client: RolloutClient,
    train: Train,
    initial: Path,
    *,
    steps: int = 3,
    groups: int = 2,
    n: int = 4,
    max_tokens: int = 16,
    layout: ReplayLayout = PRIME_RL,
    on_step: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    """Run `steps` steps; step k generates on weights version k (and waits for them)."""
    reports = []
    checkpoint = initial
    update_seconds: float | None = None
    for step in range(steps):
        prompts = [[(7 * step + 13 * g + i) % 400 + 20 for i in range(8)] for g in range(groups)]
        jobs = [
            Job(
                job_id=f"step{step}-group{g}",
                prompt_token_ids=prompt,
                sampling=SamplingSpec(n=n, max_tokens=max_tokens, seed=step * 100 + g),
                return_routed_experts=True,
                # Never a sample from an older policy than this step's.
                min_weight_version=step,
                metadata={"step": str(step), "group": str(g)},
            )
            for g, prompt in enumerate(prompts)
        ]
        t0 = time.perf_counter()
        results = await client.generate(jobs)
        seconds = time.perf_counter() - t0
        advantages: list[float] = []
        scored: list[tuple[str, int, Completion, float]] = []  # job id, version, completion, reward
        for job, result in zip(jobs, results, strict=True):
            if isinstance(result, Failed):
                raise RolloutError(f"step {step}: {job.job_id} failed: {result.error.detail}")
            rewards = [
                float(np.mean([t % 2 == 0 for t in c.token_ids])) for c in result.completions
            ]
            baseline = float(np.mean(rewards))  # GRPO: the group's mean is the baseline
            advantages += [reward - baseline for reward in rewards]
            version = _version(result.weight_version)
            scored += [
                (job.job_id, version, c, reward)
                for c, reward in zip(result.completions, rewards, strict=True)
            ]
        prompt_lens = {job.job_id: len(job.prompt_token_ids or ()) for job in jobs}
        # One call for the step's samples: a trainer packs them into micro-batches, which take
        # one dtype.
        arrays = replay_arrays([ReplaySample(c, prompt_lens[j]) for j, _, c, _ in scored], layout)
        samples = [
            SampleReport(
                job_id=job_id,
                index=c.index,
                weight_version=version,
                prompt_len=prompt_lens[job_id],
                tokens=len(c.token_ids),
                replay_shape=tuple(replay.shape),
                reward=reward,
            )
            for (job_id, version, c, reward), replay in zip(scored, arrays, strict=True)
        ]
        tokens = sum(s.tokens for s in samples)
        report = StepReport(
            step=step,
            seconds=seconds,
            samples_per_s=len(samples) / seconds,
            tokens_per_s=tokens / seconds,
            samples=samples,
            update_seconds=update_seconds,
        )
        reports.append(report)
        if on_step is not None:
            on_step(report)
        if step + 1 < steps:
            checkpoint = await train(checkpoint, step + 1, float(np.mean(np.abs(advantages))))
            started = time.perf_counter()
            await client.update_weights(str(checkpoint), step + 1, mode="wait")
            update_seconds = time.perf_counter() - started
    return reports


def _version(value: object) -> int:
    if not isinstance(value, int):
        raise RolloutError(
            "a result without a weight version: the worker predates the control plane"
        )
    return value
