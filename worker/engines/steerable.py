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
  on the new engine from where they stopped (prompt + tokens so far, the rest of
  `max_tokens`); the completion joins both halves: tokens, logprobs, text, two version spans,
  and routed experts by the multi-turn rule (the continuation starts at the last row the
  first half lacks), so its rows are exactly those of one sequence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Literal

import msgspec
import numpy as np

from schemas import (
    Abort,
    Completion,
    InflightMode,
    Job,
    PauseMode,
    RoutedExperts,
    VersionSpan,
    WeightReload,
)
from worker.core.clock import Clock
from worker.core.errors import (
    EngineDeadError,
    EngineError,
    EngineLostToUpdateError,
    JobAbortedError,
    JobExpiredError,
    WeightsLostError,
)
from worker.engines.protocol import ControllableEngine, EngineOutput

__all__ = ["SteerableEngine"]

logger = logging.getLogger(__name__)

_Reason = Literal["abort", "restart", "keep"]
_ABORTED: Final = "abort"


class _Request:
    """A job inside `generate`: waiting at the gate or running in the engine."""

    __slots__ = ("aborted", "job", "reason", "running")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.running = False
        #: Why the control plane interrupted it (None: it was not).
        self.reason: _Reason | None = None
        #: Set by an abort: a job waiting at the gate is answered at once. Made only for a
        #: job that waits: an event per job is measurable on the hot path.
        self.aborted: asyncio.Event | None = None


