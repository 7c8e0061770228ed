"""The trainer's half of the simulation (`worker.dev.sim.trainer`, `trainer_checks`): the real
`RolloutClient` on simulated clients, the invariants its calls are judged by, and the client
defects the simulation found, each at the unit level."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from schemas import Completed, Failed, SamplingSpec
from tests.unit.test_rollout_answers import Topics, completed, prompt
from worker.client.conversation import Conversation, ConversationError


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


async def test_a_turn_whose_answer_does_not_continue_the_conversation_can_be_run_again(
    topics: Topics,
) -> None:
    """An answer to the turn's very sending (its submission echoed) that is to another prompt
    (a worker's defect, or a forged record) fails the turn with `ConversationError`; the
    conversation is where it was, and the turn is run again. Before, the refused turn stayed
    in flight in the conversation, and every re-run raised 'still in flight' for ever."""
    client = topics.client(timeout_s=3, max_retries=0)
    conversation = Conversation(sampling=SamplingSpec(max_tokens=4))
    first = asyncio.create_task(client.turn(conversation, prompt(6)))
    wrong = completed(await topics.job(0), [1, 2])
    topics.publish({**wrong, "prompt_token_count": 9})
    with pytest.raises(ConversationError, match="prompt of 9 tokens"):
        await asyncio.wait_for(first, 2)
    assert conversation.in_flight is None

    again = asyncio.create_task(client.turn(conversation, prompt(6)))
    topics.publish(completed(await topics.job(1), [3, 4]))
    result = await asyncio.wait_for(again, 2)

    assert isinstance(result, Completed) and result.completions[0].token_ids == [3, 4]
    assert [t.completion.token_ids for t in conversation.turns] == [[3, 4]]
    assert client.in_flight == 0
