"""The RL loop's trainer side on a fake fleet: replay arrays per step, in one dtype."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from schemas import Completed, Job, Result
from worker.client.conversation import Conversation
from worker.client.rl_loop import rl_loop
from worker.client.rollout import RolloutClient
from worker.engines.mock import MockEngine, MockEngineSettings


class MockFleet:
    """`RolloutClient.generate` and `update_weights` answered by a mock engine in-process."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        self.version = 0
        self.keys: list[bytes] = []

    async def generate(self, jobs: list[Job]) -> list[Result]:
        results: list[Result] = []
        for job in jobs:
            out = await self.engine.generate(job, job.job_id)
            results.append(
                Completed(
                    job_id=job.job_id,
                    completions=out.completions,
                    prompt_token_count=len(out.prompt_token_ids),
                    weight_version=self.version,
                    cached_prompt_tokens=out.cached_prompt_tokens or 0,
                    worker="mock",
                )
            )
        return results

    async def turn(self, conversation: Conversation, new_tokens: list[int]) -> Result:
        job = conversation.next_job(new_tokens)
        self.keys.append(job.record_key)
        (result,) = await self.generate([job])
        conversation.record(result)
        return result

    async def update_weights(self, path: str, version: int, *, mode: str) -> None:
        self.version = version


async def test_each_step_replays_every_sample_in_the_layouts_shape(tmp_path: Path) -> None:
    settings = MockEngineSettings(num_layers=3, top_k=2, num_experts=300, max_model_len=256)
    fleet = MockFleet(MockEngine(settings))

    async def train(checkpoint: Path, step: int, advantage: float) -> Path:
        return tmp_path / f"step-{step}"

    reports = await rl_loop(
        cast(RolloutClient, fleet), train, tmp_path, steps=2, groups=2, n=3, max_tokens=5
    )

    assert [r.step for r in reports] == [0, 1]
    for report in reports:
        assert len(report.samples) == 6
        assert {s.weight_version for s in report.samples} == {report.step}
        for sample in report.samples:
            # prime-rl: one row per position of prompt + completion, every layer.
            assert sample.replay_shape == (sample.prompt_len + sample.tokens, 3, 2)


async def test_multi_turn_samples_are_conversations_keyed_by_their_group(tmp_path: Path) -> None:
    settings = MockEngineSettings(num_layers=3, top_k=2, num_experts=8, max_model_len=1024)
    fleet = MockFleet(MockEngine(settings))

    async def train(checkpoint: Path, step: int, advantage: float) -> Path:
        return tmp_path / f"step-{step}"

    reports = await rl_loop(
        cast(RolloutClient, fleet),
        train,
        tmp_path,
        steps=2,
        groups=2,
        n=3,
        max_tokens=5,
        turns=3,
        prompt_tokens=40,
    )

    for report in reports:
        assert len(report.samples) == 6
        assert {s.weight_version for s in report.samples} == {report.step}
        for sample in report.samples:
            # Three outputs of 5 and two tool responses of 40 after the first prompt.
            assert (sample.prompt_len, sample.tokens) == (40, 3 * 5 + 2 * 40)
            # prime-rl: one row per position of the whole conversation, every layer.
            assert sample.replay_shape == (40 + 95, 3, 2)
        assert [t.turn for t in report.turns] == [0, 1, 2]
        assert all(t.jobs == 6 for t in report.turns)
        first, *later = report.turns
        # A group's samples share its prompt: after the first, each finds 2 blocks of it
        # (40 tokens; the last one is computed) in the mock engine's cache (16-token blocks).
        assert first.cached_prompt_tokens == 2 * 2 * 32
        for turn in later:
            # Every earlier turn of each conversation, in whole blocks but its last token.
            history = 40 + turn.turn * 5 + (turn.turn - 1) * 40
            assert turn.cached_prompt_tokens == 6 * ((history - 1) // 16 * 16)
            assert turn.workers == 1
    # Every turn of a group's conversations went out under the group's session.
    assert set(fleet.keys) == {f"step{s}-group{g}".encode() for s in (0, 1) for g in (0, 1)}
