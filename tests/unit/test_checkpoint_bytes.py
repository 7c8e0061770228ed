"""A checkpoint, checked before an update pauses anything: its bytes (a shard cut short, a copy
or a trainer's write still under way, passes the header and shape checks, and safetensors
refuses it only inside the engine's load), and, for an in-place reload, every weight the served
model has and the config it computes with (the reload reads tensors only)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from worker.core.errors import WeightUpdateError
from worker.engines.vllm_weights import (
    ServedCheckpoint,
    check_checkpoint,
    check_in_place,
    checkpoint_fingerprint,
    served_checkpoint,
)

TENSORS = {"a.weight": np.ones((4, 3), np.float32), "b.weight": np.zeros((5,), np.float32)}


def write_shard(path: Path, tensors: dict[str, np.ndarray], **override: Any) -> Path:
    """A safetensors file by hand (the format: u64 header length, JSON header, data), with
    header entries changed by `override` (name -> fields)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, array in tensors.items():
        raw = array.tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
            **override.get(name, {}),
        }
        data += raw
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


def checkpoint(root: Path, **override: Any) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    write_shard(root / "model.safetensors", TENSORS, **override)
    return root


SERVED = SimpleNamespace(num_hidden_layers=2)


def test_a_whole_checkpoint_passes(tmp_path):
    path = checkpoint(tmp_path / "good")
    assert check_checkpoint(path, SERVED, {"a.weight": (4, 3)}) == path.resolve()


def test_a_shard_cut_short_is_refused_though_its_header_and_shapes_pass(tmp_path):
    path = checkpoint(tmp_path / "short")
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(WeightUpdateError, match=r"hold 64 bytes .* describes 68 \(cut short"):
        check_checkpoint(path, SERVED, {"a.weight": (4, 3)})


def test_a_shard_with_bytes_past_its_tensors_is_refused(tmp_path):
    path = checkpoint(tmp_path / "long")
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes() + b"\0" * 8)
    with pytest.raises(WeightUpdateError, match="hold 76 bytes"):
        check_checkpoint(path, SERVED)


def test_a_tensor_whose_bytes_do_not_match_its_shape_is_refused(tmp_path):
    path = checkpoint(tmp_path / "shape", **{"b.weight": {"shape": [6]}})
    with pytest.raises(WeightUpdateError, match=r"b.weight \(F32 \[6\]\) spans 20 bytes"):
        check_checkpoint(path, SERVED)


def test_overlapping_or_gapped_tensors_are_refused(tmp_path):
    path = checkpoint(tmp_path / "gap", **{"b.weight": {"data_offsets": [52, 72]}})
    with pytest.raises(WeightUpdateError, match=r"b\.weight starts at byte 52 of the data"):
        check_checkpoint(path, SERVED)


def test_a_tensor_entry_without_offsets_is_refused(tmp_path):
    path = checkpoint(tmp_path / "offsets", **{"a.weight": {"data_offsets": None}})
    with pytest.raises(WeightUpdateError, match=r"a\.weight has no readable dtype"):
        check_checkpoint(path, SERVED)


def test_a_dtype_of_unknown_size_is_not_sized_but_the_file_still_is(tmp_path):
    path = checkpoint(tmp_path / "f4", **{"a.weight": {"dtype": "F4"}})
    assert check_checkpoint(path, SERVED) == path.resolve()


# ---- what an in-place reload must fill: every weight, the same config --------------------------

#: A Qwen3-MoE checkpoint in miniature: attention, a MoE layer of two experts, a dense layer.
QWEN: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (8, 4),
    "model.layers.0.self_attn.q_proj.weight": (4, 4),
    "model.layers.0.self_attn.k_proj.weight": (2, 4),
    "model.layers.0.self_attn.v_proj.weight": (2, 4),
    "model.layers.0.self_attn.o_proj.weight": (4, 4),
    "model.layers.0.mlp.gate.weight": (2, 4),
    **{
        f"model.layers.0.mlp.experts.{e}.{proj}.weight": shape
        for e in range(2)
        for proj, shape in (("gate_proj", (3, 4)), ("up_proj", (3, 4)), ("down_proj", (4, 3)))
    },
    "model.layers.1.mlp.gate_proj.weight": (6, 4),
    "model.layers.1.mlp.up_proj.weight": (6, 4),
    "model.layers.1.mlp.down_proj.weight": (4, 6),
    "model.norm.weight": (4,),
    "lm_head.weight": (8, 4),
}
QWEN_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 2,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "transformers_version": "4.57.0",
}
QWEN_SERVED = SimpleNamespace(num_experts=2, tie_word_embeddings=False)


