"""The answered offsets above a commit, as the string that travels in the commit's metadata.

A job answered out of order, behind a slower one, is past the committed offset: after a crash
or a rebalance it would be redelivered and generated again. The commit therefore carries the
offsets above it that are answered already, so the next owner skips them; and, for the
crash-loop breaker, the offsets running when it was made and how many process deaths each
earlier suspect was in flight at.

Format (version 2): `vkw2:` then URL-safe base64 (unpadded) of unsigned LEB128 varints: a flags number
(1: written on a clean hand-over; 2: the writer is named), the committed offset the map was
written for (its anchor), the writer's incarnation when flag 2 is set (a random number each
worker process draws at start and announces to the group, so the next owner can tell a writer
that is still alive from one that died: `worker.core.incarnation`), then three
sections, each a count and that many runs: answered runs and running runs (gap from
the previous run's end, the anchor first, then the run's length, as Confluent's
parallel-consumer's run-length encoding does), and death runs (gap, length, deaths each offset
of the run was in flight at). Runs suit the usual shapes: long answered runs behind a few slow
jobs, and a death with a thousand jobs in flight, which is one run. The worst case (every other
offset answered) costs two bytes an offset, which the worker's cap on the map bounds.

The map is read as untrusted input (another tool's metadata, a damaged or hand-made one, a bug
of a future version): runs must be non-empty and in order, answered offsets may be neither
running nor suspects, the anchor must be the committed offset it is read at, offsets at or
past the partition's end are dropped, and the expansion is bounded. Anything else is refused
with `OffsetMapError`, and the reader falls back to plain at-least-once. A version-1 map
(`vkw1:`, which did not name its anchor) is refused the same way: it cannot be told apart from
one read at a position it was not written for.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Iterator, Mapping
from typing import Final, NamedTuple

import msgspec

__all__ = [
    "PREFIX",
    "BoundedMap",
    "OffsetMap",
    "OffsetMapError",
    "Run",
    "decode_offset_map",
    "encode_bounded",
    "encode_bounded_runs",
    "encode_offset_map",
    "encoded_length",
]

PREFIX: Final = "vkw2:"
_OLD_PREFIX: Final = "vkw1:"

# More offsets than any worker leaves above a commit: a map claiming more is damaged, and
# expanding it would take the memory of a process that must not fall over on bad input.
MAX_DECODED_OFFSETS: Final = 1_000_000

_CLEAN: Final = 1
_WRITER: Final = 2
_KNOWN_FLAGS: Final = _CLEAN | _WRITER


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
    #: The incarnation of the worker process that wrote it (0: not named).
    writer: int = 0


class BoundedMap(NamedTuple):
    """A map made to fit a size: the metadata, and what had to be left out of it."""

    metadata: str
    #: "answered", "running", "deaths": the sections left out (wholly or, for deaths, partly).
    dropped: tuple[str, ...] = ()


def encode_offset_map(
    position: int,
    answered: Iterable[int],
    *,
    running: Iterable[int] = (),
    deaths: Mapping[int, int] | None = None,
    clean: bool = False,
    writer: int = 0,
) -> str:
    """The metadata for a commit at `position`; "" when there is nothing to say."""
    return _encode(
        position,
        _runs(position, answered),
        _runs(position, running),
        _death_runs(position, deaths or {}),
        _Header(clean, writer),
    )


def encode_bounded(
    limit: int,
    position: int,
    answered: Iterable[int],
    *,
    running: Iterable[int] = (),
    deaths: Mapping[int, int] | None = None,
    clean: bool = False,
    writer: int = 0,
) -> BoundedMap:
    """The map for a commit at `position` in at most `limit` characters.

    What does not fit is left out in the order it matters least: first the answered runs (those
    records then run again: plain at-least-once), then the running ones (a death would go
    uncounted), and only then deaths, keeping those nearest the position (the next suspects).
    """
    return encode_bounded_runs(
        limit,
        position,
        _runs(position, answered),
        running=running,
        deaths=deaths,
        clean=clean,
        writer=writer,
    )


def encode_bounded_runs(
    limit: int,
    position: int,
    answered_runs: list[Run],
    *,
    running: Iterable[int] = (),
    deaths: Mapping[int, int] | None = None,
    clean: bool = False,
    writer: int = 0,
) -> BoundedMap:
    """`encode_bounded` of answered offsets given as their runs (in order, disjoint, none
    below `position`): what an owner that keeps its answered offsets as runs commits, at a
    cost that grows with the runs, not with the offsets in them."""
    answered_runs = list(answered_runs)
    running_runs = _runs(position, running)
    death_runs = _death_runs(position, deaths or {})
    header = _Header(clean, writer)
    full = _encode(position, answered_runs, running_runs, death_runs, header)
    if len(full) <= limit:
        return BoundedMap(full)
    dropped: list[str] = []
    for section in (answered_runs, running_runs):
        if section:
            section.clear()
            dropped.append("answered" if section is answered_runs else "running")
            metadata = _encode(position, answered_runs, running_runs, death_runs, header)
            if len(metadata) <= limit:
                return BoundedMap(metadata, tuple(dropped))
    # Deaths alone are over the limit: keep the longest prefix that fits (bisected).
    low, high = 0, len(death_runs)
    while low < high:
        middle = (low + high + 1) // 2
        if len(_encode(position, [], [], death_runs[:middle], header)) <= limit:
            low = middle
        else:
            high = middle - 1
    metadata = _encode(position, [], [], death_runs[:low], header)
    if len(metadata) > limit:
        metadata = ""
    return BoundedMap(metadata, (*dropped, "deaths"))


def encoded_length(position: int, answered_runs: list[Run]) -> int:
    """`len(encode_offset_map(position, answered))` for the answered offsets of these runs,
    counted without building it."""
    if not answered_runs:
        return 0
    # Flags (0), the anchor, the answered runs' count and runs, two empty sections.
    size = 1 + _varint_length(position) + _varint_length(len(answered_runs)) + 2
    cursor = position
    for start, stop, _ in answered_runs:
        size += _varint_length(start - cursor) + _varint_length(stop - start)
        cursor = stop
    return len(PREFIX) + (4 * size + 2) // 3  # unpadded base64


def decode_offset_map(position: int, metadata: str, *, end: int | None = None) -> OffsetMap:
    """What `metadata`, committed at `position`, says about the offsets above it; empty for no
    map. `end`: the partition's end offset, when known; offsets at or past it are dropped.

    Raise `OffsetMapError` (and nothing else) for metadata that is not a version-2 map written
    for `position` (another tool's, an older or newer version, damaged, inconsistent): the
    caller then falls back to plain at-least-once.
    """
    if not metadata:
        return OffsetMap()
    if metadata.startswith(_OLD_PREFIX):
        raise OffsetMapError("a version-1 offset map, which does not name its position")
    if not metadata.startswith(PREFIX):
        raise OffsetMapError(f"not an offset map (starts {metadata[:12]!r})")
    text = metadata[len(PREFIX) :]
    try:
        padded = (text + "=" * (-len(text) % 4)).encode("ascii")
        raw = base64.b64decode(padded, b"-_", validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise OffsetMapError(f"offset map is not base64: {exc}") from None
    numbers = _varints(raw)
    try:
        flags = next(numbers)
        anchor = next(numbers)
        writer = next(numbers) if flags & _WRITER else 0
        answered_runs = _section(numbers, anchor, 2)
        running_runs = _section(numbers, anchor, 2)
        death_runs = _section(numbers, anchor, 3)
    except StopIteration:
        raise OffsetMapError("offset map ends inside a section") from None
    if next(numbers, None) is not None:
        raise OffsetMapError("offset map has bytes after its last section")
    if flags & ~_KNOWN_FLAGS:
        raise OffsetMapError(f"offset map has unknown flags {flags:#x}")
    if anchor != position:
        raise OffsetMapError(f"offset map written for offset {anchor}, read at {position}")
    if _overlap(answered_runs, running_runs) or _overlap(answered_runs, death_runs):
        raise OffsetMapError("offset map names an offset both answered and running or suspect")
    # Each section expands to at most what the partition holds above the position.
    limit = MAX_DECODED_OFFSETS if end is None else max(min(end - position, MAX_DECODED_OFFSETS), 0)
    answered = _expand(answered_runs, end, limit)
    running = _expand(running_runs, end, limit)
    deaths: dict[int, int] = {}
    for start, stop, count in death_runs:
        for offset in _expand([(start, stop, count)], end, limit - len(deaths)):
            deaths[offset] = count
    return OffsetMap(frozenset(answered), frozenset(running), deaths, bool(flags & _CLEAN), writer)


#: A run: [start, stop) and, for deaths, the count (else 0).
Run = tuple[int, int, int]


class _Header(NamedTuple):
    clean: bool
    writer: int


def _encode(
    position: int, answered: list[Run], running: list[Run], deaths: list[Run], header: _Header
) -> str:
    if not answered and not running and not deaths:
        return ""
    out = bytearray()
    _varint(out, (_CLEAN if header.clean else 0) | (_WRITER if header.writer else 0))
    _varint(out, position)
    if header.writer:
        _varint(out, header.writer)
    for section, with_count in ((answered, False), (running, False), (deaths, True)):
        _varint(out, len(section))
        cursor = position
        for start, stop, count in section:
            _varint(out, start - cursor)
            _varint(out, stop - start)
            if with_count:
                _varint(out, count)
            cursor = stop
    return PREFIX + base64.urlsafe_b64encode(bytes(out)).decode("ascii").rstrip("=")


def _runs(position: int, offsets: Iterable[int]) -> list[Run]:
    """The runs of consecutive offsets in `offsets`, in order."""
    out: list[Run] = []
    for offset in sorted(set(offsets)):
        if offset < position:
            raise ValueError(f"offset {offset} is below the committed position {position}")
        if out and out[-1][1] == offset:
            out[-1] = (out[-1][0], offset + 1, 0)
        else:
            out.append((offset, offset + 1, 0))
    return out


def _death_runs(position: int, deaths: Mapping[int, int]) -> list[Run]:
    """Runs of consecutive offsets with the same death count, in order."""
    out: list[Run] = []
    for offset, count in sorted(deaths.items()):
        if offset < position or count <= 0:
            continue  # committed past: no longer a suspect
        if out and out[-1][1] == offset and out[-1][2] == count:
            out[-1] = (out[-1][0], offset + 1, count)
        else:
            out.append((offset, offset + 1, count))
    return out


def _section(numbers: Iterator[int], anchor: int, width: int) -> list[Run]:
    count = next(numbers)
    if count > MAX_DECODED_OFFSETS:
        raise OffsetMapError(f"offset map claims over {MAX_DECODED_OFFSETS} runs")
    runs: list[Run] = []
    cursor = anchor
    for _ in range(count):
        start = cursor + next(numbers)
        length = next(numbers)
        death_count = next(numbers) if width == 3 else 0
        if length == 0:
            raise OffsetMapError("offset map holds an empty run")
        if width == 3 and death_count == 0:
            raise OffsetMapError("offset map holds a death run of no deaths")
        cursor = start + length
        runs.append((start, cursor, death_count))
    return runs


def _overlap(one: list[Run], other: list[Run]) -> bool:
    """Whether two ordered, disjoint lists of runs share an offset (a merge, no expansion)."""
    i = j = 0
    while i < len(one) and j < len(other):
        if one[i][1] <= other[j][0]:
            i += 1
        elif other[j][1] <= one[i][0]:
            j += 1
        else:
            return True
    return False


def _expand(runs: list[Run], end: int | None, limit: int) -> list[int]:
    """The offsets of `runs` below `end`; refused past `limit` offsets."""
    offsets: list[int] = []
    for start, run_stop, _ in runs:
        stop = run_stop if end is None else min(run_stop, end)
        if start >= stop:
            continue
        if len(offsets) + (stop - start) > limit:
            raise OffsetMapError(f"offset map claims over {limit} offsets")
        offsets.extend(range(start, stop))
    return offsets


def _varint_length(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _varints(raw: bytes) -> Iterator[int]:
    value = shift = 0
    for byte in raw:
        value |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
            if shift > 63:
                raise OffsetMapError("offset map holds a number over 63 bits")
            continue
        yield value
        value = shift = 0
    if shift:
        raise OffsetMapError("offset map ends inside a number")
