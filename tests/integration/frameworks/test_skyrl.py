"""SkyRL 0.4.0: the worker's turns go through SkyRL's own trace, and the SKYRL recipe's entries
through its own batch packing; every row it replays must be the route the rollout took.

Per turn, SkyRL's generator asks for `routed_experts_prompt_start` = the rows its trace holds,
decodes the engine's envelope (`skyrl/backends/skyrl_train/inference_servers/generate_wire.py:
decode_packed_routed_experts`) and appends it (`skyrl/backends/skyrl_train/utils/
routed_experts.py:RoutedExpertTrace.record_generation`), then `finalize`s the entry
(`skyrl/train/generators/skyrl_gym_generator.py`). The trainer packs entries into one
`[sum(T), layers, top_k]` tensor with `cu_seqlens`, filling each sequence's uncaptured tail with
`arange(top_k)`, and masks those rows (`skyrl/train/dataset/preprocess.py:
convert_prompts_responses_to_batch_tensors`, `make_router_padding_mask`).
"""

from __future__ import annotations

from types import ModuleType

import msgspec
import numpy as np
import pytest
import torch

from schemas import ReplayError, replay_arrays
from schemas.replay import SKYRL
from tests.integration.frameworks.rollouts import (
    CASE_IDS,
    CASES,
    Case,
    Model,
    Rollout,
    rollout,
    wire,
)


def generated_mask(r: Rollout) -> list[int]:
    """The loss mask over the response: 1 on sampled tokens, 0 on later turns' user tokens."""
    generated = {t for turn in r.turns for t in turn.completion.token_ids}
    return [int(t in generated) for t in r.tokens[r.prompt_len :]]


def skyrl_entry(routed_experts: ModuleType, wire_module: ModuleType, r: Rollout) -> np.ndarray:
    """What SkyRL's generator keeps of the worker's turns (skyrl_gym_generator.py)."""
    trace = routed_experts.RoutedExpertTrace()
    for turn in r.turns:
        routed = turn.completion.routed_experts
        assert routed is not None
        # The start SkyRL asks for is the one the worker's chaining rule gives.
        assert trace.prompt_start == routed.start
        record = wire(routed)
        if record["dtype"] == "uint16":
            # Its decoder takes uint8, int16 and int32 only: a >256-expert model's records
            # reach the trace as arrays (an in-process engine), which it compacts itself.
            with pytest.raises(ValueError, match="is not one of"):
                wire_module.decode_packed_routed_experts(record)
            rows = routed.to_array()
        else:
            rows = wire_module.decode_packed_routed_experts(record)
        trace.record_generation(
            prompt_token_count=len(turn.prompt_token_ids),
            generated_token_count=len(turn.completion.token_ids),
            routed_experts=rows,
        )
    entry: np.ndarray = trace.finalize(
        token_count=r.total, loss_mask=[0] * r.prompt_len + generated_mask(r)
    )
    return entry


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_skyrl_trace_keeps_the_recipes_rows(
    case: Case, skyrl_routed_experts: ModuleType, skyrl_wire: ModuleType
) -> None:
    r = case.rollout()
    entry = skyrl_entry(skyrl_routed_experts, skyrl_wire, r)
    recipe = replay_arrays([r.sample()], SKYRL)[0]
    assert recipe.shape[0] == r.total - 1
    np.testing.assert_array_equal(entry, recipe)
    np.testing.assert_array_equal(recipe, r.full_run())
    # The recipe's dtype follows the model; SkyRL compacts by the ids seen. Both are its
    # canonical dtypes, never uint16.
    assert recipe.dtype in skyrl_routed_experts.ROUTED_EXPERT_DTYPES
    assert recipe.dtype == (np.uint8 if case.model.num_experts <= 256 else np.int16)
    assert entry.dtype == (np.uint8 if int(recipe.max()) < 256 else np.int16)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_skyrl_packed_batch_replays_the_rollouts_route_at_every_captured_position(
    case: Case, skyrl_preprocess: ModuleType
) -> None:
    rollouts = [case.rollout(), rollout(case.model, 3, [(0, 2)])]
    entries = replay_arrays([r.sample() for r in rollouts], SKYRL)
    (_, attention, *_, packed, _) = skyrl_preprocess.convert_prompts_responses_to_batch_tensors(
        0,
        [r.tokens[: r.prompt_len] for r in rollouts],
        [r.tokens[r.prompt_len :] for r in rollouts],
        [[0.0] * (r.total - r.prompt_len) for r in rollouts],
        [generated_mask(r) for r in rollouts],
        rollout_expert_indices=entries,
    )
    totals = [r.total for r in rollouts]
    assert packed.values.shape == (sum(totals), case.model.layers, case.model.top_k)
    assert packed.cu_seqlens.tolist() == np.cumsum([0, *totals]).tolist()
    router_padding = skyrl_preprocess.make_router_padding_mask(attention, [len(e) for e in entries])
    # The recipe with `arange(top_k)` for the last row is the packed tensor, segment by segment.
    segments = replay_arrays(
        [r.sample() for r in rollouts], msgspec.structs.replace(SKYRL, last_row="arange")
    )
    np.testing.assert_array_equal(packed.values.numpy(), np.concatenate(segments))
    for i, r in enumerate(rollouts):
        segment = packed.values[packed.cu_seqlens[i] : packed.cu_seqlens[i + 1]]
        # Replayed (not router padding): exactly the positions with a captured route, in the
        # row's left-padded layout.
        replayed = ~router_padding[i][attention[i].bool()]
        assert replayed.tolist() == [True] * (r.total - 1) + [False]
        np.testing.assert_array_equal(segment[replayed].numpy(), r.full_run())
        assert (segment[~replayed] == torch.arange(case.model.top_k)).all()


def test_skyrl_refuses_uint16_entries_and_a_first_turn_that_starts_late(
    skyrl_routed_experts: ModuleType, skyrl_wire: ModuleType, skyrl_preprocess: ModuleType
) -> None:
    # preprocess.py:_collate_rollout_expert_indices takes uint8, int16 and int32 only: the
    # wire's uint16 must be converted, which the recipe does.
    r = rollout(Model(384), 4, [(0, 3)])
    raw = r.turns[0].completion.routed_experts
    assert raw is not None and raw.dtype == "uint16"
    with pytest.raises(ValueError, match="canonical routed-expert dtype"):
        skyrl_preprocess.convert_prompts_responses_to_batch_tensors(
            0, [r.tokens[:4]], [r.tokens[4:]], [[0.0] * 3], [[1, 1, 1]],
            rollout_expert_indices=[raw.to_array()],
        )  # fmt: skip
    assert replay_arrays([r.sample()], SKYRL)[0].dtype == np.int16
    # RoutedExpertTrace asks for start 0 on a first turn; rows from later on do not add up to
    # the count it checks, and the recipe refuses them too.
    late = rollout(Model(64), 6, [(0, 3)], first_start=2)
    routed = late.turns[0].completion.routed_experts
    assert routed is not None
    trace = skyrl_routed_experts.RoutedExpertTrace()
    with pytest.raises(ValueError, match="token metadata has 6 rows, expected 8"):
        trace.record_generation(
            prompt_token_count=6,
            generated_token_count=3,
            routed_experts=skyrl_wire.decode_packed_routed_experts(wire(routed)),
        )
    with pytest.raises(ReplayError, match="send routed_experts_prompt_start=0"):
        replay_arrays([late.sample()], SKYRL)
