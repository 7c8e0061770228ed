"""The trainer's half of the simulation (`worker.dev.sim.trainer`, `trainer_checks`): the real
`RolloutClient` on simulated clients, the invariants its calls are judged by, and the client
defects the simulation found, each at the unit level."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from schemas import Failed
from tests.unit.test_rollout_answers import Topics, prompt


@pytest.fixture
async def topics() -> Any:
    topics = Topics()
    yield topics
    await topics.close()


async def test_an_expired_answer_names_the_submission_of_the_asking_it_answers(
    topics: Topics,
) -> None:
    """The client's own `expired` answer stands for a worker's, which echoes the job's
    submission: a caller that matches answers to askings by it finds this one's asking.
    (Seen as `trainer_wrong_answer` in every seed of the trainer flag set: the answer named no
    submission.)"""
    client = topics.client(timeout_s=0.3, max_retries=0)
    future = client.submit(
        {"job_id": "j", "prompt_token_ids": prompt(3), "submission_id": "asking-1"}
    )
    result = await asyncio.wait_for(future, 2)
    assert isinstance(result, Failed) and result.error.code == "expired"
    assert result.submission_id == "asking-1"
    assert client.in_flight == 0
