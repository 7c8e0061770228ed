"""Encoding and decoding, with decoders built once and one exception type for bad input."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from schemas.errors import SchemaError
from schemas.jobs import MAX_JOB_ID_CHARS, Job
from schemas.results import Completed, Failed, Result

__all__ = ["as_job", "decode_job", "decode_result", "encode", "peek_job_id", "peek_reply_to"]


class _JobIdOnly(msgspec.Struct):
    job_id: str


class _ReplyToOnly(msgspec.Struct):
    reply_to: str | None = None


_ENCODER: Final = msgspec.json.Encoder()
_JOB_DECODER: Final = msgspec.json.Decoder(Job)
_RESULT_DECODER: Final = msgspec.json.Decoder(Completed | Failed)
_JOB_ID_DECODER: Final = msgspec.json.Decoder(_JobIdOnly)
_REPLY_TO_DECODER: Final = msgspec.json.Decoder(_ReplyToOnly)
# What `Job.reply_to` accepts: a Kafka topic name.
_TOPIC_NAME: Final = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
# msgspec ends validation messages with " - at `$.sampling.n`" (" - at `key` in `$.metadata`"
# when a dict key is bad); the path is what callers want.
_PATH: Final = re.compile(r" - at (?P<key>`key` in )?`(?P<path>[^`]*)`$")


def encode(obj: Any) -> bytes:
    """Encode a job, a result or any msgspec-supported value as compact JSON."""
    return _ENCODER.encode(obj)


def decode_job(data: bytes | str) -> Job:
    """Decode and validate one job; raise `SchemaError` naming the bad field."""
    try:
        return _JOB_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise _schema_error(exc) from None
    except msgspec.DecodeError as exc:
        raise SchemaError(f"not a JSON job: {exc}") from None
    except RecursionError:
        # msgspec gives up on deep nesting with RecursionError, not DecodeError.
        raise SchemaError("not a JSON job: nested too deeply") from None


def as_job(job: Job | Mapping[str, Any]) -> Job:
    """`job` (a `Job`, or a mapping of its fields) checked as a worker will check it on the
    wire: constructing a Struct in Python checks no constraint, decoding does. Raises
    `SchemaError` naming the bad field."""
    try:
        data = _ENCODER.encode(job)
    except (TypeError, msgspec.EncodeError) as exc:
        raise SchemaError(f"not a job: {exc}") from None
    return decode_job(data)


def decode_result(data: bytes | str) -> Result:
    """Decode and validate one result; raise `SchemaError` naming the bad field."""
    try:
        return _RESULT_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise _schema_error(exc) from None
    except msgspec.DecodeError as exc:
        raise SchemaError(f"not a JSON result: {exc}") from None
    except RecursionError:
        raise SchemaError("not a JSON result: nested too deeply") from None


def peek_job_id(data: bytes | str) -> str | None:
    """The `job_id` of a record that failed validation, if one can be read at all."""
    try:
        job_id = _JOB_ID_DECODER.decode(data).job_id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    # An id the schema would reject is not echoed: it could be megabytes long.
    return job_id if 0 < len(job_id) <= MAX_JOB_ID_CHARS else None


def peek_reply_to(data: bytes | str) -> str | None:
    """The `reply_to` of a record that failed validation, if one can be read and is a topic
    name, so that the answer to a record that is not a valid job still goes where its
    producer waits for it."""
    try:
        reply_to = _REPLY_TO_DECODER.decode(data).reply_to
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return reply_to if reply_to is not None and _TOPIC_NAME.fullmatch(reply_to) else None


def _schema_error(exc: msgspec.ValidationError) -> SchemaError:
    message = str(exc)
    match = _PATH.search(message)
    if match is None:
        return SchemaError(message, "$")
    suffix = " (in a key)" if match["key"] else ""
    return SchemaError(message[: match.start()] + suffix, match["path"])
