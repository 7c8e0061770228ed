"""A process's resident memory, sampled in the background against the run's progress."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Final, Self

import psutil

from worker.dev.harness.background import InBackground

MiB: Final = 1024 * 1024


def mib(n: int) -> str:
    return f"{n / MiB:.0f}MiB"


class RssSampler(InBackground):
    """Samples a process's RSS in the background, each sample tagged with `progress()`."""

    def __init__(self, pid: int, progress: Callable[[], int], interval_s: float = 0.1) -> None:
        self._process = psutil.Process(pid)
        self._progress = progress
        self._interval_s = interval_s
        self.samples: list[tuple[int, int]] = []  # (progress, rss bytes)

    async def __aenter__(self) -> Self:
        self._run_in_background(self._run())
        return self

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(psutil.Error):
                self.samples.append((self._progress(), self._process.memory_info().rss))
            await asyncio.sleep(self._interval_s)

    @property
    def peak(self) -> int:
        return max((rss for _, rss in self.samples), default=0)

    def peaks_by_quarter(self, total: int) -> list[int]:
        """Peak RSS while progress was in each quarter of `total` (0 for an unsampled quarter)."""
        peaks = [0, 0, 0, 0]
        for progress, rss in self.samples:
            quarter = min(progress * 4 // max(total, 1), 3)
            peaks[quarter] = max(peaks[quarter], rss)
        return peaks
