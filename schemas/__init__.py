"""Wire types shared by job producers, the worker and trainers (needs only msgspec and numpy)."""

from schemas.codec import decode_job, decode_result, encode, peek_job_id
from schemas.errors import RoutedExpertsError, SchemaError
from schemas.jobs import Job, SamplingSpec
from schemas.results import Completed, Completion, ErrorCode, ErrorInfo, Failed, Result, Timings
from schemas.routed_experts import RoutedExperts

__all__ = [
    "Completed",
    "Completion",
    "ErrorCode",
    "ErrorInfo",
    "Failed",
    "Job",
    "Result",
    "RoutedExperts",
    "RoutedExpertsError",
    "SamplingSpec",
    "SchemaError",
    "Timings",
    "decode_job",
    "decode_result",
    "encode",
    "peek_job_id",
]