def qwen(
    root: Path,
    tensors: dict[str, tuple[int, ...]] | None = None,
    *,
    shards: int = 1,
    stored: type = np.float32,
    generation: dict[str, Any] | None = None,
    **config: Any,
) -> Path:
    """A checkpoint of `tensors` (zeros of these shapes; `QWEN` by default) in `shards` files."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({**QWEN_CONFIG, **config}))
    if generation is not None:
        (root / "generation_config.json").write_text(json.dumps(generation))
    names = list(QWEN if tensors is None else tensors)
    shapes = QWEN if tensors is None else tensors
    for i in range(shards):
        part: dict[str, np.ndarray] = {n: np.zeros(shapes[n], stored) for n in names[i::shards]}
        dtypes = {name: {"dtype": "F16"} for name in part} if stored == np.float16 else {}
        write_shard(root / f"model-{i:05d}-of-{shards:05d}.safetensors", part, **dtypes)
    return root


@pytest.fixture
def built_on(tmp_path: Path) -> ServedCheckpoint:
    return served_checkpoint(qwen(tmp_path / "built-on"), QWEN_SERVED)


def without(*names: str) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, shape in QWEN.items() if name not in names}


def experts_fused_per_expert() -> dict[str, tuple[int, ...]]:
    tensors = without(*(n for n in QWEN if ".experts." in n and "down_proj" not in n))
    for e in range(2):
        tensors[f"model.layers.0.mlp.experts.{e}.gate_up_proj.weight"] = (6, 4)
    return tensors


def experts_stacked(gate_up: tuple[int, ...] = (2, 6, 4)) -> dict[str, tuple[int, ...]]:
    tensors = without(*(n for n in QWEN if ".experts." in n))
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = gate_up
    tensors["model.layers.0.mlp.experts.down_proj"] = (2, 4, 3)
    return tensors


@pytest.mark.parametrize(
    ("layout", "tensors", "options"),
    [
        ("the same tensors", None, {}),
        ("in three shards", None, {"shards": 3}),
        ("in float16", None, {"stored": np.float16}),
        ("with each expert's gate and up in one tensor", experts_fused_per_expert(), {}),
        ("with every expert stacked in one tensor", experts_stacked(), {}),
        ("with a bias the model has no parameter for", {**QWEN, "model.norm.bias": (4,)}, {}),
        (
            "with a rotary table vLLM drops",
            {**QWEN, "model.layers.0.self_attn.rotary_emb.inv_freq": (2,)},
            {},
        ),
        ("written by another transformers", None, {"transformers_version": "5.0.0"}),
        ("with dtype under its newer key", None, {"dtype": "float32", "torch_dtype": None}),
    ],
)
def test_a_checkpoint_filling_every_weight_with_the_same_config_loads_in_place(
    tmp_path, built_on, layout, tensors, options
):
    config = {k: v for k, v in options.items() if k not in ("shards", "stored")}
    files = {k: v for k, v in options.items() if k in ("shards", "stored")}
    path = qwen(tmp_path / "new", tensors, **files, **config)
    if config.get("torch_dtype", "") is None:
        stored = json.loads((path / "config.json").read_text())
        del stored["torch_dtype"]
        (path / "config.json").write_text(json.dumps(stored))
    check_in_place(path, built_on)  # nothing raised: `layout` fits


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        # vLLM's reload keeps the old value of a tensor it is not given, with a warning.
        (
            without("model.layers.0.self_attn.o_proj.weight"),
            r"model\.layers\.0\.self_attn\.o_proj\.weight missing",
        ),
        # A fused parameter counts as loaded when one shard is (`weights_not_loaded`).
        (
            without("model.layers.0.self_attn.k_proj.weight"),
            r"model\.layers\.0\.self_attn\.qkv_proj\.weight#k missing",
        ),
        (
            without("model.layers.1.mlp.up_proj.weight"),
            r"model\.layers\.1\.mlp\.gate_up_proj\.weight#1 missing",
        ),
        (
            without("model.layers.0.mlp.experts.1.up_proj.weight"),
            r"model\.layers\.0\.mlp\.experts\.w13_weight#1\.w3 missing",
        ),
        (without("lm_head.weight"), r"lm_head\.weight missing"),
        (without("model.embed_tokens.weight"), r"model\.embed_tokens\.weight missing"),
    ],
)
def test_a_checkpoint_missing_a_weight_is_refused_in_place(tmp_path, built_on, tensors, reason):
    path = qwen(tmp_path / "new", tensors)
    with pytest.raises(WeightUpdateError, match=f"does not hold every weight.*{reason}"):
        check_in_place(path, built_on)


def test_tied_embeddings_into_an_untied_model_are_refused_in_place(tmp_path, built_on):
    path = qwen(tmp_path / "tied", without("lm_head.weight"), tie_word_embeddings=True)
    with pytest.raises(WeightUpdateError, match=r"tie_word_embeddings: False -> True"):
        check_in_place(path, built_on)


def test_a_tied_model_loads_a_checkpoint_with_or_without_its_output_head(tmp_path):
    tied = SimpleNamespace(num_experts=2, tie_word_embeddings=True)
    served = qwen(tmp_path / "built-on", without("lm_head.weight"), tie_word_embeddings=True)
    built_on = served_checkpoint(served, tied)
    # vLLM skips `lm_head.*` of a tied model (`AutoWeightsLoader._can_skip`): a fresh engine too.
    check_in_place(qwen(tmp_path / "with", tie_word_embeddings=True), built_on)
    check_in_place(
        qwen(tmp_path / "without", without("lm_head.weight"), tie_word_embeddings=True), built_on
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"rope_theta": 1e6}, r"rope_theta: 10000\.0 -> 1000000\.0"),
        ({"rms_norm_eps": 1e-5}, r"rms_norm_eps: 1e-06 -> 1e-05"),
        ({"eos_token_id": 7}, r"eos_token_id: '\(absent\)' -> 7"),
        ({"rope_theta": 1e6, "rms_norm_eps": 1e-5}, r"rms_norm_eps: .*; also rope_theta"),
    ],
)
def test_a_config_change_a_forward_pass_reads_is_refused_in_place(
    tmp_path, built_on, change, reason
):
    path = qwen(tmp_path / "new", **change)
    with pytest.raises(WeightUpdateError, match=f"changes the model's config \\({reason}"):
        check_in_place(path, built_on)


def test_a_new_generation_config_is_refused_in_place(tmp_path, built_on):
    path = qwen(tmp_path / "new", generation={"eos_token_id": [0, 2], "transformers_version": "5"})
    with pytest.raises(WeightUpdateError, match=r"changes the generation config \(eos_token_id\)"):
        check_in_place(path, built_on)


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        ({**QWEN, "model.layers.0.mlp.experts.2.up_proj.weight": (3, 4)}, "does not load"),
        (experts_stacked(gate_up=(2, 8, 4)), r"w13_weight#0\.w1 has shape \[4, 4\]"),
        ({**QWEN, "model.layers.0.self_attn.k_proj.weight": (3, 4)}, r"qkv_proj\.weight#k has"),
    ],
)
def test_a_tensor_the_served_model_does_not_load_as_it_is_refused_in_place(
    tmp_path, built_on, tensors, reason
):
    with pytest.raises(WeightUpdateError, match=reason):
        check_in_place(qwen(tmp_path / "new", tensors), built_on)


def test_every_shard_of_a_fused_weight_is_required_though_the_built_on_checkpoint_named_one(
    tmp_path,
):
    # vLLM starts on a checkpoint that fills one shard of qkv_proj (its completeness check is
    # by parameter), so the built-on checkpoint's names alone do not say what must be filled.
    served = qwen(tmp_path / "built-on", without("model.layers.0.self_attn.k_proj.weight"))
    built_on = served_checkpoint(served, QWEN_SERVED)
    assert built_on.pieces["model.layers.0.self_attn.qkv_proj.weight#k"] is None
    with pytest.raises(WeightUpdateError, match=r"qkv_proj\.weight#k missing"):
        check_in_place(
            qwen(tmp_path / "new", without("model.layers.0.self_attn.k_proj.weight")), built_on
        )


def test_a_rewritten_checkpoint_has_another_fingerprint_an_untouched_one_the_same(tmp_path):
    path = qwen(tmp_path / "latest")
    before = checkpoint_fingerprint(path)
    assert checkpoint_fingerprint(path) == before
    (path / "tokenizer.json").write_text("{}")  # not a file the weights come from
    assert checkpoint_fingerprint(path) == before
    shard = path / "model-00000-of-00001.safetensors"
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert checkpoint_fingerprint(path) != before
