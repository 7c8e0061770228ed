"""`results --routing` and `results --plot FILE.png`: how a run's tokens spread over the experts
of each MoE layer, and which completions carry routing no router would choose.

A router picks `top_k` distinct experts for every token of an MoE layer, and the worker sends
one row per position from `start` on, up to but not including the last sampled token
(`schemas.RoutedExperts`). What breaks that shows here, per completion:

- **repeated ids**: a row of a layer names one expert twice. A router never does; a capture
  that did not run (vLLM's compiled CPU path returns zeros) does, since `[0, 0]` repeats.
- **all zeros**: a layer that routes in other completions of the run is all zeros in this
  one. A dense layer's slot is all zeros in every completion, as vLLM gives it, so a layer
  that is all zeros everywhere is shown as dense, not flagged; when no layer routes at all,
  every completion is flagged (nothing was captured).
- **rows**: the rows held are not `prompt_token_count + len(token_ids) - 1 - start`.
- **ids out of range**: an id at or above the record's `num_experts` (or `MAX_EXPERTS`).
- **implausible shape**: more layers or experts than any model has (`MAX_LAYERS`,
  `MAX_EXPERTS`).
- **unreadable**: the array does not decode, or its payload cannot be read from the store.

The checks print as a table; the heatmap (layers x experts, routed tokens per cell) needs
matplotlib, the `plot` extra, and is drawn only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

import numpy as np
import numpy.typing as npt

from schemas import Completed, Completion, PayloadError, RoutedExperts, SchemaError
from schemas.payloads import payload_root
from worker.core.errors import ConfigError

__all__ = [
    "PLOT_EXTRA_HINT",
    "RoutingFlag",
    "RoutingView",
    "figure_size_in",
    "plot_available",
]

#: The one line `results --plot` prints when matplotlib is not installed.
PLOT_EXTRA_HINT: Final = (
    "--plot draws with matplotlib: pip install 'vllm-kafka-worker[plot]' "
    "(--routing prints the same checks without it)"
)
#: Resolution of the heatmap; its size in pixels is `figure_size_in` times this.
PLOT_DPI: Final = 100
#: What the load counts at most. The largest MoE models have about a hundred layers and a few
#: hundred experts; a record past these bounds is broken or forged, and counting it would
#: allocate whatever size it claims. It is flagged and left out of the load.
MAX_LAYERS: Final = 1024
MAX_EXPERTS: Final = 1 << 16


def plot_available() -> bool:
    """Whether matplotlib can be imported (the `plot` extra)."""
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def figure_size_in(layers: int) -> tuple[float, float]:
    """The heatmap's width and height in inches: a fixed width, a row band per layer, and a
    height between 4 and 24 inches (a 94-layer model stays on one screen)."""
    return 10.0, min(max(4.0, 1.5 + 0.25 * layers), 24.0)


@dataclass(frozen=True, slots=True)
class RoutingFlag:
    """One thing wrong with one completion's routing (`layer` None: the completion as a whole)."""

    job_id: str
    index: int
    layer: int | None
    problem: str
    detail: str


@dataclass(slots=True)
class _Seen:
    """What one completion's routing showed, kept until the whole run is read."""

    job_id: str
    index: int
    routing_layers: npt.NDArray[np.bool_]  # per layer: any non-zero id
    flags: list[RoutingFlag] = field(default_factory=list)


