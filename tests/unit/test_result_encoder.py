"""The worker's result encoder writes exactly the bytes `schemas.encode` writes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    Completed,
    Completion,
    ErrorCode,
    ErrorInfo,
    Failed,
    RoutedExperts,
    decode_result,
    encode,
)
from tests.hypothesis_profiles import examples
from worker.answering.encoder import SPLICE_MIN_BYTES, encode_result

# Strings that look like the spliced spot, to be sure only the real one is spliced.
LOOKALIKE = '"routed_experts":{"data":"'


def routed(rows: int, seed: int, start: int = 0) -> RoutedExperts:
    rng = np.random.default_rng(seed)
    return RoutedExperts.from_array(
        rng.integers(0, 128, size=(rows, 48, 8), dtype=np.int32), start=start
    )


def completion(index: int, routed_experts: RoutedExperts | None, text: str = "") -> Completion:
    return Completion(
        index=index,
        token_ids=list(range(index, index + 5)),
        text=text,
        finish_reason="length",
        logprobs=[-0.5, None, -1.25, -2.0, 0.0],
        routed_experts=routed_experts,
    )


BIG_ROWS = SPLICE_MIN_BYTES // (48 * 8) + 1


@pytest.mark.parametrize(
    "result",
    [
        pytest.param(
            Failed(job_id="j", error=ErrorInfo(code=ErrorCode.EXPIRED, detail=LOOKALIKE)),
            id="failed",
        ),
        pytest.param(
            Completed(job_id="j", completions=[completion(0, None)], prompt_token_count=3),
            id="no-routing",
        ),
        pytest.param(
            Completed(job_id="j", completions=[completion(0, routed(2, 1))], prompt_token_count=3),
            id="small-routing",
        ),
        pytest.param(
            Completed(
                job_id=LOOKALIKE,
                completions=[
                    completion(0, routed(BIG_ROWS, 1, start=4), text=LOOKALIKE),
                    completion(1, None, text='"data":""'),
                    completion(2, routed(BIG_ROWS + 7, 2)),
                    completion(3, RoutedExperts.from_array(np.zeros((0, 48, 8), np.int32))),
                ],
                prompt_token_count=3,
                metadata={"data": "", "routed_experts": LOOKALIKE, LOOKALIKE: '{"data":"'},
                worker=LOOKALIKE,
            ),
            id="big-routing-among-lookalikes",
        ),
    ],
)
def test_encode_result_writes_what_schemas_encode_writes(result: Completed | Failed) -> None:
    encoded = encode_result(result)

    assert encoded == encode(result)
    assert decode_result(encoded) == result


@settings(max_examples=examples(0.4))
@given(
    rows=st.lists(st.one_of(st.none(), st.integers(0, 2 * BIG_ROWS)), min_size=1, max_size=4),
    texts=st.lists(st.text(max_size=40), min_size=4, max_size=4),
    metadata=st.dictionaries(st.text(max_size=30), st.text(max_size=30), max_size=4),
)
def test_encode_result_matches_schemas_encode_for_any_completions(
    rows: list[int | None], texts: list[str], metadata: dict[str, str]
) -> None:
    result = Completed(
        job_id="j",
        completions=[
            completion(i, None if n is None else routed(n, i, start=i), text=texts[i])
            for i, n in enumerate(rows)
        ],
        prompt_token_count=1,
        metadata=metadata,
    )

    assert encode_result(result) == encode(result)
