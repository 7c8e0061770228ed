"""The engine seam: the few calls the service makes into a generation engine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import msgspec

from schemas import Completion, Job, WeightReload

__all__ = ["ControllableEngine", "Engine", "EngineOutput"]


class EngineOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine returns for one job: the prompt as tokenised and the `n` completions.

    `interrupted`: the request was stopped by `interrupt` before it finished; unfinished
    completions then hold what was generated so far (`finish_reason` "abort"), with their
    routed experts by the usual row rule.
    """

    prompt_token_ids: list[int]
    completions: list[Completion]
    #: The weight version the engine served when the request ended.
    weight_version: int = 0
    interrupted: bool = False
    #: Prompt tokens served from the prefix cache (vLLM's `num_cached_tokens`); None when the
    #: engine does not say.
    cached_prompt_tokens: int | None = None


class Engine(Protocol):
    """A generation engine as the worker sees it (vLLM's `EngineClient` has ~20 methods; we call these).

    `generate` raises `worker.core.errors.JobError` subclasses for one job's problems and
    `worker.core.errors.EngineDeadError` when nothing can run any more. Cancelling `generate` is the
    abort: it must stop the engine request, so a revoked or shut-down job frees the accelerator.
    """

    @property
    def model_name(self) -> str:
        """The model id reported in results."""
        ...

    @property
    def max_concurrency(self) -> int:
        """How many sequences the engine batches at once (vLLM's `max_num_seqs`)."""
        ...

    @property
    def supports_routed_experts(self) -> bool:
        """Whether routed experts can be captured (an MoE model with capture on and verified)."""
        ...

    @property
    def weight_version(self) -> int:
        """The version of the weights being served (jobs' `min_weight_version` waits for it)."""
        ...

    async def start(self) -> None:
        """Load the model and become ready; called inside the worker's event loop."""
        ...

    async def generate(
        self, job: Job, request_id: str, *, trace_headers: Mapping[str, str] | None = None
    ) -> EngineOutput:
        """Run one job to completion. `trace_headers`: the job's W3C trace context
        (`traceparent`, `tracestate`), checked, for the engine's own request spans."""
        ...

    async def check_health(self) -> None:
        """Raise `EngineDeadError` when the engine cannot serve."""
        ...

    async def close(self) -> None:
        """Release the engine's processes and memory."""
        ...


@runtime_checkable
class ControllableEngine(Engine, Protocol):
    """An engine the control plane can steer (`worker.engines.steerable.SteerableEngine` drives these calls).

    `load_weights` either keeps running requests across the load (`weight_reload.mode` is
    `in-place`: the running engine loads it while they are frozen), or needs none running
    (`rebuild`: a new engine is built).
    """

    @property
    def weight_reload(self) -> WeightReload:
        """How `load_weights` takes a checkpoint, and why."""
        ...

    async def interrupt(self, request_id: str) -> None:
        """Stop a running request: its `generate` returns what it has (`interrupted`)."""
        ...

    async def freeze(self) -> None:
        """Running requests stop advancing (and keep their state) until `thaw`."""
        ...

    async def thaw(self) -> None:
        """Frozen requests continue. After a load while they were frozen, the check of the new
        weights that could not run then runs now: `WeightUpdateError` (rolled back) or
        `WeightsLostError` (frozen again) as for `load_weights`."""
        ...

    async def verify_checkpoint(self, path: str) -> None:
        """Raise `WeightUpdateError` when the checkpoint at `path` cannot be loaded (checks
        cheap enough to run before anything is paused)."""
        ...

    async def load_weights(self, path: str, version: int) -> None:
        """Serve the checkpoint at `path` as `version`, checked before any job runs on it;
        `WeightUpdateError` leaves the old weights serving, `WeightsLostError` none (no job
        may run until the next load)."""
        ...

    async def transfer_weights(
        self,
        backend: str,
        init_info: dict[str, Any] | None,
        update_info: dict[str, Any],
        version: int,
    ) -> None:
        """Receive weights streamed by the trainer (vLLM's weight-transfer engine)."""
        ...

    async def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (computed with whatever weights served them)."""
        ...
