"""Where routed experts too large for any record go: a directory the trainers also mount.

A payload is written under a temporary name, flushed to disk and renamed, so a record never
names a file that is not whole; a crash leaves at most an orphan, which `payloads gc` removes
once it is old. Only `file://` is built in: RL clusters already share a filesystem for
checkpoints. An object store (`s3://`) would be a second class with the same two methods.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
import urllib.parse
from pathlib import Path
from typing import Final

from schemas.payloads import PayloadError, file_uri_path
from worker.core.errors import ConfigError

__all__ = ["FilePayloadStore", "PayloadStoreError", "open_payload_store", "parse_duration"]

logger = logging.getLogger(__name__)

# Names the worker writes: `gc` touches nothing else in the directory.
_PAYLOAD_NAME: Final = re.compile(r"^vkw-[0-9a-f]+-c\d+-[0-9a-f]{16}\.bin$")
_TEMP_NAME: Final = re.compile(r"^\.vkw-.*\.tmp$")
_DURATION: Final = re.compile(r"^(?P<value>\d+(?:\.\d+)?)(?P<unit>s|m|h|d)$")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class PayloadStoreError(Exception):
    """The store could not take a payload (unwritable, full, gone); the job may be retried."""


class FilePayloadStore:
    """Payloads as files in one directory, named by attempt, completion and content hash."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = root.as_uri()

    def put(self, attempt: str, index: int, data: bytes) -> tuple[str, str]:
        """Write `data` for completion `index` of `attempt`; its URI and SHA-256 (hex) once the
        file is whole on disk. Blocking (run it in a thread); PayloadStoreError on failure."""
        digest = hashlib.sha256(data).hexdigest()
        name = f"vkw-{attempt}-c{index}-{digest[:16]}.bin"
        final = self.root / name
        temp = self.root / f".{name}.{os.getpid()}.tmp"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with temp.open("wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            temp.replace(final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            raise PayloadStoreError(
                f"payload store {self.uri} could not take {len(data)} bytes: {exc}"
            ) from exc
        return final.as_uri(), digest

    def gc(self, older_than_s: float, *, now: float | None = None) -> tuple[int, int]:
        """Remove payloads (and orphaned temporary files) last written over `older_than_s` ago;
        (files removed, bytes freed)."""
        cutoff = (time.time() if now is None else now) - older_than_s
        removed = freed = 0
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return 0, 0
        for entry in entries:
            if not (_PAYLOAD_NAME.match(entry.name) or _TEMP_NAME.match(entry.name)):
                continue
            try:
                stat = entry.stat(follow_symlinks=False)
                if not entry.is_file(follow_symlinks=False) or stat.st_mtime >= cutoff:
                    continue
                Path(entry.path).unlink()
            except FileNotFoundError:
                continue  # another gc, or the worker renaming it: either way not ours now
            removed += 1
            freed += stat.st_size
        return removed, freed


def open_payload_store(uri: str) -> FilePayloadStore:
    """The store a `--payload-store` URI names; ConfigError for what cannot be one."""
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme != "file":
        raise ConfigError(
            f"--payload-store {uri!r}: only file:///absolute/dir is supported "
            f"(got scheme {scheme or 'none'!r})"
        )
    try:
        root = file_uri_path(uri)
    except PayloadError as exc:
        raise ConfigError(f"--payload-store: {exc}") from None
    return FilePayloadStore(root)


def parse_duration(text: str) -> float:
    """Seconds in a duration like `90s`, `30m`, `12h` or `7d`; ConfigError otherwise."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise ConfigError(
            f"duration {text!r}: expected a number and a unit, like 90s, 30m, 12h, 7d"
        )
    return float(match["value"]) * _UNIT_S[match["unit"]]
