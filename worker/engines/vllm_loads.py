"""How a running vLLM engine takes new weights: in place or on a new engine, and what keeps
the KV cache honest across the change.

`VllmEngine` owns the `AsyncLLM` and its lifecycle; `WeightLoads` decides how a checkpoint
reaches it (`--weight-reload`), loads it, goes back to the old weights when a load fails, and
resets the prefix cache after each change.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Literal, Protocol

from schemas import WeightReload
from worker.core.errors import ConfigError, EngineDeadError, WeightUpdateError
from worker.engines.vllm_reload import Probe, reload_in_place, same_model_after_reload
from worker.engines.vllm_weights import check_checkpoint, tensor_shapes, transfer_weights

__all__ = ["EngineHost", "ReloadChoice", "WeightLoads", "local_checkpoint"]

logger = logging.getLogger(__name__)

#: `--weight-reload`: `auto` proves in place at start (`WeightLoads.choose`).
ReloadChoice = Literal["auto", "in-place", "rebuild"]


class EngineHost(Protocol):
    """What `WeightLoads` needs of the engine it loads weights into."""

    @property
    def vllm_config(self) -> Any: ...

    @property
    def weight_version(self) -> int: ...

    def running_llm(self) -> Any:
        """The running `AsyncLLM`; EngineDeadError when there is none."""
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


class WeightLoads:
    """Checkpoint loads and weight transfers into `host`, and the prefix cache around them."""

    def __init__(
        self, host: EngineHost, choice: ReloadChoice, in_place_blocker: str | None
    ) -> None:
        self._host = host
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
        # Tensor shapes of the checkpoint the engine was built on: what every update must match.
        self._shapes: dict[str, tuple[int, ...]] | None = None
        # A prefix-cache reset refused while requests held blocks (frozen across an update):
        # tried again when none runs. Until then the version salt keeps new requests off them.
        self._cache_stale = False
        self._transfer_ready = False

    @property
    def reload(self) -> WeightReload:
        return self._reload

    @property
    def cache_reset_pending(self) -> bool:
        return self._cache_stale

    @property
    def cache_salt(self) -> str:
        """Every request's prefix-cache salt: KV cached under other weights is never read."""
        return f"weights-{self._host.weight_version}"

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
                host.running_llm(), host.vllm_config, self._checkpoint, before
            )
            if self._reload.mode == "rebuild":
                logger.warning(
                    "in-place weight reload is wrong here (%s): building the engine again, "
                    "and every update rebuilds it",
                    self._reload.reason,
                )
                await host.rebuild(host.vllm_config, [], host.weight_version)
        logger.info("weight updates: %s (%s)", self._reload.mode, self._reload.reason)

    async def load(self, path: str, version: int) -> None:
        """Serve the checkpoint at `path` as `version`. A checkpoint that does not fit the
        served model is refused before anything changes; a load that fails leaves the old
        weights serving."""
        host = self._host
        served = host.vllm_config.model_config.hf_config
        if self._shapes is None:
            built_on = local_checkpoint(host.vllm_config)
            self._shapes = (
                {} if built_on is None else await asyncio.to_thread(tensor_shapes, built_on)
            )
        checkpoint = await asyncio.to_thread(check_checkpoint, Path(path), served, self._shapes)
        if self._reload.mode == "in-place":
            await self._load_in_place(checkpoint, version)
        else:
            await self._rebuild_on(checkpoint, version)
        self._checkpoint = checkpoint

    async def _load_in_place(self, checkpoint: Path, version: int) -> None:
        try:
            await reload_in_place(self._host.running_llm(), checkpoint)
        except WeightUpdateError:
            await self._restore_after_failed_reload()
            raise
        await self._host.stamp_version(version)
        await self.reset_cache()

    async def _restore_after_failed_reload(self) -> None:
        """A reload that raised may have loaded part of the checkpoint, and vLLM cannot load
        even the old one in place after that (measured: its reload state keeps the failed
        tensor's shape). So the old checkpoint gets a new engine; EngineDeadError when it is
        not on disk (the weights came from a transfer) or that engine does not start."""
        old, host = self._checkpoint, self._host
        if old is None:
            raise EngineDeadError(
                "an in-place reload failed part-way, and the weights before it came from a "
                "transfer: they cannot be loaded again"
            )
        logger.warning("in-place reload failed: building the engine on %s again", old)
        if old == local_checkpoint(host.vllm_config):
            config, args = host.vllm_config, list[str]()
        else:
            try:
                config, args = await asyncio.to_thread(host.configure, old)
            except ConfigError as exc:
                raise EngineDeadError(f"cannot configure an engine on {old}: {exc}") from exc
        await host.rebuild(config, args, host.weight_version)

    async def _rebuild_on(self, checkpoint: Path, version: int) -> None:
        """A new engine on `checkpoint`, built in a thread so the event loop (and the
        consumer's group membership) keeps going; one that fails to start is replaced by an
        engine on the old configuration again."""
        host = self._host
        try:
            config, args = await asyncio.to_thread(host.configure, checkpoint)
        except ConfigError as exc:
            raise WeightUpdateError(f"checkpoint {checkpoint}: {exc}") from None
        old_config, old_version = host.vllm_config, host.weight_version
        try:
            await host.rebuild(config, args, version)
        except Exception as exc:
            logger.exception("the engine on %s did not start; back to the old weights", checkpoint)
            await host.rebuild(old_config, [], old_version)  # EngineDeadError if that fails
            raise WeightUpdateError(f"the engine on {checkpoint} did not start: {exc}") from exc

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
        self._checkpoint = None
        await self._host.stamp_version(version, in_vllm=False)

    async def reset_cache(self) -> None:
        """Reset the prefix cache; vLLM refuses while running (or frozen) requests hold
        blocks, and then it is tried again when none runs (`after_requests`)."""
        cleared = bool(await self._host.running_llm().reset_prefix_cache())
        if not cleared and not self._cache_stale:
            logger.info(
                "prefix cache: running requests still hold blocks; reset again when none runs "
                "(new requests do not read them: cache keys carry the weight version)"
            )
        self._cache_stale = not cleared

    async def after_requests(self) -> None:
        """No request runs any more: the time to retry a refused reset."""
        if self._cache_stale:
            await self.reset_cache()
