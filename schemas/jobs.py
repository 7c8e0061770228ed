"""Generation jobs, as producers write them to the jobs topic."""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
from msgspec import Meta

__all__ = [
    "MAX_JOB_ID_CHARS",
    "MAX_METADATA_ENTRIES",
    "MAX_N",
    "MAX_PROMPT_CHARS",
    "MAX_PROMPT_TOKENS",
    "MAX_SESSION_ID_CHARS",
    "MAX_SUBMISSION_ID_CHARS",
    "Job",
    "SamplingSpec",
]

MAX_JOB_ID_CHARS: Final = 256
MAX_SESSION_ID_CHARS: Final = 256
MAX_SUBMISSION_ID_CHARS: Final = 64
MAX_PROMPT_CHARS: Final = 4 * 1024 * 1024
MAX_PROMPT_TOKENS: Final = 1024 * 1024
MAX_N: Final = 128
MAX_TOKENS: Final = 1024 * 1024
MAX_STOP_STRINGS: Final = 16
MAX_STOP_STRING_CHARS: Final = 1024
MAX_STOP_TOKEN_IDS: Final = 1024
MAX_LOGPROBS: Final = 20
MAX_METADATA_ENTRIES: Final = 64
MAX_METADATA_KEY_CHARS: Final = 256
MAX_METADATA_VALUE_CHARS: Final = 8192

TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Metadata = Annotated[
    dict[
        Annotated[str, Meta(max_length=MAX_METADATA_KEY_CHARS)],
        Annotated[str, Meta(max_length=MAX_METADATA_VALUE_CHARS)],
    ],
    Meta(max_length=MAX_METADATA_ENTRIES),
]


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The `vllm.SamplingParams` fields a trainer uses, with vLLM's names and defaults.

    Limits live here so that a bad value fails at decode time with the field's path.
    """

    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] | None = 16
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    # 0 and -1 both mean "no top-k cut", as in vLLM.
    top_k: Annotated[int, Meta(ge=-1, le=1_000_000)] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    # Number of top logprobs vLLM computes per token; results carry the sampled token's logprob.
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list, whichever form the producer used."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One generation request. Exactly one of `prompt` and `prompt_token_ids` is set.

    `routed_experts_prompt_start` skips that many leading prompt rows (vLLM's parameter of the
    same name): in a multi-turn rollout, turn 2 sets it to the length of turn 1's prompt plus
    output minus one, so turn 1's rows followed by turn 2's rows equal a fresh full run.
    Its turns share a `session_id`, so they are served where the earlier turns are cached.
    """

    job_id: Annotated[str, Meta(min_length=1, max_length=MAX_JOB_ID_CHARS)]
    prompt: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    prompt_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)] | None = None
    sampling: SamplingSpec = msgspec.field(default_factory=SamplingSpec)
    return_routed_experts: bool = False
    routed_experts_prompt_start: Annotated[int, Meta(ge=0, le=MAX_PROMPT_TOKENS)] = 0
    # The conversation this job is a turn of: the record key when set, so every turn of it goes
    # to one partition and so to the worker whose prefix cache holds the turns before it.
    session_id: Annotated[str, Meta(min_length=1, max_length=MAX_SESSION_ID_CHARS)] | None = None
    metadata: Metadata = msgspec.field(default_factory=dict)
    # Unix seconds; a job still queued past it is answered `expired` instead of being run.
    deadline: float | None = None
    # The oldest weights this job may run on: a worker below it holds the job (keeping its
    # partition's place) until a weight update reaches it, or `deadline` expires the job.
    min_weight_version: Annotated[int, Meta(ge=0)] | None = None
    # The topic the answer goes to instead of the worker's results topic (many trainers, one
    # fleet); the worker answers it only if its --reply-topics allows it.
    reply_to: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,249}$")] | None = None
    # Names this sending of the job; its results echo it. A job id sent again (a re-run turn,
    # a restarted trainer, a second trainer) gets a new one, so its sender tells the answer to
    # this sending from a late answer to an earlier one under the same id.
    submission_id: Annotated[str, Meta(min_length=1, max_length=MAX_SUBMISSION_ID_CHARS)] | None = (
        None
    )

    @property
    def record_key(self) -> bytes:
        """The Kafka key this job is produced with: its `session_id`, else its `job_id`.

        A key picks the partition, and a partition has one owner in the group: the turns of a
        session reach the same worker, and after a rebalance the partition's next owner."""
        return (self.session_id or self.job_id).encode()

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("exactly one of `prompt` or `prompt_token_ids` must be set")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("`prompt_token_ids` must not be empty")
