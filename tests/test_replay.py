"""Replay arrays: the row rule, every fill and dtype choice, multi-turn stitching, the recipes."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    RECIPES,
    Completion,
    ReplayError,
    ReplayLayout,
    RoutedExperts,
    Turn,
    replay_array,
    stitch_turns,
)
from schemas.replay import NEMO_RL, PRIME_RL, SKYRL, SLIME, VERL

LAYERS, TOP_K, EXPERTS = 4, 2, 8
DENSE = 0  # layer 0 is dense: its slots are all zeros, as vLLM reports them
PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def routing_at(position: int) -> npt.NDArray[np.uint8]:
    """A deterministic 'full run': the row every position gets, distinct ids per MoE layer."""
    row = np.zeros((LAYERS, TOP_K), dtype=np.uint8)
    for layer in range(1, LAYERS):
        first = (position * 7 + layer * 3) % EXPERTS
        row[layer] = [(first + k * 3) % EXPERTS for k in range(TOP_K)]
    return row


def completion(prompt_len: int, tokens: int, start: int) -> Completion:
    rows = rows_for(range(start, prompt_len + tokens - 1))
    return Completion(
        index=0,
        token_ids=list(range(100, 100 + tokens)),
        text="",
        finish_reason="length",
        routed_experts=RoutedExperts.from_array(rows, start=start),
    )


def rows_for(positions: range) -> npt.NDArray[np.uint8]:
    if not positions:
        return np.zeros((0, LAYERS, TOP_K), dtype=np.uint8)
    return np.stack([routing_at(p) for p in positions])


def full(positions: int) -> npt.NDArray[np.uint8]:
    return rows_for(range(positions))


shapes = st.integers(1, 30).flatmap(
    lambda p: st.tuples(st.just(p), st.integers(1, 20), st.integers(0, p))
)


@PROPERTY
@given(shape=shapes)
def test_rows_sit_at_absolute_positions_and_fills_cover_the_rest(shape):
    prompt_len, tokens, start = shape
    c = completion(prompt_len, tokens, start)
    total = prompt_len + tokens
    out = replay_array(
        c, prompt_len, ReplayLayout(before_start="zeros", last_row="minus_one", dtype="int16")
    )
    assert out.shape == (total, LAYERS, TOP_K) and out.dtype == np.int16
    np.testing.assert_array_equal(out[start : total - 1], full(total - 1)[start:])
    assert (out[:start] == 0).all() and (out[total - 1] == -1).all()
    dropped = replay_array(c, prompt_len, ReplayLayout(before_start="zeros"))
    assert dropped.shape[0] == total - 1 and dropped.dtype == np.uint8  # the wire dtype
    response = replay_array(
        c, prompt_len, ReplayLayout(before_start="zeros", last_row="repeat", prompt_rows=False)
    )
    assert response.shape[0] == tokens
    if tokens >= 2:
        np.testing.assert_array_equal(response[-1], response[-2])
    if start < total - 1:
        moe = replay_array(c, prompt_len, ReplayLayout(before_start="zeros", moe_layers_only=True))
        assert moe.shape[1] == LAYERS - 1  # the dense layer's zeros are gone
        named = replay_array(
            c,
            prompt_len,
            ReplayLayout(before_start="zeros", moe_layers_only=True),
            moe_layers=[1, 3],
        )
        assert named.shape[1] == 2


@PROPERTY
@given(shape=shapes, recipe=st.sampled_from(sorted(RECIPES)))
def test_each_recipe_keeps_its_documented_shape_rule(shape, recipe):
    prompt_len, tokens, start = shape
    layout = RECIPES[recipe]
    c = completion(prompt_len, tokens, start)
    total = prompt_len + tokens
    if start > 0 and layout.before_start == "error":
        with pytest.raises(ReplayError, match="routing starts at position"):
            replay_array(c, prompt_len, layout)
        return
    out = replay_array(c, prompt_len, layout)
    # Every recipe: one row per position of prompt + completion, aligned at position 0.
    assert out.shape == (total, LAYERS, TOP_K)
    np.testing.assert_array_equal(out[start : total - 1], full(total - 1)[start:])
    last = out[total - 1]
    if layout is PRIME_RL:
        assert out.dtype == np.uint8
        if total >= 2:
            np.testing.assert_array_equal(last, out[total - 2])
    elif layout is SLIME:
        assert out.dtype == np.int32
        assert (last == np.arange(TOP_K)).all()
    elif layout is VERL:
        assert out.dtype == np.int16 and (last == 0).all() and (out[:start] == 0).all()
    elif layout is SKYRL:
        assert out.dtype == np.uint8 and (out >= 0).all()
    else:
        assert layout is NEMO_RL
        assert out.dtype == np.int8 and (last == -1).all() and (out[:start] == -1).all()


def test_skyrl_left_pads_and_canonical_dtype_widens_for_large_ids():
    c = completion(4, 3, 0)
    padded = replay_array(
        c, 4, ReplayLayout(last_row="arange", dtype="canonical", pad_side="left", pad_to=10)
    )
    assert padded.shape[0] == 10 and (padded[:3] == 0).all()
    big = Completion(
        index=0,
        token_ids=[1, 2],
        text="",
        finish_reason="length",
        routed_experts=RoutedExperts.from_array(np.full((3, 2, 2), 300, dtype=np.int32)),
    )
    assert replay_array(big, 2, SKYRL).dtype == np.int16
    with pytest.raises(ReplayError, match="do not fit"):
        replay_array(big, 2, ReplayLayout(dtype="uint8"))
    with pytest.raises(ReplayError, match="signed dtype"):
        replay_array(c, 4, ReplayLayout(last_row="minus_one", dtype="narrowest_unsigned"))
    with pytest.raises(ReplayError, match="do not fit pad_to"):
        replay_array(c, 4, ReplayLayout(pad_to=2))


turn_plans = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=4)


def turns_from(first_prompt: int, plan: list[tuple[int, int]]) -> list[Turn]:
    """Each turn: the previous sequence plus `user` new tokens as its prompt, `tokens` out."""
    turns: list[Turn] = []
    sequence = list(range(1, first_prompt + 1))
    start = 0
    for number, (user, tokens) in enumerate(plan):
        prompt = sequence if number == 0 else [*sequence, *range(500, 500 + user)]
        c = completion(len(prompt), tokens, start)
        turns.append(Turn(prompt, c))
        sequence = [*prompt, *c.token_ids]
        start = len(sequence) - 1  # the next turn's routed_experts_prompt_start
    return turns


@PROPERTY
@given(first_prompt=st.integers(1, 10), plan=turn_plans, recipe=st.sampled_from(sorted(RECIPES)))
def test_multi_turn_stitching_equals_one_full_run(first_prompt, plan, recipe):
    turns = turns_from(first_prompt, plan)
    sequence, first_len, stitched = stitch_turns(turns)
    assert first_len == first_prompt
    assert stitched.start == 0 and stitched.end == len(sequence) - 1
    np.testing.assert_array_equal(stitched.to_array(), full(len(sequence) - 1))
    *earlier, last = turns
    out = replay_array(
        last.completion,
        len(last.prompt_token_ids),
        RECIPES[recipe],
        earlier=earlier,
        prompt_token_ids=last.prompt_token_ids,
    )
    assert out.shape[0] == len(sequence)
    np.testing.assert_array_equal(out[: len(sequence) - 1], full(len(sequence) - 1))


def test_inconsistent_inputs_are_refused_with_what_is_wrong():
    c = completion(5, 3, 0)
    with pytest.raises(
        ReplayError, match=r"cover positions \[0, 7\) but the row rule gives \[0, 8\)"
    ):
        replay_array(c, 6)
    turns = turns_from(4, [(1, 3), (2, 2)])
    second = turns[1].completion.routed_experts
    assert second is not None
    broken = Turn(
        turns[1].prompt_token_ids, completion(len(turns[1].prompt_token_ids), 2, second.start + 1)
    )
    with pytest.raises(ReplayError, match="must be 6"):
        stitch_turns([turns[0], broken])
    other_prompt = Turn([9, 9, 9, 9, 9, 9, 9, 9], turns[1].completion)
    with pytest.raises(ReplayError, match="does not begin with turn 0's prompt and output"):
        stitch_turns([turns[0], other_prompt])
    with pytest.raises(ReplayError, match="pass this turn's prompt_token_ids"):
        replay_array(turns[1].completion, 8, earlier=[turns[0]])
    bare = Completion(index=0, token_ids=[1], text="", finish_reason="stop")
    with pytest.raises(ReplayError, match="has no routed experts"):
        replay_array(bare, 3)
    with pytest.raises(ReplayError, match="no turns"):
        stitch_turns([])
