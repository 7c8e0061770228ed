"""The jobs inside a `SteerableEngine`: the gate they wait at, which of them run in the engine,
the control plane's interrupts, and what becomes of an interrupted one.

An interrupted request is answered `aborted` with its partial completions (`abort`), run
again from the start on the new weights (`restart`), or continued on the new engine from where
it stopped (`keep`): prompt + tokens so far, the rest of `max_tokens`; the completion joins
both halves (tokens, logprobs, text, two version spans, and routed experts by the multi-turn
rule: the continuation starts at the last row the first half lacks), so its rows are exactly
those of one sequence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Final, Literal

import msgspec
import numpy as np

from schemas import Abort, Completion, Job, RoutedExperts, VersionSpan
from worker.core.clock import Clock
from worker.core.errors import EngineDeadError, EngineError, JobAbortedError, JobExpiredError
from worker.engines.protocol import ControllableEngine, EngineOutput

__all__ = ["InterruptReason", "SteeredRequests"]

logger = logging.getLogger(__name__)

#: What the control plane interrupts a request for.
InterruptReason = Literal["abort", "restart", "keep"]
_ABORTED: Final = "abort"


class _RestartFromTheStart(Exception):
    """A `restart` update interrupted a continuation: its job runs again from its start."""


class _Request:
    """A job inside `generate`: waiting at the gate or running in the engine."""

    __slots__ = ("aborted", "job", "reason", "running")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.running = False
        #: Why the control plane interrupted it (None: it was not).
        self.reason: InterruptReason | None = None
        #: Set by an abort: a job waiting at the gate is answered at once. Made only for a
        #: job that waits: an event per job is measurable on the hot path.
        self.aborted: asyncio.Event | None = None


class SteeredRequests:
    """The requests inside a `SteerableEngine`'s `generate`, waiting at its gate or running in
    `inner`. `blamed` maps an engine death to what caused it (see `SteerableEngine`)."""

    def __init__(
        self,
        inner: ControllableEngine,
        *,
        clock: Clock,
        blamed: Callable[[EngineDeadError], EngineDeadError],
    ) -> None:
        self._inner = inner
        self._clock = clock
        self._blamed = blamed
        self._open = asyncio.Event()
        self._open.set()
        self._requests: dict[str, _Request] = {}
        # Requests running in the engine (not waiting at the gate), and whether there are none.
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        #: Tokens generated and then thrown away by `restart` updates.
        self.tokens_discarded = 0
        #: Tokens fed forward again to continue sequences after `keep` updates (prompt and
        #: tokens so far, on an engine that cannot keep requests across a load).
        self.tokens_recomputed = 0

    @property
    def inside(self) -> int:
        """Requests inside `generate` (waiting at the gate or running)."""
        return len(self._requests)

    def open_gate(self) -> None:
        """Let waiting and new requests into the engine."""
        self._open.set()

    def close_gate(self) -> None:
        """Hold new requests (and those interrupted to run again) at the gate."""
        self._open.clear()

    async def idle(self) -> None:
        """Wait until no request runs in the engine (those at the gate aside)."""
        await self._idle.wait()

    async def generate(
        self,
        job: Job,
        request_id: str,
        *,
        trace_headers: Mapping[str, str] | None = None,
        continuation: bool = False,
    ) -> EngineOutput:
        """`job`'s output; `continuation`: a part of a job that a `keep` update continues, which
        a `restart` runs again from its job's start, not from its own."""
        request = _Request(job)
        self._requests[request_id] = request
        try:
            return await self._generate(request, request_id, trace_headers, continuation)
        finally:
            del self._requests[request_id]

    async def _generate(
        self,
        request: _Request,
        request_id: str,
        trace_headers: Mapping[str, str] | None,
        continuation: bool,
    ) -> EngineOutput:
        job = request.job
        while True:
            await self._pass_gate(request)
            wanted = job.min_weight_version
            if wanted is not None and self._inner.weight_version < wanted:
                # Rolled back below the version the job asked for since it was let through
                # (or while it ran, restarted or continued): run now, its result would carry
                # weights it refused. Answered retryable: sent again, it waits for them.
                raise JobAbortedError(
                    f"the weights were rolled back to version {self._inner.weight_version}, below "
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
                self.tokens_discarded += sum(len(c.token_ids) for c in output.completions)
                if continuation:
                    raise _RestartFromTheStart
                logger.info("job %s: running again on the new weights", job.job_id)
                continue
            try:
                return await self._continue(job, request_id, output, trace_headers)
            except _RestartFromTheStart:
                # A continuation was restarted: the tokens before it are older weights' too,
                # and `restart` promises none of them (seed 700004 of the hostile flag set).
                self.tokens_discarded += sum(len(c.token_ids) for c in output.completions)
                if continuation:
                    raise  # itself a part: its job starts again, not it
                logger.info("job %s: running again from its start on the new weights", job.job_id)

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
                rest, f"{request_id}/{c.index}", trace_headers=trace_headers, continuation=True
            )
            versions.append(continued.weight_version)
            return _join(c, continued.completions[0], whole=done == 0)

        finished = await asyncio.gather(
            *(finish(c) for c in first.completions), return_exceptions=True
        )
        # Every part ends before the job does (a part left running would generate for nothing):
        # a restart of one restarts the whole job; any other error is the first raised.
        errors = [e for e in finished if isinstance(e, BaseException)]
        if errors:
            restart = next((e for e in errors if isinstance(e, _RestartFromTheStart)), None)
            raise restart or errors[0]
        completions = [c for c in finished if isinstance(c, Completion)]
        return EngineOutput(
            prompt_token_ids=prompt,
            completions=list(completions),
            # The weights of the part that finished last: a forced rollback continues a job
            # on a version lower than the one it began on.
            weight_version=versions[-1],
            # The prompt's own prefill was the first run's; continuations feed forward more.
            cached_prompt_tokens=first.cached_prompt_tokens,
        )

    async def interrupt_matching(self, command: Abort) -> list[str]:
        """Interrupt the matching jobs (running or waiting); the job ids it matched."""
        matched = []
        for request_id, request in list(self._requests.items()):
            if command.matches(request.job.job_id, request.job.metadata):
                matched.append(request.job.job_id)
                await self._interrupt(request_id, request, "abort")
        return matched

    async def interrupt_all(self, reason: InterruptReason) -> None:
        for request_id, request in list(self._requests.items()):
            await self._interrupt(request_id, request, reason)

    async def _interrupt(self, request_id: str, request: _Request, reason: InterruptReason) -> None:
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
