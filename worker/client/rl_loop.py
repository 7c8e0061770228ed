"""A GRPO-shaped RL loop on the rollout fleet: generate groups, score, "train", update, repeat.

This is the whole trainer side a real loop needs from the fleet: `RolloutClient.generate` for
groups of `n` samples with routed experts, replay arrays in the trainer's layout, and
`update_weights` to move the fleet to the next policy. Scoring and training are toys here (a
reward for even token ids; training writes the next checkpoint by nudging the weights).

With `turns` > 1 every sample is a conversation (`RolloutClient.turn`): each turn after the
first adds a toy tool response to the conversation so far. A group's conversations share one
session, so the group runs on one worker, whose prefix cache holds their common prompt and each
conversation's earlier turns; each step reports the prompt tokens each turn found cached.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import numpy as np

from schemas import (
    Completed,
    Failed,
    Job,
    ReplayLayout,
    ReplaySample,
    SamplingSpec,
    replay_arrays,
)
from schemas.replay import PRIME_RL
from worker.client.conversation import Conversation
from worker.client.rollout import RolloutClient, RolloutError

__all__ = ["SampleReport", "StepReport", "TurnReport", "rl_loop"]

# Writes checkpoint `step` from the previous one and the step's mean |advantage|.
Train = Callable[[Path, int, float], Awaitable[Path]]


class SampleReport(msgspec.Struct, frozen=True):
    job_id: str
    index: int
    weight_version: int
    #: The first turn's prompt; `tokens` is everything after it (every turn's output and the
    #: tool responses between them), so prompt_len + tokens is the whole sequence.
    prompt_len: int
    tokens: int
    replay_shape: tuple[int, ...]
    reward: float


class TurnReport(msgspec.Struct, frozen=True):
    """Turn `turn` of a step's conversations, together: what the prefix cache saved."""

    turn: int
    jobs: int
    prompt_tokens: int
    cached_prompt_tokens: int
    workers: int


class StepReport(msgspec.Struct, frozen=True):
    step: int
    seconds: float
    samples_per_s: float
    tokens_per_s: float
    samples: list[SampleReport]
    #: Seconds the fleet took to move to this step's weights (the `update_weights` call);
    #: None on the first step, which runs on the weights the fleet started with.
    update_seconds: float | None = None
    #: Per turn, with `turns` > 1.
    turns: list[TurnReport] = msgspec.field(default_factory=list)


#: Tokens of the toy tool response a multi-turn sample gets after each turn.
TOOL_TOKENS = 40


class _Scored(msgspec.Struct, frozen=True):
    """One sample, scored: its job, weights, replay input and reward."""

    job_id: str
    index: int
    version: int
    sample: ReplaySample
    tokens: int
    reward: float


