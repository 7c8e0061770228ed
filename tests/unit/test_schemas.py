"""The wire contract in `schemas/`: round trips, limits, schema evolution and the examples of
the wire-format page (`docs/trainer/wire-format.md`)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import schemas
from schemas import (
    Completed,
    Completion,
    ErrorCode,
    ErrorInfo,
    Failed,
    Job,
    RoutedExperts,
    RoutedExpertsError,
    SamplingSpec,
    SchemaError,
    Timings,
    decode_job,
    decode_result,
    encode,
    peek_job_id,
)
from schemas.jobs import (
    MAX_JOB_ID_CHARS,
    MAX_LOGPROBS,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_VALUE_CHARS,
    MAX_N,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS,
)
from tests.hypothesis_profiles import examples

WIRE_FORMAT_PAGE = Path(__file__).resolve().parents[2] / "docs" / "trainer" / "wire-format.md"

# Modest example counts keep the whole file to a few seconds on a busy 2-core machine.
PROPERTY_SETTINGS = settings(
    max_examples=examples(0.6), suppress_health_check=[HealthCheck.too_slow]
)

INPUT_DTYPES = ["uint8", "uint16", "uint32", "int8", "int16", "int32", "int64"]
# Wire dtypes from narrowest to widest, unsigned first at each width: the first one whose range
# holds [min, max] is the narrowest. Written out here, independently of schemas/routed_experts.py.
WIRE_DTYPES_BY_WIDTH = [
    np.dtype(name) for name in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64")
]
# Magnitudes on both sides of every narrowing boundary, so values land in every wire dtype.
BOUNDS = [0, 1, 127, 128, 255, 256, 32767, 32768, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**62]


def expected_wire_dtype(arr: npt.NDArray[np.integer]) -> np.dtype[Any]:
    if arr.size == 0:
        return np.dtype(np.uint8)
    low, high = int(arr.min()), int(arr.max())
    return next(
        d for d in WIRE_DTYPES_BY_WIDTH if np.iinfo(d).min <= low and high <= np.iinfo(d).max
    )


@st.composite
def expert_arrays(draw: st.DrawFn) -> npt.NDArray[np.integer]:
    """3-D integer arrays of every input dtype, with values spread over every narrowing class."""
    dtype = np.dtype(draw(st.sampled_from(INPUT_DTYPES)))
    info = np.iinfo(dtype)
    bound = min(draw(st.sampled_from(BOUNDS)), int(info.max))
    negatives = info.min < 0 and draw(st.booleans())
    low = max(int(info.min), -bound - 1) if negatives else 0
    shape = draw(hnp.array_shapes(min_dims=3, max_dims=3, min_side=0, max_side=6))
    elements = st.integers(min_value=low, max_value=bound)
    return draw(hnp.arrays(dtype, shape, elements=elements))


def completed_with(routed_experts: RoutedExperts | None) -> Completed:
    return Completed(
        job_id="job-1",
        completions=[
            Completion(
                index=0,
                token_ids=[5, 6, 7],
                text="abc",
                finish_reason="length",
                routed_experts=routed_experts,
            )
        ],
        prompt_token_count=4,
    )


def routed_experts_of(result: schemas.Result) -> RoutedExperts:
    assert isinstance(result, Completed)
    routed = result.completions[0].routed_experts
    assert routed is not None
    return routed


def job_bytes(**fields: Any) -> bytes:
    return json.dumps({"job_id": "job-1", "prompt": "hi", **fields}).encode()


# --- Routed experts: round trips and narrowing -------------------------------------------------


@PROPERTY_SETTINGS
@given(arr=expert_arrays(), start=st.integers(min_value=0, max_value=2**40))
@example(arr=np.zeros((0, 48, 8), dtype=np.int32), start=17)
@example(arr=np.full((2, 3, 4), -1, dtype=np.int32), start=0)
def test_routed_experts_round_trip_exactly_in_the_narrowest_dtype(
    arr: npt.NDArray[np.integer], start: int
) -> None:
    wire = encode(completed_with(RoutedExperts.from_array(arr, start)))

    routed = routed_experts_of(decode_result(wire))
    decoded = routed.to_array()

    assert decoded.dtype == expected_wire_dtype(arr)
    assert routed.dtype == expected_wire_dtype(arr).name
    assert decoded.shape == arr.shape
    assert routed.start == start
    assert np.array_equal(decoded, arr)


@PROPERTY_SETTINGS
@given(arr=expert_arrays(), start=st.integers(min_value=0, max_value=2**40))
@example(arr=np.zeros((0, 48, 8), dtype=np.int32), start=17)
@example(arr=np.full((2, 3, 4), -1, dtype=np.int32), start=0)
def test_json_bytes_decode_with_plain_base64_and_frombuffer(
    arr: npt.NDArray[np.integer], start: int
) -> None:
    wire = encode(completed_with(RoutedExperts.from_array(arr, start)))

    # How a trainer without this package reads it (prime-rl, Dynamo's tests).
    d = json.loads(wire)["completions"][0]["routed_experts"]
    raw = base64.b64decode(d["data"], validate=True)
    decoded = np.frombuffer(raw, dtype=np.dtype(d["dtype"])).reshape(d["shape"])

    assert np.array_equal(decoded, arr)
    assert decoded.shape == arr.shape
    assert d["start"] == start
    assert d["dtype"] == expected_wire_dtype(arr).name


@pytest.mark.parametrize(
    ("values", "input_dtype", "wire_dtype"),
    [
        ([], "int32", "uint8"),
        ([0, 255], "int32", "uint8"),
        ([0, 127], "int8", "uint8"),
        ([256], "int32", "uint16"),
        ([0, 65535], "int32", "uint16"),
        ([65536], "int64", "uint32"),
        ([2**32 - 1], "int64", "uint32"),
        ([2**32], "int64", "int64"),
        ([2**63 - 1], "uint64", "int64"),
        ([-1, 127], "int32", "int8"),
        ([-128, 0], "int64", "int8"),
        ([-1, 128], "int32", "int16"),
        ([-32768, 32767], "int32", "int16"),
        ([-1, 32768], "int32", "int32"),
        ([-32769], "int32", "int32"),
        ([-(2**31), 2**31 - 1], "int64", "int32"),
        ([-1, 2**31], "int64", "int64"),
        ([-(2**63), 2**63 - 1], "int64", "int64"),
    ],
)
def test_from_array_picks_the_narrowest_dtype_that_holds_every_value(
    values: list[int], input_dtype: str, wire_dtype: str
) -> None:
    arr = np.array(values, dtype=input_dtype).reshape(len(values), 1, 1)

    routed = RoutedExperts.from_array(arr)

    assert routed.dtype == wire_dtype
    assert len(routed.data) == len(values) * np.dtype(wire_dtype).itemsize
    assert routed.to_array().tolist() == arr.tolist()


def test_vllm_era_int32_ids_shrink_four_times_to_uint8() -> None:
    arr = np.random.default_rng(0).integers(0, 128, size=(64, 48, 8), dtype=np.int32)

    routed = RoutedExperts.from_array(arr, start=3)

    assert routed.dtype == "uint8"
    assert len(routed.data) == arr.nbytes // 4
    assert routed.shape == [64, 48, 8]
    assert np.array_equal(routed.to_array(), arr)


@pytest.mark.parametrize(
    ("late_value", "input_dtype", "wire_dtype"),
    [
        (255, "int32", "uint8"),
        (256, "int32", "uint16"),
        (-1, "int32", "int8"),
        (-129, "int64", "int16"),
        (70_000, "uint32", "uint32"),
    ],
)
def test_from_array_finds_a_value_beyond_the_first_chunks(
    late_value: int, input_dtype: str, wire_dtype: str
) -> None:
    # Large arrays are narrowed a chunk at a time; a value only the last chunk holds must still
    # decide the dtype, and the chunks must join in order.
    flat = (np.arange(300_001, dtype=np.int64) % 100).astype(input_dtype)
    flat[-1] = late_value
    arr = flat.reshape(-1, 1, 1)

    routed = RoutedExperts.from_array(arr)

    assert routed.dtype == wire_dtype
    assert np.array_equal(routed.to_array(), arr)


@pytest.mark.parametrize(
    "make_view",
    [
        pytest.param(lambda a: a[::-1, :, ::2], id="reversed-strided"),
        pytest.param(lambda a: a.transpose(1, 0, 2), id="transposed"),
        pytest.param(lambda a: a.astype(">i4"), id="big-endian-int32"),
        pytest.param(lambda a: (a - 300).astype(">i8"), id="big-endian-negative-int64"),
        pytest.param(lambda a: np.asfortranarray(a * 1000), id="fortran-order"),
    ],
)
def test_from_array_packs_views_and_foreign_byte_orders_in_c_order(make_view: Any) -> None:
    base = np.arange(4 * 3 * 4, dtype=np.int32).reshape(4, 3, 4)
    view = make_view(base)

    routed = RoutedExperts.from_array(view)
    raw = np.frombuffer(base64.b64decode(json.loads(encode(routed))["data"]), dtype=routed.dtype)

    assert routed.dtype == expected_wire_dtype(view).name
    assert raw.tolist() == view.ravel(order="C").tolist()
    assert routed.to_array().tolist() == view.tolist()


def test_from_array_accepts_nested_lists() -> None:
    routed = RoutedExperts.from_array([[[1, 2]], [[3, 300]]], start=7)

    assert routed.dtype == "uint16"
    assert routed.shape == [2, 1, 2]
    assert routed.start == 7
    assert routed.to_array().tolist() == [[[1, 2]], [[3, 300]]]


def test_to_array_is_read_only() -> None:
    decoded = RoutedExperts.from_array(np.zeros((2, 2, 2), dtype=np.int32)).to_array()

    with pytest.raises(ValueError, match="read-only"):
        decoded[0, 0, 0] = 1


@pytest.mark.parametrize(
    "array",
    [
        pytest.param(np.zeros((2, 3, 4), dtype=np.float32), id="float32"),
        pytest.param(np.zeros((2, 3, 4), dtype=np.bool_), id="bool"),
        pytest.param(np.array([[["1"]]]), id="str"),
        pytest.param(np.array([[[1.5]]]), id="float-list"),
    ],
)
def test_from_array_rejects_non_integer_arrays(array: npt.NDArray[Any]) -> None:
    with pytest.raises(RoutedExpertsError, match="must be integers"):
        RoutedExperts.from_array(array)


@pytest.mark.parametrize("shape", [(), (6,), (2, 3), (1, 2, 3, 1)])
def test_from_array_rejects_arrays_that_are_not_3d(shape: tuple[int, ...]) -> None:
    with pytest.raises(RoutedExpertsError, match="must be 3-D"):
        RoutedExperts.from_array(np.zeros(shape, dtype=np.int32))


def test_from_array_rejects_a_negative_start() -> None:
    with pytest.raises(RoutedExpertsError, match="start must be >= 0"):
        RoutedExperts.from_array(np.zeros((1, 1, 1), dtype=np.uint8), start=-1)


def test_from_array_rejects_values_no_wire_dtype_holds() -> None:
    arr = np.array([[[2**64 - 1]]], dtype=np.uint64)

    with pytest.raises(RoutedExpertsError, match="fit no supported dtype"):
        RoutedExperts.from_array(arr)


def test_routed_experts_error_is_a_schema_error() -> None:
    assert issubclass(RoutedExpertsError, SchemaError)
    assert issubclass(SchemaError, ValueError)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        pytest.param(
            RoutedExperts(data=b"\0" * 4, shape=[1, 1, 1], dtype="float32"),
            "unknown dtype 'float32'",
            id="float32",
        ),
        pytest.param(
            RoutedExperts(data=b"\0" * 8, shape=[1, 1, 1], dtype="uint64"),
            "unknown dtype 'uint64'",
            id="uint64-not-on-the-wire",
        ),
        pytest.param(
            RoutedExperts(data=b"\0" * 2, shape=[1, 1, 1], dtype="<u2"),
            "unknown dtype '<u2'",
            id="dtype-string-not-a-name",
        ),
        pytest.param(
            RoutedExperts(data=b"\0" * 6, shape=[2, 3], dtype="uint8"),
            "shape must be 3 non-negative ints",
            id="2-d",
        ),
        pytest.param(
            RoutedExperts(data=b"\0" * 6, shape=[1, 2, 3, 1], dtype="uint8"),
            "shape must be 3 non-negative ints",
            id="4-d",
        ),
        pytest.param(
            RoutedExperts(data=b"", shape=[-1, 2, 3], dtype="uint8"),
            "shape must be 3 non-negative ints",
            id="negative-dim",
        ),
        pytest.param(
            RoutedExperts(data=b"\0" * 23, shape=[2, 3, 4], dtype="uint8"),
            "data is 23 bytes but shape \\[2, 3, 4\\] of uint8 needs 24",
            id="one-byte-short",
        ),
        pytest.param(
            RoutedExperts(data=b"\0" * 24, shape=[2, 3, 4], dtype="uint16"),
            "data is 24 bytes but shape \\[2, 3, 4\\] of uint16 needs 48",
            id="uint16-itemsize-counted",
        ),
        pytest.param(
            RoutedExperts(data=b"\0" * 25, shape=[2, 3, 4], dtype="uint8"),
            "data is 25 bytes but shape \\[2, 3, 4\\] of uint8 needs 24",
            id="one-byte-long",
        ),
    ],
)
def test_to_array_rejects_a_malformed_record(record: RoutedExperts, message: str) -> None:
    with pytest.raises(RoutedExpertsError, match=message):
        record.to_array()


def test_decoded_record_with_wrong_length_is_rejected_by_to_array() -> None:
    doc = json.loads(encode(completed_with(RoutedExperts.from_array(np.ones((2, 3, 4), np.int32)))))
    doc["completions"][0]["routed_experts"]["shape"] = [2, 3, 5]
    routed = routed_experts_of(decode_result(json.dumps(doc)))

    with pytest.raises(RoutedExpertsError, match="data is 24 bytes"):
        routed.to_array()


@pytest.mark.parametrize(
    ("field", "value", "path"),
    [
        ("shape", [2, 12], "$.completions[0].routed_experts.shape"),
        ("shape", [2, 3, -4], "$.completions[0].routed_experts.shape[2]"),
        ("data", "not base64!", "$.completions[0].routed_experts.data"),
        ("start", -1, "$.completions[0].routed_experts.start"),
        ("dtype", 8, "$.completions[0].routed_experts.dtype"),
        ("num_experts", 0, "$.completions[0].routed_experts.num_experts"),
        ("num_experts", "128", "$.completions[0].routed_experts.num_experts"),
    ],
)
def test_decode_result_rejects_a_malformed_routed_experts_record(
    field: str, value: Any, path: str
) -> None:
    doc = json.loads(encode(completed_with(RoutedExperts.from_array(np.ones((2, 3, 4), np.int32)))))
    doc["completions"][0]["routed_experts"][field] = value

    with pytest.raises(SchemaError) as info:
        decode_result(json.dumps(doc))

    assert info.value.path == path


# --- Routed experts: which rows are which positions --------------------------------------------


def rows_tagged_with_positions(start: int, end: int) -> RoutedExperts:
    """Rows for positions [start, end), every value in row i equal to its position start + i."""
    positions = np.arange(start, end, dtype=np.int32)
    return RoutedExperts.from_array(
        np.broadcast_to(positions[:, None, None], (end - start, 2, 3)), start
    )


def row_positions(rows: npt.NDArray[np.integer]) -> list[int]:
    return [int(row[0, 0]) for row in rows]


def test_rows_cover_prompt_from_start_and_every_generated_token_but_the_last() -> None:
    prompt_len, token_ids, start = 5, [11, 12, 13, 14], 2
    routed = rows_tagged_with_positions(start, prompt_len + len(token_ids) - 1)

    assert routed.rows == prompt_len + len(token_ids) - 1 - start == 6
    assert routed.end == 8
    assert row_positions(routed.completion_rows(prompt_len)) == [5, 6, 7]
    assert len(routed.completion_rows(prompt_len)) == len(token_ids) - 1
    assert row_positions(routed.rows_for_positions(start)) == [2, 3, 4, 5, 6, 7]
    assert row_positions(routed.rows_for_positions(3, 6)) == [3, 4, 5]
    assert row_positions(routed.rows_for_positions(8)) == []


def test_completion_rows_when_start_is_the_prompt_length() -> None:
    routed = rows_tagged_with_positions(10, 10 + 3 - 1)

    assert row_positions(routed.completion_rows(10)) == [10, 11]


def test_completion_rows_of_a_single_token_completion_are_empty() -> None:
    routed = rows_tagged_with_positions(0, 4 + 1 - 1)

    assert routed.completion_rows(4).shape == (0, 2, 3)


@PROPERTY_SETTINGS
@given(
    prompt_len=st.integers(min_value=1, max_value=40),
    generated=st.integers(min_value=1, max_value=40),
    data=st.data(),
)
def test_completion_rows_are_the_generated_tokens_fed_forward(
    prompt_len: int, generated: int, data: st.DataObject
) -> None:
    start = data.draw(st.integers(min_value=0, max_value=prompt_len))
    sent = rows_tagged_with_positions(start, prompt_len + generated - 1)
    routed = routed_experts_of(decode_result(encode(completed_with(sent))))

    assert row_positions(routed.rows_for_positions(start, prompt_len)) == list(
        range(start, prompt_len)
    )

    assert row_positions(routed.completion_rows(prompt_len)) == list(
        range(prompt_len, prompt_len + generated - 1)
    )


@pytest.mark.parametrize(
    ("first", "stop"),
    [(1, None), (1, 4), (3, 9), (6, 5), (9, None), (9, 9), (0, 0)],
)
def test_rows_for_positions_rejects_positions_outside_the_rows_held(
    first: int, stop: int | None
) -> None:
    routed = rows_tagged_with_positions(2, 8)

    with pytest.raises(RoutedExpertsError, match=r"outside the rows held, \[2, 8\)"):
        routed.rows_for_positions(first, stop)


def test_completion_rows_rejects_a_prompt_length_beyond_the_rows() -> None:
    routed = rows_tagged_with_positions(2, 8)

    with pytest.raises(RoutedExpertsError, match="outside the rows held"):
        routed.completion_rows(9)
    with pytest.raises(RoutedExpertsError, match="outside the rows held"):
        routed.completion_rows(1)


# --- Jobs: every limit, with the path of the bad field -----------------------------------------


BAD_JOBS: list[Any] = [
    # (id, payload fields overriding a valid job, expected path, message fragment)
    ("job_id-empty", {"job_id": ""}, "$.job_id", "length >= 1"),
    ("job_id-too-long", {"job_id": "x" * (MAX_JOB_ID_CHARS + 1)}, "$.job_id", "length <= 256"),
    ("job_id-int", {"job_id": 7}, "$.job_id", "Expected `str`, got `int`"),
    ("job_id-null", {"job_id": None}, "$.job_id", "Expected `str`, got `null`"),
    ("job_id-missing", {"job_id": msgspec.UNSET}, "$", "missing required field `job_id`"),
    ("prompt-and-token-ids", {"prompt_token_ids": [1]}, "$", "exactly one of `prompt`"),
    ("neither-prompt", {"prompt": msgspec.UNSET}, "$", "exactly one of `prompt`"),
    ("prompt-null", {"prompt": None}, "$", "exactly one of `prompt`"),
    ("prompt-int", {"prompt": 5}, "$.prompt", "Expected `str | null`, got `int`"),
    ("prompt-too-long", {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "$.prompt", "length <="),
    ("token-ids-empty", {"prompt": msgspec.UNSET, "prompt_token_ids": []}, "$", "not be empty"),
    (
        "token-id-negative",
        {"prompt": msgspec.UNSET, "prompt_token_ids": [1, -1]},
        "$.prompt_token_ids[1]",
        ">= 0",
    ),
    (
        "token-id-beyond-int32",
        {"prompt": msgspec.UNSET, "prompt_token_ids": [2**31]},
        "$.prompt_token_ids[0]",
        "<= 2147483647",
    ),
    (
        "token-id-float",
        {"prompt": msgspec.UNSET, "prompt_token_ids": [1.0]},
        "$.prompt_token_ids[0]",
        "got `float`",
    ),
    (
        "token-ids-string",
        {"prompt": msgspec.UNSET, "prompt_token_ids": "1 2 3"},
        "$.prompt_token_ids",
        "got `str`",
    ),
    (
        "too-many-token-ids",
        {"prompt": msgspec.UNSET, "prompt_token_ids": [0] * (MAX_PROMPT_TOKENS + 1)},
        "$.prompt_token_ids",
        "length <=",
    ),
    ("sampling-list", {"sampling": []}, "$.sampling", "Expected `object`, got `array`"),
    ("n-zero", {"sampling": {"n": 0}}, "$.sampling.n", ">= 1"),
    ("n-too-big", {"sampling": {"n": MAX_N + 1}}, "$.sampling.n", f"<= {MAX_N}"),
    ("n-float", {"sampling": {"n": 2.0}}, "$.sampling.n", "got `float`"),
    ("n-string", {"sampling": {"n": "2"}}, "$.sampling.n", "got `str`"),
    ("max_tokens-zero", {"sampling": {"max_tokens": 0}}, "$.sampling.max_tokens", ">= 1"),
    (
        "max_tokens-too-big",
        {"sampling": {"max_tokens": MAX_TOKENS + 1}},
        "$.sampling.max_tokens",
        f"<= {MAX_TOKENS}",
    ),
    ("temperature-negative", {"sampling": {"temperature": -0.01}}, "$.sampling.temperature", ">="),
    ("temperature-too-big", {"sampling": {"temperature": 100.5}}, "$.sampling.temperature", "<="),
    ("top_p-zero", {"sampling": {"top_p": 0}}, "$.sampling.top_p", "> 0.0"),
    ("top_p-above-one", {"sampling": {"top_p": 1.01}}, "$.sampling.top_p", "<= 1.0"),
    ("top_k-below-minus-one", {"sampling": {"top_k": -2}}, "$.sampling.top_k", ">= -1"),
    ("top_k-too-big", {"sampling": {"top_k": 1_000_001}}, "$.sampling.top_k", "<= 1000000"),
    ("min_p-negative", {"sampling": {"min_p": -0.1}}, "$.sampling.min_p", ">= 0.0"),
    ("min_p-above-one", {"sampling": {"min_p": 1.1}}, "$.sampling.min_p", "<= 1.0"),
    ("seed-beyond-int64", {"sampling": {"seed": 2**63}}, "$.sampling.seed", "<="),
    ("seed-below-int64", {"sampling": {"seed": -(2**63) - 1}}, "$.sampling.seed", ">="),
    ("logprobs-negative", {"sampling": {"logprobs": -1}}, "$.sampling.logprobs", ">= 0"),
    (
        "logprobs-too-many",
        {"sampling": {"logprobs": MAX_LOGPROBS + 1}},
        "$.sampling.logprobs",
        "<= 20",
    ),
    (
        "presence-below",
        {"sampling": {"presence_penalty": -2.01}},
        "$.sampling.presence_penalty",
        ">= -2.0",
    ),
    (
        "presence-above",
        {"sampling": {"presence_penalty": 2.01}},
        "$.sampling.presence_penalty",
        "<= 2.0",
    ),
    (
        "frequency-below",
        {"sampling": {"frequency_penalty": -2.01}},
        "$.sampling.frequency_penalty",
        ">= -2.0",
    ),
    (
        "frequency-above",
        {"sampling": {"frequency_penalty": 2.01}},
        "$.sampling.frequency_penalty",
        "<= 2.0",
    ),
    (
        "repetition-zero",
        {"sampling": {"repetition_penalty": 0}},
        "$.sampling.repetition_penalty",
        "> 0.0",
    ),
    (
        "repetition-above",
        {"sampling": {"repetition_penalty": 10.5}},
        "$.sampling.repetition_penalty",
        "<= 10.0",
    ),
    (
        "stop-too-many",
        {"sampling": {"stop": ["s"] * (MAX_STOP_STRINGS + 1)}},
        "$.sampling.stop",
        "length <= 16",
    ),
    (
        "stop-string-too-long",
        {"sampling": {"stop": "s" * (MAX_STOP_STRING_CHARS + 1)}},
        "$.sampling.stop",
        "length <= 1024",
    ),
    (
        "stop-list-item-too-long",
        {"sampling": {"stop": ["ok", "s" * (MAX_STOP_STRING_CHARS + 1)]}},
        "$.sampling.stop[1]",
        "length <= 1024",
    ),
    ("stop-empty-string", {"sampling": {"stop": ""}}, "$.sampling.stop", "length >= 1"),
    ("stop-list-of-ints", {"sampling": {"stop": [1]}}, "$.sampling.stop[0]", "got `int`"),
    (
        "stop_token_ids-negative",
        {"sampling": {"stop_token_ids": [3, -1]}},
        "$.sampling.stop_token_ids[1]",
        ">= 0",
    ),
    (
        "stop_token_ids-too-many",
        {"sampling": {"stop_token_ids": [0] * (MAX_STOP_TOKEN_IDS + 1)}},
        "$.sampling.stop_token_ids",
        "length <= 1024",
    ),
    ("ignore_eos-string", {"sampling": {"ignore_eos": "yes"}}, "$.sampling.ignore_eos", "`bool`"),
    ("return_routed_experts-int", {"return_routed_experts": 1}, "$.return_routed_experts", "bool"),
    (
        "prompt_start-negative",
        {"routed_experts_prompt_start": -1},
        "$.routed_experts_prompt_start",
        ">= 0",
    ),
    (
        "prompt_start-too-big",
        {"routed_experts_prompt_start": MAX_PROMPT_TOKENS + 1},
        "$.routed_experts_prompt_start",
        "<=",
    ),
    (
        "metadata-too-many",
        {"metadata": {f"k{i}": "v" for i in range(MAX_METADATA_ENTRIES + 1)}},
        "$.metadata",
        "length <= 64",
    ),
    ("metadata-int-value", {"metadata": {"k": 1}}, "$.metadata[...]", "got `int`"),
    ("metadata-null-value", {"metadata": {"k": None}}, "$.metadata[...]", "got `null`"),
    (
        "metadata-value-too-long",
        {"metadata": {"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}},
        "$.metadata[...]",
        "length <= 8192",
    ),
    (
        "metadata-key-too-long",
        {"metadata": {"k" * (MAX_METADATA_KEY_CHARS + 1): "v"}},
        "$.metadata",
        "length <= 256 (in a key)",
    ),
    ("metadata-list", {"metadata": ["k", "v"]}, "$.metadata", "got `array`"),
    ("deadline-string", {"deadline": "soon"}, "$.deadline", "got `str`"),
]


@pytest.mark.parametrize(
    ("fields", "path", "message"),
    [pytest.param(fields, path, message, id=case) for case, fields, path, message in BAD_JOBS],
)
def test_decode_job_rejects_a_violating_field_and_names_its_path(
    fields: dict[str, Any], path: str, message: str
) -> None:
    payload = {"job_id": "job-1", "prompt": "hi", **fields}
    wire = msgspec.json.encode({k: v for k, v in payload.items() if v is not msgspec.UNSET})

    with pytest.raises(SchemaError) as info:
        decode_job(wire)

    assert info.value.path == path
    assert message in info.value.message
    assert path in str(info.value)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"job_id": "x"}, id="job_id-1-char"),
        pytest.param({"job_id": "x" * MAX_JOB_ID_CHARS}, id="job_id-max-chars"),
        pytest.param({"prompt": ""}, id="prompt-empty-string"),
        pytest.param(
            {"prompt": None, "prompt_token_ids": [0, 2**31 - 1]}, id="token-ids-int32-range"
        ),
        pytest.param({"sampling": {"n": MAX_N}}, id="n-max"),
        pytest.param({"sampling": {"max_tokens": None}}, id="max_tokens-null"),
        pytest.param({"sampling": {"max_tokens": MAX_TOKENS}}, id="max_tokens-max"),
        pytest.param({"sampling": {"temperature": 0}}, id="temperature-greedy"),
        pytest.param({"sampling": {"temperature": 100}}, id="temperature-max"),
        pytest.param({"sampling": {"top_p": 1}}, id="top_p-one"),
        pytest.param({"sampling": {"top_p": 1e-9}}, id="top_p-tiny"),
        pytest.param({"sampling": {"top_k": -1}}, id="top_k-minus-one"),
        pytest.param({"sampling": {"min_p": 1}}, id="min_p-one"),
        pytest.param({"sampling": {"seed": -(2**63)}}, id="seed-min"),
        pytest.param({"sampling": {"seed": 2**63 - 1}}, id="seed-max"),
        pytest.param({"sampling": {"logprobs": MAX_LOGPROBS}}, id="logprobs-max"),
        pytest.param({"sampling": {"logprobs": 0}}, id="logprobs-zero"),
        pytest.param(
            {"sampling": {"presence_penalty": -2, "frequency_penalty": 2}}, id="penalties-edges"
        ),
        pytest.param({"sampling": {"repetition_penalty": 10}}, id="repetition-max"),
        pytest.param({"sampling": {"stop": ["s"] * MAX_STOP_STRINGS}}, id="stop-max-count"),
        pytest.param({"sampling": {"stop": "s" * MAX_STOP_STRING_CHARS}}, id="stop-max-chars"),
        pytest.param({"sampling": {"stop": []}}, id="stop-empty-list"),
        pytest.param(
            {"sampling": {"stop_token_ids": [0] * MAX_STOP_TOKEN_IDS}}, id="stop_token_ids-max"
        ),
        pytest.param({"routed_experts_prompt_start": MAX_PROMPT_TOKENS}, id="prompt_start-max"),
        pytest.param(
            {"metadata": {f"k{i}": "v" for i in range(MAX_METADATA_ENTRIES)}}, id="metadata-max"
        ),
        pytest.param(
            {"metadata": {"k" * MAX_METADATA_KEY_CHARS: "v" * MAX_METADATA_VALUE_CHARS}},
            id="metadata-max-chars",
        ),
        pytest.param({"deadline": 1_700_000_000}, id="deadline-int"),
    ],
)
def test_decode_job_accepts_values_at_each_limit(fields: dict[str, Any]) -> None:
    job = decode_job(job_bytes(**fields))

    for name, value in fields.items():
        if name == "sampling":
            for sampling_name, sampling_value in value.items():
                assert getattr(job.sampling, sampling_name) == sampling_value
        else:
            assert getattr(job, name) == value


# A job-shaped and a result-shaped variant of each kind of broken bytes: msgspec reports the first
# problem it meets, so a valid-looking record of the other kind would fail validation first.
NOT_JSON = [
    ("empty", b"", b""),
    ("truncated", b'{"job_id": "job-1",', b'{"type": "failed", "job_id": "j",'),
    ("text", b"not json", b"not json"),
    ("binary", b"\x00\x01\x02", b"\x00\x01\x02"),
    (
        "trailing-garbage",
        b'{"job_id": "job-1", "prompt": "hi"} trailing',
        b'{"type": "failed", "job_id": null, "error": {"code": "expired", "detail": ""}} x',
    ),
    (
        "non-utf8",
        b'{"job_id": "job-1", "prompt": "\xff\xfe"}',
        b'{"type": "failed", "job_id": null, "error": {"code": "expired", "detail": "\xff"}}',
    ),
]


@pytest.mark.parametrize(
    ("job_data", "result_data"),
    [pytest.param(job, result, id=case) for case, job, result in NOT_JSON],
)
def test_bytes_that_are_not_json_give_a_schema_error_without_path(
    job_data: bytes, result_data: bytes
) -> None:
    with pytest.raises(SchemaError) as job_error:
        decode_job(job_data)
    with pytest.raises(SchemaError) as result_error:
        decode_result(result_data)

    assert job_error.value.path is None
    assert result_error.value.path is None
    assert job_error.value.message.startswith("not a JSON job")
    assert result_error.value.message.startswith("not a JSON result")


@pytest.mark.parametrize("data", [b"[]", b"null", b'"job"', b"42"])
def test_json_that_is_not_an_object_is_rejected_at_the_root(data: bytes) -> None:
    with pytest.raises(SchemaError) as info:
        decode_job(data)

    assert info.value.path == "$"
    assert "Expected `object`" in info.value.message


def test_decode_job_accepts_text_as_well_as_bytes() -> None:
    job = decode_job('{"job_id": "j-ü", "prompt": "grüße"}')

    assert job.job_id == "j-ü"
    assert job.prompt == "grüße"


def test_stop_strings_reads_either_form_of_stop() -> None:
    assert SamplingSpec().stop_strings == []
    assert SamplingSpec(stop="###").stop_strings == ["###"]
    assert decode_job(job_bytes(sampling={"stop": ["a", "b"]})).sampling.stop_strings == ["a", "b"]


# --- peek_job_id -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b'{"job_id": "job-7", "sampling": {"n": 0}}', id="bad-sampling"),
        pytest.param(b'{"job_id": "job-7"}', id="no-prompt"),
        pytest.param(b'{"prompt": 5, "job_id": "job-7", "x": [1, {"y": null}]}', id="wrong-types"),
        pytest.param(b'{"job_id": "job-7", "prompt": "\xff"}', id="non-utf8-elsewhere"),
    ],
)
def test_peek_job_id_reads_the_id_of_a_record_that_fails_validation(data: bytes) -> None:
    with pytest.raises(SchemaError):
        decode_job(data)

    assert peek_job_id(data) == "job-7"


def test_peek_job_id_returns_an_id_of_the_maximum_length() -> None:
    job_id = "x" * MAX_JOB_ID_CHARS

    assert peek_job_id(json.dumps({"job_id": job_id, "prompt": 1}).encode()) == job_id


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\x00\xff garbage", id="garbage"),
        pytest.param(b'{"job_id": "job-7"', id="truncated"),
        pytest.param(b'["job-7"]', id="array"),
        pytest.param(b'{"prompt": "hi"}', id="missing"),
        pytest.param(b'{"job_id": 7}', id="int"),
        pytest.param(b'{"job_id": null}', id="null"),
        pytest.param(b'{"job_id": ["job-7"]}', id="list"),
        pytest.param(b'{"job_id": ""}', id="empty-string"),
        pytest.param(json.dumps({"job_id": "x" * (MAX_JOB_ID_CHARS + 1)}).encode(), id="over-long"),
        pytest.param(b'{"job_id": "\xff"}', id="non-utf8-id"),
    ],
)
def test_peek_job_id_returns_none_when_no_usable_id_can_be_read(data: bytes) -> None:
    assert peek_job_id(data) is None


# --- Schema evolution --------------------------------------------------------------------------


def test_job_from_a_newer_producer_with_unknown_fields_decodes() -> None:
    payload = {
        "job_id": "job-9",
        "prompt_token_ids": [1, 2, 3],
        "priority": 7,
        "tenant": {"name": "rl", "quota": [1, 2]},
        "sampling": {
            "n": 4,
            "temperature": 0.7,
            "guided_decoding": {"regex": "[a-z]+"},
            "future_knob": None,
        },
        "return_routed_experts": True,
        "metadata": {"step": "12"},
    }

    job = decode_job(json.dumps(payload))

    assert job.job_id == "job-9"
    assert job.prompt_token_ids == [1, 2, 3]
    assert job.sampling.n == 4
    assert job.sampling.temperature == 0.7
    assert job.return_routed_experts is True
    assert job.metadata == {"step": "12"}


def test_job_from_an_older_producer_gets_vllm_defaults() -> None:
    job = decode_job(b'{"job_id": "job-old", "prompt": "hello"}')

    # vllm.SamplingParams' defaults, field for field.
    assert msgspec.structs.asdict(job.sampling) == {
        "n": 1,
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": None,
        "stop": None,
        "stop_token_ids": None,
        "ignore_eos": False,
        "logprobs": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    assert job == Job(job_id="job-old", prompt="hello")
    assert job.prompt_token_ids is None
    assert job.return_routed_experts is False
    assert job.routed_experts_prompt_start == 0
    assert job.metadata == {}
    assert job.deadline is None


def test_result_from_a_newer_worker_with_unknown_fields_decodes() -> None:
    routed = RoutedExperts.from_array(np.arange(24, dtype=np.int32).reshape(2, 3, 4), start=1)
    doc = json.loads(encode(completed_with(routed)))
    doc["schema_version"] = 3
    doc["trace"] = {"spans": [1, 2]}
    doc["completions"][0]["entropy"] = [0.1, 0.2]
    doc["completions"][0]["routed_experts"]["weights"] = "AAAA"
    doc["completions"][0]["routed_experts"]["layout"] = "rows,layers,top_k"
    doc["timings"] = {"queue_wait_s": 0.5, "engine_s": 2.0, "tokenize_s": 0.01}

    result = decode_result(json.dumps(doc))

    assert isinstance(result, Completed)
    assert result.timings == Timings(queue_wait_s=0.5, engine_s=2.0)
    assert result.completions[0].token_ids == [5, 6, 7]
    assert routed_experts_of(result).start == 1
    assert routed_experts_of(result).to_array().tolist() == np.arange(24).reshape(2, 3, 4).tolist()


def test_failed_result_from_a_newer_worker_with_unknown_fields_decodes() -> None:
    data = (
        b'{"type": "failed", "job_id": "j", "attempt": 2,'
        b' "error": {"code": "expired", "detail": "late", "retryable": true, "hint": "x"}}'
    )

    assert decode_result(data) == Failed(
        job_id="j", error=ErrorInfo(code=ErrorCode.EXPIRED, detail="late", retryable=True)
    )


def test_routed_experts_carry_the_models_expert_count_only_when_the_writer_knows_it() -> None:
    rows = np.ones((2, 3, 4), np.int32)
    old = json.loads(encode(completed_with(RoutedExperts.from_array(rows, start=1))))
    # A record of a worker that predates the field: absent, not null, and it still decodes.
    assert "num_experts" not in old["completions"][0]["routed_experts"]
    assert routed_experts_of(decode_result(json.dumps(old))).num_experts is msgspec.UNSET

    known = RoutedExperts.from_array(rows, start=1, num_experts=384)
    doc = json.loads(encode(completed_with(known)))
    assert doc["completions"][0]["routed_experts"]["num_experts"] == 384
    # `data` stays the first field: the worker's fast encoder splices base64 in after it.
    assert next(iter(doc["completions"][0]["routed_experts"])) == "data"
    assert routed_experts_of(decode_result(encode(completed_with(known)))) == known
    with pytest.raises(RoutedExpertsError, match="num_experts must be >= 1, got 0"):
        RoutedExperts.from_array(rows, num_experts=0)
    with pytest.raises(ValueError, match="num_experts must be >= 1, got -3"):
        RoutedExperts(data=b"", shape=[0, 3, 4], dtype="uint8", num_experts=-3)


def test_result_from_an_older_worker_with_only_required_fields_decodes() -> None:
    data = (
        b'{"type": "completed", "job_id": "j", "prompt_token_count": 3, "completions":'
        b' [{"index": 0, "token_ids": [9], "text": "x", "finish_reason": "stop"}]}'
    )

    result = decode_result(data)

    assert result == Completed(
        job_id="j",
        prompt_token_count=3,
        completions=[Completion(index=0, token_ids=[9], text="x", finish_reason="stop")],
    )
    assert isinstance(result, Completed)
    assert result.completions[0].routed_experts is None
    assert result.completions[0].logprobs is None


# --- Results -----------------------------------------------------------------------------------


def test_completed_result_round_trips_every_field() -> None:
    routed = RoutedExperts.from_array(np.full((3, 2, 2), 200, dtype=np.int32), start=2)
    result = Completed(
        job_id="job-1",
        completions=[
            Completion(
                index=0,
                token_ids=[1, 2, 3, 4],
                text="abcd",
                finish_reason="stop",
                logprobs=[-0.25, -1.5, None, -3.0],
                cumulative_logprob=-4.75,
                routed_experts=routed,
                stop_reason="###",
            ),
            Completion(index=1, token_ids=[1], text="a", finish_reason="stop", stop_reason=151645),
        ],
        prompt_token_count=4,
        prompt_token_ids=[10, 11, 12, 13],
        metadata={"step": "3"},
        model="Qwen/Qwen3-30B-A3B",
        worker="w-0",
        timings=Timings(queue_wait_s=0.25, engine_s=1.5),
    )

    decoded = decode_result(encode(result))

    assert decoded == result
    assert isinstance(decoded, Completed)
    assert decoded.completions[1].stop_reason == 151645
    assert routed_experts_of(decoded).to_array().tolist() == [[[200, 200], [200, 200]]] * 3


def test_a_minus_infinity_logprob_reads_back_as_null() -> None:
    completion = Completion(
        index=0, token_ids=[1, 2], text="ab", finish_reason=None, logprobs=[-0.5, float("-inf")]
    )
    wire = encode(Completed(job_id="j", completions=[completion], prompt_token_count=1))

    decoded = decode_result(wire)

    assert json.loads(wire)["completions"][0]["logprobs"] == [-0.5, None]
    assert isinstance(decoded, Completed)
    assert decoded.completions[0].logprobs == [-0.5, None]


@pytest.mark.parametrize("code", list(ErrorCode))
@pytest.mark.parametrize("job_id", ["job-1", None])
def test_failed_result_round_trips_each_error_code(code: ErrorCode, job_id: str | None) -> None:
    failed = Failed(
        job_id=job_id,
        error=ErrorInfo(code=code, detail=f"because {code}", retryable=True),
        metadata={"step": "1"},
        worker="w-1",
    )

    wire = encode(failed)
    doc = json.loads(wire)

    assert decode_result(wire) == failed
    assert doc["type"] == "failed"
    assert doc["job_id"] == job_id
    assert doc["error"]["code"] == code.value


def test_error_codes_are_the_documented_closed_set() -> None:
    assert {code.value for code in ErrorCode} == {
        "invalid_job",
        "expired",
        "engine_error",
        "result_too_large",
        "internal_error",
        "aborted",
    }


@pytest.mark.parametrize(
    ("data", "path"),
    [
        pytest.param(
            b'{"type": "failed", "job_id": null, "error": {"code": "oops", "detail": ""}}',
            "$.error.code",
            id="unknown-error-code",
        ),
        pytest.param(b'{"type": "partial", "job_id": "j"}', "$.type", id="unknown-type"),
        pytest.param(b'{"job_id": "j", "completions": []}', "$", id="no-type"),
        pytest.param(
            b'{"type": "completed", "job_id": "j", "completions": [], "prompt_token_count": "3"}',
            "$.prompt_token_count",
            id="count-as-string",
        ),
        pytest.param(
            b'{"type": "completed", "job_id": "j", "prompt_token_count": 1, "completions":'
            b' [{"index": -1, "token_ids": [], "text": "", "finish_reason": null}]}',
            "$.completions[0].index",
            id="negative-index",
        ),
    ],
)
def test_decode_result_rejects_an_invalid_result_and_names_its_path(data: bytes, path: str) -> None:
    with pytest.raises(SchemaError) as info:
        decode_result(data)

    assert info.value.path == path


# --- the wire-format page's examples ------------------------------------------------------------


_EXAMPLE_BLOCK = re.compile(
    r'^[ \t]*```json[ \t]+title="(?P<kind>job|result)"[ \t]*\n(?P<body>.*?)^[ \t]*```[ \t]*$',
    re.MULTILINE | re.DOTALL,
)


def test_wire_format_json_examples_decode_as_jobs_and_results() -> None:
    page = WIRE_FORMAT_PAGE
    assert page.is_file(), f"{page} is missing; it must show an example job and result"
    text = page.read_text(encoding="utf-8")
    blocks = [
        (m["kind"], m["body"], text.count("\n", 0, m.start()) + 1)
        for m in _EXAMPLE_BLOCK.finditer(text)
    ]
    kinds = {kind for kind, _, _ in blocks}
    assert kinds == {"job", "result"}, (
        f'{page.name} needs at least one ```json title="job" and one ```json title="result" '
        f"block; found {kinds or 'none'}"
    )

    decoded_kinds = []
    for kind, body, line in blocks:
        try:
            decoded = decode_job(body) if kind == "job" else decode_result(body)
            # An example a reader copies must also hold as many bytes as its shape says (a
            # reference's file is not here: its `nbytes` must match instead).
            routed = [
                c.routed_experts
                for c in (decoded.completions if isinstance(decoded, Completed) else [])
                if c.routed_experts is not None
            ]
            arrays = [r.to_array() for r in routed if not r.is_reference]
            for r in routed:
                if r.is_reference:
                    assert r.nbytes == int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize
        except SchemaError as exc:
            pytest.fail(f"{page.name} line {line}: the ```json {kind} block does not decode: {exc}")
        assert all(a.ndim == 3 for a in arrays)
        decoded_kinds.append("job" if isinstance(decoded, Job) else "result")

    assert decoded_kinds == [kind for kind, _, _ in blocks]


def test_deeply_nested_json_is_a_schema_error_not_a_recursion_error():
    deep = b'{"job_id": "deep", "prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(SchemaError, match="nested too deeply") as info:
        decode_job(deep)
    assert info.value.path is None
    assert peek_job_id(deep) is None
    with pytest.raises(SchemaError, match="nested too deeply"):
        decode_result(b'{"type": "failed", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")


def test_a_payload_reference_needs_all_three_fields_and_no_inline_data(tmp_path: Path):
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    inline = RoutedExperts.from_array(array, start=5)
    payload = tmp_path / "p.bin"
    payload.write_bytes(inline.data)
    sha = hashlib.sha256(inline.data).hexdigest()
    ref = inline.as_reference(payload.as_uri(), sha)
    assert ref.is_reference and not inline.is_reference
    decoded = msgspec.json.decode(encode(ref), type=RoutedExperts)
    np.testing.assert_array_equal(decoded.to_array(), array)
    assert decoded.rows_for_positions(6).tolist() == array[1:].tolist()
    raw = msgspec.json.decode(encode(ref))
    for drop in ("uri", "sha256", "nbytes"):
        partial = {k: v for k, v in raw.items() if k != drop}
        with pytest.raises(msgspec.ValidationError, match="needs uri, sha256 and nbytes"):
            msgspec.json.decode(encode(partial), type=RoutedExperts)
    with pytest.raises(msgspec.ValidationError, match="no inline data"):
        msgspec.json.decode(encode({**raw, "data": "AQ=="}), type=RoutedExperts)
    with pytest.raises(msgspec.ValidationError, match="sha256"):
        msgspec.json.decode(encode({**raw, "sha256": "xyz"}), type=RoutedExperts)
    for uri, message in (
        ("s3://bucket/key", "only file://"),
        ("file://elsewhere/p.bin", "not a host"),
    ):
        with pytest.raises(schemas.PayloadError, match=message):
            msgspec.structs.replace(ref, uri=uri).to_array()
