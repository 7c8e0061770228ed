"""How a running vLLM engine takes new weights: in place or on a new engine, and what keeps
the KV cache honest across the change.

`VllmEngine` owns the `AsyncLLM` and its lifecycle; `WeightLoads` decides how a checkpoint
reaches it (`--weight-reload`), loads it, checks the new weights before any job runs on them,
goes back to the old weights when a load or that check fails, and has the prefix cache reset
after each change (`PrefixCacheKeeper`, which also salts every request by the weights).

The check after each update: every floating-point parameter finite (read in vLLM's worker),
then one short greedy probe generation whose logprobs must be finite and whose routing must be
real (`worker.engines.vllm_engine.probe_problem`). A failed load or check loads the previous
checkpoint again in place; where that is impossible (the weights came from a transfer) or
fails too, `WeightsLostError`: the worker then holds its jobs until the next update loads.

While requests are frozen across an in-place `keep` update, vLLM schedules nothing, so the
probe cannot run before the thaw: the parameter check runs while they are frozen, the probe
right after the thaw (jobs still held at the gate), and a probe that fails freezes them again
and rolls back. Those frozen requests are the one thing that may run a few steps on
unproven weights; their version spans say so.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Literal, NoReturn, Protocol

from schemas import WeightReload
from worker.core.clock import Clock
from worker.core.errors import ConfigError, WeightsLostError, WeightUpdateError
from worker.engines.vllm_reload import (
    Probe,
    nonfinite_parameters,
    reload_in_place,
    same_model_after_reload,
)
from worker.engines.vllm_weights import (
    ServedCheckpoint,
    check_checkpoint,
    check_in_place,
    checkpoint_fingerprint,
    served_checkpoint,
    tensor_shapes,
    transfer_weights,
)

__all__ = ["EngineHost", "PrefixCacheKeeper", "ReloadChoice", "WeightLoads", "local_checkpoint"]

logger = logging.getLogger(__name__)

#: `--weight-reload`: `auto` proves in place at start (`WeightLoads.choose`).
ReloadChoice = Literal["auto", "in-place", "rebuild"]


class EngineHost(Protocol):
    """What `WeightLoads` needs of the engine it loads weights into."""

    @property
    def vllm_config(self) -> Any: ...

    @property
    def weight_version(self) -> int: ...

    @property
    def frozen(self) -> bool:
        """Requests are frozen in the engine (vLLM's `keep` pause): nothing is scheduled."""
        ...

    def running_llm(self) -> Any:
        """The running `AsyncLLM`; EngineDeadError when there is none."""
        ...

    async def freeze(self) -> None:
        """Freeze the running requests (vLLM's `keep` pause)."""
        ...

    async def thaw(self) -> None:
        """Let frozen requests continue (and run a check owed since a load while frozen)."""
        ...

    async def weights_problem(self) -> str | None:
        """The probe generation on the served weights: why they look broken, or None."""
        ...

    async def requeue_unstarted(self) -> int:
        """Requests in vLLM's queue that have not started are submitted again, so that they
        carry the new weights' cache salt; how many."""
        ...

    async def stamp_version(self, version: int, *, in_vllm: bool = True) -> None:
        """Serve `version` from now on; `in_vllm`: tell vLLM, which stamps it on every step's
        outputs (a weight transfer has told it already)."""
        ...

    async def rebuild(self, vllm_config: Any, engine_args: list[str], version: int) -> None:
        """A new engine on `vllm_config` (and `engine_args`, unless empty), serving `version`;
        EngineDeadError if it fails."""
        ...

    def configure(self, checkpoint: Path) -> tuple[Any, list[str]]:
        """The engine configuration and arguments with `checkpoint` as the model (ConfigError)."""
        ...


def local_checkpoint(vllm_config: Any) -> Path | None:
    """The served model's directory when it is a local checkpoint."""
    path = Path(str(vllm_config.model_config.model))
    return path.resolve() if (path / "config.json").is_file() else None


#: What a rollback loads: a checkpoint and its fingerprint when loaded, or None (a transfer).
_Previous = tuple[Path, str] | None


class WeightLoads:
    """Checkpoint loads and weight transfers into `host`, and the prefix cache around them."""

    def __init__(
        self,
        host: EngineHost,
        choice: ReloadChoice,
        in_place_blocker: str | None,
        *,
        clock: Clock,
    ) -> None:
        self._host = host
        self._clock = clock
        self._in_place_blocker = in_place_blocker
        #: `auto` before the start-up proof.
        self.choosing = choice == "auto"
        if choice == "auto":
            self._reload = WeightReload(mode="rebuild", reason="not chosen yet: not started")
        else:
            self._reload = WeightReload(mode=choice, reason=f"--weight-reload {choice}")
        # The checkpoint the served weights came from (None after a transfer): where a failed
        # in-place load goes back to.
        self._checkpoint = local_checkpoint(host.vllm_config)
        # What that checkpoint's files were when its weights were loaded: a rollback loads it
        # again only if they still are, or it would serve other weights under the old version.
        self._fingerprint = (
            None if self._checkpoint is None else checkpoint_fingerprint(self._checkpoint)
        )
        # What an in-place update must fill and keep, read from the checkpoint the engine was
        # built on (in place never changes it).
        self._built_on: ServedCheckpoint | None = None
        # Tensor shapes of the checkpoint the engine was built on: what every update must match.
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._cache = PrefixCacheKeeper(host)
        self._transfer_ready = False
        # A load while requests were frozen: the probe it owes runs after the thaw, and what
        # to roll back to when it fails (the checkpoint, its version, the update's name).
        self._unproven: tuple[_Previous, int, str] | None = None

    @property
    def reload(self) -> WeightReload:
        return self._reload

    @property
    def cache(self) -> PrefixCacheKeeper:
        """The prefix cache of the engine these loads change the weights of."""
        return self._cache

    async def choose(self, before: Probe | None) -> None:
        """`auto`: in place if reloading the served checkpoint in place leaves the probe
        `before` unchanged, else rebuild (and the engine is built again: the reload may have
        left a wrong model)."""
        self.choosing = False
        if self._in_place_blocker is not None:
            self._reload = WeightReload(mode="rebuild", reason=self._in_place_blocker)
        elif self._checkpoint is None or before is None:
            reason = "the served model is not a local checkpoint directory to reload"
            self._reload = WeightReload(mode="rebuild", reason=reason)
        else:
            host = self._host
            self._reload = await same_model_after_reload(
                host.running_llm(), host.vllm_config, self._checkpoint, before, clock=self._clock
            )
            if self._reload.mode == "rebuild":
                logger.warning(
                    "in-place weight reload is wrong here (%s): building the engine again, "
                    "and every update rebuilds it",
                    self._reload.reason,
                )
                await host.rebuild(host.vllm_config, [], host.weight_version)
        logger.info("weight updates: %s (%s)", self._reload.mode, self._reload.reason)

    async def verify(self, path: str) -> Path:
        """`path`, resolved, if it holds a checkpoint the served model can load: the
        architecture, every tensor's shape, and every shard's bytes (one cut short is found
        here, before anything is paused); WeightUpdateError saying what does not fit. In place,
        also every weight of the served model and the same config (`check_in_place`): the
        reload reads tensors only."""
        host = self._host
        built_on = local_checkpoint(host.vllm_config)
        if self._shapes is None:
            self._shapes = (
                {} if built_on is None else await asyncio.to_thread(tensor_shapes, built_on)
            )
        served = host.vllm_config.model_config.hf_config
        checkpoint = await asyncio.to_thread(check_checkpoint, Path(path), served, self._shapes)
        if self._reload.mode == "in-place":
            if built_on is None:
                raise WeightUpdateError(
                    "the served model is not a local checkpoint: nothing says what an in-place "
                    "update must fill"
                )
            if self._built_on is None or self._built_on.path != built_on:
                self._built_on = await asyncio.to_thread(served_checkpoint, built_on, served)
            await asyncio.to_thread(check_in_place, checkpoint, self._built_on)
        return checkpoint

    async def load(self, path: str, version: int) -> None:
        """Serve the checkpoint at `path` as `version`. A checkpoint that does not fit the
        served model is refused before anything changes; a load or a check after it that
        fails puts the old weights back (WeightUpdateError), or cannot (WeightsLostError)."""
        checkpoint = await self.verify(path)
        # Taken after the checks: the files as they were checked (and, an instant later, read).
        fingerprint = await asyncio.to_thread(checkpoint_fingerprint, checkpoint)
        if self._reload.mode == "in-place":
            await self._load_in_place(checkpoint, version)
        else:
            await self._rebuild_on(checkpoint, version)
        self._checkpoint, self._fingerprint = checkpoint, fingerprint

    def _previous(self) -> _Previous:
        return None if self._checkpoint is None else (self._checkpoint, self._fingerprint or "")

    async def _load_in_place(self, checkpoint: Path, version: int) -> None:
        host = self._host
        previous, previous_version = self._previous(), host.weight_version
        what = f"the update to {checkpoint} (version {version})"
        try:
            await reload_in_place(host.running_llm(), checkpoint)
        except WeightUpdateError as exc:
            await self._roll_back(previous, previous_version, str(exc))
        await self._serve(version)
        if host.frozen:
            # Stamped with the new version now: they are prefilled on the new weights.
            requeued = await host.requeue_unstarted()
            if requeued:
                logger.info("%d queued requests submitted again with the new weights", requeued)
        problem = await self._nonfinite()
        if problem is None and host.frozen:
            self._unproven = (previous, previous_version, what)
            return
        if problem is None:
            problem = await host.weights_problem()
        if problem is not None:
            await self._roll_back(previous, previous_version, f"{what} failed the check: {problem}")

    async def _serve(self, version: int) -> None:
        self._cache.new_weights()
        await self._host.stamp_version(version)
        await self._cache.reset()

    async def _nonfinite(self) -> str | None:
        if self._in_place_blocker is not None:
            return None  # another worker extension: the probe alone decides
        try:
            names = await nonfinite_parameters(self._host.running_llm())
        except WeightUpdateError as exc:
            return str(exc)
        return None if not names else f"parameters hold NaN or infinity: {', '.join(names)}"

    async def _roll_back(self, before: _Previous, version: int, reason: str) -> NoReturn:
        """Load the checkpoint `before` again in place, serving `version`, and raise
        WeightUpdateError with `reason`; WeightsLostError when that cannot be done (its files
        changed since it was loaded: a trainer that rewrites one directory) or its weights fail
        the check (the probe only when nothing is frozen: those weights passed it before).
        Either way the engine reports `version` again."""
        if before is None:
            await self._host.stamp_version(version)
            raise WeightsLostError(
                f"{reason}; the weights before it came from a transfer and cannot be loaded again"
            )
        previous, fingerprint = before
        now = await asyncio.to_thread(checkpoint_fingerprint, previous)
        if now != fingerprint:
            await self._host.stamp_version(version)
            raise WeightsLostError(
                f"{reason}; the previous checkpoint {previous} changed on disk since it was "
                f"loaded (its files' sizes, times or headers), so loading it again would not "
                f"serve the weights of version {version}"
            )
        logger.warning("%s: loading %s again in place", reason, previous)
        try:
            await reload_in_place(self._host.running_llm(), previous)
        except WeightUpdateError as exc:
            await self._host.stamp_version(version)
            raise WeightsLostError(
                f"{reason}; loading the previous checkpoint again failed too: {exc}"
            ) from exc
        self._checkpoint, self._fingerprint = previous, fingerprint
        await self._serve(version)
        problem = await self._nonfinite()
        if problem is None and not self._host.frozen:
            problem = await self._host.weights_problem()
        if problem is not None:
            raise WeightsLostError(
                f"{reason}; the previous checkpoint {previous} failed the check when loaded "
                f"again: {problem}"
            )
        raise WeightUpdateError(f"{reason}; rolled back in place to {previous} (version {version})")

    async def after_thaw(self) -> None:
        """The probe a load while frozen owes, now that requests run again: a failure freezes
        them, rolls back and thaws them (WeightUpdateError), or leaves them frozen on weights
        that cannot be restored (WeightsLostError)."""
        owed, self._unproven = self._unproven, None
        if owed is None:
            return
        previous, version, what = owed
        problem = await self._host.weights_problem()
        if problem is None:
            return
        await self._host.freeze()
        try:
            await self._roll_back(previous, version, f"{what} failed the check: {problem}")
        except WeightsLostError:
            raise
        except WeightUpdateError:
            await self._host.thaw()
            raise

    async def _rebuild_on(self, checkpoint: Path, version: int) -> None:
        """A new engine on `checkpoint`, built in a thread so the event loop (and the
        consumer's group membership) keeps going, and checked before any job runs on it; one
        that fails to start or the check is replaced by an engine on the old configuration
        again."""
        host = self._host
        try:
            config, args = await asyncio.to_thread(host.configure, checkpoint)
        except ConfigError as exc:
            raise WeightUpdateError(f"checkpoint {checkpoint}: {exc}") from None
        old_config, old_version = host.vllm_config, host.weight_version
        previous = self._previous()
        try:
            await host.rebuild(config, args, version)
            self._cache.new_weights()
            problem = await host.weights_problem()
        except Exception as exc:
            logger.exception("the engine on %s did not start; back to the old weights", checkpoint)
            await host.rebuild(old_config, [], old_version)  # EngineDeadError if that fails
            reason = f"the engine on {checkpoint} did not start: {exc}"
            await self._lost_if_changed(previous, old_version, reason)
            raise WeightUpdateError(reason) from exc
        if problem is not None:
            logger.warning(
                "the engine on %s failed the check (%s): back to the old weights",
                checkpoint,
                problem,
            )
            await host.rebuild(old_config, [], old_version)
            self._cache.new_weights()
            reason = f"the update to {checkpoint} (version {version}) failed the check: {problem}"
            await self._lost_if_changed(previous, old_version, reason)
            raise WeightUpdateError(f"{reason}; the engine was built on the previous weights again")

    async def _lost_if_changed(self, before: _Previous, version: int, reason: str) -> None:
        """WeightsLostError when the engine was just built again on the checkpoint `before`
        and its files changed since it was loaded: the engine runs, but not on the weights
        `version` had, so it must hold its jobs until an update loads."""
        if before is None:
            return
        previous, fingerprint = before
        if await asyncio.to_thread(checkpoint_fingerprint, previous) != fingerprint:
            raise WeightsLostError(
                f"{reason}; the engine was built on {previous} again, but its files changed "
                f"on disk since it was loaded, so it does not serve the weights of version "
                f"{version}"
            )

    async def transfer(
        self,
        backend: str,
        init_info: dict[str, Any] | None,
        update_info: dict[str, Any],
        version: int,
    ) -> None:
        """Weights streamed by the trainer through vLLM's weight-transfer engine (the backend
        the engine was configured with), as vLLM's own RL endpoints pass them."""
        await transfer_weights(
            self._host.running_llm(),
            backend,
            # The first transfer initialises vLLM's transfer engine, with or without info.
            init_info if init_info is not None or self._transfer_ready else {},
            update_info,
            version,
        )
        self._transfer_ready = True
        previous, previous_version = self._previous(), self._host.weight_version
        self._checkpoint = self._fingerprint = None
        self._cache.new_weights()
        await self._host.stamp_version(version, in_vllm=False)
        await self._cache.reset()
        what = f"the {backend} transfer (version {version})"
        problem = await self._nonfinite()
        if problem is None and self._host.frozen:
            self._unproven = (previous, previous_version, what)
            return
        if problem is None:
            problem = await self._host.weights_problem()
        if problem is not None:
            if self._reload.mode != "in-place":
                previous = None  # an engine that cannot reload in place cannot roll back so
            await self._roll_back(previous, previous_version, f"{what} failed the check: {problem}")


class PrefixCacheKeeper:
    """The prefix cache of `host`'s engine across weight changes: the salt every request is
    keyed by, so that KV cached under other weights is never read, and the reset after each
    change, tried again when vLLM refuses it."""

    def __init__(self, host: EngineHost) -> None:
        self._host = host
        # A prefix-cache reset refused while requests held blocks (frozen across an update):
        # tried again when none runs. Until then the version salt keeps new requests off them.
        self._stale = False
        # Weight loads so far: part of the cache salt, so that KV computed under weights that
        # were rolled back is never read under the same version loaded again.
        self._loads = 0

    @property
    def reset_pending(self) -> bool:
        """vLLM refused the last reset: it is tried again when no request runs."""
        return self._stale

    @property
    def salt(self) -> str:
        """Every request's prefix-cache salt: KV cached under other weights is never read."""
        return f"weights-{self._host.weight_version}-{self._loads}"

    def new_weights(self) -> None:
        """Weights were loaded (or loaded again): requests from now on get a new salt."""
        self._loads += 1

    async def reset(self) -> None:
        """Reset the prefix cache; vLLM refuses while running (or frozen) requests hold
        blocks, and then it is tried again when none runs (`after_requests`)."""
        cleared = bool(await self._host.running_llm().reset_prefix_cache())
        if not cleared and not self._stale:
            logger.info(
                "prefix cache: running requests still hold blocks; reset again when none runs "
                "(new requests do not read them: cache keys carry the weight version)"
            )
        self._stale = not cleared

    async def after_requests(self) -> None:
        """No request runs any more: the time to retry a refused reset."""
        if self._stale:
            await self.reset()
