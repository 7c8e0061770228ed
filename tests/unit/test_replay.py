"""Replay arrays: each recipe against its framework's own rule, the layout options, the batch
dtype, multi-turn stitching, and bad input.

Each framework's rule is written here a second time, as a small function that does what that
framework's code does with what vLLM returned for each turn (NOTES §5 names the file and the
function; the citation is on each), in the release the recipe names (`checked_against`). The
recipes must build exactly that, or refuse the input where the framework cannot take it. The
`frameworks` lane (tests/integration/frameworks/) runs the same arrays through the released
code of verifiers, verl and SkyRL itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    RECIPES,
    Completed,
    Completion,
    ReplayError,
    ReplayLayout,
    ReplaySample,
    RoutedExperts,
    Turn,
    replay_array,
    replay_arrays,
    stitch_turns,
)
from schemas.replay import NEMO_RL, PRIME_RL, SKYRL, SLIME, VERL
from tests.hypothesis_profiles import examples

LAYERS, TOP_K = 4, 2
DENSE = 0  # layer 0 is dense: its slots are all zeros, as vLLM reports them
PROPERTY = settings(max_examples=examples(0.8), suppress_health_check=[HealthCheck.too_slow])
Rows = npt.NDArray[np.integer]


def routing_at(position: int, ids_below: int) -> npt.NDArray[np.int64]:
    """A deterministic 'full run': the row every position gets, distinct ids below `ids_below`
    in each MoE layer (`ids_below` >= 4, not 3), the highest of them at position 0."""
    row = np.zeros((LAYERS, TOP_K), dtype=np.int64)
    for layer in range(1, LAYERS):
        first = (ids_below - 1 + position * 97 + (layer - 1) * 41) % ids_below
        row[layer] = [(first + k * 3) % ids_below for k in range(TOP_K)]
    return row


def rows_for(positions: range, ids_below: int = 8) -> npt.NDArray[np.int64]:
    if not positions:
        return np.zeros((0, LAYERS, TOP_K), dtype=np.int64)
    return np.stack([routing_at(p, ids_below) for p in positions])


def completion(
    prompt_len: int,
    tokens: int,
    start: int,
    *,
    ids_below: int = 8,
    num_experts: int | None = 8,
    index: int = 0,
) -> Completion:
    """What the worker publishes for one completion: vLLM's rows `[start, prompt + tokens - 1)`."""
    rows = rows_for(range(start, prompt_len + tokens - 1), ids_below)
    return Completion(
        index=index,
        token_ids=list(range(100 + index, 100 + index + tokens)),
        text="",
        finish_reason="length",
        routed_experts=RoutedExperts.from_array(rows, start=start, num_experts=num_experts),
    )


@dataclass(frozen=True)
class Rollout:
    """A multi-turn rollout as the worker answers it, and the full run's rows it stands for."""

    turns: list[Turn]
    ids_below: int

    @property
    def total(self) -> int:
        last = self.turns[-1]
        return len(last.prompt_token_ids) + len(last.completion.token_ids)

    @property
    def first_start(self) -> int:
        routed = self.turns[0].completion.routed_experts
        assert routed is not None
        return routed.start

    def full_run(self) -> npt.NDArray[np.int64]:
        """What one request with `routed_experts_prompt_start=0` for the whole sequence returns
        (NOTES §1: chained turns' rows equal these)."""
        return rows_for(range(self.total - 1), self.ids_below)

    def sample(self) -> ReplaySample:
        *earlier, last = self.turns
        return ReplaySample(
            last.completion, len(last.prompt_token_ids), earlier, last.prompt_token_ids
        )


def rollout(
    first_prompt: int,
    plan: list[tuple[int, int]],
    *,
    first_start: int = 0,
    ids_below: int = 8,
    num_experts: int | None = 8,
) -> Rollout:
    """Turns chained as `docs/trainer/wire-format.md` says: each prompt = the previous sequence
    plus `user` new tokens, `tokens` out, `routed_experts_prompt_start` = len(previous
    sequence) - 1."""
    turns: list[Turn] = []
    sequence = list(range(1, first_prompt + 1))
    start = first_start
    for number, (user, tokens) in enumerate(plan):
        prompt = sequence if number == 0 else [*sequence, *range(500, 500 + user)]
        c = completion(len(prompt), tokens, start, ids_below=ids_below, num_experts=num_experts)
        turns.append(Turn(prompt, c))
        sequence = [*prompt, *c.token_ids]
        start = len(sequence) - 1
    return Rollout(turns, ids_below)


def returned(turn: Turn) -> tuple[int, npt.NDArray[np.integer]]:
    routed = turn.completion.routed_experts
    assert routed is not None
    return routed.start, routed.to_array()