async def rl_loop(
    client: RolloutClient,
    train: Train,
    initial: Path,
    *,
    steps: int = 3,
    groups: int = 2,
    n: int = 4,
    max_tokens: int = 16,
    turns: int = 1,
    prompt_tokens: int = 8,
    layout: ReplayLayout = PRIME_RL,
    on_step: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    """Run `steps` steps; step k generates on weights version k (and waits for them). Each
    sample has `turns` turns (one job of n samples per group when 1, else a conversation per
    sample); the first prompt has `prompt_tokens` tokens."""
    reports = []
    checkpoint = initial
    update_seconds: float | None = None
    for step in range(steps):
        prompts = [
            [(7 * step + 13 * g + i) % 400 + 20 for i in range(prompt_tokens)]
            for g in range(groups)
        ]
        t0 = time.perf_counter()
        per_turn: list[TurnReport] = []
        if turns == 1:
            scored = await _one_turn(client, step, prompts, n, max_tokens)
        else:
            scored, per_turn = await _conversations(
                client, step, prompts=prompts, n=n, max_tokens=max_tokens, turns=turns
            )
        seconds = time.perf_counter() - t0
        advantages: list[float] = []
        for g in range(groups):
            rewards = [s.reward for s in scored[g * n : (g + 1) * n]]
            baseline = float(np.mean(rewards))  # GRPO: the group's mean is the baseline
            advantages += [reward - baseline for reward in rewards]
        # One call for the step's samples: a trainer packs them into micro-batches, which take
        # one dtype.
        arrays = replay_arrays([s.sample for s in scored], layout)
        samples = [
            SampleReport(
                job_id=s.job_id,
                index=s.index,
                weight_version=s.version,
                prompt_len=len(prompts[0]),
                tokens=s.tokens,
                replay_shape=tuple(replay.shape),
                reward=s.reward,
            )
            for s, replay in zip(scored, arrays, strict=True)
        ]
        tokens = sum(s.tokens for s in samples)
        report = StepReport(
            step=step,
            seconds=seconds,
            samples_per_s=len(samples) / seconds,
            tokens_per_s=tokens / seconds,
            samples=samples,
            update_seconds=update_seconds,
            turns=per_turn,
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


async def _one_turn(
    client: RolloutClient, step: int, prompts: list[list[int]], n: int, max_tokens: int
) -> list[_Scored]:
    """Each group as one job of `n` samples."""
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
    results = await client.generate(jobs)
    scored = []
    for job, result in zip(jobs, results, strict=True):
        if isinstance(result, Failed):
            raise RolloutError(f"step {step}: {job.job_id} failed: {result.error.detail}")
        version = _version(result.weight_version)
        prompt_len = len(job.prompt_token_ids or ())
        scored += [
            _Scored(
                job.job_id,
                c.index,
                version,
                ReplaySample(c, prompt_len),
                len(c.token_ids),
                _reward(c.token_ids),
            )
            for c in result.completions
        ]
    return scored


async def _conversations(
    client: RolloutClient,
    step: int,
    *,
    prompts: list[list[int]],
    n: int,
    max_tokens: int,
    turns: int,
) -> tuple[list[_Scored], list[TurnReport]]:
    """Each sample as a conversation of `turns` turns; a group's conversations share its
    session, so one worker serves the group and its cache holds their common prompt."""
    groups = [
        [
            Conversation(
                f"step{step}-group{g}",
                conversation_id=f"step{step}-group{g}-sample{i}",
                # Every turn its full length: the toy tool always answers, and each turn's
                # cached share is then the same from run to run.
                sampling=SamplingSpec(
                    max_tokens=max_tokens, seed=step * 100 + g * n + i, ignore_eos=True
                ),
                min_weight_version=step,
                metadata={"step": str(step), "group": str(g), "sample": str(i)},
            )
            for i in range(n)
        ]
        for g in range(len(prompts))
    ]
    everyone = [c for group in groups for c in group]
    per_turn = []
    for turn in range(turns):

        async def take(conversation: Conversation, group: int, turn: int) -> Completed:
            new = prompts[group] if turn == 0 else _tool_response(conversation, turn)
            result = await client.turn(conversation, new)
            if isinstance(result, Failed):
                raise RolloutError(f"step {step}: {result.job_id} failed: {result.error.detail}")
            return result

        answered = await asyncio.gather(
            *(take(c, g, turn) for g, group in enumerate(groups) for c in group)
        )
        per_turn.append(
            TurnReport(
                turn=turn,
                jobs=len(answered),
                prompt_tokens=sum(r.prompt_token_count for r in answered),
                cached_prompt_tokens=sum(_cached(r) for r in answered),
                workers=len({r.worker for r in answered}),
            )
        )
    scored = []
    for conversation in everyone:
        sequence = conversation.token_ids
        first_prompt = len(conversation.turns[0].prompt_token_ids)
        outputs = [t for turn in conversation.turns for t in turn.completion.token_ids]
        scored.append(
            _Scored(
                conversation.conversation_id,
                0,
                _version(conversation.results[-1].weight_version),
                conversation.replay_sample(),
                len(sequence) - first_prompt,
                _reward(outputs),
            )
        )
    return scored, per_turn


def _tool_response(conversation: Conversation, turn: int) -> list[int]:
    """A toy tool's answer: tokens drawn from the conversation so far."""
    history = conversation.token_ids
    return [(history[-1] + 11 * turn + 5 * i) % 400 + 20 for i in range(TOOL_TOKENS)]


def _reward(tokens: list[int]) -> float:
    """The toy reward: the share of even token ids."""
    return float(np.mean([t % 2 == 0 for t in tokens])) if tokens else 0.0


def _cached(result: Completed) -> int:
    cached = result.cached_prompt_tokens
    return cached if isinstance(cached, int) else 0


def _version(value: object) -> int:
    if not isinstance(value, int):
        raise RolloutError(
            "a result without a weight version: the worker predates the control plane"
        )
    return value