class RoutingView:
    """Reads completed results one by one; at the end prints the checks and, with `plot`,
    draws the expert load. Payload references are read from under `payload_store` only (the
    store as mounted here), as `results --replay` reads them."""

    def __init__(self, plot: Path | None, payload_store: str | None = None) -> None:
        if plot is not None and not plot_available():
            raise ConfigError(PLOT_EXTRA_HINT)
        self._plot = plot
        try:
            self._root = None if payload_store is None else payload_root(payload_store)
        except PayloadError as exc:
            raise ConfigError(f"--payload-store: {exc}") from None
        self._seen: list[_Seen] = []
        self._unreadable: list[RoutingFlag] = []  # and implausible shapes: no layer stats
        self._load: npt.NDArray[np.int64] = np.zeros((0, 0), dtype=np.int64)
        self._tokens = 0
        self._jobs: set[str] = set()
        self._completions: set[tuple[str, int]] = set()

    def add(self, result: Completed) -> None:
        """One whole result; completions without routed experts are skipped, and the first
        answer of a job and completion counts (as with the results themselves)."""
        for completion in result.completions:
            key = (result.job_id, completion.index)
            meta = completion.routed_experts
            if meta is None or key in self._completions:
                continue
            self._completions.add(key)
            self._jobs.add(result.job_id)
            try:
                routed = self._array(meta)
            except SchemaError as exc:  # RoutedExpertsError, PayloadError: the reason
                self._unreadable.append(
                    RoutingFlag(result.job_id, completion.index, None, "unreadable", str(exc))
                )
                continue
            self._check(result, completion, meta, routed)

    def _array(self, routed: RoutedExperts) -> npt.NDArray[np.integer]:
        if routed.is_reference:
            if self._root is None:
                raise PayloadError(
                    f"payload {routed.uri} not read: pass --payload-store, the store as "
                    "mounted here"
                )
            routed = routed.resolved(self._root)
        return routed.to_array()

    def _check(
        self,
        result: Completed,
        completion: Completion,
        meta: RoutedExperts,
        routed: npt.NDArray[np.integer],
    ) -> None:
        rows, layers, top_k = routed.shape
        if layers > MAX_LAYERS:
            self._unreadable.append(
                RoutingFlag(
                    result.job_id,
                    completion.index,
                    None,
                    "implausible shape",
                    f"{layers} layers, past the {MAX_LAYERS} this view counts",
                )
            )
            return
        seen = _Seen(result.job_id, completion.index, np.asarray(routed.any(axis=(0, 2))))
        flag = seen.flags.append
        expected_rows = result.prompt_token_count + len(completion.token_ids) - 1 - meta.start
        if rows != expected_rows:
            flag(
                RoutingFlag(
                    result.job_id,
                    completion.index,
                    None,
                    "rows",
                    f"{rows} rows, expected {expected_rows} = prompt {result.prompt_token_count}"
                    f" + {len(completion.token_ids)} tokens - 1 - start {meta.start}",
                )
            )
        num_experts = meta.num_experts if isinstance(meta.num_experts, int) else None
        if num_experts is not None and num_experts > MAX_EXPERTS:
            flag(
                RoutingFlag(
                    result.job_id,
                    completion.index,
                    None,
                    "implausible shape",
                    f"num_experts {num_experts}, past the {MAX_EXPERTS} this view counts",
                )
            )
            num_experts = None  # its ids are still counted, as far as they go
        highest = int(routed.max()) if routed.size else -1
        countable = highest < min(num_experts or MAX_EXPERTS, MAX_EXPERTS)
        if not countable:
            bound = (
                f"the model has {num_experts} experts"
                if num_experts is not None and highest >= num_experts
                else f"past the {MAX_EXPERTS} experts this view counts"
            )
            flag(
                RoutingFlag(
                    result.job_id,
                    completion.index,
                    None,
                    "ids out of range",
                    f"ids up to {highest}, {bound}",
                )
            )
        if top_k > 1 and rows:
            ordered = np.sort(routed, axis=-1)
            repeats = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)  # [rows, layers]
            for layer in range(layers):
                # An all-zero layer is dense or silent: judged once the whole run is read.
                if not seen.routing_layers[layer] or not repeats[:, layer].any():
                    continue
                row = int(np.argmax(repeats[:, layer]))
                flag(
                    RoutingFlag(
                        result.job_id,
                        completion.index,
                        layer,
                        "repeated ids",
                        f"row {row} (position {meta.start + row}) routes to "
                        f"{routed[row, layer].tolist()}; a router picks {top_k} distinct experts",
                    )
                )
        self._seen.append(seen)
        self._tokens += rows
        if countable:
            self._count(routed, num_experts)

    def _count(self, routed: npt.NDArray[np.integer], num_experts: int | None) -> None:
        layers = routed.shape[1]
        ids = routed.astype(np.int64, copy=False)
        if ids.size and int(ids.min()) < 0:  # older vLLM's -1 for rows it did not route
            ids = ids[(ids >= 0).all(axis=(1, 2))]
        width = max(
            num_experts or 0,
            int(ids.max()) + 1 if ids.size else 0,
            self._load.shape[1],
        )
        height = max(layers, self._load.shape[0])
        if self._load.shape != (height, width):
            grown = np.zeros((height, width), dtype=np.int64)
            grown[: self._load.shape[0], : self._load.shape[1]] = self._load
            self._load = grown
        for layer in range(layers):
            self._load[layer] += np.bincount(ids[:, layer].ravel(), minlength=width)[:width]

    def dense_layers(self) -> list[int]:
        """Layers all zeros in every completion read (dense layers), when some layer routes."""
        routing = self._routing_anywhere()
        if routing is None or not routing.any():
            return []
        return [int(layer) for layer in np.flatnonzero(~routing)]

    def _routing_anywhere(self) -> npt.NDArray[np.bool_] | None:
        if not self._seen:
            return None
        layers = max(len(s.routing_layers) for s in self._seen)
        anywhere = np.zeros(layers, dtype=np.bool_)
        for s in self._seen:
            anywhere[: len(s.routing_layers)] |= s.routing_layers
        return anywhere

    def flags(self) -> list[RoutingFlag]:
        """Everything flagged, in the order the completions were read."""
        anywhere = self._routing_anywhere()
        found = list(self._unreadable)
        for s in self._seen:
            found.extend(s.flags)
            if anywhere is None:
                continue
            if not anywhere.any():
                found.append(
                    RoutingFlag(
                        s.job_id,
                        s.index,
                        None,
                        "all zeros",
                        "no layer routes in any completion: nothing was captured (vLLM's "
                        "compiled CPU path returns zeros; serve with --enforce-eager)",
                    )
                )
                continue
            for layer in np.flatnonzero(anywhere[: len(s.routing_layers)] & ~s.routing_layers):
                found.append(
                    RoutingFlag(
                        s.job_id,
                        s.index,
                        int(layer),
                        "all zeros",
                        "every row routes to expert 0 only, while other completions route "
                        "this layer",
                    )
                )
        return found

    @property
    def load(self) -> npt.NDArray[np.int64]:
        """Routed tokens per layer and expert, `[layers, experts]`, over every completion; a
        dense layer's zeros are no expert's load and count nothing."""
        load = self._load.copy()
        load[self.dense_layers()] = 0
        return load

    def table(self) -> str:
        """The per-layer load and the flags, as printed."""
        flags = self.flags()
        flagged_layers = {f.layer for f in flags if f.layer is not None}
        dense = set(self.dense_layers())
        load = self.load
        layers, experts = load.shape
        lines = [
            f"routing of {len(self._completions)} completions of {len(self._jobs)} jobs: "
            f"{self._tokens} rows, {layers} layers, {experts} experts"
        ]
        if layers:
            lines.append(f"{'layer':>5}  {'experts used':>12}  {'busiest (share)':>16}  note")
        for layer in range(layers):
            counts = load[layer]
            total = int(counts.sum())
            if layer in dense:
                note = "dense (all zeros in every completion)"
            elif layer in flagged_layers:
                note = "FLAGGED"
            else:
                note = ""
            busiest = int(np.argmax(counts)) if total else 0
            share = f"{busiest} ({counts[busiest] / total:.0%})" if total else "-"
            used = int((counts > 0).sum())
            lines.append(f"{layer:>5}  {used:>12}  {share:>16}  {note}".rstrip())
        if not flags:
            lines.append("no routing flagged")
            return "\n".join(lines)
        lines.append(f"{len(flags)} flagged:")
        for f in flags:
            where = f"{f.job_id}/{f.index}" + ("" if f.layer is None else f" layer {f.layer}")
            lines.append(f"  {where}: {f.problem}: {f.detail}")
        return "\n".join(lines)

    def finish(self, out: IO[str], err: IO[str]) -> int:
        """Write the checks to `out` (and draw the heatmap, saying where on `err`); returns how
        many completions are flagged."""
        out.write(self.table() + "\n")
        flags = self.flags()
        if self._plot is not None:
            draw_expert_load(self.load, self._plot, flags, self.dense_layers())
            err.write(f"expert load heatmap written to {self._plot}\n")
        return len({(f.job_id, f.index) for f in flags})


