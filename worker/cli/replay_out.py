"""`results --replay`: a run's replay arrays in one `.npz`, for checking them offline."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import numpy as np

from schemas import (
    RECIPES,
    Completed,
    Completion,
    PayloadError,
    ReplaySample,
    SchemaError,
    replay_array,
    replay_arrays,
)
from schemas.payloads import payload_root
from worker.core.errors import ConfigError

__all__ = ["ReplayWriter"]


class ReplayWriter:
    """Collects every completed job's completions and, at the end, writes their replay arrays
    in `recipe`'s layout to `out`: one entry `"<job_id>/<index>"` per job and completion.

    The arrays are made in one call, so they share one dtype, as in a trainer's micro-batch.
    A completion the recipe cannot take is named on stderr and left out. Payload references
    are read as they arrive, only from under `payload_store` (`--payload-store`, the store as
    mounted here); one outside it, or any when it is unset, is named and left out the same way.
    """

    def __init__(
        self, recipe: str, out: Path, num_experts: int | None, payload_store: str | None = None
    ) -> None:
        if recipe not in RECIPES:
            raise ConfigError(
                f"--replay: no recipe {recipe!r}; choose one of {', '.join(sorted(RECIPES))}"
            )
        if num_experts is not None and num_experts < 1:
            raise ConfigError(f"--num-experts must be >= 1, got {num_experts}")
        self._recipe = recipe
        self._layout = RECIPES[recipe]
        self._out = out
        self._num_experts = num_experts
        try:
            self._root = None if payload_store is None else payload_root(payload_store)
        except PayloadError as exc:
            raise ConfigError(f"--payload-store: {exc}") from None
        self._samples: dict[str, ReplaySample] = {}
        self._unreadable: dict[str, str] = {}

    def add(self, result: Completed) -> None:
        for c in result.completions:
            name = f"{result.job_id}/{c.index}"
            # The first answer of a job wins, as with the results themselves.
            if name in self._samples or name in self._unreadable:
                continue
            try:
                readable = self._inlined(c)
            except SchemaError as exc:  # PayloadError, RoutedExpertsError: the reason
                self._unreadable[name] = str(exc)
                continue
            self._samples[name] = ReplaySample(readable, result.prompt_token_count)

    def _inlined(self, completion: Completion) -> Completion:
        """`completion` with a payload reference read from under the root and inline."""
        routed = completion.routed_experts
        if routed is None or not routed.is_reference:
            return completion
        if self._root is None:
            raise PayloadError(
                f"payload {routed.uri} not read: pass --payload-store, the store as mounted here"
            )
        return msgspec.structs.replace(completion, routed_experts=routed.resolved(self._root))

    def finish(self) -> int:
        """Write the file; returns how many completions could not be replayed."""
        usable: dict[str, ReplaySample] = {}
        refused = len(self._unreadable)
        for name, reason in self._unreadable.items():
            print(f"{name}: not replayable as {self._recipe}: {reason}", file=sys.stderr)
        for name, sample in self._samples.items():
            # Each alone first, to name the completions the recipe refuses; the batch below
            # then picks the dtype from those it takes.
            try:
                replay_array(
                    sample.completion,
                    sample.prompt_len,
                    self._layout,
                    num_experts=self._num_experts,
                )
            except SchemaError as exc:  # the recipe refuses it, or its payload is gone
                refused += 1
                print(f"{name}: not replayable as {self._recipe}: {exc}", file=sys.stderr)
            else:
                usable[name] = sample
        try:
            arrays = replay_arrays(
                list(usable.values()), self._layout, num_experts=self._num_experts
            )
        except SchemaError as exc:  # across samples: different models in one topic
            print(f"replay arrays not written: {exc}", file=sys.stderr)
            return refused + len(usable)
        entries = dict(zip(usable, arrays, strict=True))
        with self._out.open("wb") as sink:  # a file object: numpy adds no suffix to its name
            # numpy's stubs type **kwds like its `allow_pickle` flag; every entry name ends in
            # "/<index>", so none can be taken for that flag.
            np.savez(sink, **entries)  # type: ignore[arg-type]
        dtype = arrays[0].dtype.name if arrays else "-"
        print(
            f"{len(arrays)} replay arrays ({self._recipe}, {dtype}) written to {self._out}"
            + (f", {refused} not replayable" if refused else ""),
            file=sys.stderr,
        )
        return refused
