"""The history of a run: every event the clients and the cluster saw, stamped with virtual time.

The checker reads it afterwards, as Jepsen's Kafka checker reads a history of sends and polls
(jepsen-io/jepsen `jepsen/src/jepsen/tests/kafka.clj`); the runner prints it up to a violation.
Two runs of one seed give the same history, byte for byte: its digest is compared by a test.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Event", "History"]


@dataclass(frozen=True)
class Event:
    at: float
    kind: str
    fields: dict[str, Any]

    def line(self) -> str:
        detail = " ".join(f"{k}={_short(v)}" for k, v in self.fields.items())
        return f"{self.at:10.3f} {self.kind:<16} {detail}"


class History:
    """Append-only events; `clock()` stamps them (seconds of virtual time)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.events: list[Event] = []
        #: Once closed (the run is over and checked), nothing more is recorded.
        self.closed = False
        #: How many times each path of the worker worth reaching ran (`count`): kept beside
        #: the events, out of the digest, so that counting one more path replays every seed.
        self.paths: Counter[str] = Counter()

    def count(self, path: str, times: int = 1) -> None:
        if not self.closed and times:
            self.paths[path] += times

    def add(self, kind: str, **fields: Any) -> None:
        if self.closed:
            return
        self.events.append(Event(round(self._clock(), 6), kind, fields))

    def of(self, *kinds: str) -> Iterator[Event]:
        return (e for e in self.events if e.kind in kinds)

    def digest(self) -> str:
        sha = hashlib.sha256()
        for event in self.events:
            sha.update(
                json.dumps(
                    [event.at, event.kind, event.fields], sort_keys=True, default=str
                ).encode()
            )
        return sha.hexdigest()

    def lines(self, until: float | None = None) -> Iterator[str]:
        for event in self.events:
            if until is not None and event.at > until:
                return
            yield event.line()


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
