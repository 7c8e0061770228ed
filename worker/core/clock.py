"""Where a worker's time comes from: one `Clock`, passed at build and handed to everything that
reads the time.

The system's by default. The simulation (`worker.dev.sim`) passes its virtual clock, so the
code under it runs unchanged and nothing captured before the run keeps reading real time:
TigerBeetle and FoundationDB run their production state machines under simulation the same way,
with time behind an interface.
"""

from __future__ import annotations

import time
from typing import Final, Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


class Clock(Protocol):
    """Two readings of one clock: seconds that only go forward, for timeouts and ages inside
    a process; and seconds since the epoch, for instants that other processes compare (a
    command's `issued_at`, a job's deadline, a status's `at`)."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary start, never going back (`time.monotonic`)."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch (`time.time`)."""
        ...


class SystemClock:
    """The machine's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


#: The clock everything reads unless it is given another.
SYSTEM_CLOCK: Final = SystemClock()
