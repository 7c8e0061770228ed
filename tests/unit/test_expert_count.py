"""The served model's expert count travels with routed experts: from vLLM's output into the
record, through payload references, and into the copy a trainer's client inlines."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np

from schemas import Completed, Completion, Job, RoutedExperts
from worker.client.rollout import _resolved
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
    # The ids seen stay below 256, so the wire dtype narrows; the expert count says otherwise.
    assert routed.dtype == "uint8"
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
