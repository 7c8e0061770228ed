"""Wire types shared by job producers, the worker and trainers (needs only msgspec and numpy)."""

from schemas.assembler import Incomplete, ResultAssembler, merge_parts
from schemas.codec import decode_job, decode_result, encode, peek_job_id
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
)
from schemas.routed_experts import RoutedExperts

__all__ = [
    "Completed",
    "Completion",
    "ErrorCode",
    "ErrorInfo",
    "Failed",
    "Incomplete",
    "Job",
    "Part",
    "PayloadError",
    "Result",
    "ResultAssembler",
    "RoutedExperts",
    "RoutedExpertsError",
    "SamplingSpec",
    "SchemaError",
    "Timings",
    "decode_job",
    "decode_result",
    "encode",
    "merge_parts",
    "peek_job_id",
]