def sequence_len(turn: Turn) -> int:
    return len(turn.prompt_token_ids) + len(turn.completion.token_ids)


# --- Each framework's rule, from what vLLM returned per turn ----------------------------------


@dataclass(frozen=True)
class Refused:
    """The framework cannot take the input; `reason` matches the ReplayError that says so."""

    reason: str


# What a recipe answers a start past position 0 with, where its framework needs rows from 0.
START = "send routed_experts_prompt_start=0 for this job"


def prime_rl_builds(turns: list[Turn], num_experts: int) -> Rows | Refused:
    # verifiers 0.4.0, verifiers/v1/graph.py:_attribute_routed_experts: rows per message from
    # `off = path_len - start`; a start past the node's start reports no routing; the engine
    # omitted the last row, so a copy of the row before is appended as a placeholder, which
    # the next turn replaces with its first captured row, `arr[off - 1]`
    # (`_replace_placeholder_routing_row`).
    path = np.zeros((0, LAYERS, TOP_K), dtype=np.int64)
    for turn in turns:
        start, rows = returned(turn)
        off = len(path) - start
        if off < 0:
            return Refused(START)
        if len(path) and 1 <= off <= len(rows):
            path = np.concatenate([path[:-1], rows[off - 1 : off]])
        path = np.concatenate([path, rows[off:]])
        path = np.concatenate([path, path[-1:]])
    # src/prime_rl/trainer/batch.py: asserts shape[0] == len(input_ids), one dtype per
    # micro-batch; src/prime_rl/inference/vllm/routed_experts.py: uint8, uint16 past 255,
    # here by the model's expert count so that every sample agrees.
    assert path.shape[0] == sequence_len(turns[-1])
    return path.astype(np.uint8 if num_experts <= 256 else np.uint16)


def slime_builds(turns: list[Turn]) -> Rows | Refused:
    # slime/utils/misc.py:decode_int32_meta_array decodes as int32;
    # slime/utils/types.py:Sample._apply_meta_info keeps len(tokens) - 1 - start rows and
    # merges turns as existing[:start] + new.
    existing: Rows | None = None
    for turn in turns:
        start, rows = returned(turn)
        new = rows.astype(np.int32)
        assert new.shape[0] == sequence_len(turn) - 1 - start
        existing = new if existing is None else np.concatenate([existing[:start], new])
    assert existing is not None
    # The trainer asserts shape[0] == tokens - 1 before adding its dummy row.
    return existing if existing.shape[0] == sequence_len(turns[-1]) - 1 else Refused(START)


def slime_dummy_row(layers: int, num_experts: int) -> Rows:
    # slime/backends/megatron_utils/cp_utils.py: the one row the trainer appends (and its
    # TP/CP padding): arange(L * K).reshape(1, L, K) % num_experts.
    return np.arange(layers * TOP_K).reshape(1, layers, TOP_K) % num_experts


def verl_builds(r: Rollout) -> Rows | Refused:
    # verl/experimental/agent_loop/agent_loop.py: vLLM's raw array with no prompt start, each
    # turn's full array overwriting the last (tool_agent_loop.py), copied into an int16 zero
    # tensor of prompt + response rows. A raw array that starts past position 0 would sit at
    # position 0 there: verl cannot take it. Nor ids that int16 cannot hold.
    if r.first_start:
        return Refused(START)
    full = r.full_run()
    if full.size and full.max() > np.iinfo(np.int16).max:
        return Refused("do not fit dtype 'int16'")
    out = np.zeros((r.total, LAYERS, TOP_K), dtype=np.int16)
    out[: len(full)] = full
    return out


def verl_replayed_rows(array: Rows) -> Rows:
    # verl/utils/megatron/router_replay_utils.py:build_r3_replay_mask: every row but the
    # sequence's last is replayed.
    return array[: array.shape[0] - 1]


def skyrl_builds(turns: list[Turn], num_experts: int) -> Rows | Refused:
    # SkyRL 0.4.0, skyrl/backends/skyrl_train/utils/routed_experts.py:RoutedExpertTrace: each
    # turn asks for routed_experts_prompt_start = the rows held so far (0 on the first turn),
    # the rows it returns must number exactly prompt - start + generated - 1, and they are
    # appended; `finalize` gives the T - 1 captured rows. Entries are uint8, int16 or int32
    # (ROUTED_EXPERT_DTYPES), here for every id the model can produce.
    held: list[Rows] = []
    for turn in turns:
        start, rows = returned(turn)
        if start != sum(len(h) for h in held):
            return Refused(START)
        assert len(rows) == sequence_len(turn) - start - 1
        held.append(rows)
    high = num_experts - 1
    dtype = np.uint8 if high < 2**8 else np.int16 if high < 2**15 else np.int32
    return np.concatenate(held).astype(dtype)


