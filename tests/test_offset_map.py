"""The offset map's codec: round trips, size, and metadata it must refuse."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.offset_map import PREFIX, OffsetMapError, decode_offset_map, encode_offset_map


@given(
    position=st.integers(min_value=0, max_value=2**62),
    above=st.sets(st.integers(min_value=0, max_value=5000), max_size=300),
)
def test_a_map_decodes_to_the_offsets_it_was_made_of(position: int, above: set[int]) -> None:
    answered = {position + a for a in above}
    metadata = encode_offset_map(position, answered)
    assert decode_offset_map(position, metadata) == answered
    assert (metadata == "") == (not answered)


def test_long_runs_cost_a_few_bytes_each():
    # 500 jobs answered behind one slow job at the front, in two runs.
    answered = set(range(101, 400)) | set(range(401, 602))
    metadata = encode_offset_map(100, answered)
    assert len(metadata) < 20
    assert metadata.startswith(PREFIX)


def test_an_offset_below_the_position_is_a_bug_not_a_map():
    with pytest.raises(ValueError, match="below the committed position"):
        encode_offset_map(10, [9])


def _raw(data: bytes) -> str:
    return PREFIX + base64.urlsafe_b64encode(data).decode()


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ("some other tool's metadata", "not an offset map"),
        ("vkw2:AAAA", "not an offset map"),  # a newer version
        (PREFIX + "***", "not base64"),
        (_raw(bytes([1])), "ends inside a run"),
        (_raw(bytes([1, 0])), "empty run"),
        (_raw(bytes([0x80])), "ends inside a number"),
        (_raw(bytes([0xFF] * 10 + [1])), "over 63 bits"),
        (_raw(bytes([0, 0xFF, 0xFF, 0xFF, 0x7F])), "claims over"),
    ],
)
def test_metadata_that_is_not_a_readable_map_is_refused_with_the_reason(metadata, reason):
    with pytest.raises(OffsetMapError, match=reason):
        decode_offset_map(0, metadata)