def draw_expert_load(
    load: npt.NDArray[np.int64], out: Path, flags: list[RoutingFlag], dense: list[int]
) -> Any:
    """Draw `load` (`[layers, experts]`) as a heatmap into `out` and return the figure: one
    heatmap and its colour bar; flagged layers' labels in red and marked `!`, dense ones `d`."""
    # Not pyplot: a Figure of its own draws with no global state and no display.
    from matplotlib.figure import Figure  # noqa: PLC0415

    layers = load.shape[0]
    figure = Figure(figsize=figure_size_in(layers), dpi=PLOT_DPI)
    axes = figure.add_subplot()
    image = axes.imshow(
        load if load.size else np.zeros((1, 1)),
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
    )
    figure.colorbar(image, ax=axes, label="routed tokens")
    flagged_layers = {f.layer for f in flags if f.layer is not None}
    step = max(1, layers // 48)  # a label per layer up to 48 layers, then every few
    ticks = list(range(0, layers, step))
    axes.set_yticks(ticks)
    axes.set_yticklabels(
        [f"{t}{'!' if t in flagged_layers else 'd' if t in dense else ''}" for t in ticks]
    )
    for label, layer in zip(axes.get_yticklabels(), ticks, strict=True):
        if layer in flagged_layers:
            label.set_color("red")
    axes.set_xlabel("expert")
    axes.set_ylabel("layer (! flagged, d dense)")
    flagged = sorted({f"{f.job_id}/{f.index}" for f in flags})
    title = f"expert load: {int(load.sum())} routed tokens"
    if flagged:
        shown = ", ".join(flagged[:4]) + (
            f" and {len(flagged) - 4} more" if len(flagged) > 4 else ""
        )
        title += f"\nflagged: {shown}"
    axes.set_title(title)
    figure.savefig(out, dpi=PLOT_DPI)
    return figure