def skyrl_batch(entries: list[Rows], totals: list[int]) -> tuple[Rows, list[int]]:
    # SkyRL 0.4.0, skyrl/train/dataset/preprocess.py:convert_prompts_responses_to_batch_tensors:
    # one [sum(T), layers, top_k] tensor and its cu_seqlens, each sequence's segment its entry
    # then arange(top_k) rows to the sequence's end; make_router_padding_mask counts an entry's
    # captured rows by its length.
    out = np.empty((sum(totals), LAYERS, TOP_K), dtype=max(e.dtype for e in entries))
    out[:] = np.arange(TOP_K)
    cu_seqlens = [0]
    for entry, total in zip(entries, totals, strict=True):
        out[cu_seqlens[-1] : cu_seqlens[-1] + len(entry)] = entry
        cu_seqlens.append(cu_seqlens[-1] + total)
    return out, cu_seqlens


def nemo_rl_builds(turns: list[Turn], num_experts: int, pad_to: int | None = None) -> Rows:
    # nemo_rl/models/generation/vllm/utils.py: [S, L, K] from arange(top_k) everywhere, the
    # returned rows copied in, -1 only in rows vLLM did not return; the next turn's prefill
    # replaces the previous turn's padded last row.
    sequence: Rows | None = None
    for turn in turns:
        start, rows = returned(turn)
        total = sequence_len(turn)
        out = np.empty((total, LAYERS, TOP_K), dtype=np.int64)
        out[:] = np.arange(TOP_K)
        out[:start] = -1
        out[start : total - 1] = rows
        if sequence is not None:
            out[: len(sequence) - 1] = sequence[:-1]
        sequence = out
    assert sequence is not None
    if pad_to is not None:
        padding = np.empty((pad_to - len(sequence), LAYERS, TOP_K), dtype=np.int64)
        padding[:] = np.arange(TOP_K)
        sequence = np.concatenate([sequence, padding])
    # interfaces.py:resolve_routed_experts_dtype: from the model's expert count.
    dtype = np.int8 if num_experts <= 128 else np.int16 if num_experts <= 32768 else np.int32
    return sequence.astype(dtype)


def assert_same(out: Rows, expected: Rows | Refused) -> None:
    assert not isinstance(expected, Refused), expected
    assert out.dtype == expected.dtype, (out.dtype, expected.dtype)
    assert out.shape == expected.shape
    np.testing.assert_array_equal(out, expected)


# --- prime-rl ----------------------------------------------------------------------------------


def test_prime_rl_copies_the_row_before_at_the_end_and_keeps_real_routes_at_turn_boundaries():
    # verifiers 0.4.0, verifiers/v1/graph.py:_attribute_routed_experts (rows, the last row's
    # copy) and _replace_placeholder_routing_row (a turn boundary gets the next turn's first
    # captured row); src/prime_rl/trainer/batch.py (shape[0] == len(input_ids), one dtype per
    # micro-batch).
    single = rollout(5, [(0, 4)])
    out = replay_array(single.turns[0].completion, 5, PRIME_RL)
    assert out.shape == (9, LAYERS, TOP_K) and out.dtype == np.uint8
    np.testing.assert_array_equal(out[:8], single.full_run())
    np.testing.assert_array_equal(out[8], out[7])
    assert_same(out, prime_rl_builds(single.turns, 8))

    two = rollout(4, [(0, 3), (2, 3)])  # turn 1 ends at position 6, turn 2 at 11
    out = replay_arrays([two.sample()], PRIME_RL)[0]
    assert out.shape == (12, LAYERS, TOP_K)
    # The boundary holds turn 2's first captured row, the real route, not a copy of row 5.
    np.testing.assert_array_equal(out[:11], two.full_run())
    assert (out[6] != out[5]).any()
    np.testing.assert_array_equal(out[11], out[10])
    assert_same(out, prime_rl_builds(two.turns, 8))


def test_prime_rl_refuses_a_start_past_position_zero_and_zero_pads():
    # verifiers/v1/graph.py:_attribute_routed_experts: a start past the node's start leaves
    # that branch without routing; src/prime_rl/trainer/batch.py zero-pads.
    late = rollout(6, [(0, 3)], first_start=2)
    assert isinstance(prime_rl_builds(late.turns, 8), Refused)
    with pytest.raises(ReplayError, match="send routed_experts_prompt_start=0 for this job"):
        replay_array(late.turns[0].completion, 6, PRIME_RL)
    c = completion(3, 2, 0)
    padded = replay_array(c, 3, msgspec.structs.replace(PRIME_RL, pad_to=8))
    assert padded.shape[0] == 8 and (padded[5:] == 0).all()
    np.testing.assert_array_equal(padded[:5], replay_array(c, 3, PRIME_RL))


