"""verl 0.9.1: the VERL recipe's batch goes through verl's own unpadding and R3 functions, and
every row verl replays must be the route the rollout took.

The recipe lays a batch out as the agent loop does (`verl/experimental/agent_loop/
agent_loop.py:_agent_loop_postprocess`: an int16 zero tensor over the left-padded prompt and
right-padded response, rows from position 0); the trainer unpads it with the attention mask
(`verl/workers/utils/padding.py:left_right_2_no_padding`), aligns it to the input ids
(`verl/utils/megatron/router_replay_utils.py:align_r3_router_replay_data`) and replays the rows
its mask selects (`build_r3_replay_mask`), as `verl/workers/engine/megatron/transformer_impl.py`
calls them.
"""

from __future__ import annotations

from types import ModuleType

import msgspec
import numpy as np
import pytest
import torch

from schemas import ReplayError, replay_arrays
from schemas.replay import VERL
from tests.integration.frameworks.rollouts import (
    CASE_IDS,
    CASES,
    Case,
    Model,
    Rollout,
    rollout,
)


def padded_batch(rollouts: list[Rollout], arrays: list[np.ndarray]):
    """The agent loop's tensors for `rollouts`: prompts left-padded to the longest, responses
    right-padded, the routed experts as the recipe laid them out."""
    from tensordict import TensorDict  # noqa: PLC0415 - installed with the releases

    prompt_width = max(r.prompt_len for r in rollouts)
    response_width = max(r.total - r.prompt_len for r in rollouts)
    width = prompt_width + response_width
    input_ids = torch.zeros((len(rollouts), width), dtype=torch.int64)
    attention = torch.zeros((len(rollouts), width), dtype=torch.int64)
    response_mask = torch.zeros((len(rollouts), response_width), dtype=torch.int64)
    for i, r in enumerate(rollouts):
        first = prompt_width - r.prompt_len
        input_ids[i, first : first + r.total] = torch.tensor(r.tokens)
        attention[i, first : first + r.total] = 1
        # Only sampled tokens are response_mask 1: later turns' user tokens are not trained.
        generated = {t for turn in r.turns for t in turn.completion.token_ids}
        for j, token in enumerate(r.tokens[r.prompt_len :]):
            response_mask[i, j] = int(token in generated)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    routed = torch.from_numpy(np.stack(arrays))
    assert routed.shape[1] == width
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention,
            "response_mask": response_mask,
            "position_ids": position_ids,
            "routed_experts": routed,
        },
        batch_size=[len(rollouts)],
    )


def verl_replays(
    r3: ModuleType, padding: ModuleType, rollouts: list[Rollout], arrays: list[np.ndarray]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What verl replays of each sequence: its aligned routes and its replay mask."""
    data = padding.left_right_2_no_padding(padded_batch(rollouts, arrays))
    routes = r3.align_r3_router_replay_data(data["routed_experts"], data["input_ids"])
    mask = r3.build_r3_replay_mask(data["input_ids"], data["response_mask"])
    return list(zip(routes.unbind(), mask.unbind(), strict=True))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_verl_replays_the_rollouts_route_at_every_position_but_the_last(
    case: Case, verl_r3: ModuleType, verl_padding: ModuleType
) -> None:
    # A batch of the case's rollout and a shorter one of the same model, so both paddings
    # occur on both sides.
    rollouts = [case.rollout(), rollout(case.model, 2, [(0, 2)])]
    prompt_width = max(r.prompt_len for r in rollouts)
    width = prompt_width + max(r.total - r.prompt_len for r in rollouts)
    layout = msgspec.structs.replace(VERL, prompt_pad_to=prompt_width, pad_to=width)
    arrays = replay_arrays([r.sample() for r in rollouts], layout)
    assert all(a.dtype == np.int16 for a in arrays)
    for r, (routes, mask) in zip(
        rollouts, verl_replays(verl_r3, verl_padding, rollouts, arrays), strict=True
    ):
        assert routes.shape == (r.total, case.model.layers, case.model.top_k)
        assert mask.tolist() == [True] * (r.total - 1) + [False]
        np.testing.assert_array_equal(routes[mask].numpy(), r.full_run())


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_verl_aligns_the_recipes_rows_with_or_without_the_last_tokens_row(
    case: Case, verl_r3: ModuleType
) -> None:
    # verl/utils/megatron/router_replay_utils.py:align_r3_router_replay_data takes T rows or
    # T - 1 (vLLM's own count): both of the recipe's forms reach the trainer the same.
    r = case.rollout()
    ids = torch.nested.as_nested_tensor([torch.tensor(r.tokens)], layout=torch.jagged)
    full = replay_arrays([r.sample()], VERL)[0]
    short = replay_arrays([r.sample()], msgspec.structs.replace(VERL, last_row="drop"))[0]
    assert short.shape[0] == r.total - 1
    for array in (full, short):
        nested = torch.nested.as_nested_tensor([torch.from_numpy(array)], layout=torch.jagged)
        (aligned,) = verl_r3.align_r3_router_replay_data(nested, ids).unbind()
        np.testing.assert_array_equal(aligned[:-1].numpy(), r.full_run())


def test_verl_would_replay_a_filled_row_before_start_so_the_recipe_refuses_it(
    verl_r3: ModuleType, verl_padding: ModuleType
) -> None:
    # build_r3_replay_mask replays every row but the last: rows the engine was told to skip,
    # filled with zeros, would be trained as routes to expert 0.
    late = rollout(Model(64), 6, [(0, 3)], first_start=2)
    with pytest.raises(ReplayError, match="routed_experts_prompt_start=0"):
        replay_arrays([late.sample()], VERL)
    filled = msgspec.structs.replace(VERL, before_start="zeros")
    arrays = replay_arrays([late.sample()], filled)
    ((routes, mask),) = verl_replays(verl_r3, verl_padding, [late], arrays)
    assert mask[:2].all()
    assert (routes[:2] == 0).all()
    assert (routes[:2].numpy() != late.model.routes(range(2))).any()
