"""The answered offsets above a commit, as the string that travels in the commit's metadata.

A job answered out of order, behind a slower one, is past the committed offset: after a crash
or a rebalance it would be redelivered and generated again. The commit therefore carries the
offsets above it that are answered already, so the next owner skips them; and, for the
crash-loop breaker, the offsets running when it was made and how many process deaths each
earlier suspect was in flight at.

Format (version 1): `vkw1:` then URL-safe base64 of unsigned LEB128 varints: a flags number
(1: written on a clean hand-over), then three sections, each a count and that many pairs:
answered runs and running runs (gap from the previous position, the committed offset first,
then the run's length, as Confluent's parallel-consumer's run-length encoding does), and
deaths (gap, count). Runs suit the usual shape, long answered runs behind a few slow jobs; the
worst case (every other offset answered) costs two bytes an offset, which the worker's cap on
the map bounds.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

import msgspec

__all__ = ["PREFIX", "OffsetMap", "OffsetMapError", "decode_offset_map", "encode_offset_map"]

PREFIX: Final = "vkw1:"

# More offsets than any worker leaves above a commit: a map claiming more is damaged, and
# expanding it would take the memory of a process that must not fall over on bad input.
MAX_DECODED_OFFSETS: Final = 1_000_000

_CLEAN: Final = 1


class OffsetMapError(ValueError):
    """Metadata that is not an offset map this version can read."""


class OffsetMap(msgspec.Struct, frozen=True):
    """What a commit says about the offsets above it."""

    #: Answered: the next owner skips them.
    answered: frozenset[int] = frozenset()
    #: In flight when the commit was made: if its writer then died, each was at that death.
    running: frozenset[int] = frozenset()
    #: Offsets in flight at earlier process deaths, and at how many.
    deaths: Mapping[int, int] = msgspec.field(default_factory=dict)
    #: Written by a worker that handed the partition over (revoke, shutdown), not one that died.
    clean: bool = False


def encode_offset_map(
    position: int,
    answered: Iterable[int],
    *,
    running: Iterable[int] = (),
    deaths: Mapping[int, int] | None = None,
    clean: bool = False,
) -> str:
    """The metadata for a commit at `position`; "" when there is nothing to say."""
    answered_runs = _runs(position, answered)
    running_runs = _runs(position, running)
    death_pairs = _gaps(position, sorted((deaths or {}).items()))
    if not answered_runs and not running_runs and not death_pairs:
        return ""
    out = bytearray()
    _varint(out, _CLEAN if clean else 0)
    for section in (answered_runs, running_runs, death_pairs):
        _varint(out, len(section) // 2)
        for number in section:
            _varint(out, number)
    return PREFIX + base64.urlsafe_b64encode(bytes(out)).decode("ascii")


def decode_offset_map(position: int, metadata: str) -> OffsetMap:
    """What `metadata` says about the offsets above `position`; empty for no map.

    Raise `OffsetMapError` for metadata that is not a version-1 map (another tool's, a newer
    version, or damaged): the caller then falls back to plain at-least-once.
    """
    if not metadata:
        return OffsetMap()
    if not metadata.startswith(PREFIX):
        raise OffsetMapError(f"not an offset map (starts {metadata[:12]!r})")
    try:
        raw = base64.b64decode(metadata[len(PREFIX) :].encode("ascii"), b"-_", validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise OffsetMapError(f"offset map is not base64: {exc}") from None
    numbers = iter(_varints(raw))
    try:
        flags = next(numbers)
        answered = _expand(position, _section(numbers))
        running = _expand(position, _section(numbers))
        deaths_pairs = _section(numbers)
    except StopIteration:
        raise OffsetMapError("offset map ends inside a section") from None
    if next(numbers, None) is not None:
        raise OffsetMapError("offset map has bytes after its last section")
    deaths: dict[int, int] = {}
    cursor = position
    for gap, count in deaths_pairs:
        cursor += gap
        deaths[cursor] = count
    return OffsetMap(frozenset(answered), frozenset(running), deaths, bool(flags & _CLEAN))


def _runs(position: int, offsets: Iterable[int]) -> list[int]:
    """Alternating gaps and lengths of the runs in `offsets`, from `position` on."""
    out: list[int] = []
    cursor = position
    run_start = run_end = None
    for offset in sorted(offsets):
        if offset < position:
            raise ValueError(f"offset {offset} is below the committed position {position}")
        if run_end is not None and offset == run_end:
            run_end += 1
            continue
        if run_start is not None and run_end is not None:
            out += (run_start - cursor, run_end - run_start)
            cursor = run_end
        run_start, run_end = offset, offset + 1
    if run_start is not None and run_end is not None:
        out += (run_start - cursor, run_end - run_start)
    return out


def _gaps(position: int, pairs: list[tuple[int, int]]) -> list[int]:
    out: list[int] = []
    cursor = position
    for offset, count in pairs:
        if offset < position:
            continue  # committed past: no longer a suspect
        out += (offset - cursor, count)
        cursor = offset
    return out


def _section(numbers: Iterator[int]) -> list[tuple[int, int]]:
    count = next(numbers)
    if count > MAX_DECODED_OFFSETS:
        raise OffsetMapError(f"offset map claims over {MAX_DECODED_OFFSETS} entries")
    return [(next(numbers), next(numbers)) for _ in range(count)]


def _expand(position: int, runs: list[tuple[int, int]]) -> set[int]:
    offsets: set[int] = set()
    cursor = position
    for gap, length in runs:
        if length == 0:
            raise OffsetMapError("offset map holds an empty run")
        start = cursor + gap
        if len(offsets) + length > MAX_DECODED_OFFSETS:
            raise OffsetMapError(f"offset map claims over {MAX_DECODED_OFFSETS} offsets")
        offsets.update(range(start, start + length))
        cursor = start + length
    return offsets


def _varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _varints(raw: bytes) -> list[int]:
    numbers: list[int] = []
    value = shift = 0
    for byte in raw:
        value |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
            if shift > 63:
                raise OffsetMapError("offset map holds a number over 63 bits")
            continue
        numbers.append(value)
        value = shift = 0
    if shift:
        raise OffsetMapError("offset map ends inside a number")
    return numbers
