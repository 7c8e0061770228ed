"""Payload references: routed experts kept outside the record, on storage the trainers share.

A completion whose routing alone is larger than a record may be carries, instead of `data`, a
`uri` to the raw bytes with their `sha256` and `nbytes`. This module reads `file://` references
(the shared filesystem RL clusters keep checkpoints on) and checks that the bytes are the ones
the record names.
"""

from __future__ import annotations

import hashlib
import urllib.parse
import urllib.request
from pathlib import Path

from schemas.errors import RoutedExpertsError

__all__ = ["PayloadError", "file_uri_path", "read_payload"]


class PayloadError(RoutedExpertsError):
    """A payload reference cannot be resolved: missing, altered, or of an unknown scheme."""


def file_uri_path(uri: str) -> Path:
    """The local path of a `file://` URI (absolute, percent-decoded); PayloadError otherwise."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme != "file":
        raise PayloadError(
            f"payload {uri!r}: only file:// references can be read here; fetch other schemes "
            "yourself and check `sha256`"
        )
    if parsed.netloc not in ("", "localhost"):
        raise PayloadError(f"payload {uri!r}: a file:// URI must name a local path, not a host")
    path = Path(urllib.request.url2pathname(parsed.path))
    if not path.is_absolute():
        raise PayloadError(f"payload {uri!r}: the path must be absolute")
    return path


def read_payload(uri: str, sha256: str, nbytes: int) -> bytes:
    """The bytes `uri` names, after checking their length and SHA-256 against the record's."""
    path = file_uri_path(uri)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PayloadError(
            f"payload {uri} is missing: no file at {path} (removed by `payloads gc`, or the "
            "store is not mounted here)"
        ) from None
    except OSError as exc:
        raise PayloadError(f"payload {uri} cannot be read: {exc}") from None
    if len(data) != nbytes:
        raise PayloadError(
            f"payload {uri} was altered: it is {len(data)} bytes, the record says {nbytes}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise PayloadError(
            f"payload {uri} was altered: its sha256 is {digest}, the record says {sha256}"
        )
    return data
