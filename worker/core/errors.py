"""Errors the worker raises, and what each one means for the job and the process.

    WorkerError
    ├── ConfigError            bad settings or CLI arguments: refuse to start (exit 2)
    ├── JobError               one job's problem: answered as a `failed` result, offset moves on
    │   ├── InvalidJobError        code `invalid_job` (also vLLM's validation errors)
    │   │   └── InvalidRecordError     not a readable job at all: also dead-lettered
    │   ├── EngineError            code `engine_error`; `retryable` says if resubmitting may help
    │   ├── ResultTooLargeError    code `result_too_large`
    │   ├── JobExpiredError        code `expired`: its deadline passed while it waited
    │   └── JobAbortedError        code `aborted`: stopped by the control plane, with its partial
    ├── WeightUpdateError      a weight update could not be applied; the old weights still serve
    │   └── WeightsLostError       ... and the old weights could not be restored either: the
    │                              worker holds its jobs until an update loads (`needs_weights`)
    └── FatalError             the process cannot go on: stop fetching, commit only what
        │                      finished, exit non-zero so a supervisor restarts it
        ├── EngineDeadError        the engine is gone (maybe a job's doing: blames the jobs)
        │   └── EngineLostToUpdateError    a weight update left no engine: blames no job
        └── BrokerError            results cannot be delivered (auth, unreachable for too long)

Like aiokafka's errors, each class carries its policy (`code`, `retryable`, `blames_jobs`) so
the handler needs no table of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from schemas import ErrorCode

if TYPE_CHECKING:
    from worker.engines.protocol import EngineOutput

__all__ = [
    "BrokerError",
    "ConfigError",
    "EngineDeadError",
    "EngineError",
    "EngineLostToUpdateError",
    "FatalError",
    "InvalidJobError",
    "InvalidRecordError",
    "JobAbortedError",
    "JobError",
    "JobExpiredError",
    "ResultTooLargeError",
    "WeightUpdateError",
    "WeightsLostError",
    "WorkerError",
]


class WorkerError(Exception):
    """Base of every error the worker raises on purpose."""


class ConfigError(WorkerError):
    """Settings or CLI arguments are invalid; the message names the setting."""


class JobError(WorkerError):
    """A problem confined to one job, answered as a `failed` result."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL_ERROR
    retryable: bool = False

    def __init__(self, detail: str, *, retryable: bool | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if retryable is not None:
            self.retryable = retryable


class InvalidJobError(JobError):
    """The job cannot run as written; resubmitting it unchanged fails again."""

    code = ErrorCode.INVALID_JOB


class InvalidRecordError(InvalidJobError):
    """The record is not a readable job (no value, not JSON, a field out of bounds): answered
    from what can be read of it, and copied to the dead-letter topic as it was."""


class EngineError(JobError):
    """The engine failed on this one job but is still serving others."""

    code = ErrorCode.ENGINE_ERROR
    retryable = True


class ResultTooLargeError(JobError):
    """The encoded result is larger than the broker will take."""

    code = ErrorCode.RESULT_TOO_LARGE


class JobExpiredError(JobError):
    """The job's deadline passed while it waited (held for a weight version, or paused)."""

    code = ErrorCode.EXPIRED


class JobAbortedError(JobError):
    """The control plane stopped the job; `partial` is what the engine had generated."""

    code = ErrorCode.ABORTED
    retryable = True

    def __init__(self, detail: str, partial: EngineOutput | None) -> None:
        super().__init__(detail)
        self.partial = partial


class WeightUpdateError(WorkerError):
    """A weight update was refused or failed; the engine serves the weights it had."""


class WeightsLostError(WeightUpdateError):
    """A weight update failed and the weights before it could not be put back (they came from
    a transfer, or loading them failed too): the engine holds weights nobody should sample
    from, so the worker runs no job until the next update loads."""


class FatalError(WorkerError):
    """The service must stop; unfinished jobs stay uncommitted and are redelivered."""

    #: Whether a job in flight may have caused it: then the stop is no clean hand-over and
    #: each of them counts a death for the crash-loop breaker.
    blames_jobs: ClassVar[bool] = True


class EngineDeadError(FatalError):
    """The engine can no longer serve any request."""


class EngineLostToUpdateError(EngineDeadError):
    """A weight update (a failed load, a rebuild that did not start) left no engine: the
    control plane's doing, not a job's."""

    blames_jobs = False


class BrokerError(FatalError):
    """The broker refuses or cannot be reached for longer than the worker will wait."""

    blames_jobs = False
