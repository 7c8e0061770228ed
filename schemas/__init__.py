"""Wire types shared by job producers, the worker and trainers (needs only msgspec and numpy)."""

from schemas.assembler import Incomplete, ResultAssembler, merge_parts
from schemas.codec import decode_job, decode_result, encode, peek_job_id
from schemas.control import (
    Abort,
    Command,
    CommandAck,
    ControlRecordError,
    InflightMode,
    Pause,
    PauseMode,
    ResetPrefixCache,
    Resume,
    StatusMessage,
    Target,
    UpdateWeights,
    WorkerStatus,
    decode_command,
    decode_status,
)
from schemas.errors import RoutedExpertsError, SchemaError
from schemas.jobs import Job, SamplingSpec
from schemas.payloads import PayloadError
from schemas.results import (
    Completed,
    Completion,
    ErrorCode,
    ErrorInfo,
    Failed,
    Part,
    Result,
    Timings,
    VersionSpan,
)
from schemas.routed_experts import RoutedExperts

__all__ = [
    "Abort",
    "Command",
    "CommandAck",
    "Completed",
    "Completion",
    "ControlRecordError",
    "ErrorCode",
    "ErrorInfo",
    "Failed",
    "Incomplete",
    "InflightMode",
    "Job",
    "Part",
    "Pause",
    "PauseMode",
    "PayloadError",
    "ResetPrefixCache",
    "Result",
    "ResultAssembler",
    "Resume",
    "RoutedExperts",
    "RoutedExpertsError",
    "SamplingSpec",
    "SchemaError",
    "StatusMessage",
    "Target",
    "Timings",
    "UpdateWeights",
    "VersionSpan",
    "WorkerStatus",
    "decode_command",
    "decode_job",
    "decode_result",
    "decode_status",
    "encode",
    "merge_parts",
    "peek_job_id",
]
