"""The RL loop's trainer side on a fake fleet: replay arrays per step, in one dtype."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from schemas import Completed, Job, Result
from worker.client.rl_loop import rl_loop
from worker.client.rollout import RolloutClient
from worker.engines.mock import MockEngine, MockEngineSettings


class MockFleet:
    """`RolloutClient.generate` and `update_weights` answered by a mock engine in-process."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        self.version = 0

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
                )
            )
        return results

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