def test_prime_rl_dtype_follows_the_model_not_the_ids_seen():
    # src/prime_rl/trainer/batch.py requires one dtype across a micro-batch: on a 300-expert
    # model a sample whose ids stay below 256 must not come out uint8 beside uint16 ones.
    small = completion(4, 3, 0, ids_below=8, num_experts=300)
    large = completion(4, 3, 0, ids_below=300, num_experts=300)
    arrays = replay_arrays([ReplaySample(small, 4), ReplaySample(large, 4)], PRIME_RL)
    assert [a.dtype for a in arrays] == [np.uint16, np.uint16]
    assert replay_array(small, 4, PRIME_RL).dtype == np.uint16
    # A record without the expert count (an older worker): the ids seen in the whole call.
    old_small = completion(4, 3, 0, ids_below=8, num_experts=None)
    old_large = completion(4, 3, 0, ids_below=300, num_experts=None)
    assert replay_array(old_small, 4, PRIME_RL).dtype == np.uint8
    both = replay_arrays([ReplaySample(old_small, 4), ReplaySample(old_large, 4)], PRIME_RL)
    assert [a.dtype for a in both] == [np.uint16, np.uint16]
    assert replay_array(old_small, 4, PRIME_RL, num_experts=300).dtype == np.uint16


# --- slime -------------------------------------------------------------------------------------


def test_slime_gets_tokens_minus_one_int32_rows_and_its_trainer_adds_the_dummy_row():
    # slime/utils/types.py:Sample._apply_meta_info (len(tokens) - 1 - start rows, turns merged
    # existing[:start] + new) and slime/utils/misc.py:decode_int32_meta_array (int32).
    two = rollout(4, [(0, 3), (2, 3)])
    out = replay_arrays([two.sample()], SLIME)[0]
    assert out.shape == (two.total - 1, LAYERS, TOP_K) and out.dtype == np.int32
    assert_same(out, slime_builds(two.turns))
    np.testing.assert_array_equal(out, two.full_run())  # the boundary row is a real route
    # slime/backends/megatron_utils/cp_utils.py: the trainer asserts shape[0] == tokens - 1,
    # then appends arange(L*K).reshape(1, L, K) % num_experts; `arange_flat` is that row.
    trained = np.concatenate([out, slime_dummy_row(LAYERS, 8)])
    with_dummy = replay_arrays(
        [two.sample()], msgspec.structs.replace(SLIME, last_row="arange_flat")
    )
    assert_same(with_dummy[0], trained.astype(np.int32))
    assert len({tuple(layer) for layer in with_dummy[0][-1].tolist()}) == LAYERS


def test_slime_refuses_a_first_turn_that_starts_past_zero():
    # slime/utils/types.py:Sample._apply_meta_info keeps only len(tokens) - 1 - start rows of
    # a first turn, and the trainer's shape[0] == tokens - 1 assertion then fails.
    late = rollout(6, [(0, 3), (1, 2)], first_start=3)
    assert isinstance(slime_builds(late.turns), Refused)
    with pytest.raises(ReplayError, match="routing starts at position 3"):
        replay_arrays([late.sample()], SLIME)


# --- verl --------------------------------------------------------------------------------------


def test_verl_gets_every_row_from_zero_and_a_zero_last_row_it_never_replays():
    # verl/experimental/agent_loop/agent_loop.py (int16 zero tensor of prompt + response rows)
    # and verl/utils/megatron/router_replay_utils.py:build_r3_replay_mask (every row but the
    # last is replayed).
    two = rollout(4, [(0, 3), (2, 3)])
    out = replay_arrays([two.sample()], VERL)[0]
    assert_same(out, verl_builds(two))
    np.testing.assert_array_equal(verl_replayed_rows(out), two.full_run())
    assert (out[-1] == 0).all()


def test_verl_refuses_rows_missing_before_position_zero_and_says_what_to_send():
    # verl/utils/megatron/router_replay_utils.py:build_r3_replay_mask replays the rows before
    # `start` too: filled with zeros they would train expert 0 as the route.
    late = rollout(7, [(0, 2)], first_start=4)
    assert isinstance(verl_builds(late), Refused)
    with pytest.raises(
        ReplayError, match=r"routing starts at position 4.*routed_experts_prompt_start=0"
    ):
        replay_array(late.turns[0].completion, 7, VERL)


