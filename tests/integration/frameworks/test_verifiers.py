"""prime-rl's client side, verifiers 0.4.0: the worker's records go through verifiers' own turn
commit, and the branch it builds must be `replay_array(..., PRIME_RL)` and the route the rollout
took at every position.

Each turn is committed as verifiers' client does it: `prepare_turn` resolves the stored prefix,
the request asks for `routed_experts_prompt_start = path_len - 1` on a bridged turn
(`verifiers/v1/clients/train.py`), and `PendingTurn`'s commit (`verifiers/v1/graph.py:
_commit_turn`) hands the turn's routed experts to `_attribute_routed_experts` with the
`TurnTokens` built by `model_construct`, as the client builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from schemas import ReplayError, replay_arrays
from schemas.replay import PRIME_RL
from tests.integration.frameworks.rollouts import (
    CASE_IDS,
    CASES,
    Case,
    Model,
    Rollout,
    rollout,
    wire,
)


@dataclass
class Graph:
    """What verifiers' graph functions read and write of a `Trace` (`verifiers/v1/trace.py`,
    whose own module imports the whole runtime): its nodes and their index."""

    nodes: list[Any] = field(default_factory=list)
    _head_index: dict[Any, int] = field(default_factory=dict)
    mm_token_type_id_map: dict[int, int] | None = None
    tools: list[Any] = field(default_factory=list)


def commit_turns(graph: ModuleType, types: ModuleType, r: Rollout) -> Graph:
    trace = Graph()
    history: list[Any] = []
    for number, turn in enumerate(r.turns):
        prompt = [*history, types.UserMessage(content=f"user turn {number}")]
        pending = graph.prepare_turn(trace, prompt)
        routed = turn.completion.routed_experts
        assert routed is not None
        # verifiers/v1/clients/train.py: a bridged turn asks for max(path_len - 1, 0); the
        # worker's chaining rule asks for the same position.
        assert routed.start == (max(pending.path_len - 1, 0) if number else routed.start)
        reply = types.AssistantMessage(content=f"assistant turn {number}")
        tokens = types.TurnTokens.model_construct(
            prompt_ids=turn.prompt_token_ids,
            completion_ids=turn.completion.token_ids,
            completion_logprobs=[],
            renderer_prompt_ids=None,
            bridged=number > 0,
            message_spans=None,
            is_content=None,
            mm_placeholders=None,
            mm_token_type_id_map=None,
            routed_experts=wire(routed),
            sampling_mask=None,
        )
        response = types.Response.model_construct(
            id=f"r{number}",
            created=0,
            model="m",
            message=reply,
            finish_reason="length",
            tokens=tokens,
        )
        graph._commit_turn(pending, response)
        history = [*prompt, reply]
    return trace


def branch_routing(graph: ModuleType, trace: Graph) -> np.ndarray | None:
    """`verifiers/v1/trace.py:Branch.routed_experts`: the routed experts of the nodes with
    tokens on the path to the leaf, concatenated; None when any of them has none."""
    (leaf,) = graph.leaves(trace)
    path: list[Any] = []
    node: int | None = leaf
    while node is not None:
        path.append(trace.nodes[node])
        node = trace.nodes[node].parent
    nodes = [n for n in reversed(path) if n.token_ids]
    if any(n.routed_experts is None for n in nodes):
        return None
    merged: np.ndarray = np.concatenate([n.routed_experts for n in nodes])
    assert merged.shape[0] == sum(len(n.token_ids) for n in nodes)
    return merged


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_verifiers_branch_is_the_prime_rl_recipe_and_the_rollouts_route(
    case: Case, verifiers_graph: ModuleType, verifiers_types: ModuleType
) -> None:
    r = case.rollout()
    branch = branch_routing(verifiers_graph, commit_turns(verifiers_graph, verifiers_types, r))
    assert branch is not None
    recipe = replay_arrays([r.sample()], PRIME_RL)[0]
    assert (
        branch.dtype == recipe.dtype == (np.uint8 if case.model.num_experts <= 256 else np.uint16)
    )
    np.testing.assert_array_equal(branch, recipe)
    # Every position with a route replays it, turn boundaries included (verifiers 0.4.0's
    # `_replace_placeholder_routing_row`); the last token gets a copy of the row before.
    np.testing.assert_array_equal(branch[:-1], r.full_run())
    np.testing.assert_array_equal(branch[-1], branch[-2] if r.total > 1 else branch[-1])
    assert branch.shape[0] == r.total  # src/prime_rl/trainer/batch.py: one row per input id


def test_verifiers_leaves_a_branch_without_routing_when_the_first_turn_starts_late(
    verifiers_graph: ModuleType, verifiers_types: ModuleType
) -> None:
    # verifiers/v1/graph.py:_attribute_routed_experts: a `start` past a node's first position
    # leaves that node unset, so the branch reports no routing; the recipe refuses the same
    # input and says what to send.
    late = rollout(Model(64), 6, [(0, 3)], first_start=2)
    trace = commit_turns(verifiers_graph, verifiers_types, late)
    assert branch_routing(verifiers_graph, trace) is None
    with pytest.raises(ReplayError, match="send routed_experts_prompt_start=0"):
        replay_arrays([late.sample()], PRIME_RL)


def test_verifiers_validated_turn_tokens_lose_the_dtype_of_a_uint16_record(
    verifiers_types: ModuleType,
) -> None:
    # verifiers/v1/types.py: its RoutedExperts TypedDict has data, shape and start only; a
    # validated TurnTokens drops `dtype`, and `_attribute_routed_experts` then reads uint8. Its
    # own client builds TurnTokens with model_construct (as `commit_turns` does), which keeps it.
    r = rollout(Model(384), 3, [(0, 2)])
    record = wire(r.turns[0].completion.routed_experts)
    assert record["dtype"] == "uint16"
    validated = verifiers_types.TurnTokens(routed_experts=record)
    assert "dtype" not in validated.routed_experts
    constructed = verifiers_types.TurnTokens.model_construct(routed_experts=record)
    assert constructed.routed_experts["dtype"] == "uint16"
