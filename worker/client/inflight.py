"""The jobs a `RolloutClient` has sent and not yet answered, and which result answers which.

No Kafka here: the client produces and reads, this decides. A result is taken only for the
sending of a job in flight, by the `submission_id` it echoes; split results are reassembled; a
`retryable` failure is sent again under a new id and submission; a job past its timeout is
answered `expired`, or fails with `RolloutError` when only answers echoing no submission came
for it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Final

import msgspec

from schemas import (
    Completed,
    ErrorCode,
    ErrorInfo,
    Failed,
    Job,
    PayloadError,
    Result,
    ResultAssembler,
    SchemaError,
    decode_result,
)
from worker.client.conversation import new_submission_id
from worker.core.clock import Clock
from worker.core.tracing import TraceContext

__all__ = ["RETRY_SEPARATOR", "InFlight", "Pending", "RolloutError"]

logger = logging.getLogger(__name__)

# A resubmitted job gets the original id with this and the attempt number appended, so its
# answer is not taken for a duplicate of the failed one.
RETRY_SEPARATOR: Final = "~retry"


class RolloutError(Exception):
    """The client cannot do what was asked (not started, a payload that cannot be read)."""


class Pending:
    """One job in flight: the caller's job and future, and the sending it travels under."""

    __slots__ = (
        "deadline",
        "future",
        "job",
        "retries",
        "submission",
        "trace",
        "unechoed",
        "wire_id",
    )

    def __init__(
        self, job: Job, future: asyncio.Future[Result], deadline: float, trace: TraceContext
    ) -> None:
        self.job = job
        # Sent with the job, and with each resubmission of it: one trace for all its tries.
        self.trace = trace
        self.future = future
        self.deadline = deadline
        self.retries = 0
        # The id the job travels under now: its own, or its latest resubmission's.
        self.wire_id = job.job_id
        # The submission it travels under now: new for every sending, so an answer to an
        # earlier sending of the same id (a re-run, an earlier trainer) is told apart.
        self.submission = new_submission_id()
        # The last answer to the id in flight that echoed no submission: not taken, since it
        # may answer an earlier sending, but said when the job times out.
        self.unechoed: Result | None = None


class InFlight:
    """The jobs in flight, by the id each travels under (`pending`).

    `resend(pending)`: send a job again (its `wire_id` and `submission` are new), for a
    `retryable` failure while fewer than `max_retries` resubmissions were made. `resolve`:
    read payload references from under `payload_root` before answering. `on_progress(done,
    submitted)` after every answer.
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        max_retries: int,
        resolve: bool,
        payload_root: Path | None,
        resend: Callable[[Pending], None],
        on_progress: Callable[[int, int], None] | None = None,
        clock: Clock,
    ) -> None:
        self.pending: dict[str, Pending] = {}
        self._clock = clock
        self._assembler = ResultAssembler(clock=clock.monotonic)
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._resolve = resolve
        self._payload_root = payload_root
        self._resend = resend
        self._on_progress = on_progress
        self._submitted = 0
        self._answered = 0

    def add(self, job: Job, trace: TraceContext) -> Pending:
        """`job`, in flight from now until its timeout; `RolloutError` when its id is in flight
        already (its own, or a resubmission's)."""
        if (holder := self.pending.get(job.job_id)) is not None:
            if holder.job.job_id != job.job_id:
                raise RolloutError(
                    f"job {job.job_id}: a resubmission of job {holder.job.job_id} travels under "
                    "that id until it is answered"
                )
            raise RolloutError(f"job {job.job_id} is already in flight on this client")
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        pending = Pending(job, future, self._clock.wall() + self._timeout_s, trace)
        self.pending[job.job_id] = pending
        # A caller that stops waiting (a cancelled `generate`, `wait_for` around the future)
        # cancels the future: the job is then forgotten, so `in_flight` drops and its id may be
        # submitted again.
        future.add_done_callback(lambda _: self._forget_if_cancelled(pending))
        self._submitted += 1
        return pending

    def not_sent(self, pending: Pending, error: RolloutError) -> None:
        """The broker refused the sending of `pending` in flight: the job fails with `error`."""
        if self.pending.get(pending.wire_id) is pending and not pending.future.done():
            del self.pending[pending.wire_id]
            pending.future.set_exception(error)

    def fail_all(self, error: RolloutError) -> None:
        """Fail every job in flight with `error` (nothing can answer them any more)."""
        for pending in self.pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)
        self.pending.clear()

    def expire(self, now: float) -> None:
        """Answer every job past its timeout at `now` `expired`, so no caller waits forever."""
        for wire_id, pending in list(self.pending.items()):
            if now < pending.deadline or pending.future.done():
                continue
            del self.pending[wire_id]
            self._discard_parts(pending)
            if pending.unechoed is None:
                pending.future.set_result(_expired(pending, self._timeout_s))
            else:
                pending.future.set_exception(_unechoed(pending, pending.unechoed, self._timeout_s))
            self._progress()

    async def take_record(self, value: bytes | None) -> None:
        """Take the result a record of the results topic holds (see `take`)."""
        try:
            result = decode_result(value or b"")
        except SchemaError as exc:
            logger.warning("undecodable result skipped: %s", exc)
            return
        await self.take(result)

    async def take(self, result: Result) -> None:
        """Take `result` if it answers (part of) a sending in flight; skip it otherwise."""
        pending = None if result.job_id is None else self.pending.get(result.job_id)
        if pending is None:
            return  # another client's job, or one answered already: nothing of it is kept
        if isinstance(result.submission_id, msgspec.UnsetType):
            # A worker that could not read the job's submission (or one older than
            # submissions): the answer may be to an earlier sending of this id, by this
            # trainer or by a run before it.
            logger.warning("an answer to job %s that echoes no submission skipped", result.job_id)
            pending.unechoed = result
            return
        if not _answers(pending, result):
            # A late answer to an earlier sending of this id: another prompt, or the same one
            # generated for a caller who has since stopped waiting for it.
            logger.info("an answer to an earlier submission of job %s skipped", result.job_id)
            return
        try:
            whole = self._assembler.add(result)
        except SchemaError as exc:  # a part that disagrees with its attempt's other parts
            logger.warning("result part skipped: %s", exc)
            return
        if whole is None or whole.job_id is None:
            return
        if self.pending.get(whole.job_id) is not pending or pending.future.done():
            return
        del self.pending[whole.job_id]
        if isinstance(whole, Failed) and whole.error.retryable and self._retry(pending, whole):
            return
        # The caller sees its own job: its id and submission, whichever sending was answered.
        answer: Result = msgspec.structs.replace(
            whole,
            job_id=pending.job.job_id,
            submission_id=msgspec.UNSET
            if pending.job.submission_id is None
            else pending.job.submission_id,
        )
        if self._resolve and isinstance(answer, Completed) and _has_references(answer):
            try:
                answer = await asyncio.to_thread(_resolved, answer, self._payload_root)
            except SchemaError as exc:  # PayloadError, RoutedExpertsError: the reason
                pending.future.set_exception(RolloutError(f"job {pending.job.job_id}: {exc}"))
                self._progress()
                return
        pending.future.set_result(answer)
        self._progress()

    def _retry(self, pending: Pending, failed: Failed) -> bool:
        """Send `pending` again after `failed`, unless it was resubmitted enough already."""
        if pending.retries >= self._max_retries:
            return False
        pending.retries += 1
        original = pending.job.job_id
        wire_id = self._retry_id(original, pending.retries)
        logger.info("job %s failed (%s): resubmitting as %s", original, failed.error.code, wire_id)
        pending.wire_id = wire_id
        pending.submission = new_submission_id()
        self.pending[wire_id] = pending
        self._resend(pending)
        return True

    def _retry_id(self, original: str, retries: int) -> str:
        """The id a job's resubmission travels under: `<id>~retry<n>`, the first such `n` from
        `retries` that no job in flight here holds (a caller may have submitted that very id)."""
        number = retries
        while (wire_id := f"{original}{RETRY_SEPARATOR}{number}") in self.pending:
            number += 1
        return wire_id

    def _forget_if_cancelled(self, pending: Pending) -> None:
        if not pending.future.cancelled():
            return
        if self.pending.get(pending.wire_id) is pending:
            del self.pending[pending.wire_id]
            self._discard_parts(pending)

    def _discard_parts(self, pending: Pending) -> None:
        """Drop the parts held for the sending of `pending` that is in flight."""
        self._assembler.discard(pending.wire_id, pending.submission)

    def _progress(self) -> None:
        self._answered += 1
        if self._on_progress is not None:
            self._on_progress(self._answered, self._submitted)


