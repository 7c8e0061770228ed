"""Routed experts as the array a trainer replays: aligned at absolute position 0, in its layout.

vLLM gives rows for positions `[start, prompt_len + len(token_ids) - 1)`; training frameworks
each want something slightly different: rows from position 0 or for the response only, the
missing last row padded with zeros, -1, a repeated row or `arange`, int16, int32 or the
narrowest dtype, all decoder layers or MoE layers only. Getting this wrong is silent, so every
choice is explicit here (`ReplayLayout`), the recipes name each framework's (`RECIPES`), and
inputs that do not follow the row rule are refused with `ReplayError`.

Multi-turn: pass the earlier turns' completions (`earlier`); each turn's routing must start
where the one before it ends (turn k's `routed_experts_prompt_start` = len(turn k-1's prompt +
output) - 1), and each turn's prompt must extend the one before it with its output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from schemas.errors import SchemaError
from schemas.results import Completion
from schemas.routed_experts import RoutedExperts

__all__ = [
    "NEMO_RL",
    "PRIME_RL",
    "RECIPES",
    "SKYRL",
    "SLIME",
    "VERL",
    "ReplayError",
    "ReplayLayout",
    "Turn",
    "replay_array",
    "stitch_turns",
]

RowFill = Literal["zeros", "minus_one", "error"]
LastRow = Literal["drop", "zeros", "minus_one", "repeat", "arange"]
Dtype = Literal[
    "wire",
    "uint8",
    "uint16",
    "int16",
    "int32",
    "int64",
    "narrowest_unsigned",
    "narrowest_signed",
    "canonical",
]


class ReplayError(SchemaError):
    """Routed experts that do not fit the row rule, turns that do not chain, or a layout the
    values cannot take."""


class ReplayLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Every choice a replay array needs, none of them implicit.

    - `before_start`: rows before the first turn's `start` (prompt rows vLLM trimmed): filled,
      or refused (`error`).
    - `last_row`: the last generated token has no row (it was never fed forward): `drop`
      leaves the array one row short of the sequence; otherwise one row of zeros, of -1, a copy
      of the row before, or `arange(top_k)` in every layer (a dummy route).
    - `dtype`: the wire dtype, a numpy name, the narrowest unsigned or signed one that holds
      the ids and the fills, or `canonical` (uint8 below 256, int16 below 32768, else int32).
    - `moe_layers_only`: drop the dense layers' all-zero slots.
    - `prompt_rows`: False keeps only the response's rows (from `prompt_len` on).
    - `pad_to`: pad (`pad_side`) with `pad_fill` rows to this many positions.
    """

    before_start: RowFill = "error"
    last_row: LastRow = "drop"
    dtype: Dtype = "wire"
    moe_layers_only: bool = False
    prompt_rows: bool = True
    pad_to: int | None = None
    pad_side: Literal["left", "right"] = "right"
    pad_fill: Literal["zeros", "minus_one"] = "zeros"


#: prime-rl / verifiers: rows for every position (rows == len(prompt + completion tokens)),
#: the missing last row a copy of the one before, the narrowest unsigned dtype (uint8 or
#: uint16), all decoder layers (indexed globally).
PRIME_RL: Final = ReplayLayout(last_row="repeat", dtype="narrowest_unsigned")
#: slime / Miles: int32, every decoder layer, rows for every position, the missing last row a
#: dummy route (`arange % num_experts`); earlier turns merged (here: `earlier`).
SLIME: Final = ReplayLayout(last_row="arange", dtype="int32")
#: verl: int16 rows at absolute positions from 0 in a zero tensor; rows it has no routing for
#: (before `start`, the last token, padding) stay zero and are masked by its replay.
VERL: Final = ReplayLayout(before_start="zeros", last_row="zeros", dtype="int16")
#: SkyRL: the canonical dtype (uint8 if max < 256, int16 if < 32768, else int32), no negative
#: ids, dummy routes where routing is missing, left padding (`pad_to` with `pad_side` left).
SKYRL: Final = ReplayLayout(last_row="arange", dtype="canonical", pad_side="left")
#: NeMo-RL: the full sequence `[S, layers, top_k]`, the narrowest signed dtype, a missing row
#: all -1 (Megatron then routes that token with its live router).
NEMO_RL: Final = ReplayLayout(
    before_start="minus_one", last_row="minus_one", dtype="narrowest_signed"
)