def test_verl_batch_layout_left_pads_the_prompt_and_right_pads_the_response():
    # verl/experimental/agent_loop/agent_loop.py: the tensor spans the padded prompt and
    # response; rows start at prompt_length - len(prompt_ids); the rest stays zero.
    prompt_length, response_length = 8, 6
    r = rollout(5, [(0, 4)])
    layout = msgspec.structs.replace(
        VERL, prompt_pad_to=prompt_length, pad_to=prompt_length + response_length
    )
    out = replay_array(r.turns[0].completion, 5, layout)
    expected = np.zeros((prompt_length + response_length, LAYERS, TOP_K), dtype=np.int16)
    first = prompt_length - 5
    expected[first : first + r.total - 1] = r.full_run()
    assert_same(out, expected)


# --- SkyRL -------------------------------------------------------------------------------------


def test_skyrl_gets_only_the_captured_rows_unpadded_in_the_canonical_dtype():
    # SkyRL 0.4.0: skyrl/backends/skyrl_train/utils/routed_experts.py:RoutedExpertTrace (turns
    # appended from start = rows held, T - 1 rows; uint8, int16 or int32) and
    # skyrl/train/dataset/preprocess.py:make_router_padding_mask (captured rows = the entry's
    # length).
    two = rollout(4, [(0, 3), (2, 3)])
    out = replay_arrays([two.sample()], SKYRL)[0]
    assert_same(out, skyrl_builds(two.turns, 8))
    assert out.shape[0] == two.total - 1 and (out >= 0).all()
    big = completion(4, 3, 0, ids_below=8, num_experts=300)
    assert big.routed_experts is not None and big.routed_experts.dtype == "uint16"
    # The wire's uint16 becomes int16 (SkyRL refuses uint16), by the model's expert count.
    assert replay_array(big, 4, SKYRL).dtype == np.int16
    late = rollout(5, [(0, 3)], first_start=1)
    with pytest.raises(ReplayError, match="routing starts at position 1"):
        replay_array(late.turns[0].completion, 5, SKYRL)


def test_skyrl_packs_a_batch_with_arange_after_each_entry():
    # SkyRL 0.4.0, preprocess.py:convert_prompts_responses_to_batch_tensors: the segments of
    # one [sum(T), layers, top_k] tensor are the recipe's arrays with an arange(top_k) last row.
    rollouts = [rollout(3, [(0, 2)]), rollout(5, [(0, 4)]), rollout(2, [(0, 2), (1, 3)])]
    samples = [r.sample() for r in rollouts]
    entries = replay_arrays(samples, SKYRL)
    packed, cu_seqlens = skyrl_batch(entries, [r.total for r in rollouts])
    segments = replay_arrays(samples, msgspec.structs.replace(SKYRL, last_row="arange"))
    assert_same(np.concatenate(segments), packed)
    assert cu_seqlens == np.cumsum([0, *(len(s) for s in segments)]).tolist()


# --- NeMo-RL -----------------------------------------------------------------------------------


def test_nemo_rl_fills_the_last_and_padding_rows_with_arange_and_minus_one_only_where_missing():
    # nemo_rl/models/generation/vllm/utils.py: [S, L, K] from arange(top_k), the returned rows
    # copied in, -1 only where vLLM returned no row; the next prefill replaces a padded row.
    two = rollout(6, [(0, 3), (2, 3)], first_start=2)
    layout = msgspec.structs.replace(NEMO_RL, pad_to=16)
    out = replay_arrays([two.sample()], layout)[0]
    assert_same(out, nemo_rl_builds(two.turns, 8, pad_to=16))
    assert (out[:2] == -1).all()
    assert (out[two.total - 1 :] == np.arange(TOP_K)).all()
    np.testing.assert_array_equal(out[2 : two.total - 1], two.full_run()[2:])


def test_nemo_rl_dtype_comes_from_the_models_expert_count():
    # interfaces.py:resolve_routed_experts_dtype (NeMo-RL): int8 up to 128
    # experts, int16 up to 32768, whatever ids a sample happens to hold.
    for experts, dtype in [(128, np.int8), (129, np.int16), (32768, np.int16), (40000, np.int32)]:
        c = completion(4, 3, 0, ids_below=8, num_experts=experts)
        assert replay_array(c, 4, NEMO_RL).dtype == dtype, experts
    old = completion(4, 3, 0, num_experts=None)
    with pytest.raises(ReplayError, match=r"follows the model's expert count.*pass num_experts"):
        replay_array(old, 4, NEMO_RL)
    assert replay_array(old, 4, NEMO_RL, num_experts=200).dtype == np.int16


# --- Every recipe, over prompt lengths, starts, turns and expert counts -------------------------

EXPERT_COUNTS = [8, 40, 128, 129, 256, 257, 384, 32768, 32769]
plans = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=4)


