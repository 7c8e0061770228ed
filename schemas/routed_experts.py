"""Routed experts on the wire: the expert ids each MoE router chose, per token and layer."""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
import numpy as np
import numpy.typing as npt

from schemas.errors import RoutedExpertsError

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

    @classmethod
    def from_array(cls, array: npt.ArrayLike, start: int = 0) -> RoutedExperts:
        """Encode an integer `[rows, layers, top_k]` array in the narrowest dtype that holds it.

        Narrowing shrinks vLLM-era int32 arrays 4x (uint8 for models with <= 256 experts) and
        never loses a value: negatives (older vLLM's -1 sentinels) keep a signed dtype.
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
        narrow = _narrowest_dtype(arr)
        packed = np.ascontiguousarray(arr, dtype=narrow)
        return cls(data=packed.tobytes(), shape=list(arr.shape), dtype=narrow.name, start=start)

    def to_array(self) -> npt.NDArray[np.integer]:
        """Decode to a read-only `[rows, layers, top_k]` array, checking dtype, shape and length."""
        if self.dtype not in WIRE_DTYPES:
            raise RoutedExpertsError(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(WIRE_DTYPES)}"
            )
        if len(self.shape) != 3 or any(d < 0 for d in self.shape):
            raise RoutedExpertsError(
                f"shape must be 3 non-negative ints [rows, layers, top_k], got {self.shape}"
            )
        dtype = np.dtype(self.dtype)
        rows, layers, top_k = self.shape
        expected = rows * layers * top_k * dtype.itemsize
        if len(self.data) != expected:
            raise RoutedExpertsError(
                f"data is {len(self.data)} bytes but shape {self.shape} of {self.dtype} needs {expected}"
            )
        return np.frombuffer(self.data, dtype=dtype).reshape(rows, layers, top_k)

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


def _narrowest_dtype(arr: npt.NDArray[np.integer]) -> np.dtype[np.integer]:
    if arr.size == 0 or arr.dtype == np.uint8:
        return np.dtype(np.uint8)  # nothing is narrower: no need to look at the values
    # One pass over the array in the usual case (no negatives) instead of min() then max().
    # Read as unsigned of the same width and byte order, a signed array's negatives are the values
    # above its positive range: if the unsigned maximum stays in that range, there are no
    # negatives and it is the maximum; otherwise take the true min and max (older vLLM's -1).
    if arr.dtype.kind == "u":
        low, high = 0, int(arr.max())
    else:
        high = int(arr.view(arr.dtype.str.replace("i", "u", 1)).max())
        low = 0
        if high > np.iinfo(arr.dtype).max:
            low, high = int(arr.min()), int(arr.max())
    for dtype, lowest, highest in _NARROWING:
        if lowest <= low and high <= highest:
            return dtype
    raise RoutedExpertsError(f"values in [{int(arr.min())}, {high}] fit no supported dtype")
