"""Routed experts as the array a trainer replays, in the layout that trainer's own code takes.

vLLM gives rows for positions `[start, prompt_len + len(token_ids) - 1)`. Training frameworks
each take something different: one row per position or one fewer, rows from position 0 or the
response's only, the last token's missing row dropped or filled (zeros, a copy of the row
before, `arange(top_k)`), a turn boundary's row copied, a dtype fixed or chosen from the
model's expert count, padding of zeros or `arange(top_k)`. Getting one of these wrong is
silent: the trainer replays a filler as a route, or miscounts the rows it has. So every choice
is explicit here (`ReplayLayout`), the recipes (`RECIPES`) give each framework's, each naming
the release (or source) it was checked against (`ReplayLayout.checked_against`), and inputs a
layout cannot take are refused with `ReplayError`, which says what to send instead.

Multi-turn: pass the earlier turns (`earlier`, or `ReplaySample.earlier`); each turn's routing
must start where the one before it ends (turn k's `routed_experts_prompt_start` =
len(turn k-1's prompt + output) - 1), and each turn's prompt must extend the one before it
with its output.

A batch (`replay_arrays`) gets one dtype for every array, as trainers that pack samples into a
micro-batch require.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
    "ReplaySample",
    "Turn",
    "replay_array",
    "replay_arrays",
    "stitch_turns",
]

RowFill = Literal["zeros", "minus_one", "error"]
LastRow = Literal["drop", "zeros", "minus_one", "repeat", "arange", "arange_flat"]
PadFill = Literal["zeros", "minus_one", "arange", "arange_flat"]
TurnBoundary = Literal["captured", "repeat"]
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
DtypeBasis = Literal["num_experts_or_ids", "num_experts"]


class ReplayError(SchemaError):
    """Routed experts that do not fit the row rule, turns that do not chain, or a layout the
    input or its values cannot take."""


class ReplayLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Every choice a replay array needs, none of them implicit.

    Rows are absolute positions of the sequence (prompt + completion of the last turn), from 0.

    - `before_start`: rows before the first turn's `start` (prompt rows vLLM was asked to
      skip): all zeros, all -1 (a row the engine did not return), or refused (`error`), for a
      trainer that would replay a filler there as a real route or counts rows from 0.
    - `last_row`: the last generated token has no row (it was never fed forward). `drop`
      leaves the array one row short of the sequence; otherwise one row of zeros, of -1, a copy
      of the row before (`repeat`), `arange(top_k)` in every layer (`arange`), or
      `arange(layers * top_k).reshape(layers, top_k) % num_experts` (`arange_flat`: a dummy
      route with distinct ids in every layer, slime's formula).
    - `turn_boundary`: the row at each earlier turn's end (position len(prompt + output) - 1
      of that turn, which the next turn's prefill routes): the next turn's row, as a fresh full
      run gives it (`captured`), or a copy of the row before (`repeat`), the placeholder that
      verifiers' source of 2026-08 kept there (0.4.0 replaces it with the captured row).
    - `dtype`: the wire dtype (`wire`), a numpy name, or the narrowest dtype of a list that
      holds the ids and fills: `narrowest_unsigned` (uint8, uint16, ...), `narrowest_signed`
      (int8, int16, ...), `canonical` (uint8, int16, int32). A narrowest choice holds every id
      the model can produce (below `num_experts`) when the expert count is known; without it
      (`dtype_from="num_experts_or_ids"`) the ids seen in the call, or it is refused
      (`dtype_from="num_experts"`, for a trainer that takes the dtype from its model config).
    - `moe_layers_only`: drop the dense layers' all-zero slots.
    - `prompt_rows`: False keeps only the response's rows: from the first turn's prompt length
      on (a multi-turn trainer's response holds the later turns, their prompts included).
    - `prompt_pad_to`: left-pad the (first turn's) prompt's rows with `pad_fill` rows to this
      many, as a batch of left-padded prompts lays them out.
    - `pad_to`: pad the whole array on `pad_side` with `pad_fill` rows to this many.
    - `pad_fill`: what a padding row holds, one of `last_row`'s fills: zeros, -1, `arange`
      or `arange_flat` (slime pads for tensor and context parallelism with the latter).
    - `checked_against`: for a recipe, the framework release (or dated source, where there is
      no usable release) whose code builds what this layout builds. Informational: it changes
      no array.
    """

    before_start: RowFill = "error"
    last_row: LastRow = "drop"
    turn_boundary: TurnBoundary = "captured"
    dtype: Dtype = "wire"
    dtype_from: DtypeBasis = "num_experts_or_ids"
    moe_layers_only: bool = False
    prompt_rows: bool = True
    prompt_pad_to: int | None = None
    pad_to: int | None = None
    pad_side: Literal["left", "right"] = "right"
    pad_fill: PadFill = "zeros"
    checked_against: str = ""

    def __post_init__(self) -> None:
        for name in ("prompt_pad_to", "pad_to"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ReplayError(f"{name} must be >= 0, got {value}")
        if self.prompt_pad_to is not None and not self.prompt_rows:
            raise ReplayError("prompt_pad_to pads the prompt's rows, which prompt_rows=False drops")


# Each recipe's rule as its framework's code has it, and the release it was checked against:
# verifiers, verl and SkyRL by calling their released functions on these arrays (the
# `frameworks` test lane), slime and NeMo-RL (no usable release) as read in their source. The
# file and function are in each comment; the tests cite the same places.

#: prime-rl / verifiers 0.4.0: one row per position, all decoder layers. verifiers slices each
#: message's rows from `off = path_len - start` and appends a copy of the row before for the
#: last token (`verifiers/v1/graph.py:_attribute_routed_experts`); the next turn asks for
#: `routed_experts_prompt_start = path_len - 1` (`verifiers/v1/clients/train.py`) and puts that
#: turn's first captured row in place of the copy (`_replace_placeholder_routing_row`), so a
#: turn boundary holds the real route. The trainer asserts `shape[0] == len(input_ids)`, needs
#: one dtype per micro-batch and zero-pads (`src/prime_rl/trainer/batch.py`, source 2026-08);
#: the server sends uint8, or uint16 past 255 (`src/prime_rl/inference/vllm/routed_experts.py`),
#: here by the model's expert count. A start past position 0 leaves that branch without
#: routing: refused.
PRIME_RL: Final = ReplayLayout(
    last_row="repeat",
    dtype="narrowest_unsigned",
    checked_against="verifiers 0.4.0 (prime-rl's client side); prime-rl trainer source 2026-08",
)
#: slime: `len(tokens) - 1` rows, int32, all layers, turns merged `existing[:start] + new`
#: (`slime/utils/types.py:Sample._apply_meta_info`, `slime/utils/misc.py:
#: decode_int32_meta_array`). Its trainer asserts `shape[0] == tokens - 1` and appends the
#: dummy row itself (`slime/backends/megatron_utils/cp_utils.py`): the last row is dropped.
SLIME: Final = ReplayLayout(
    dtype="int32", checked_against="slime source 2026-08 (no release on PyPI)"
)
#: verl 0.9.1: rows from position 0 copied into an int16 zero tensor spanning the left-padded
#: prompt and right-padded response (`verl/experimental/agent_loop/agent_loop.py:
#: _agent_loop_postprocess`); the trainer unpads them with the attention mask
#: (`verl/workers/utils/padding.py:left_right_2_no_padding`), takes T or T - 1 rows
#: (`verl/utils/megatron/router_replay_utils.py:align_r3_router_replay_data`) and replays every
#: row but each sequence's last (`build_r3_replay_mask`), so a row before `start` would be
#: replayed as expert 0: refused. Batches: `prompt_pad_to` and `pad_to`.
VERL: Final = ReplayLayout(last_row="zeros", dtype="int16", checked_against="verl 0.9.1")
#: SkyRL 0.4.0: an entry holds only the captured rows, T - 1 of them from position 0: each
#: turn asks for `routed_experts_prompt_start` = the rows held so far and appends its rows, the
#: row count checked exactly (`skyrl/backends/skyrl_train/utils/routed_experts.py:
#: RoutedExpertTrace`). Entries are uint8, int16 or int32 (`ROUTED_EXPERT_DTYPES`: uint16 is
#: refused, by `_collate_rollout_expert_indices` and by `generate_wire.py:
#: decode_packed_routed_experts`), here by the model's expert count. The trainer packs a batch
#: as `[sum(T), layers, top_k]` with `cu_seqlens`, each entry followed by `arange(top_k)` rows
#: to its sequence's end (`skyrl/train/dataset/preprocess.py:
#: convert_prompts_responses_to_batch_tensors`), and counts captured rows by the entry's length
#: (`make_router_padding_mask`): entries stay unpadded.
SKYRL: Final = ReplayLayout(dtype="canonical", checked_against="skyrl 0.4.0")
#: NeMo-RL: `[S, layers, top_k]` from `arange(top_k)` everywhere, the returned rows copied in,
#: -1 only where vLLM returned no row (`nemo_rl/models/generation/vllm/utils.py`); the dtype
#: from the model's expert count, int8 up to 128, int16 up to 32768
#: (`interfaces.py:resolve_routed_experts_dtype`). A -1 row is routed by the live router.
NEMO_RL: Final = ReplayLayout(
    before_start="minus_one",
    last_row="arange",
    dtype="narrowest_signed",
    dtype_from="num_experts",
    pad_fill="arange",
    checked_against="NeMo-RL source 2026-08 (no release on PyPI)",
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


class ReplaySample(msgspec.Struct, frozen=True):
    """One sequence of a batch: its last turn's completion and prompt length, and for a
    multi-turn rollout the turns before it and the last turn's prompt (checked to extend them)."""

    completion: Completion
    prompt_len: int
    earlier: list[Turn] = msgspec.field(default_factory=list)
    prompt_token_ids: list[int] | None = None


def stitch_turns(turns: Sequence[Turn]) -> tuple[list[int], int, RoutedExperts]:
    """One sequence from the turns of a multi-turn rollout: its token ids, the first turn's
    prompt length, and the routing of every position from the first turn's `start`.

    Each turn's prompt must begin with the previous turn's prompt and output, and its routing
    must start where the previous turn's ends (ReplayError otherwise)."""
    stitched = _stitch(turns)
    routed = RoutedExperts.from_array(
        stitched.rows, start=stitched.start, num_experts=stitched.num_experts
    )
    last = turns[-1]
    return [*last.prompt_token_ids, *last.completion.token_ids], stitched.prompt_len, routed


def replay_array(
    completion: Completion,
    prompt_len: int,
    layout: ReplayLayout | None = None,
    *,
    earlier: Sequence[Turn] = (),
    prompt_token_ids: Sequence[int] | None = None,
    moe_layers: Sequence[int] | None = None,
    num_experts: int | None = None,
) -> npt.NDArray[np.integer]:
    """The routing of `completion` (with `earlier` turns before it) as `layout` says (default:
    `ReplayLayout()`, vLLM's rows from 0 with nothing filled in).

    Rows are absolute positions from 0 (from the first turn's prompt length with
    `prompt_rows=False`): `prompt_len + len(token_ids)` of them, one fewer with
    `last_row="drop"`, then padding.
    With `earlier`, `prompt_token_ids` (this turn's prompt) is required and checked to extend
    them. `moe_layers` names the MoE layers for `moe_layers_only` (default: the layers that
    are not all zeros). `num_experts` is the model's expert count (default: the records').
    For a batch with one dtype, use `replay_arrays`.
    """
    sample = ReplaySample(
        completion,
        prompt_len,
        list(earlier),
        None if prompt_token_ids is None else list(prompt_token_ids),
    )
    return replay_arrays([sample], layout, moe_layers=moe_layers, num_experts=num_experts)[0]


def replay_arrays(
    samples: Sequence[ReplaySample],
    layout: ReplayLayout | None = None,
    *,
    moe_layers: Sequence[int] | None = None,
    num_experts: int | None = None,
) -> list[npt.NDArray[np.integer]]:
    """`replay_array` for each sample, every array in the same dtype: the one `layout` picks
    for all of them together (the widest any of them needs), so arrays of one call can be
    packed into one micro-batch.

    `num_experts` is the model's expert count; by default it is read from the records, which
    must then agree. ReplayError names the sample (by index) that cannot be replayed."""
    layout = layout or ReplayLayout()
    plans = []
    for number, sample in enumerate(samples):
        try:
            plans.append(_plan(sample, layout, moe_layers))
        except ReplayError as exc:
            if len(samples) == 1:
                raise
            raise ReplayError(f"sample {number}: {exc.message}") from exc
    if not plans:
        return []
    shapes = {plan.rows.shape[1:] for plan in plans}
    if len(shapes) > 1:
        raise ReplayError(
            f"the samples have different [layers, top_k] {sorted(shapes)}: not one model's "
            "routing, and no micro-batch packs them together"
        )
    experts = _model_experts(plans, num_experts)
    dtype = _batch_dtype(layout, plans, experts)
    return [_build(plan, layout, dtype, experts) for plan in plans]


@dataclass(frozen=True, slots=True)
class _Stitched:
    """A sequence's routing: rows for positions `[start, total - 1)` and where turns meet."""

    total: int  # positions: the last turn's prompt and output
    prompt_len: int  # the first turn's: what follows it is the response, later turns included
    start: int
    rows: npt.NDArray[np.integer]
    wire: np.dtype[np.integer]
    #: Positions of the earlier turns' last rows (each the next turn's first captured row).
    boundaries: tuple[int, ...]
    num_experts: int | None


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one array needs, checked, before the batch's dtype is known."""

    routing: _Stitched
    rows: npt.NDArray[np.integer]  # the routing's rows, in the layers kept
    ids_low: int
    ids_high: int


def _plan(sample: ReplaySample, layout: ReplayLayout, moe_layers: Sequence[int] | None) -> _Plan:
    routing = _sample_routing(sample)
    if routing.start and layout.before_start == "error":
        raise ReplayError(
            f"routing starts at position {routing.start}, but this layout needs real rows from "
            "position 0 (its trainer would replay a filled row as a route, or count rows from "
            "0): send routed_experts_prompt_start=0 for this job, or pass the earlier turns of "
            "a multi-turn rollout"
        )
    rows = routing.rows
    if layout.moe_layers_only:
        layers = rows.shape[1]
        keep = list(moe_layers) if moe_layers is not None else _moe_layers(rows)
        if any(not 0 <= layer < layers for layer in keep):
            raise ReplayError(f"moe_layers {keep} name layers outside the {layers} held")
        rows = rows[:, keep]
    low, high = 0, 0
    if rows.size:
        high = int(rows.max())
        # Unsigned ids are never negative; only older vLLM's signed arrays held -1 sentinels.
        low = 0 if rows.dtype.kind == "u" else min(int(rows.min()), 0)
    return _Plan(routing, rows, low, high)


def _sample_routing(sample: ReplaySample) -> _Stitched:
    """The routing of the whole sequence, checked against the row rule (and the turns)."""
    if not sample.earlier:
        routed = _routing(sample.completion, 0)
        _check_rows(routed, sample.prompt_len, len(sample.completion.token_ids), "the completion")
        return _Stitched(
            total=sample.prompt_len + len(sample.completion.token_ids),
            prompt_len=sample.prompt_len,
            start=routed.start,
            rows=routed.to_array(),
            wire=np.dtype(routed.dtype),
            boundaries=(),
            num_experts=_experts_of(routed),
        )
    if sample.prompt_token_ids is None:
        raise ReplayError("with earlier turns, pass this turn's prompt_token_ids")
    if len(sample.prompt_token_ids) != sample.prompt_len:
        raise ReplayError(
            f"prompt_token_ids has {len(sample.prompt_token_ids)} tokens, prompt_len says "
            f"{sample.prompt_len}"
        )
    return _stitch([*sample.earlier, Turn(sample.prompt_token_ids, sample.completion)])


def _stitch(turns: Sequence[Turn]) -> _Stitched:
    if not turns:
        raise ReplayError("no turns to stitch")
    pieces: list[npt.NDArray[np.integer]] = []
    first = _routing(turns[0].completion, 0)
    end = first.start
    sequence: list[int] = []
    counts: set[int] = set()
    boundaries: list[int] = []
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
        if pieces and list(routed.shape[1:]) != list(pieces[0].shape[1:]):
            raise ReplayError(
                f"turn {number}'s routed experts have {routed.shape[1:]} layers x top_k, "
                f"turn 0's {list(pieces[0].shape[1:])}: not one model's routing"
            )
        if number:
            boundaries.append(routed.start)
        experts = _experts_of(routed)
        if experts is not None:
            counts.add(experts)
        pieces.append(routed.to_array())
        end = routed.end
        sequence = [*prompt, *turn.completion.token_ids]
    if len(counts) > 1:
        raise ReplayError(f"the turns come from models with different expert counts {counts}")
    rows = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    return _Stitched(
        total=len(sequence),
        prompt_len=len(turns[0].prompt_token_ids),
        start=first.start,
        rows=rows,
        wire=rows.dtype,
        boundaries=tuple(boundaries),
        num_experts=counts.pop() if counts else None,
    )


def _build(
    plan: _Plan, layout: ReplayLayout, dtype: np.dtype[np.integer], experts: int | None
) -> npt.NDArray[np.integer]:
    total, start = plan.routing.total, plan.routing.start
    _, layers, top_k = plan.rows.shape
    out = np.empty((total - 1 if layout.last_row == "drop" else total, layers, top_k), dtype)
    out[:start] = _fill_row(layout.before_start, layers, top_k, experts)
    out[start : total - 1] = plan.rows
    if layout.turn_boundary == "repeat":
        # In order: a boundary right after another copies the copy, as verifiers does.
        for position in plan.routing.boundaries:
            out[position] = out[position - 1]
    if layout.last_row == "repeat":
        if total < 2:
            raise ReplayError("no row before the last token's to repeat")
        out[total - 1] = out[total - 2]
    elif layout.last_row != "drop":
        out[total - 1] = _fill_row(layout.last_row, layers, top_k, experts)
    if not layout.prompt_rows:
        out = out[plan.routing.prompt_len :]
    if layout.prompt_pad_to is None and layout.pad_to is None:
        return out
    fill = _fill_row(layout.pad_fill, layers, top_k, experts)
    if layout.prompt_pad_to is not None:
        missing = _missing(plan.routing.prompt_len, layout.prompt_pad_to, "prompt_pad_to")
        out = np.concatenate([_rows_of(fill, missing, dtype), out])
    if layout.pad_to is not None:
        pad = _rows_of(fill, _missing(out.shape[0], layout.pad_to, "pad_to"), dtype)
        out = np.concatenate([pad, out] if layout.pad_side == "left" else [out, pad])
    return out


def _missing(held: int, target: int, name: str) -> int:
    if held > target:
        raise ReplayError(f"{held} positions do not fit {name}={target}")
    return target - held


def _rows_of(
    row: npt.NDArray[np.int64], count: int, dtype: np.dtype[np.integer]
) -> npt.NDArray[np.integer]:
    out = np.empty((count, *row.shape), dtype=dtype)
    out[:] = row
    return out


def _fill_row(fill: str, layers: int, top_k: int, experts: int | None) -> npt.NDArray[np.int64]:
    """One `[layers, top_k]` row of `fill` (not `error`: nothing is filled then)."""
    if fill in ("zeros", "error"):
        return np.zeros((layers, top_k), dtype=np.int64)
    if fill == "minus_one":
        return np.full((layers, top_k), -1, dtype=np.int64)
    if fill == "arange":
        return np.broadcast_to(np.arange(top_k, dtype=np.int64), (layers, top_k))
    assert fill == "arange_flat"  # noqa: S101 - the Literal has no other value
    if experts is None:
        raise ReplayError(
            "an arange_flat row is arange(layers * top_k) % num_experts: pass num_experts (the "
            "routed experts do not carry it)"
        )
    return np.arange(layers * top_k, dtype=np.int64).reshape(layers, top_k) % experts


def _routing(completion: Completion, number: int) -> RoutedExperts:
    if completion.routed_experts is None:
        raise ReplayError(f"turn {number}'s completion has no routed experts")
    return completion.routed_experts


def _experts_of(routed: RoutedExperts) -> int | None:
    return routed.num_experts if isinstance(routed.num_experts, int) else None


def _check_rows(routed: RoutedExperts, prompt_len: int, tokens: int, what: str) -> None:
    expected_end = prompt_len + tokens - 1
    if routed.end != expected_end:
        raise ReplayError(
            f"{what}'s routed experts cover positions [{routed.start}, {routed.end}) but the row "
            f"rule gives [{routed.start}, {expected_end}) (prompt {prompt_len} + {tokens} tokens "
            "- 1): the prompt length or the completion does not match its routing"
        )


def _model_experts(plans: Sequence[_Plan], given: int | None) -> int | None:
    """The model's expert count: `given`, else the records', which must agree with it."""
    carried = {p.routing.num_experts for p in plans if p.routing.num_experts is not None}
    if given is not None:
        if given < 1:
            raise ReplayError(f"num_experts must be >= 1, got {given}")
        if carried - {given}:
            raise ReplayError(
                f"num_experts={given} was passed, but the routed experts say {sorted(carried)}"
            )
        return given
    if len(carried) > 1:
        raise ReplayError(
            f"the samples come from models with different expert counts {sorted(carried)}: "
            "replay each model's in a call of its own"
        )
    return carried.pop() if carried else None


_CANDIDATES: Final[dict[str, tuple[str, ...]]] = {
    "narrowest_unsigned": ("uint8", "uint16", "uint32", "uint64"),
    "narrowest_signed": ("int8", "int16", "int32", "int64"),
    "canonical": ("uint8", "int16", "int32"),
}


def _batch_dtype(
    layout: ReplayLayout, plans: Sequence[_Plan], experts: int | None
) -> np.dtype[np.integer]:
    """The one dtype for every array of the call: the first candidate that holds the ids (all
    the model can produce, for a narrowest choice with a known expert count) and the fills."""
    ids_low = min(p.ids_low for p in plans)
    ids_high = max(p.ids_high for p in plans)
    if experts is not None and ids_high >= experts:
        raise ReplayError(
            f"expert id {ids_high} is not below the model's {experts} experts: num_experts "
            "does not belong to this routing"
        )
    fill_low, fill_high = _fill_range(layout, plans, experts)
    high = ids_high
    if layout.dtype in _CANDIDATES:
        candidates = _CANDIDATES[layout.dtype]
        if experts is not None:
            high = experts - 1
        elif layout.dtype_from == "num_experts":
            raise ReplayError(
                f"this layout's dtype ({layout.dtype}) follows the model's expert count, which "
                "the routed experts do not carry (a record of an older worker): pass num_experts"
            )
    elif layout.dtype == "wire":
        candidates = (np.result_type(*(p.routing.wire for p in plans)).name,)
    else:
        candidates = (layout.dtype,)
    low, high = min(ids_low, fill_low), max(high, fill_high)
    for name in candidates:
        info = np.iinfo(name)
        if info.min <= low and high <= info.max:
            return np.dtype(name)
    raise ReplayError(
        f"values in [{low}, {high}] (ids and fills) do not fit dtype {layout.dtype!r}"
        + (" (-1 fills need a signed dtype)" if low < 0 else "")
    )


def _fill_range(
    layout: ReplayLayout, plans: Sequence[_Plan], experts: int | None
) -> tuple[int, int]:
    """The lowest and highest value the fills write into any of the arrays."""
    fills: list[str] = []
    if any(p.routing.start for p in plans):
        fills.append(layout.before_start)
    if layout.last_row not in ("drop", "repeat"):
        fills.append(layout.last_row)
    if layout.pad_to is not None or layout.prompt_pad_to is not None:
        fills.append(layout.pad_fill)
    low, high = 0, 0
    _, layers, top_k = plans[0].rows.shape
    for fill in fills:
        if fill == "minus_one":
            low = -1
        elif fill == "arange":
            high = max(high, top_k - 1)
        elif fill == "arange_flat":
            high = max(high, min(layers * top_k, experts or layers * top_k) - 1)
    return low, high


def _moe_layers(rows: npt.NDArray[np.integer]) -> list[int]:
    """MoE layers are those with any non-zero id: a router's top-k ids are distinct, so an
    MoE layer is never all zeros, and a dense layer always is."""
    if not rows.size:
        raise ReplayError("cannot tell MoE layers from an empty array: pass moe_layers")
    return [i for i in range(rows.shape[1]) if rows[:, i].any()]