@st.composite
def rollouts(draw: st.DrawFn, experts: int | None = None) -> tuple[Rollout, int]:
    if experts is None:
        experts = draw(st.sampled_from(EXPERT_COUNTS))
    # Ids seen either stay small (below 256 on a large model) or span the model's range.
    ids_below = draw(st.sampled_from(sorted({min(experts, 8), min(experts, 300), experts})))
    first_prompt = draw(st.integers(1, 12))
    first_start = draw(st.sampled_from([0, 0, draw(st.integers(0, first_prompt))]))
    r = rollout(
        first_prompt,
        draw(plans),
        first_start=first_start,
        ids_below=ids_below,
        num_experts=experts,
    )
    return r, experts


batches = st.sampled_from(EXPERT_COUNTS).flatmap(
    lambda experts: st.lists(rollouts(experts), min_size=2, max_size=4)
)


def framework_builds(recipe: str, r: Rollout, experts: int) -> Rows | Refused:
    if recipe == "prime-rl":
        return prime_rl_builds(r.turns, experts)
    if recipe == "slime":
        return slime_builds(r.turns)
    if recipe == "verl":
        return verl_builds(r)
    if recipe == "skyrl":
        return skyrl_builds(r.turns, experts)
    assert recipe == "nemo-rl"
    return nemo_rl_builds(r.turns, experts)


@PROPERTY
@given(drawn=rollouts(), recipe=st.sampled_from(sorted(RECIPES)))
def test_every_recipe_builds_what_its_framework_builds_or_refuses_what_it_cannot_take(
    drawn, recipe
):
    r, experts = drawn
    expected = framework_builds(recipe, r, experts)
    if isinstance(expected, Refused):
        with pytest.raises(ReplayError, match=expected.reason):
            replay_arrays([r.sample()], RECIPES[recipe])
        return
    assert_same(replay_arrays([r.sample()], RECIPES[recipe])[0], expected)


@PROPERTY
@given(batch=batches, recipe=st.sampled_from(sorted(RECIPES)), carried=st.booleans())
def test_one_call_gives_every_array_of_a_batch_one_dtype(batch, recipe, carried):
    layout = RECIPES[recipe]
    experts = batch[0][1]
    samples = [
        r.sample() if carried else strip_expert_counts(r.sample())  # as older workers wrote them
        for r, _ in batch
        if not isinstance(framework_builds(recipe, r, experts), Refused)
    ]
    if not samples:
        return
    if not carried and layout.dtype_from == "num_experts":
        with pytest.raises(ReplayError, match="pass num_experts"):
            replay_arrays(samples, layout)
        return
    arrays = replay_arrays(samples, layout)
    assert len({a.dtype for a in arrays}) == 1
    alone = [replay_arrays([sample], layout)[0] for sample in samples]
    if carried:
        # The dtype follows the model: a sample gets the same array in any batch.
        for array, single in zip(arrays, alone, strict=True):
            assert_same(array, single)
    else:
        # From the ids seen: the widest any sample needs alone, for all of them.
        assert arrays[0].dtype == max((a.dtype for a in alone), key=lambda d: d.itemsize)
        for array, single in zip(arrays, alone, strict=True):
            np.testing.assert_array_equal(array, single)
        passed = replay_arrays(samples, layout, num_experts=experts)
        expected = [replay_arrays([s], layout, num_experts=experts)[0] for s in samples]
        for array, single in zip(passed, expected, strict=True):
            assert_same(array, single)


def strip_expert_counts(sample: ReplaySample) -> ReplaySample:
    def strip(c: Completion) -> Completion:
        assert c.routed_experts is not None
        return msgspec.structs.replace(
            c, routed_experts=msgspec.structs.replace(c.routed_experts, num_experts=msgspec.UNSET)
        )

    return msgspec.structs.replace(
        sample,
        completion=strip(sample.completion),
        earlier=[Turn(t.prompt_token_ids, strip(t.completion)) for t in sample.earlier],
    )


def test_n_completions_of_one_job_each_get_their_own_rows_in_one_dtype():
    # n > 1: each completion is its own sequence on the shared prompt.
    prompt_len = 5
    result = Completed(
        job_id="g",
        prompt_token_count=prompt_len,
        completions=[
            completion(prompt_len, tokens, 0, ids_below=ids, num_experts=300, index=i)
            for i, (tokens, ids) in enumerate([(3, 8), (6, 300), (1, 8)])
        ],
    )
    samples = [ReplaySample(c, result.prompt_token_count) for c in result.completions]
    for recipe, layout in RECIPES.items():
        arrays = replay_arrays(samples, layout)
        assert len({a.dtype for a in arrays}) == 1, recipe
        for c, array in zip(result.completions, arrays, strict=True):
            turns = [Turn(list(range(prompt_len)), c)]
            r = Rollout(turns, 300 if len(c.token_ids) == 6 else 8)
            assert_same(array, framework_builds(recipe, r, 300))


