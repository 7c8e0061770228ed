"""Routed experts on the wire: the expert ids each MoE router chose, per token and layer."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Annotated, Final

import msgspec
import numpy as np
import numpy.typing as npt

from schemas.errors import RoutedExpertsError
from schemas.payloads import read_payload

__all__ = ["WIRE_DTYPES", "RoutedExperts"]

#: dtype names a reader accepts; the writer picks the narrowest one that holds every value.
WIRE_DTYPES: Final = frozenset({"uint8", "uint16", "uint32", "int8", "int16", "int32", "int64"})

_NARROWING: Final = (
    # (dtype, lowest value, highest value), narrowest first; unsigned first because expert ids
    # are never negative in current vLLM, only older releases used -1 for prefix-cached rows.
    (np.dtype(np.uint8), 0, 0xFF),
    (np.dtype(np.uint16), 0, 0xFFFF),
    (np.dtype(np.uint32), 0, 0xFFFF_FFFF),
    (np.dtype(np.int8), -0x80, 0x7F),
    (np.dtype(np.int16), -0x8000, 0x7FFF),
    (np.dtype(np.int32), -0x8000_0000, 0x7FFF_FFFF),
    (np.dtype(np.int64), -(2**63), 2**63 - 1),
)


# numpy builds `dtype.name` anew on each access (5 us here); from_array runs once per completion.
_NAMES: Final[dict[np.dtype[np.integer], str]] = {dtype: dtype.name for dtype, _, _ in _NARROWING}


class RoutedExperts(msgspec.Struct, frozen=True, kw_only=True):
    """Expert ids as a `[rows, layers, top_k]` array; row `i` is absolute position `start + i`.

    `data` holds the C-order bytes of the array (base64 in JSON, as NVIDIA Dynamo and prime-rl
    read it), `dtype` its numpy dtype name. vLLM gives rows for positions
    `[start, prompt_len + len(token_ids) - 1)`: the last sampled token is never fed forward, so it
    has no routing. A dense (non-MoE) layer's slot is all zeros, exactly as vLLM returns it.
    """

    data: bytes
    shape: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=3, max_length=3)
    ]
    dtype: str
    start: Annotated[int, msgspec.Meta(ge=0)] = 0
    uri: Annotated[str, msgspec.Meta(min_length=1)] | msgspec.UnsetType = msgspec.UNSET
    sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")] | msgspec.UnsetType = (
        msgspec.UNSET
    )
    nbytes: Annotated[int, msgspec.Meta(ge=0)] | msgspec.UnsetType = msgspec.UNSET
    #: How many experts each MoE layer of the served model has (ids are below it). Absent from
    #: records of older workers, and whenever the writer does not know the model. A replay
    #: dtype that follows the model (`schemas.replay`) reads it: the ids seen in a batch can
    #: stay below 256 on a model with more experts, and a dtype taken from them would change
    #: from one batch to the next.
    num_experts: Annotated[int, msgspec.Meta(ge=1)] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        # msgspec checks `Meta` constraints only when decoding; a writer gets the same rule.
        if isinstance(self.num_experts, int) and self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        given = [f for f in ("uri", "sha256", "nbytes") if getattr(self, f) is not msgspec.UNSET]
        if given and len(given) < 3:
            raise ValueError(f"a payload reference needs uri, sha256 and nbytes; got only {given}")
        if given and self.data:
            raise ValueError("a payload reference carries no inline data")

    @property
    def is_reference(self) -> bool:
        """Whether the bytes are in a payload store (`uri`) rather than in `data`."""
        return self.uri is not msgspec.UNSET

    def as_reference(self, uri: str, sha256: str) -> RoutedExperts:
        """This array as a reference to `uri`, which holds exactly `data` (hex `sha256`)."""
        return msgspec.structs.replace(
            self, data=b"", uri=uri, sha256=sha256, nbytes=len(self.data)
        )

    def payload(self, root: Path | None = None) -> bytes:
        """The C-order bytes: `data`, or for a reference the checked bytes at `uri` (only
        under `root` when given: see `schemas.payloads.read_payload`)."""
        uri, sha256, nbytes = self.uri, self.sha256, self.nbytes
        # All three or none (`__post_init__`).
        if isinstance(uri, str) and isinstance(sha256, str) and isinstance(nbytes, int):
            expected = self._expected_bytes()
            if nbytes != expected:
                # Before reading: a record cannot make a reader load more than its array.
                raise RoutedExpertsError(
                    f"payload {uri}: the record says {nbytes} bytes but shape {self.shape} of "
                    f"{self.dtype} needs {expected}"
                )
            return read_payload(uri, sha256, nbytes, root=root)
        return self.data

    def resolved(self, root: Path) -> RoutedExperts:
        """This array with a reference's bytes read from under `root`, checked, and inline
        (`data` filled in); itself when it is not a reference. What a reader of records from
        a topic calls: `PayloadError` or `RoutedExpertsError` says what is wrong."""
        if not self.is_reference:
            return self
        inline = RoutedExperts(
            data=self.payload(root),
            shape=self.shape,
            dtype=self.dtype,
            start=self.start,
            num_experts=self.num_experts,
        )
        inline.to_array()  # the shape and dtype agree with the bytes
        return inline

    def _expected_bytes(self) -> int:
        """The byte length `shape` of `dtype` needs; RoutedExpertsError when either is bad."""
        if self.dtype not in WIRE_DTYPES:
            raise RoutedExpertsError(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(WIRE_DTYPES)}"
            )
        if len(self.shape) != 3 or any(d < 0 for d in self.shape):
            raise RoutedExpertsError(
                f"shape must be 3 non-negative ints [rows, layers, top_k], got {self.shape}"
            )
        rows, layers, top_k = self.shape
        return rows * layers * top_k * np.dtype(self.dtype).itemsize

    @classmethod
    def from_array(
        cls, array: npt.ArrayLike, start: int = 0, *, num_experts: int | None = None
    ) -> RoutedExperts:
        """Encode an integer `[rows, layers, top_k]` array; `num_experts` is the model's expert
        count when the writer knows it.

        With `num_experts`, the dtype is the model's, as vLLM returns it and Dynamo serializes it
        (uint8 up to 256 experts, uint16 above): the same for every completion of one model,
        since trainers require one dtype per micro-batch (prime-rl's `_materialize_bin`).
        Without it, or for arrays of older vLLM releases whose -1 sentinels need a signed type,
        the narrowest dtype that holds every value. Neither ever loses a value.
        """
        arr = np.asarray(array)
        if arr.ndim != 3:
            raise RoutedExpertsError(
                f"routed experts must be 3-D [rows, layers, top_k], got shape {arr.shape}"
            )
        if arr.dtype.kind not in "iu":
            raise RoutedExpertsError(f"routed experts must be integers, got dtype {arr.dtype}")
        if start < 0:
            raise RoutedExpertsError(f"start must be >= 0, got {start}")
        if num_experts is not None and num_experts < 1:
            raise RoutedExpertsError(f"num_experts must be >= 1, got {num_experts}")
        data, narrow = _pack(arr) if num_experts is None else _pack_for_model(arr, num_experts)
        return cls(
            data=data,
            shape=list(arr.shape),
            dtype=_NAMES[narrow],
            start=start,
            num_experts=msgspec.UNSET if num_experts is None else num_experts,
        )

    def to_array(self) -> npt.NDArray[np.integer]:
        """Decode to a read-only `[rows, layers, top_k]` array, checking dtype, shape and length
        (and for a reference, that the payload is there and unaltered: `PayloadError`)."""
        expected = self._expected_bytes()
        dtype = np.dtype(self.dtype)
        rows, layers, top_k = self.shape
        data = self.payload()
        if len(data) != expected:
            raise RoutedExpertsError(
                f"data is {len(data)} bytes but shape {self.shape} of {self.dtype} needs {expected}"
            )
        return np.frombuffer(data, dtype=dtype).reshape(rows, layers, top_k)

    @property
    def rows(self) -> int:
        """Number of rows (token positions) carried."""
        return self.shape[0]

    @property
    def end(self) -> int:
        """Absolute position one past the last row."""
        return self.start + self.shape[0]

    def rows_for_positions(self, first: int, stop: int | None = None) -> npt.NDArray[np.integer]:
        """Rows for absolute positions `[first, stop)` (to the last row when `stop` is None)."""
        stop = self.end if stop is None else stop
        if not self.start <= first <= stop <= self.end:
            raise RoutedExpertsError(
                f"positions [{first}, {stop}) are outside the rows held, [{self.start}, {self.end})"
            )
        return self.to_array()[first - self.start : stop - self.start]

    def completion_rows(self, prompt_len: int) -> npt.NDArray[np.integer]:
        """Rows of the generated tokens that were fed forward: positions `[prompt_len, end)`.

        That is one row per generated token except the last, in generation order.
        """
        return self.rows_for_positions(prompt_len)


# Elements per chunk when narrowing: 256 KiB of int32, so a chunk is still in cache when it is
# cast after being checked.
_CHUNK_ELEMENTS: Final = 1 << 16


def _pack(arr: npt.NDArray[np.integer]) -> tuple[bytes, np.dtype[np.integer]]:
    """The array's C-order bytes in its narrowest dtype, and that dtype."""
    uint8 = np.dtype(np.uint8)
    if arr.dtype == uint8 or arr.size == 0:
        return np.ascontiguousarray(arr, dtype=uint8).tobytes(), uint8
    # Expert ids of every model with up to 256 experts fit uint8: try that first, checking and
    # casting a chunk at a time, which reads the array once instead of twice.
    # (Wider than a byte, read as unsigned, negatives are above 255, so one comparison checks.)
    if arr.dtype.itemsize > 1:
        try:
            return _pack_chunks(arr, uint8, check=True), uint8
        except _DoesNotFit:
            pass
    narrow = _narrowest_dtype(arr)
    if narrow == arr.dtype:
        return np.ascontiguousarray(arr).tobytes(), narrow
    return _pack_chunks(arr, narrow, check=False), narrow


def model_dtype(num_experts: int) -> np.dtype[np.unsignedinteger]:
    """The dtype vLLM returns a model's expert ids in: uint8 up to 256 experts, else uint16
    (uint32 beyond 65,536, which no model has)."""
    for dtype in (np.dtype(np.uint8), np.dtype(np.uint16)):
        if num_experts - 1 <= _MAX[dtype]:
            return dtype
    return np.dtype(np.uint32)


def _pack_for_model(
    arr: npt.NDArray[np.integer], num_experts: int
) -> tuple[bytes, np.dtype[np.integer]]:
    """The array's bytes in the model's dtype when every value fits it, else `_pack`'s."""
    dtype = model_dtype(num_experts)
    if arr.dtype == dtype or arr.size == 0:
        return np.ascontiguousarray(arr, dtype=dtype).tobytes(), dtype
    if arr.dtype.itemsize > dtype.itemsize:
        # Read as unsigned, negatives lie above every narrower limit: one comparison checks.
        with contextlib.suppress(_DoesNotFit):
            return _pack_chunks(arr, dtype, check=True), dtype
    elif _narrowest_dtype(arr).kind == "u":  # narrower or as wide: no negatives, so it fits
        return np.ascontiguousarray(arr, dtype=dtype).tobytes(), dtype
    return _pack(arr)


class _DoesNotFit(Exception):
    pass


def _pack_chunks(
    arr: npt.NDArray[np.integer], dtype: np.dtype[np.integer], *, check: bool
) -> bytes:
    """Cast to `dtype` through a small reused buffer; with `check`, raise if a value won't fit.

    `check` is only used with unsigned `dtype`s narrower than `arr`'s: it compares the values
    read as unsigned, which turns negatives into values above every such limit. Cast chunks are
    joined into the result, the only large allocation: a full-size intermediate array would
    double the memory churned per result, which glibc tends to hand back to the OS and then
    fault in again, page by page.
    """
    flat = arr.reshape(-1)
    unsigned = flat.view(_unsigned(flat.dtype))
    limit = _MAX[dtype]
    if flat.size <= _CHUNK_ELEMENTS:  # most completions: one step, no buffer to reuse
        if check and unsigned.max() > limit:
            raise _DoesNotFit
        return flat.astype(dtype).tobytes()
    buffer = np.empty(_CHUNK_ELEMENTS, dtype=dtype)
    pieces: list[bytes] = []
    for first in range(0, flat.size, _CHUNK_ELEMENTS):
        if check and unsigned[first : first + _CHUNK_ELEMENTS].max() > limit:
            raise _DoesNotFit
        chunk = flat[first : first + _CHUNK_ELEMENTS]
        out = buffer[: chunk.size]
        np.copyto(out, chunk, casting="unsafe")
        pieces.append(out.tobytes())
    return b"".join(pieces)


_MAX: Final[dict[np.dtype[np.integer], int]] = {dtype: high for dtype, _, high in _NARROWING}


@functools.cache
def _unsigned(dtype: np.dtype[np.integer]) -> np.dtype[np.unsignedinteger]:
    """The unsigned dtype of the same width and byte order: it reads negatives as large values."""
    return np.dtype(dtype.str.replace("i", "u", 1))


def _narrowest_dtype(arr: npt.NDArray[np.integer]) -> np.dtype[np.integer]:
    # One pass over the array in the usual case (no negatives) instead of min() then max().
    # Read as unsigned, a signed array's negatives are the values above its positive range: if
    # the unsigned maximum stays in that range, there are no negatives and it is the maximum;
    # otherwise take the true min and max (older vLLM's -1).
    low, high = 0, int(arr.view(_unsigned(arr.dtype)).max())
    if arr.dtype.kind == "i" and high > np.iinfo(arr.dtype).max:
        low, high = int(arr.min()), int(arr.max())
    for dtype, lowest, highest in _NARROWING:
        if lowest <= low and high <= highest:
            return dtype
    raise RoutedExpertsError(f"values in [{int(arr.min())}, {high}] fit no supported dtype")
