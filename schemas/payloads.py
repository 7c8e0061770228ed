"""Payload references: routed experts kept outside the record, on storage the trainers share.

A completion whose routing alone is larger than a record may be carries, instead of `data`, a
`uri` to the raw bytes with their `sha256` and `nbytes`. This module reads `file://` references
(the shared filesystem RL clusters keep checkpoints on) and checks that the bytes are the ones
the record names. A record comes from whoever can write to the results topic, so a reader
confines what it reads to the store it was given (`root`).
"""

from __future__ import annotations

import hashlib
import os
import stat
import urllib.parse
import urllib.request
from pathlib import Path

from schemas.errors import RoutedExpertsError

__all__ = ["PayloadError", "file_uri_path", "payload_root", "read_payload"]


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
    if "\x00" in str(path):
        raise PayloadError(f"payload {uri!r}: the path holds a NUL byte")
    if not path.is_absolute():
        raise PayloadError(f"payload {uri!r}: the path must be absolute")
    return path


def payload_root(location: str | Path) -> Path:
    """The directory a reader confines payload reads to, from a path or a `file://` URI
    (`--payload-store`); PayloadError unless it is absolute."""
    text = str(location)
    path = file_uri_path(text) if text.startswith("file:") else Path(text)
    if not path.is_absolute():
        raise PayloadError(f"payload root {str(location)!r}: the path must be absolute")
    return Path(os.path.realpath(path))


def read_payload(uri: str, sha256: str, nbytes: int, *, root: Path | None = None) -> bytes:
    """The bytes `uri` names, after checking their length and SHA-256 against the record's.

    With `root` (see `payload_root`) only a file under it, symlinks resolved, is read; a record
    naming anything else fails before any file is touched. Only a regular file is read, and
    only when its size is `nbytes`: a FIFO, a device (`/dev/zero`) or a file of another size
    fails without a byte read. The errors name the URI and what the record says, never the
    size or digest of the file found, so a record cannot be used to learn about files.
    """
    path = file_uri_path(uri)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if root is not None:
        root = Path(os.path.realpath(root))
        resolved = Path(os.path.realpath(path))
        if not resolved.is_relative_to(root):
            raise PayloadError(
                f"payload {uri} is outside the payload root {root}: not read (a reader reads "
                "only the store it was given)"
            )
        # Resolved already: a symlink put in its place since is refused, not followed.
        path, flags = resolved, flags | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise PayloadError(
            f"payload {uri} is missing (removed by `payloads gc`, or the store is not mounted here)"
        ) from None
    except OSError as exc:
        raise PayloadError(f"payload {uri} cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PayloadError(f"payload {uri} is not a regular file: not read")
        if info.st_size != nbytes:
            raise PayloadError(f"payload {uri} was altered: its size is not the record's {nbytes}")
        try:
            data = file.read(nbytes + 1)  # one more: a file that grew since is caught too
        except OSError as exc:
            raise PayloadError(f"payload {uri} cannot be read: {exc.strerror}") from None
    if len(data) != nbytes:
        raise PayloadError(f"payload {uri} was altered: its size is not the record's {nbytes}")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise PayloadError(f"payload {uri} was altered: its sha256 is not the record's {sha256}")
    return data
