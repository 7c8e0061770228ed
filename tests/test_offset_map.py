"""The offset map's codec: round trips, size, and metadata it must refuse."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.delivery.offset_map import PREFIX, OffsetMapError, decode_offset_map, encode_offset_map


@given(
    position=st.integers(min_value=0, max_value=2**62),
    above=st.sets(st.integers(min_value=0, max_value=5000), max_size=300),
    running=st.sets(st.integers(min_value=0, max_value=5000), max_size=50),
    deaths=st.dictionaries(st.integers(0, 5000), st.integers(1, 10), max_size=20),
    clean=st.booleans(),
)
def test_a_map_decodes_to_what_it_was_made_of(
    position: int, above: set[int], running: set[int], deaths: dict[int, int], clean: bool
) -> None:
    answered = {position + a for a in above}
    running_now = {position + r for r in running}
    earlier = {position + o: n for o, n in deaths.items()}
    metadata = encode_offset_map(
        position, answered, running=running_now, deaths=earlier, clean=clean
    )
    decoded = decode_offset_map(position, metadata)
    assert decoded.answered == frozenset(answered)
    assert decoded.running == frozenset(running_now)
    assert dict(decoded.deaths) == earlier
    if metadata:
        assert decoded.clean == clean
    assert (metadata == "") == (not answered and not running_now and not earlier)


def test_long_runs_cost_a_few_bytes_each():
    # 500 jobs answered behind one slow job at the front, in two runs.
    answered = set(range(101, 400)) | set(range(401, 602))
    metadata = encode_offset_map(100, answered, running=[100])
    assert len(metadata) < 24
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
        (_raw(bytes([0])), "ends inside a section"),
        (_raw(bytes([0, 1, 0])), "ends inside a section"),
        (_raw(bytes([0, 1, 0, 0, 0, 0])), "empty run"),
        (_raw(bytes([0, 0, 0, 0, 5])), "bytes after its last section"),
        (_raw(bytes([0x80])), "ends inside a number"),
        (_raw(bytes([0xFF] * 10 + [1])), "over 63 bits"),
        (_raw(bytes([0, 0xFF, 0xFF, 0xFF, 0x7F])), "claims over"),
    ],
)
def test_metadata_that_is_not_a_readable_map_is_refused_with_the_reason(metadata, reason):
    with pytest.raises(OffsetMapError, match=reason):
        decode_offset_map(0, metadata)