def _answers(pending: Pending, result: Result) -> bool:
    """Whether `result` answers the sending of `pending` in flight: it echoes its submission."""
    return result.submission_id == pending.submission


def _expired(pending: Pending, timeout_s: float) -> Failed:
    """The answer to a job no worker answered within the client's timeout."""
    detail = (
        f"no result within {timeout_s:.0f}s of submitting "
        f"(client timeout; {pending.retries} resubmissions)"
    )
    # It answers the caller's job as a worker's answer would: its id, metadata and submission.
    submission = pending.job.submission_id
    return Failed(
        job_id=pending.job.job_id,
        error=ErrorInfo(code=ErrorCode.EXPIRED, detail=detail, retryable=True),
        metadata=pending.job.metadata,
        worker="rollout-client",
        submission_id=msgspec.UNSET if submission is None else submission,
    )


def _unechoed(pending: Pending, answer: Result, timeout_s: float) -> RolloutError:
    """Why a job that only answers echoing no submission came for ends at its timeout."""
    what = (
        f"a failure ({answer.error.code.value}: {answer.error.detail})"
        if isinstance(answer, Failed)
        else "a completed result"
    )
    return RolloutError(
        f"job {pending.job.job_id}: no answer to its sending within {timeout_s:.0f}s; "
        f"{what} echoing no submission_id came, which may answer an earlier sending of the "
        "id (a worker that could not read the job's submission_id, or one older than it)"
    )


def _has_references(result: Completed) -> bool:
    return any(
        c.routed_experts is not None and c.routed_experts.is_reference for c in result.completions
    )


def _resolved(result: Completed, root: Path | None) -> Completed:
    """`result` with every payload reference read from under `root`, checked and inlined
    (blocking: files); PayloadError or RoutedExpertsError for the first that cannot be."""
    completions = []
    for c in result.completions:
        routed = c.routed_experts
        if routed is not None and routed.is_reference:
            if root is None:
                raise PayloadError(
                    f"payload {routed.uri} not read: the client has no payload_root (pass "
                    "RolloutClient(payload_root=...), the store as mounted here)"
                )
            completions.append(msgspec.structs.replace(c, routed_experts=routed.resolved(root)))
        else:
            completions.append(c)
    return msgspec.structs.replace(result, completions=completions)
