"""The offset map's codec: round trips, size, and metadata it must refuse."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples
from worker.delivery.offset_map import (
    PREFIX,
    OffsetMapError,
    decode_offset_map,
    encode_bounded,
    encode_offset_map,
)


@given(
    position=st.integers(min_value=0, max_value=2**62),
    above=st.sets(st.integers(min_value=0, max_value=5000), max_size=300),
    running=st.sets(st.integers(min_value=0, max_value=5000), max_size=50),
    deaths=st.dictionaries(st.integers(0, 5000), st.integers(1, 10), max_size=20),
    clean=st.booleans(),
    writer=st.integers(min_value=0, max_value=2**48 - 1),
)
def test_a_map_decodes_to_what_it_was_made_of(
    *,
    position: int,
    above: set[int],
    running: set[int],
    deaths: dict[int, int],
    clean: bool,
    writer: int,
) -> None:
    running_now = {position + r for r in running}
    earlier = {position + o: n for o, n in deaths.items()}
    # A map never names an answered offset running or suspect (the decoder refuses one that does).
    answered = {position + a for a in above} - running_now - set(earlier)
    metadata = encode_offset_map(
        position, answered, running=running_now, deaths=earlier, clean=clean, writer=writer
    )
    decoded = decode_offset_map(position, metadata)
    assert decoded.answered == frozenset(answered)
    assert decoded.running == frozenset(running_now)
    assert dict(decoded.deaths) == earlier
    if metadata:
        assert decoded.clean == clean
        assert decoded.writer == writer
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
        ("vkw3:AAAA", "not an offset map"),  # a newer version
        ("vkw1:" + base64.urlsafe_b64encode(bytes([0, 1, 0, 1, 0, 0])).decode(), "version-1"),
        (PREFIX + "***", "not base64"),
        (_raw(bytes([0])), "ends inside a section"),
        (_raw(bytes([0, 0, 1, 0])), "ends inside a section"),
        (_raw(bytes([0, 0, 1, 0, 0, 0, 0])), "empty run"),
        (_raw(bytes([0, 0, 0, 0, 1, 0, 1, 0])), "death run of no deaths"),
        (_raw(bytes([0, 0, 0, 0, 0, 5])), "bytes after its last section"),
        (_raw(bytes([4, 0, 0, 0, 0])), "unknown flags"),
        (_raw(bytes([0x80])), "ends inside a number"),
        (_raw(bytes([0xFF] * 10 + [1])), "over 63 bits"),
        (_raw(bytes([0, 0, 0xFF, 0xFF, 0xFF, 0x7F])), "claims over"),
        # One run of 2**21 offsets, in 13 bytes or so: more than any worker leaves above a commit.
        (_raw(bytes([0, 0, 1, 0, 0x80, 0x80, 0x80, 0x01, 0, 0])), "claims over"),
        (encode_offset_map(5, [6]), "written for offset 5, read at 0"),
        # Answered and running at once, and answered and a suspect at once: a record would run
        # twice, and finish twice.
        (_raw(bytes([0, 0, 1, 3, 1, 1, 3, 1, 0])), "both answered and running"),
        (_raw(bytes([0, 0, 1, 3, 1, 0, 1, 3, 1, 2])), "both answered and running or suspect"),
    ],
)
def test_metadata_that_is_not_a_readable_map_is_refused_with_the_reason(metadata, reason):
    with pytest.raises(OffsetMapError, match=reason):
        decode_offset_map(0, metadata)


def test_a_death_with_a_thousand_in_flight_is_one_run():
    # One pair per offset made this ~2.7 KB: past 3/4 of the default 3 KB cap, the partition
    # stalled; past the cap, every death count was dropped.
    metadata = encode_offset_map(0, [], running=range(1024), deaths=dict.fromkeys(range(1024), 1))
    assert len(metadata) < 24
    decoded = decode_offset_map(0, metadata)
    assert dict(decoded.deaths) == dict.fromkeys(range(1024), 1)


def test_offsets_at_or_past_the_partitions_end_are_dropped():
    metadata = encode_offset_map(10, [11, 12, 30], running=[13, 31], deaths={14: 1, 15: 1, 40: 2})
    decoded = decode_offset_map(10, metadata, end=20)
    assert decoded.answered == {11, 12}
    assert decoded.running == {13}
    assert dict(decoded.deaths) == {14: 1, 15: 1}
    # A committed position past the end (the log was truncated under it): nothing applies.
    assert decode_offset_map(10, metadata, end=5) == decode_offset_map(10, "")


def test_a_map_that_cannot_fit_leaves_out_the_answered_runs_first_and_keeps_the_deaths():
    answered = range(1, 4000, 2)  # every other offset: the map's worst shape
    deaths = {4001: 1, 4005: 2}
    full = encode_bounded(10_000, 0, answered, running=[0], deaths=deaths)
    assert full.dropped == ()
    bounded = encode_bounded(100, 0, answered, running=[0], deaths=deaths)
    assert bounded.dropped == ("answered",)
    decoded = decode_offset_map(0, bounded.metadata)
    assert decoded.answered == frozenset()
    assert decoded.running == {0}
    assert dict(decoded.deaths) == deaths
    # Deaths alone too large: those nearest the position stay, and it says so.
    many = {o: 1 + o % 2 for o in range(0, 2000, 3)}
    tight = encode_bounded(60, 0, [], deaths=many)
    assert tight.dropped == ("deaths",)
    kept = decode_offset_map(0, tight.metadata).deaths
    assert kept and len(tight.metadata) <= 60
    assert dict(kept) == {o: n for o, n in many.items() if o <= max(kept)}


@settings(max_examples=examples(5))
@given(st.text(max_size=60) | st.binary(max_size=40).map(_raw), st.integers(0, 2**40))
def test_any_metadata_decodes_or_is_refused_as_not_a_map(metadata: str, position: int) -> None:
    # Fuzzed: whatever the metadata, the reader gets a map or an OffsetMapError, never another
    # exception, and never more offsets than the partition holds.
    try:
        decoded = decode_offset_map(position, metadata, end=position + 5000)
    except OffsetMapError:
        return
    assert not decoded.answered & decoded.running
    assert not decoded.answered & set(decoded.deaths)
    offsets = decoded.answered | decoded.running | set(decoded.deaths)
    assert all(position <= o < position + 5000 for o in offsets)


@settings(max_examples=examples(3))
@given(
    st.sets(st.integers(0, 300), max_size=40),
    st.sets(st.integers(0, 300), max_size=10),
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_a_damaged_map_decodes_consistently_or_is_refused(
    answered: set[int], running: set[int], damage: list[tuple[int, int]]
) -> None:
    # A real map with bytes overwritten: the damage that passes the checks still yields a map
    # whose sections are disjoint and above the position.
    text = encode_offset_map(0, answered - running, running=running)[len(PREFIX) :] or "AAAA"
    raw = bytearray(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    for index, value in damage:
        raw[index % len(raw)] = value
    try:
        decoded = decode_offset_map(0, _raw(bytes(raw)))
    except OffsetMapError:
        return
    assert not decoded.answered & decoded.running
    assert all(o >= 0 for o in decoded.answered | decoded.running | set(decoded.deaths))
