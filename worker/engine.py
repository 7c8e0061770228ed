"""The engine seam: the few calls the service makes into a generation engine."""

from __future__ import annotations

from typing import Protocol

import msgspec

from schemas import Completion, Job

__all__ = ["Engine", "EngineOutput"]


class EngineOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine returns for one job: the prompt as tokenised and the `n` completions."""

    prompt_token_ids: list[int]
    completions: list[Completion]


class Engine(Protocol):
    """A generation engine as the worker sees it (vLLM's `EngineClient` has ~20 methods; we call these).

    `generate` raises `worker.errors.JobError` subclasses for one job's problems and
    `worker.errors.EngineDeadError` when nothing can run any more. Cancelling `generate` must
    abort the engine request, so a revoked or shut-down job stops using the accelerator.
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

    async def start(self) -> None:
        """Load the model and become ready; called inside the worker's event loop."""
        ...

    async def generate(self, job: Job, request_id: str) -> EngineOutput:
        """Run one job to completion."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request that is running; a no-op when it already finished."""
        ...

    async def check_health(self) -> None:
        """Raise `EngineDeadError` when the engine cannot serve."""
        ...

    async def close(self) -> None:
        """Release the engine's processes and memory."""
        ...