RECIPES: Final = {
    "prime-rl": PRIME_RL,
    "slime": SLIME,
    "verl": VERL,
    "skyrl": SKYRL,
    "nemo-rl": NEMO_RL,
}


class Turn(msgspec.Struct, frozen=True):
    """One turn of a multi-turn rollout: the prompt it was sent and the completion it got."""

    prompt_token_ids: list[int]
    completion: Completion


def stitch_turns(turns: Sequence[Turn]) -> tuple[list[int], int, RoutedExperts]:
    """One sequence from the turns of a multi-turn rollout: its token ids, the first turn's
    prompt length, and the routing of every position from the first turn's `start`.

    Each turn's prompt must begin with the previous turn's prompt and output, and its routing
    must start where the previous turn's ends (ReplayError otherwise)."""
    if not turns:
        raise ReplayError("no turns to stitch")
    pieces: list[npt.NDArray[np.integer]] = []
    first = _routing(turns[0].completion, 0)
    end = first.start
    sequence: list[int] = []
    for number, turn in enumerate(turns):
        routed = _routing(turn.completion, number)
        prompt = turn.prompt_token_ids
        if prompt[: len(sequence)] != sequence:
            raise ReplayError(
                f"turn {number}'s prompt does not begin with turn {number - 1}'s prompt and "
                "output: its routing would not belong to one sequence"
            )
        if routed.start != end:
            raise ReplayError(
                f"turn {number} starts at position {routed.start} but the turns before it end "
                f"at {end}: its routed_experts_prompt_start must be {end} (len(previous prompt "
                "+ output) - 1)"
            )
        _check_rows(routed, len(prompt), len(turn.completion.token_ids), f"turn {number}")
        pieces.append(routed.to_array())
        end = routed.end
        sequence = [*prompt, *turn.completion.token_ids]
    rows = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    stitched = RoutedExperts.from_array(rows, start=first.start)
    return sequence, len(turns[0].prompt_token_ids), stitched


def replay_array(
    completion: Completion,
    prompt_len: int,
    layout: ReplayLayout | None = None,
    *,
    earlier: Sequence[Turn] = (),
    prompt_token_ids: Sequence[int] | None = None,
    moe_layers: Sequence[int] | None = None,
) -> npt.NDArray[np.integer]:
    """The routing of `completion` (with `earlier` turns before it) as `layout` says (default:
    `ReplayLayout()`, vLLM's rows from 0 with nothing filled in).

    Rows are absolute positions from 0 (or from `prompt_len` with `prompt_rows=False`):
    `prompt_len + len(token_ids)` of them, one fewer with `last_row="drop"`, or `pad_to`.
    With `earlier`, `prompt_token_ids` (this turn's prompt) is required and checked to extend
    them. `moe_layers` names the MoE layers for `moe_layers_only` (default: the layers that
    are not all zeros).
    """
    layout = layout or ReplayLayout()
    routed = _sequence_routing(completion, prompt_len, earlier, prompt_token_ids)
    total = prompt_len + len(completion.token_ids)
    rows = routed.to_array()
    _, layers, top_k = routed.shape
    dtype = _target_dtype(layout.dtype, rows, routed.dtype, _fills_used(layout, routed.start))
    out = np.empty((total if layout.last_row != "drop" else total - 1, layers, top_k), dtype)
    if routed.start:
        if layout.before_start == "error":
            raise ReplayError(
                f"routing starts at position {routed.start}: the layout needs every row from 0 "
                "(send routed_experts_prompt_start=0, pass the earlier turns, or choose a "
                "before_start fill)"
            )
        out[: routed.start] = _fill_value(layout.before_start)
    out[routed.start : routed.end] = rows
    if layout.last_row != "drop":
        _fill_last(out, layout.last_row, top_k)
    if layout.moe_layers_only:
        keep = list(moe_layers) if moe_layers is not None else _moe_layers(rows)
        out = out[:, keep]
    if not layout.prompt_rows:
        out = out[prompt_len:]
    if layout.pad_to is not None:
        out = _pad(out, layout)
    return out