class SteerableEngine:
    """An `Engine` that the control plane can pause, resume, update and abort jobs on."""

    def __init__(self, inner: ControllableEngine, *, clock: Clock) -> None:
        self._inner = inner
        self._clock = clock
        self._open = asyncio.Event()
        self._open.set()
        self._paused = False
        self._frozen = False
        self._requests: dict[str, _Request] = {}
        # Requests running in the engine (not waiting at the gate), and whether there are none.
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
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
        #: Tokens generated and then thrown away by `restart` updates.
        self.tokens_discarded = 0
        #: Tokens fed forward again to continue sequences after `keep` updates (prompt and
        #: tokens so far, on an engine that cannot keep requests across a load).
        self.tokens_recomputed = 0

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
        return len(self._requests)

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
        request = _Request(job)
        self._requests[request_id] = request
        try:
            return await self._generate(request, request_id, trace_headers)
        finally:
            del self._requests[request_id]

    async def _generate(
        self, request: _Request, request_id: str, trace_headers: Mapping[str, str] | None
    ) -> EngineOutput:
        job = request.job
        while True:
            await self._pass_gate(request)
            wanted = job.min_weight_version
            if wanted is not None and self.weight_version < wanted:
                # Rolled back below the version the job asked for since it was let through
                # (or while it ran, restarted or continued): run now, its result would carry
                # weights it refused. Answered retryable: sent again, it waits for them.
                raise JobAbortedError(
                    f"the weights were rolled back to version {self.weight_version}, below "
                    f"the job's min_weight_version {wanted}",
                    None,
                )
            request.running = True
            self._running += 1
            self._idle.clear()
            try:
                output = await self._inner.generate(job, request_id, trace_headers=trace_headers)
            except EngineDeadError as exc:
                raise self._blamed(exc) from exc
            finally:
                request.running = False
                self._running -= 1
                if not self._running:
                    self._idle.set()
            if not output.interrupted:
                return output
            reason, request.reason = request.reason, None
            if reason is None:
                raise EngineError("the request was aborted before it finished", retryable=True)
            if reason == "abort":
                raise JobAbortedError(
                    "aborted by the control plane; `partial` holds the completions so far",
                    output,
                )
            if reason == "restart":
                logger.info("job %s: running again on the new weights", job.job_id)
                self.tokens_discarded += sum(len(c.token_ids) for c in output.completions)
                continue
            return await self._continue(job, request_id, output, trace_headers)

    async def _pass_gate(self, request: _Request) -> None:
        if not self._open.is_set() and request.reason != "abort":
            deadline = request.job.deadline
            timeout = None if deadline is None else max(deadline - self._clock.wall(), 0)
            request.aborted = asyncio.Event()
            waits = {
                asyncio.ensure_future(self._open.wait()),
                asyncio.ensure_future(request.aborted.wait()),
            }
            try:
                done, _ = await asyncio.wait(
                    waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for waiting in waits:
                    waiting.cancel()
            if not done:
                raise JobExpiredError(
                    f"deadline {deadline:.3f} passed while the worker was paused or updating"
                )
        if request.reason == "abort":
            raise JobAbortedError("aborted by the control plane before it started", None)

    async def _continue(
        self,
        job: Job,
        request_id: str,
        first: EngineOutput,
        trace_headers: Mapping[str, str] | None,
    ) -> EngineOutput:
        """Each unfinished completion of `first`, continued on the new weights (in the job's
        trace) and joined."""
        prompt = first.prompt_token_ids
        # The weights each continuation ran on: read once the gather returns, the engine's
        # version may already be the next update's (a `wait` update loads as soon as the last
        # continuation finishes, before this coroutine resumes), which made no token of it.
        versions = [first.weight_version]

        async def finish(c: Completion) -> Completion:
            if c.finish_reason != _ABORTED:
                return c  # it had finished before the update
            done = len(c.token_ids)
            left = None if job.sampling.max_tokens is None else job.sampling.max_tokens - done
            if left is not None and left <= 0:
                return msgspec.structs.replace(c, finish_reason="length")
            self.tokens_recomputed += len(prompt) + done
            rest = Job(
                job_id=job.job_id,
                prompt_token_ids=[*prompt, *c.token_ids],
                sampling=msgspec.structs.replace(job.sampling, n=1, max_tokens=left),
                return_routed_experts=job.return_routed_experts,
                # The first half has rows up to its last token, which it never fed forward.
                routed_experts_prompt_start=(
                    len(prompt) + done - 1 if done else job.routed_experts_prompt_start
                ),
                metadata=job.metadata,
                deadline=job.deadline,
                min_weight_version=job.min_weight_version,
            )
            continued = await self.generate(
                rest, f"{request_id}/{c.index}", trace_headers=trace_headers
            )
            versions.append(continued.weight_version)
            return _join(c, continued.completions[0], whole=done == 0)

        completions = await asyncio.gather(*(finish(c) for c in first.completions))
        return EngineOutput(
            prompt_token_ids=prompt,
            completions=list(completions),
            # The weights of the part that finished last: a forced rollback continues a job
            # on a version lower than the one it began on.
            weight_version=versions[-1],
            # The prompt's own prefill was the first run's; continuations feed forward more.
            cached_prompt_tokens=first.cached_prompt_tokens,
        )

    # ---- control -----------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        async with self._control:
            self._paused = True
            self._open.clear()
            if mode == "keep":
                await self._inner.freeze()
                self._frozen = True
            else:
                if mode == "abort":
                    await self._interrupt_all("abort")
                await self._idle.wait()

    async def resume(self) -> None:
        async with self._control:
            if self._frozen and not self._weights_lost:
                await self._inner.thaw()
                self._frozen = False
            self._paused = False
            if not self._weights_lost:
                self._open.set()

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
            self._open.clear()
            try:
                if mode == "keep" and self._inner.weight_reload.mode == "in-place":
                    await self._update_keeping(load)
                    return
                if mode != "wait":
                    await self._interrupt_all(mode)
                if self._frozen or self._held_frozen:
                    # Frozen requests never finish: an engine that cannot keep them across a
                    # load continues them afterwards instead.
                    await self._interrupt_all("keep" if mode == "wait" else mode)
                    await self._inner.thaw()
                    self._frozen = self._held_frozen = False
                await self._idle.wait()
                await self._loaded(load)
            finally:
                if not self._paused and not self._weights_lost:
                    self._open.set()

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
        matched = []
        for request_id, request in list(self._requests.items()):
            if command.matches(request.job.job_id, request.job.metadata):
                matched.append(request.job.job_id)
                await self._interrupt(request_id, request, "abort")
        return matched

    async def reset_prefix_cache(self) -> None:
        async with self._control:
            await self._inner.reset_prefix_cache()

    async def _interrupt_all(self, reason: _Reason) -> None:
        for request_id, request in list(self._requests.items()):
            await self._interrupt(request_id, request, reason)

    async def _interrupt(self, request_id: str, request: _Request, reason: _Reason) -> None:
        if request.reason == "abort":
            return  # an abort already decided this job's answer
        request.reason = reason
        if reason == "abort" and request.aborted is not None:
            request.aborted.set()
        if request.running:
            await self._inner.interrupt(request_id)


def _join(first: Completion, rest: Completion, *, whole: bool) -> Completion:
    """One completion from its first half (old weights) and its continuation (new ones)."""
    if whole:  # interrupted before its first token: the continuation is all of it
        return msgspec.structs.replace(rest, index=first.index)
    offset = len(first.token_ids)
    logprobs = None
    if first.logprobs is not None and rest.logprobs is not None:
        logprobs = [*first.logprobs, *rest.logprobs]
    cumulative = None
    if first.cumulative_logprob is not None and rest.cumulative_logprob is not None:
        cumulative = first.cumulative_logprob + rest.cumulative_logprob
    routed = None
    if first.routed_experts is not None and rest.routed_experts is not None:
        rows = np.concatenate([first.routed_experts.to_array(), rest.routed_experts.to_array()])
        num_experts = first.routed_experts.num_experts
        routed = RoutedExperts.from_array(
            rows,
            start=first.routed_experts.start,
            num_experts=num_experts if isinstance(num_experts, int) else None,
        )
    spans = _spans(first) + [
        VersionSpan(version=s.version, start=s.start + offset, end=s.end + offset)
        for s in _spans(rest)
    ]
    return Completion(
        index=first.index,
        token_ids=[*first.token_ids, *rest.token_ids],
        text=first.text + rest.text,
        finish_reason=rest.finish_reason,
        logprobs=logprobs,
        cumulative_logprob=cumulative,
        routed_experts=routed,
        stop_reason=rest.stop_reason,
        weight_versions=_merged(spans),
    )


def _spans(c: Completion) -> list[VersionSpan]:
    return [] if isinstance(c.weight_versions, msgspec.UnsetType) else list(c.weight_versions)


def _merged(spans: list[VersionSpan]) -> list[VersionSpan]:
    out: list[VersionSpan] = []
    for span in spans:
        if out and out[-1].version == span.version and out[-1].end == span.start:
            out[-1] = VersionSpan(version=span.version, start=out[-1].start, end=span.end)
        elif span.end > span.start:
            out.append(span)
    return out
