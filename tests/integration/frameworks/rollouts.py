"""Rollouts as the worker answers them, and the routes they stand for.

A `Model` routes every absolute position the same way whichever request prefills it (as vLLM
does: NOTES §1, chained turns' rows equal a fresh full run), with `top_k` distinct ids in each
MoE layer and an all-zero dense first layer, as vLLM reports one. Turns are chained as the
wire-format page says: turn k's `routed_experts_prompt_start` = len(turn k-1's prompt + output) - 1, the
rows each turn returns cut from the model's routes and encoded by the worker's own encoder
(`RoutedExperts.from_array(..., num_experts=...)`: uint8 up to 256 experts, uint16 above).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from schemas import Completion, ReplaySample, RoutedExperts, Turn

Rows = npt.NDArray[np.integer]


@dataclass(frozen=True)
class Model:
    num_experts: int
    layers: int = 4
    top_k: int = 4
    #: Ids stay below this (below 256 on a 384-expert model: the wire is uint16 all the same).
    ids_below: int | None = None

    def routes(self, positions: range) -> npt.NDArray[np.int64]:
        """The route of each position: `[len(positions), layers, top_k]`, layer 0 dense."""
        below = self.ids_below or self.num_experts
        stride = max(below // self.top_k, 1)
        p = np.asarray(positions, dtype=np.int64).reshape(-1, 1, 1)
        layer = np.arange(self.layers, dtype=np.int64).reshape(1, -1, 1)
        k = np.arange(self.top_k, dtype=np.int64).reshape(1, 1, -1)
        # Position 0 routes its first MoE layer to the highest id, so the widest dtype is needed.
        first = (below - 1 + p * 7919 + (layer - 1) * 104_729) % below
        out = (first + k * stride) % below
        out[:, 0] = 0
        return out


@dataclass(frozen=True)
class Rollout:
    model: Model
    turns: list[Turn]

    @property
    def total(self) -> int:
        last = self.turns[-1]
        return len(last.prompt_token_ids) + len(last.completion.token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.turns[0].prompt_token_ids)

    @property
    def tokens(self) -> list[int]:
        last = self.turns[-1]
        return [*last.prompt_token_ids, *last.completion.token_ids]

    def full_run(self) -> npt.NDArray[np.int64]:
        """The route the rollout took at every position that has one (all but the last)."""
        return self.model.routes(range(self.total - 1))

    def sample(self) -> ReplaySample:
        *earlier, last = self.turns
        return ReplaySample(
            last.completion, len(last.prompt_token_ids), earlier, last.prompt_token_ids
        )


def rollout(
    model: Model, first_prompt: int, plan: list[tuple[int, int]], first_start: int = 0
) -> Rollout:
    """`plan`: (new user tokens, generated tokens) per turn; the first turn's user count is
    ignored (its prompt is `first_prompt` tokens)."""
    turns: list[Turn] = []
    sequence = list(range(1, first_prompt + 1))
    start = first_start
    for number, (user, generated) in enumerate(plan):
        prompt = (
            sequence
            if number == 0
            else [*sequence, *range(5000 + 100 * number, 5000 + 100 * number + user)]
        )
        end = len(prompt) + generated - 1
        tokens = list(range(1000 + 100 * number, 1000 + 100 * number + generated))
        routed = RoutedExperts.from_array(
            model.routes(range(start, end)), start=start, num_experts=model.num_experts
        )
        completion = Completion(
            index=0, token_ids=tokens, text="", finish_reason="length", routed_experts=routed
        )
        turns.append(Turn(prompt, completion))
        sequence = [*prompt, *tokens]
        start = len(sequence) - 1
    return Rollout(model, turns)


def wire(routed: RoutedExperts | None) -> dict[str, Any]:
    """The record's routed experts as a trainer reads them off the results topic (JSON)."""
    assert routed is not None
    decoded: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(routed))
    return decoded


@dataclass(frozen=True)
class Case:
    name: str
    model: Model
    first_prompt: int
    plan: list[tuple[int, int]]

    def rollout(self) -> Rollout:
        return rollout(self.model, self.first_prompt, self.plan)


#: Single and multi-turn; 8, 64 and 384 experts (uint8 and uint16 on the wire); every model
#: with a dense first layer. Later turns start past position 0.
CASES = [
    Case("1 turn, 8 experts top-2", Model(8, top_k=2), 5, [(0, 4)]),
    Case("1 turn, 1 token, 64 experts", Model(64), 3, [(0, 1)]),
    Case("3 turns, 64 experts", Model(64, layers=3), 6, [(0, 4), (3, 5), (2, 3)]),
    Case("2 turns, 384 experts", Model(384, layers=5, top_k=8), 7, [(0, 6), (4, 5)]),
    Case("2 turns, 384 experts, ids < 256", Model(384, ids_below=200), 4, [(0, 3), (2, 4)]),
    Case("4 turns, 384 experts, 1-token turns", Model(384), 2, [(0, 1), (1, 1), (0, 2), (3, 1)]),
]
CASE_IDS = [case.name for case in CASES]
