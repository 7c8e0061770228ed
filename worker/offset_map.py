"""The answered offsets above a commit, as the string that travels in the commit's metadata.

A job answered out of order, behind a slower one, is past the committed offset: after a crash
or a rebalance it would be redelivered and generated again. The commit therefore carries the
set of offsets above it that are answered already, so the next owner skips them.

Format (version 1): `vkw1:` then URL-safe base64 of unsigned LEB128 varints, alternating the gap
from the previous position (the committed offset first) to the next answered run, and that run's
length, as Confluent's parallel-consumer's run-length encoding does. It suits the usual shape, long
answered runs behind a few slow jobs; the worst case (every other offset answered) costs two bytes
an offset, which the worker's cap on the map bounds.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Final

__all__ = ["PREFIX", "OffsetMapError", "decode_offset_map", "encode_offset_map"]

PREFIX: Final = "vkw1:"

# More answered offsets than any worker leaves above a commit: a map claiming more is damaged,
# and expanding it would take the memory of a process that must not fall over on bad input.
MAX_DECODED_OFFSETS: Final = 1_000_000


class OffsetMapError(ValueError):
    """Metadata that is not an offset map this version can read."""


def encode_offset_map(position: int, answered: Iterable[int]) -> str:
    """The metadata for a commit at `position` with these answered offsets (all above it)."""
    out = bytearray()
    cursor = position
    run_start = run_end = None
    for offset in sorted(answered):
        if offset < position:
            raise ValueError(f"offset {offset} is below the committed position {position}")
        if run_end is not None and offset == run_end:
            run_end += 1
            continue
        if run_start is not None and run_end is not None:
            _varint(out, run_start - cursor)
            _varint(out, run_end - run_start)
            cursor = run_end
        run_start, run_end = offset, offset + 1
    if run_start is not None and run_end is not None:
        _varint(out, run_start - cursor)
        _varint(out, run_end - run_start)
    if not out:
        return ""
    return PREFIX + base64.urlsafe_b64encode(bytes(out)).decode("ascii")


def decode_offset_map(position: int, metadata: str) -> set[int]:
    """The answered offsets above `position` that `metadata` records; empty for no map.

    Raise `OffsetMapError` for metadata that is not a version-1 map (another tool's, a newer
    version, or damaged): the caller then falls back to plain at-least-once.
    """
    if not metadata:
        return set()
    if not metadata.startswith(PREFIX):
        raise OffsetMapError(f"not an offset map (starts {metadata[:12]!r})")
    try:
        raw = base64.b64decode(metadata[len(PREFIX) :].encode("ascii"), b"-_", validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise OffsetMapError(f"offset map is not base64: {exc}") from None
    numbers = _varints(raw)
    if len(numbers) % 2:
        raise OffsetMapError("offset map ends inside a run")
    answered: set[int] = set()
    cursor = position
    for gap, length in zip(numbers[::2], numbers[1::2], strict=True):
        if length == 0:
            raise OffsetMapError("offset map holds an empty run")
        start = cursor + gap
        if len(answered) + length > MAX_DECODED_OFFSETS:
            raise OffsetMapError(f"offset map claims over {MAX_DECODED_OFFSETS} offsets")
        answered.update(range(start, start + length))
        cursor = start + length
    return answered


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
