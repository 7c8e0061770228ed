"""A checkpoint's bytes, checked before an update pauses anything: a shard cut short (a copy
or a trainer's write still under way) passes the header and shape checks, and safetensors
refuses it only inside the engine's load."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from worker.core.errors import WeightUpdateError
from worker.engines.vllm_weights import check_checkpoint

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