# --- The layout options themselves --------------------------------------------------------------

shapes = st.integers(1, 30).flatmap(
    lambda p: st.tuples(st.just(p), st.integers(1, 20), st.integers(0, p))
)


@PROPERTY
@given(shape=shapes)
def test_rows_sit_at_absolute_positions_and_fills_cover_the_rest(shape):
    prompt_len, tokens, start = shape
    c = completion(prompt_len, tokens, start)
    total = prompt_len + tokens
    full = rows_for(range(total - 1))
    out = replay_array(
        c, prompt_len, ReplayLayout(before_start="zeros", last_row="minus_one", dtype="int16")
    )
    assert out.shape == (total, LAYERS, TOP_K) and out.dtype == np.int16
    np.testing.assert_array_equal(out[start : total - 1], full[start:])
    assert (out[:start] == 0).all() and (out[total - 1] == -1).all()
    dropped = replay_array(c, prompt_len, ReplayLayout(before_start="zeros"))
    assert dropped.shape[0] == total - 1 and dropped.dtype == np.uint8  # the wire dtype
    response = replay_array(
        c, prompt_len, ReplayLayout(before_start="zeros", last_row="repeat", prompt_rows=False)
    )
    assert response.shape[0] == tokens
    if tokens >= 2:
        np.testing.assert_array_equal(response[-1], response[-2])
    arange = replay_array(
        c,
        prompt_len,
        ReplayLayout(before_start="minus_one", last_row="arange", dtype="narrowest_signed"),
    )
    assert arange.dtype == np.int8 and (arange[-1] == np.arange(TOP_K)).all()
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
        np.testing.assert_array_equal(named[start : total - 1], full[start:, [1, 3]])


def test_a_repeated_turn_boundary_copies_the_row_before_in_order():
    # `turn_boundary="repeat"`: the placeholder verifiers' source of 2026-08 kept at a turn
    # boundary (no recipe uses it since verifiers 0.4.0). Boundaries at positions 6 and 7: the
    # second copies the first's copy.
    r = rollout(4, [(0, 3), (0, 1), (2, 2)])
    out = replay_arrays([r.sample()], ReplayLayout(turn_boundary="repeat"))[0]
    full = r.full_run()
    np.testing.assert_array_equal(out[6], full[5])
    np.testing.assert_array_equal(out[7], full[5])
    np.testing.assert_array_equal(np.delete(out, [6, 7], axis=0), np.delete(full, [6, 7], axis=0))


def test_arange_flat_counts_over_the_layers_the_array_keeps():
    # slime/backends/megatron_utils/cp_utils.py: L is the array's own layer count.
    c = completion(3, 2, 0, ids_below=5, num_experts=5)
    out = replay_array(c, 3, ReplayLayout(last_row="arange_flat", moe_layers_only=True))
    np.testing.assert_array_equal(out[-1], np.arange(3 * TOP_K).reshape(3, TOP_K) % 5)
    padded = replay_array(c, 3, ReplayLayout(pad_to=6, pad_fill="arange_flat"))
    np.testing.assert_array_equal(padded[4:], np.stack([slime_dummy_row(LAYERS, 5)[0]] * 2))


def test_the_dtype_choices_hold_the_ids_and_fills_or_say_why_not():
    big = completion(2, 2, 0, ids_below=300, num_experts=None)
    assert replay_array(big, 2, ReplayLayout(dtype="canonical")).dtype == np.int16
    with pytest.raises(ReplayError, match="do not fit dtype 'uint8'"):
        replay_array(big, 2, ReplayLayout(dtype="uint8"))
    c = completion(4, 3, 0)
    with pytest.raises(ReplayError, match="signed dtype"):
        replay_array(c, 4, ReplayLayout(last_row="minus_one", dtype="narrowest_unsigned"))
    with pytest.raises(ReplayError, match="4 positions do not fit prompt_pad_to=3"):
        replay_array(c, 4, ReplayLayout(prompt_pad_to=3))
    with pytest.raises(ReplayError, match="6 positions do not fit pad_to=2"):
        replay_array(c, 4, ReplayLayout(pad_to=2))


# --- Multi-turn stitching ----------------------------------------------------------------------


@PROPERTY
@given(first_prompt=st.integers(1, 10), plan=plans)
def test_multi_turn_stitching_equals_one_full_run(first_prompt, plan):
    r = rollout(first_prompt, plan, num_experts=8)
    sequence, first_len, stitched = stitch_turns(r.turns)
    assert first_len == first_prompt and len(sequence) == r.total
    assert stitched.start == 0 and stitched.end == r.total - 1
    assert stitched.num_experts == 8
    np.testing.assert_array_equal(stitched.to_array(), r.full_run())


