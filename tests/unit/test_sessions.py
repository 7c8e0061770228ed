"""Sessions: a conversation's turns keyed by one session, the prompt tokens a turn found cached,
and the jobs a conversation builds turn after turn."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from aiokafka import ConsumerRecord, TopicPartition

from schemas import (
    RECIPES,
    Completed,
    ErrorCode,
    ErrorInfo,
    Failed,
    Job,
    SamplingSpec,
    SchemaError,
    decode_job,
    decode_result,
    encode,
    replay_arrays,
)
from tests.fakes import ScriptedEngine
from worker.answering.answers import AnswerBuilder
from worker.cli.main import summarize
from worker.client.conversation import Conversation, ConversationError
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import settings_from
from worker.core.limits import RecordLimits
from worker.core.metrics import Metrics
from worker.engines.mock import MOCK_BLOCK_SIZE, MockEngine, MockEngineSettings

SETTINGS = MockEngineSettings(num_layers=3, top_k=2, num_experts=8, max_model_len=4096)
BLOCK = MOCK_BLOCK_SIZE


def tokens(count: int, first: int = 20) -> list[int]:
    return [(first + 7 * i) % 500 + 1 for i in range(count)]


# ---- the wire ----------------------------------------------------------------------------------


def test_a_job_is_keyed_by_its_session_and_without_one_by_its_id() -> None:
    turn = decode_job(b'{"job_id": "c1-turn2", "prompt": "hi", "session_id": "conversation-1"}')
    alone = decode_job(b'{"job_id": "c1-turn2", "prompt": "hi"}')

    assert turn.session_id == "conversation-1"
    assert turn.record_key == b"conversation-1"
    assert alone.session_id is None
    assert alone.record_key == b"c1-turn2"


@pytest.mark.parametrize(
    ("session", "words"),
    [("", "length >= 1"), ("s" * 257, "length <= 256"), (7, "Expected `str | null`")],
)
def test_a_session_id_that_is_empty_too_long_or_not_text_is_refused_naming_it(
    session: object, words: str
) -> None:
    with pytest.raises(SchemaError) as caught:
        decode_job(encode({"job_id": "j", "prompt": "hi", "session_id": session}))
    assert caught.value.path == "$.session_id"
    assert words in caught.value.message


def test_cached_prompt_tokens_travel_and_are_absent_when_the_engine_did_not_say() -> None:
    said = Completed(job_id="j", completions=[], prompt_token_count=300, cached_prompt_tokens=256)
    silent = Completed(job_id="j", completions=[], prompt_token_count=300)

    assert decode_result(encode(said)) == said
    assert b"cached_prompt_tokens" not in encode(silent)
    assert decode_result(encode(silent)) == silent
    with pytest.raises(SchemaError) as caught:
        decode_result(encode({**msgspec.to_builtins(said), "cached_prompt_tokens": -1}))
    assert caught.value.path == "$.cached_prompt_tokens"


# ---- the mock engine's prefix cache --------------------------------------------------------------


def job(job_id: str, prompt: list[int], max_tokens: int = 8, **fields: Any) -> Job:
    sampling = SamplingSpec(max_tokens=max_tokens, ignore_eos=True)
    return Job(job_id=job_id, prompt_token_ids=prompt, sampling=sampling, **fields)


async def test_a_turn_finds_the_full_blocks_of_the_turn_before_it_cached() -> None:
    engine = MockEngine(SETTINGS)
    first = await engine.generate(job("t0", tokens(100)), "t0")
    history = [*first.prompt_token_ids, *first.completions[0].token_ids]  # 108 tokens
    second = await engine.generate(job("t1", [*history, *tokens(30, 3)]), "t1")

    assert first.cached_prompt_tokens == 0
    # The first turn's KV but its last token (never fed forward): 107 tokens, 6 full blocks.
    assert second.cached_prompt_tokens == (len(history) - 1) // BLOCK * BLOCK == 96


async def test_a_prompt_all_cached_still_computes_its_last_token() -> None:
    # vLLM's rule: a hit covers at most the prompt's tokens but its last, whose logits must be
    # computed (`vllm/v1/core/kv_cache_manager.py`, `KVCacheManager.get_computed_blocks`:
    # max_cache_hit_length = request.num_tokens - 1), in whole blocks.
    engine = MockEngine(SETTINGS)
    prompt = tokens(BLOCK * 4 + 1)
    await engine.generate(job("a", prompt), "a")
    again = await engine.generate(job("b", prompt), "b")
    short = await engine.generate(job("c", prompt[: BLOCK * 4]), "c")

    assert again.cached_prompt_tokens == BLOCK * 4
    # A prompt of exactly 4 blocks: its last token is computed, so only 3 blocks are hits.
    assert short.cached_prompt_tokens == BLOCK * 3


async def test_new_weights_and_a_reset_leave_nothing_cached(tmp_path: Any) -> None:
    engine = MockEngine(SETTINGS)
    prompt = tokens(200)
    await engine.generate(job("a", prompt), "a")
    await engine.reset_prefix_cache()
    after_reset = await engine.generate(job("b", prompt), "b")
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 3, "num_experts_per_tok": 2, "num_experts": 8}'
    )
    await engine.load_weights(str(tmp_path), 1)
    after_update = await engine.generate(job("c", prompt), "c")

    assert after_reset.cached_prompt_tokens == 0
    # Salted by the weights, as vLLM salts its cache: KV of the old weights is never reused.
    assert after_update.cached_prompt_tokens == 0
    assert (await engine.generate(job("d", prompt), "d")).cached_prompt_tokens == 192


async def test_a_different_prefix_misses_from_its_first_differing_block() -> None:
    engine = MockEngine(SETTINGS)
    prompt = tokens(100)
    await engine.generate(job("a", prompt), "a")
    changed = [*prompt[:40], prompt[40] + 1, *prompt[41:]]

    out = await engine.generate(job("b", changed), "b")

    assert out.cached_prompt_tokens == 32  # blocks [0, 16) and [16, 32); [32, 48) differs


# ---- the answer and the metrics ------------------------------------------------------------------


async def test_a_result_says_what_was_cached_and_the_metrics_count_both_kinds() -> None:
    settings = settings_from(
        {"results_topic": "results", "dead_letter_topic": "dlq", "engine": "mock"}, {}
    )
    metrics = Metrics()
    builder = AnswerBuilder(
        settings,
        ScriptedEngine(SETTINGS),
        RecordLimits.from_topic_limits(settings, {}),
        metrics,
        clock=SYSTEM_CLOCK,
    )
    prompt = tokens(70)
    tp = TopicPartition("jobs", 0)

    results = []
    for offset, job_id in enumerate(["first", "second"]):
        value = encode(job(job_id, prompt, session_id="s"))
        record = ConsumerRecord("jobs", 0, offset, 0, 0, b"s", value, None, 1, len(value), ())
        answer = await builder.answer(tp, record)
        (out,) = answer.records
        assert out.value is not None
        results.append(decode_result(out.value))

    first, second = results
    assert isinstance(first, Completed) and isinstance(second, Completed)
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == 64
    assert metrics.prompt_tokens.values == {("cached",): 64, ("computed",): 70 + 70 - 64}


# ---- conversations -------------------------------------------------------------------------------


async def answer(engine: MockEngine, j: Job, version: int = 0) -> Completed:
    out = await engine.generate(j, j.job_id)
    return Completed(
        job_id=j.job_id,
        completions=out.completions,
        prompt_token_count=len(out.prompt_token_ids),
        weight_version=version,
        cached_prompt_tokens=out.cached_prompt_tokens or 0,
    )


async def test_each_turn_extends_the_conversation_from_where_its_rows_end() -> None:
    engine = MockEngine(SETTINGS)
    conversation = Conversation(
        "group-3", conversation_id="c7", sampling=SamplingSpec(max_tokens=5, ignore_eos=True)
    )
    new = [tokens(40), tokens(9, 1), tokens(12, 2), tokens(3, 4)]

    jobs = []
    for number, extra in enumerate(new):
        j = conversation.next_job(extra)
        history = conversation.token_ids
        assert j.job_id == f"c7-turn{number}"
        assert j.session_id == "group-3" and j.record_key == b"group-3"
        assert j.prompt_token_ids == [*history, *extra]
        assert j.routed_experts_prompt_start == max(len(history) - 1, 0)
        assert j.return_routed_experts
        turn = conversation.record(await answer(engine, j))
        assert turn is not None and turn.prompt_token_ids == j.prompt_token_ids
        jobs.append(j)

    sequence, prompt_len, routed = conversation.stitched()
    assert sequence == conversation.token_ids
    assert len(sequence) == sum(map(len, new)) + 4 * 5
    assert prompt_len == 40
    assert routed.start == 0 and routed.shape[0] == len(sequence) - 1
    assert [r.cached_prompt_tokens for r in conversation.results] == [
        0,
        *(
            (len(j.prompt_token_ids or ()) - len(e) - 1) // BLOCK * BLOCK
            for j, e in zip(jobs[1:], new[1:], strict=True)
        ),
    ]
    # One sample of a batch, in every trainer's layout, from the conversation's turns.
    for name, layout in RECIPES.items():
        (array,) = replay_arrays([conversation.replay_sample()], layout, num_experts=8)
        assert array.shape[0] in (len(sequence), len(sequence) - 1), name
    (prime,) = replay_arrays([conversation.replay_sample()], RECIPES["prime-rl"])
    np.testing.assert_array_equal(prime[: len(sequence) - 1], routed.to_array())


async def test_a_turn_never_asks_for_older_weights_than_the_turn_before_it_ran_on() -> None:
    engine = MockEngine(SETTINGS)
    conversation = Conversation(min_weight_version=2)

    first = conversation.next_job(tokens(20))
    conversation.record(await answer(engine, first, version=5))
    second = conversation.next_job(tokens(4), min_weight_version=3)
    conversation.record(await answer(engine, second, version=5))
    third = conversation.next_job(tokens(4), min_weight_version=9)

    assert first.min_weight_version == 2
    assert second.min_weight_version == 5
    assert third.min_weight_version == 9


async def test_the_weight_floor_is_the_oldest_version_the_next_turn_may_run_on() -> None:
    engine = MockEngine(SETTINGS)
    unbounded, bounded = Conversation(), Conversation(min_weight_version=7)
    assert (unbounded.weight_floor, bounded.weight_floor) == (None, 7)

    unbounded.record(await answer(engine, unbounded.next_job(tokens(20)), version=4))
    bounded.record(await answer(engine, bounded.next_job(tokens(20)), version=9))

    assert (unbounded.weight_floor, bounded.weight_floor) == (4, 9)


async def test_a_failed_turn_leaves_the_conversation_where_it_was() -> None:
    engine = MockEngine(SETTINGS)
    conversation = Conversation(sampling=SamplingSpec(max_tokens=3))
    conversation.record(await answer(engine, conversation.next_job(tokens(20))))
    asked = conversation.next_job(tokens(5))
    failed = Failed(
        job_id=asked.job_id,
        error=ErrorInfo(code=ErrorCode.ABORTED, detail="paused", retryable=True),
    )

    assert conversation.record(failed) is None
    again = conversation.next_job(tokens(5))

    # The same turn asked again, under a submission of its own.
    assert msgspec.structs.replace(again, submission_id=None) == msgspec.structs.replace(
        asked, submission_id=None
    )
    assert again.submission_id is not None and again.submission_id != asked.submission_id
    assert len(conversation.turns) == 1


async def test_answers_that_do_not_continue_the_conversation_are_refused() -> None:
    engine = MockEngine(SETTINGS)
    conversation = Conversation(sampling=SamplingSpec(max_tokens=3))
    with pytest.raises(ConversationError, match="first turn needs"):
        conversation.next_job([])
    with pytest.raises(ConversationError, match="no turn is in flight"):
        conversation.record(Completed(job_id="x", completions=[], prompt_token_count=1))
    first = conversation.next_job(tokens(20))
    with pytest.raises(ConversationError, match="still in flight"):
        conversation.next_job(tokens(3))
    with pytest.raises(ConversationError, match="not the turn in flight"):
        conversation.record(Completed(job_id="other", completions=[], prompt_token_count=1))
    # A worker that ignored the start it was asked for: its rows would not stitch.
    answered = await answer(engine, first)
    (completion,) = answered.completions
    assert completion.routed_experts is not None
    moved = msgspec.structs.replace(
        completion,
        routed_experts=msgspec.structs.replace(completion.routed_experts, start=3),
    )
    with pytest.raises(ConversationError, match="from position 0 was asked for"):
        conversation.record(msgspec.structs.replace(answered, completions=[moved]))
    two = conversation.next_job(tokens(20))
    with pytest.raises(ConversationError, match="one whole completion, not 2"):
        conversation.record(
            msgspec.structs.replace(answered, job_id=two.job_id, completions=[completion] * 2)
        )
    assert conversation.turns == []
    with pytest.raises(ConversationError, match="no turn answered"):
        conversation.stitched()


def test_a_conversation_continues_one_sequence() -> None:
    with pytest.raises(ConversationError, match=r"sampling\.n must be 1, not 4"):
        Conversation(sampling=SamplingSpec(n=4))
    conversation = Conversation()
    with pytest.raises(ConversationError, match=r"sampling\.n must be 1, not 2"):
        conversation.next_job(tokens(10), sampling=SamplingSpec(n=2))
    with pytest.raises(SchemaError) as caught:
        conversation.next_job([-1])
    assert caught.value.path == "$.prompt_token_ids[0]"


def test_results_summary_says_what_was_cached_when_the_engine_said() -> None:
    said = Completed(job_id="t1", completions=[], prompt_token_count=300, cached_prompt_tokens=256)
    silent = Completed(job_id="t1", completions=[], prompt_token_count=300)

    assert summarize(said) == "t1 completed prompt=300 cached=256"
    assert summarize(silent) == "t1 completed prompt=300"


async def test_an_answer_to_an_earlier_asking_of_a_turn_is_refused_and_the_turn_stays_asked() -> (
    None
):
    engine = MockEngine(SETTINGS)
    conversation = Conversation(sampling=SamplingSpec(max_tokens=3))
    conversation.record(await answer(engine, conversation.next_job(tokens(20))))
    first = conversation.next_job(tokens(5))
    conversation.record(
        Failed(job_id=first.job_id, error=ErrorInfo(code=ErrorCode.EXPIRED, detail="late"))
    )
    rerun = conversation.next_job(tokens(9, 3))
    late = msgspec.structs.replace(await answer(engine, first), submission_id=first.submission_id)
    unnamed = msgspec.structs.replace(late, submission_id=msgspec.UNSET)  # an older worker's

    with pytest.raises(ConversationError, match="an earlier asking of the turn"):
        conversation.record(late)
    with pytest.raises(ConversationError, match=r"a prompt of \d+ tokens, not"):
        conversation.record(unnamed)
    same_length = msgspec.structs.replace(
        unnamed,
        prompt_token_count=len(rerun.prompt_token_ids or ()),
        prompt_token_ids=[0] * len(rerun.prompt_token_ids or ()),
    )
    with pytest.raises(ConversationError, match="another prompt of the same length"):
        conversation.record(same_length)
    assert conversation.in_flight == rerun and len(conversation.turns) == 1

    fresh = msgspec.structs.replace(await answer(engine, rerun), submission_id=rerun.submission_id)
    turn = conversation.record(fresh)
    assert turn is not None and turn.prompt_token_ids == rerun.prompt_token_ids
