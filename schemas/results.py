"""Results, as the worker writes them to the results topic: a tagged union on `type`."""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, UnsetType

from schemas.jobs import MAX_N, MAX_SUBMISSION_ID_CHARS
from schemas.routed_experts import RoutedExperts

__all__ = [
    "Completed",
    "Completion",
    "ErrorCode",
    "ErrorInfo",
    "Failed",
    "Part",
    "Result",
    "Timings",
    "VersionSpan",
]


SubmissionId = Annotated[str, Meta(min_length=1, max_length=MAX_SUBMISSION_ID_CHARS)]


class ErrorCode(enum.StrEnum):
    """Why a job failed. A closed set: readers may rely on it being exhaustive."""

    #: The record is not a valid job, or vLLM rejected its values (start beyond the prompt,
    #: prompt longer than the model's context, routed experts from a model that has none).
    INVALID_JOB = "invalid_job"
    #: The job's `deadline` passed before it could start.
    EXPIRED = "expired"
    #: The engine failed on this job; `retryable` says whether resubmitting may succeed.
    ENGINE_ERROR = "engine_error"
    #: One completion does not fit a record (`max_result_bytes` or the results topic's limit) and
    #: the worker has no payload store for its routed experts; `detail` gives both sizes.
    #: `retryable` when there is a store but writing to it failed.
    RESULT_TOO_LARGE = "result_too_large"
    #: An unexpected error in the worker itself while handling this job.
    INTERNAL_ERROR = "internal_error"
    #: Stopped by the control plane (an `abort` command, a pause or weight update in `abort`
    #: mode) while running; `partial` holds what was generated so far. Always retryable.
    ABORTED = "aborted"


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What went wrong, in words a person can act on."""

    code: ErrorCode
    detail: str
    retryable: bool = False


class VersionSpan(msgspec.Struct, frozen=True, kw_only=True):
    """Output tokens `[start, end)` of a completion were sampled with weights `version`."""

    version: Annotated[int, Meta(ge=0)]
    start: Annotated[int, Meta(ge=0)]
    end: Annotated[int, Meta(ge=0)]


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """One of a job's `n` sampled sequences."""

    index: Annotated[int, Meta(ge=0)]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # The sampled tokens' logprobs, one per token, when the job set `sampling.logprobs`.
    # JSON has no -inf: a token with probability zero reads back as null.
    logprobs: list[float | None] | None = None
    cumulative_logprob: float | None = None
    routed_experts: RoutedExperts | None = None
    # The stop string or token id that ended the sequence, when one did.
    stop_reason: str | int | None = None
    # Which weights sampled which tokens: one span, or more when weights changed mid-sequence
    # (a `keep` update). Absent from results of workers older than the control plane.
    weight_versions: list[VersionSpan] | UnsetType = UNSET


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """Where the job's time went, in seconds."""

    queue_wait_s: float
    engine_s: float


class Part(msgspec.Struct, frozen=True, kw_only=True):
    """Where one record of a result split by completion belongs.

    A result too large for one record is published as `count` records, each a `Completed` with
    whole completions and the same job-level fields. `attempt` names one generation of the job:
    a job redelivered after a crash is generated again under a new attempt, so parts of two
    attempts are never mixed (`schemas.ResultAssembler` does this).
    """

    index: Annotated[int, Meta(ge=0)]
    # A result is split by completion, so it has at most as many parts as a job has completions.
    count: Annotated[int, Meta(ge=1, le=MAX_N)]
    attempt: Annotated[str, Meta(min_length=1, max_length=64)]

    def __post_init__(self) -> None:
        if self.index >= self.count:
            raise ValueError(f"part index {self.index} is not below its count {self.count}")


class Completed(msgspec.Struct, frozen=True, kw_only=True, tag="completed", tag_field="type"):
    """A job that ran to completion, or one part of it (`part` is then set)."""

    job_id: str
    completions: list[Completion]
    prompt_token_count: int
    # The exact tokenisation when the job sent text, so a trainer needs no tokenizer to align.
    prompt_token_ids: list[int] | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    model: str = ""
    worker: str = ""
    timings: Timings | None = None
    # Absent from the wire (not null) when the result is whole, as it was before results split.
    part: Part | UnsetType = UNSET
    # The weight version the engine served when the job finished.
    weight_version: int | UnsetType = UNSET
    # Prompt tokens whose KV came from the engine's prefix cache instead of being computed
    # (vLLM's `RequestOutput.num_cached_tokens`): a turn served where the turns before it ran
    # has them cached. Absent when the engine does not say.
    cached_prompt_tokens: Annotated[int, Meta(ge=0)] | UnsetType = UNSET
    # The job's `submission_id`, when it had one: which sending of the job this answers.
    submission_id: SubmissionId | UnsetType = UNSET

    @property
    def is_part(self) -> bool:
        """Whether this record holds only some of the job's completions."""
        return self.part is not UNSET


class Failed(msgspec.Struct, frozen=True, kw_only=True, tag="failed", tag_field="type"):
    """A job that was answered without completions. `job_id` is None when it was unreadable."""

    job_id: str | None
    error: ErrorInfo
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    worker: str = ""
    # An `aborted` job's completions as far as they got (tokens, logprobs, routed experts by
    # vLLM's row rule), so a trainer doing partial rollouts can continue them: next prompt =
    # prompt + token_ids, `routed_experts_prompt_start` = that length - 1.
    partial: list[Completion] | UnsetType = UNSET
    prompt_token_count: int | UnsetType = UNSET
    weight_version: int | UnsetType = UNSET
    # The job's `submission_id`, when it had one and could be read (see `Completed`).
    submission_id: SubmissionId | UnsetType = UNSET


Result = Completed | Failed