# --- Bad input ---------------------------------------------------------------------------------


def test_inconsistent_inputs_are_refused_with_what_is_wrong():
    c = completion(5, 3, 0)
    with pytest.raises(
        ReplayError, match=r"cover positions \[0, 7\) but the row rule gives \[0, 8\)"
    ):
        replay_array(c, 6)
    turns = rollout(4, [(1, 3), (2, 2)]).turns
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
    with pytest.raises(ReplayError, match="prompt_token_ids has 9 tokens, prompt_len says 7"):
        replay_array(
            turns[1].completion, 7, earlier=[turns[0]], prompt_token_ids=turns[1].prompt_token_ids
        )
    bare = Completion(index=0, token_ids=[1], text="", finish_reason="stop")
    with pytest.raises(ReplayError, match="has no routed experts"):
        replay_array(bare, 3)
    with pytest.raises(ReplayError, match="no turns"):
        stitch_turns([])


def test_routing_of_different_models_is_refused_naming_the_difference():
    turns = rollout(4, [(1, 3), (2, 2)]).turns
    second = turns[1]
    assert second.completion.routed_experts is not None
    wider = RoutedExperts.from_array(
        np.ones((second.completion.routed_experts.rows, LAYERS, TOP_K + 1), dtype=np.uint8),
        start=second.completion.routed_experts.start,
    )
    odd = Turn(
        second.prompt_token_ids,
        msgspec.structs.replace(second.completion, routed_experts=wider),
    )
    with pytest.raises(ReplayError, match="turn 1's routed experts have"):
        stitch_turns([turns[0], odd])
    recount = msgspec.structs.replace(
        second.completion,
        routed_experts=msgspec.structs.replace(second.completion.routed_experts, num_experts=16),
    )
    with pytest.raises(ReplayError, match="different expert counts"):
        stitch_turns([turns[0], Turn(second.prompt_token_ids, recount)])
    a, b = completion(3, 2, 0, num_experts=8), completion(3, 2, 0, num_experts=16)
    with pytest.raises(ReplayError, match=r"different expert counts \[8, 16\]"):
        replay_arrays([ReplaySample(a, 3), ReplaySample(b, 3)], PRIME_RL)
    with pytest.raises(
        ReplayError, match=r"num_experts=16 was passed, but the routed experts say \[8\]"
    ):
        replay_array(a, 3, PRIME_RL, num_experts=16)
    with pytest.raises(ReplayError, match="expert id 299 is not below the model's 8 experts"):
        replay_array(completion(3, 2, 0, ids_below=300, num_experts=None), 3, num_experts=8)
    narrow = msgspec.structs.replace(
        a,
        routed_experts=RoutedExperts.from_array(np.ones((4, 2, TOP_K), dtype=np.uint8)),
    )
    with pytest.raises(ReplayError, match=r"different \[layers, top_k\]"):
        replay_arrays([ReplaySample(a, 3), ReplaySample(narrow, 3)], SLIME)
    with pytest.raises(ReplayError, match="sample 1: routing starts at position 2"):
        replay_arrays([ReplaySample(a, 3), ReplaySample(completion(4, 2, 2), 4)], VERL)


def test_layouts_a_call_cannot_carry_out_are_refused():
    c = completion(3, 2, 0, num_experts=None)
    with pytest.raises(ReplayError, match=r"arange_flat row is arange.*pass num_experts"):
        replay_array(c, 3, ReplayLayout(last_row="arange_flat"))
    with pytest.raises(ReplayError, match="moe_layers \\[1, 7\\] name layers outside the 4 held"):
        replay_array(c, 3, ReplayLayout(moe_layers_only=True), moe_layers=[1, 7])
    with pytest.raises(ReplayError, match="pad_to must be >= 0, got -1"):
        ReplayLayout(pad_to=-1)
    with pytest.raises(ReplayError, match="prompt_pad_to pads the prompt's rows"):
        ReplayLayout(prompt_pad_to=4, prompt_rows=False)
    with pytest.raises(ReplayError, match="num_experts must be >= 1"):
        replay_array(c, 3, num_experts=0)
    assert replay_arrays([], PRIME_RL) == []


def test_verl_refuses_ids_its_int16_tensor_cannot_hold():
    # verl/experimental/agent_loop/agent_loop.py copies into int16: an id past 32767 would wrap.
    c = completion(2, 2, 0, ids_below=40000, num_experts=40000)
    with pytest.raises(ReplayError, match=r"values in \[0, 39999\].*do not fit dtype 'int16'"):
        replay_array(c, 2, VERL)
