"""The engine as the control plane steers it: pause, resume, weight updates, aborts.

`SteerableEngine` wraps a `ControllableEngine` and is itself an `Engine`, so the worker's loop
does not change: a job's `generate` waits at a gate while the fleet is paused or an update is
under way, and what an update does to the jobs already running is decided here, once, for every
engine:

- `wait`: close the gate, let running requests finish on the old weights, load, open.
- `restart`: interrupt them, load, run them again from the start on the new weights.
- `abort`: interrupt them; each job is answered `aborted` with its partial completions.
- `keep`: an engine that keeps requests across a load (an in-place reload) freezes them, loads
  and thaws them: vLLM stamps two version spans. A load that fails, or whose check fails, and
  puts the old weights back thaws them on the old weights; one that cannot put them back
  (`WeightsLostError`) leaves them frozen. Otherwise they are interrupted and continued
  on the new engine from where they stopped, joined into one sequence
  (`worker.engines.steered_requests`).

The jobs themselves (the gate, which of them run, interrupting them, running them again or
continuing them) are `SteeredRequests`; this module decides when and why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from schemas import Abort, InflightMode, Job, PauseMode, WeightReload
from worker.core.clock import Clock
from worker.core.errors import EngineDeadError, EngineLostToUpdateError, WeightsLostError
from worker.engines.protocol import ControllableEngine, EngineOutput
from worker.engines.steered_requests import SteeredRequests

__all__ = ["SteerableEngine"]

logger = logging.getLogger(__name__)


class SteerableEngine:
    """An `Engine` that the control plane can pause, resume, update and abort jobs on."""

    def __init__(self, inner: ControllableEngine, *, clock: Clock) -> None:
        self._inner = inner
        self._requests = SteeredRequests(inner, clock=clock, blamed=self._blamed)
        self._paused = False
        self._frozen = False
        # One control operation at a time, in the order the control topic gives them.
        self._control = asyncio.Lock()
        # A weight load is under way (nothing of a job runs in the engine meanwhile), or one
        # left the engine dead: every engine death from then on is the update's, not a job's.
        self._loading = False
        self._lost_to_update: EngineLostToUpdateError | None = None
        # The last update left weights that could not be restored: nothing runs until one
        # loads, and requests frozen across it stay frozen (`_held_frozen`, apart from the
        # fleet's own `keep` pause in `_frozen`).
        self._weights_lost = False
        self._held_frozen = False

    @property
    def tokens_discarded(self) -> int:
        """Tokens generated and then thrown away by `restart` updates."""
        return self._requests.tokens_discarded

    @property
    def tokens_recomputed(self) -> int:
        """Tokens fed forward again to continue sequences after `keep` updates (prompt and
        tokens so far, on an engine that cannot keep requests across a load)."""
        return self._requests.tokens_recomputed

    # ---- Engine ------------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._inner.model_name

    @property
    def max_concurrency(self) -> int:
        return self._inner.max_concurrency

    @property
    def supports_routed_experts(self) -> bool:
        return self._inner.supports_routed_experts

    @property
    def weight_version(self) -> int:
        return self._inner.weight_version

    @property
    def weight_reload(self) -> WeightReload:
        return self._inner.weight_reload

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def needs_weights(self) -> bool:
        """An update failed and the weights before it could not be put back: no job runs
        until an update loads."""
        return self._weights_lost

    @property
    def inside(self) -> int:
        """Jobs inside `generate` (waiting at the gate or running)."""
        return self._requests.inside

    async def start(self) -> None:
        await self._inner.start()

    async def check_health(self) -> None:
        try:
            await self._inner.check_health()
        except EngineDeadError as exc:
            raise self._blamed(exc) from exc

    async def close(self) -> None:
        await self._inner.close()

    async def generate(
        self, job: Job, request_id: str, *, trace_headers: Mapping[str, str] | None = None
    ) -> EngineOutput:
        return await self._requests.generate(job, request_id, trace_headers=trace_headers)

    # ---- control -----------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        async with self._control:
            self._paused = True
            self._requests.close_gate()
            if mode == "keep":
                await self._inner.freeze()
                self._frozen = True
            else:
                if mode == "abort":
                    await self._requests.interrupt_all("abort")
                await self._requests.idle()

    async def resume(self) -> None:
        async with self._control:
            if self._frozen and not self._weights_lost:
                await self._inner.thaw()
                self._frozen = False
            self._paused = False
            if not self._weights_lost:
                self._requests.open_gate()

    async def load_checkpoint(self, path: str, version: int, mode: InflightMode) -> None:
        """Serve the checkpoint at `path` as `version`, doing `mode` to the jobs in flight;
        `WeightUpdateError` leaves the old weights serving. The checkpoint is checked before
        anything is paused: one that cannot load is refused while the jobs run on."""
        await self._inner.verify_checkpoint(path)
        await self._update(mode, lambda: self._inner.load_weights(path, version))

    async def transfer(
        self,
        backend: str,
        init_info: dict[str, Any] | None,
        update_info: dict[str, Any],
        version: int,
        mode: InflightMode,
    ) -> None:
        """Take weights the trainer streams over `backend`, doing `mode` to the jobs in flight."""
        await self._update(
            mode, lambda: self._inner.transfer_weights(backend, init_info, update_info, version)
        )

    def _blamed(self, exc: EngineDeadError) -> EngineDeadError:
        """`exc` as what caused it: a weight update when one is loading or left the engine
        dead (the jobs in flight are not to blame), else as it is."""
        if isinstance(exc, EngineLostToUpdateError):
            return exc
        if self._lost_to_update is not None:
            return self._lost_to_update
        if self._loading:
            return EngineLostToUpdateError(f"the engine died during a weight update: {exc}")
        return exc

    async def _load(self, load: Callable[[], Awaitable[None]]) -> None:
        """Run `load`; an engine death it causes becomes `EngineLostToUpdateError`."""
        self._loading = True
        try:
            await load()
        except EngineDeadError as exc:
            lost = (
                exc
                if isinstance(exc, EngineLostToUpdateError)
                else EngineLostToUpdateError(f"a weight update left no engine: {exc}")
            )
            self._lost_to_update = lost
            raise lost from exc
        finally:
            self._loading = False

    async def _update(self, mode: InflightMode, load: Callable[[], Awaitable[None]]) -> None:
        async with self._control:
            self._requests.close_gate()
            try:
                if mode == "keep" and self._inner.weight_reload.mode == "in-place":
                    await self._update_keeping(load)
                    return
                if mode != "wait":
                    await self._requests.interrupt_all(mode)
                if self._frozen or self._held_frozen:
                    # Frozen requests never finish: an engine that cannot keep them across a
                    # load continues them afterwards instead.
                    await self._requests.interrupt_all("keep" if mode == "wait" else mode)
                    await self._inner.thaw()
                    self._frozen = self._held_frozen = False
                await self._requests.idle()
                await self._loaded(load)
            finally:
                if not self._paused and not self._weights_lost:
                    self._requests.open_gate()

    async def _update_keeping(self, load: Callable[[], Awaitable[None]]) -> None:
        """In place with the running requests frozen; they thaw on the new weights, or on the
        old ones again after a failed update, or stay frozen when neither can serve."""
        frozen_before = self._frozen or self._held_frozen
        if not frozen_before:
            await self._inner.freeze()
        try:
            await self._loaded(load)
        except WeightsLostError:
            self._held_frozen = not self._frozen
            raise
        except BaseException:
            if not frozen_before:
                await self._inner.thaw()
            raise
        # Frozen only for want of weights: they go on now, unless the fleet paused them.
        thaw = not frozen_before or (self._held_frozen and not self._frozen)
        self._held_frozen = False
        if thaw:
            try:
                await self._inner.thaw()  # the engine's check of the new weights may run now
            except WeightsLostError:
                self._weights_lost = True
                self._held_frozen = True
                raise

    async def _loaded(self, load: Callable[[], Awaitable[None]]) -> None:
        """`_load`, keeping track of whether the engine has weights to serve."""
        try:
            await self._load(load)
        except WeightsLostError:
            self._weights_lost = True
            raise
        self._weights_lost = False

    async def abort(self, command: Abort) -> list[str]:
        """Interrupt the matching jobs (running or waiting); the job ids it matched."""
        return await self._requests.interrupt_matching(command)

    async def reset_prefix_cache(self) -> None:
        async with self._control:
            await self._inner.reset_prefix_cache()