def _sequence_routing(
    completion: Completion,
    prompt_len: int,
    earlier: Sequence[Turn],
    prompt_token_ids: Sequence[int] | None,
) -> RoutedExperts:
    """The routing of the whole sequence, checked against the row rule (and the turns)."""
    if not earlier:
        routed = _routing(completion, 0)
        _check_rows(routed, prompt_len, len(completion.token_ids), "the completion")
        return routed
    if prompt_token_ids is None:
        raise ReplayError("with earlier turns, pass this turn's prompt_token_ids")
    if len(prompt_token_ids) != prompt_len:
        raise ReplayError(
            f"prompt_token_ids has {len(prompt_token_ids)} tokens, prompt_len says {prompt_len}"
        )
    _, _, routed = stitch_turns([*earlier, Turn(list(prompt_token_ids), completion)])
    return routed


def _fill_last(out: npt.NDArray[np.integer], fill: LastRow, top_k: int) -> None:
    last = out[-1]
    if fill == "repeat":
        if out.shape[0] < 2:
            raise ReplayError("no row before the last token's to repeat")
        last[:] = out[-2]
    elif fill == "arange":
        last[:] = np.arange(top_k, dtype=out.dtype)
    else:
        last[:] = _fill_value(fill)


def _routing(completion: Completion, number: int) -> RoutedExperts:
    if completion.routed_experts is None:
        raise ReplayError(f"turn {number}'s completion has no routed experts")
    return completion.routed_experts


def _check_rows(routed: RoutedExperts, prompt_len: int, tokens: int, what: str) -> None:
    expected_end = prompt_len + tokens - 1
    if routed.end != expected_end:
        raise ReplayError(
            f"{what}'s routed experts cover positions [{routed.start}, {routed.end}) but the row "
            f"rule gives [{routed.start}, {expected_end}) (prompt {prompt_len} + {tokens} tokens "
            "- 1): the prompt length or the completion does not match its routing"
        )


def _fills_used(layout: ReplayLayout, start: int) -> set[int]:
    used = set()
    if start and layout.before_start == "minus_one":
        used.add(-1)
    if layout.last_row == "minus_one":
        used.add(-1)
    if layout.pad_to is not None and layout.pad_fill == "minus_one":
        used.add(-1)
    return used


_NARROW_UNSIGNED: Final = ("uint8", "uint16", "uint32", "uint64")
_NARROW_SIGNED: Final = ("int8", "int16", "int32", "int64")


def _target_dtype(
    choice: Dtype, rows: npt.NDArray[np.integer], wire: str, fills: set[int]
) -> np.dtype[np.integer]:
    low = min([int(rows.min()) if rows.size else 0, *fills])
    high = max(int(rows.max()) if rows.size else 0, 0)
    if choice == "wire":
        candidates: tuple[str, ...] = (wire,)
    elif choice == "narrowest_unsigned":
        candidates = _NARROW_UNSIGNED
    elif choice == "narrowest_signed":
        candidates = _NARROW_SIGNED
    elif choice == "canonical":
        candidates = ("uint8", "int16", "int32")
    else:
        candidates = (choice,)
    for name in candidates:
        info = np.iinfo(name)
        if info.min <= low and high <= info.max:
            return np.dtype(name)
    raise ReplayError(
        f"values in [{low}, {high}] (ids and fills) do not fit dtype {choice!r}"
        + (" (-1 fills need a signed dtype)" if low < 0 else "")
    )


def _fill_value(fill: str) -> int:
    return -1 if fill == "minus_one" else 0


def _moe_layers(rows: npt.NDArray[np.integer]) -> list[int]:
    """MoE layers are those with any non-zero id: a router's top-k ids are distinct, so an
    MoE layer is never all zeros, and a dense layer always is."""
    if not rows.size:
        raise ReplayError("cannot tell MoE layers from an empty array: pass moe_layers")
    return [i for i in range(rows.shape[1]) if rows[:, i].any()]


def _pad(out: npt.NDArray[np.integer], layout: ReplayLayout) -> npt.NDArray[np.integer]:
    assert layout.pad_to is not None  # noqa: S101 - the caller checked
    missing = layout.pad_to - out.shape[0]
    if missing < 0:
        raise ReplayError(f"{out.shape[0]} positions do not fit pad_to={layout.pad_to}")
    pad = np.full((missing, *out.shape[1:]), _fill_value(layout.pad_fill), dtype=out.dtype)
    return np.concatenate([pad, out] if layout.pad_side == "left" else [out, pad])
