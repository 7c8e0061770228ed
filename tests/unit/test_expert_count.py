"""The served model's expert count travels with routed experts: from vLLM's output into the
record, through payload references, and into the copy a trainer's client inlines."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from schemas import Completed, Completion, Job, RoutedExperts
from worker.client.inflight import _resolved
from worker.engines.vllm_engine import _completion


def vllm_child(rows: int) -> SimpleNamespace:
    """What vLLM's `CompletionOutput` holds that `_completion` reads (a uint16 array, as vLLM
    returns for models over 256 experts)."""
    return SimpleNamespace(
        index=0,
        token_ids=[4, 5, 6],
        text="abc",
        finish_reason="length",
        logprobs=None,
        cumulative_logprob=None,
        routed_experts=np.full((rows, 2, 2), 7, dtype=np.uint16),
        stop_reason=None,
        weight_versions=None,
    )


def test_vllm_completions_carry_the_models_expert_count_and_none_when_not_moe() -> None:
    job = Job(
        job_id="j",
        prompt_token_ids=[1, 2, 3],
        return_routed_experts=True,
        routed_experts_prompt_start=1,
    )
    completion = _completion(job, vllm_child(rows=3 + 3 - 1 - 1), 0, 384)
    routed = completion.routed_experts
    assert routed is not None
    assert routed.num_experts == 384
    # The ids seen stay below 256, yet the wire dtype is the model's: uint16 above 256 experts.
    assert routed.dtype == "uint16"
    unknown = _completion(job, vllm_child(rows=4), 0, None).routed_experts
    assert unknown is not None and unknown.num_experts is msgspec.UNSET
    assert b"num_experts" not in msgspec.json.encode(unknown)


def test_an_inlined_payload_reference_keeps_the_expert_count(tmp_path: Path) -> None:
    inline = RoutedExperts.from_array(np.ones((2, 3, 2), dtype=np.uint8), num_experts=512)
    path = tmp_path / "payload.bin"
    path.write_bytes(inline.data)
    ref = inline.as_reference(path.as_uri(), hashlib.sha256(inline.data).hexdigest())
    assert ref.num_experts == 512
    result = Completed(
        job_id="j",
        prompt_token_count=2,
        completions=[
            Completion(index=0, token_ids=[1], text="", finish_reason="stop", routed_experts=ref)
        ],
    )
    routed = _resolved(result, tmp_path).completions[0].routed_experts
    assert routed is not None and not routed.is_reference
    assert routed.num_experts == 512
    np.testing.assert_array_equal(routed.to_array(), inline.to_array())


def dynamo_serialized(array: np.ndarray, start: int) -> dict[str, object]:
    """NVIDIA Dynamo 1.6.1's `_serialize_routed_experts`
    (components/src/dynamo/vllm/decoder_output.py): vLLM's array passed through in its own
    dtype, base64 of the raw C-order bytes, with the shape and the prompt start."""
    contiguous = np.ascontiguousarray(array)
    return {
        "data": base64.b64encode(contiguous.tobytes()).decode(),
        "shape": list(contiguous.shape),
        "dtype": str(contiguous.dtype),
        "start": start,
    }


@pytest.mark.parametrize(
    ("num_experts", "vllm_dtype"),
    [(8, np.uint8), (64, np.uint8), (256, np.uint8), (384, np.uint16)],
)
def test_every_completion_of_one_model_has_the_models_dtype_byte_identical_to_dynamo(
    num_experts: int, vllm_dtype: type[np.unsignedinteger]
) -> None:
    rng = np.random.default_rng(num_experts)
    # What vLLM returns for this model: ids in its dtype, one completion with small ids only.
    small = rng.integers(0, min(num_experts, 8), size=(5, 3, 2)).astype(vllm_dtype)
    full = rng.integers(0, num_experts, size=(7, 3, 2)).astype(vllm_dtype)
    full[0, 0, 0] = num_experts - 1
    encoded = [RoutedExperts.from_array(a, start=2, num_experts=num_experts) for a in (small, full)]
    # prime-rl's trainer asserts one dtype per micro-batch (`batch.py:_materialize_bin`).
    assert {e.dtype for e in encoded} == {np.dtype(vllm_dtype).name}
    for array, record in zip((small, full), encoded, strict=True):
        wire = msgspec.json.decode(msgspec.json.encode(record))
        wire.pop("num_experts")
        assert wire == dynamo_serialized(array, 2)
        # A wider array of the same ids (vLLM-era int32) travels as the model's dtype too.
        wide = RoutedExperts.from_array(array.astype(np.int32), start=2, num_experts=num_experts)
        assert wide.dtype == record.dtype and wide.data == record.data


def test_older_vllm_sentinels_keep_a_signed_dtype_even_with_the_expert_count() -> None:
    rows = np.array([[[3, 1]], [[-1, -1]]], dtype=np.int32)  # -1: a prefix-cached row
    routed = RoutedExperts.from_array(rows, num_experts=8)
    assert routed.dtype == "int8"
    np.testing.assert_array_equal(routed.to_array(), rows)
    wide = RoutedExperts.from_array(rows.astype(np.int16), num_experts=384)
    assert wide.dtype == "int8"
    np.testing.assert_array_equal(wide.to_array(), rows)
