"""Helpers for the process-level chaos tests: metrics scraping, RSS sampling, spread producing,
and the history checker."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aiokafka import AIOKafkaProducer

from tests.kafka_helpers import Record

MiB = 1024 * 1024

_METRICS_LINE = re.compile(rb"metrics on http://[^:/]+:(\d+)/metrics")


async def metrics_port(log: Path, timeout_s: float = 30.0) -> int:
    """The port a worker started with `--metrics-port 0` bound, read from its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if match := _METRICS_LINE.search(await asyncio.to_thread(_read, log)):
            return int(match[1])
        await asyncio.sleep(0.05)
    raise AssertionError(f"no metrics port in {log} after {timeout_s}s")


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


class Scraper:
    """Reads a worker's /metrics as {series: value}; `series` is the name with its labels."""

    def __init__(self, port: int) -> None:
        self._url = f"http://127.0.0.1:{port}/metrics"
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Scraper:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._http is not None
        await self._http.close()

    async def sample(self) -> dict[str, float]:
        assert self._http is not None
        async with self._http.get(self._url) as response:
            text = await response.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                out[series] = float(value)
        return out

    async def value(self, series: str) -> float | None:
        return (await self.sample()).get(series)


class InBackground:
    """An async context that runs one task while it is open and cancels it on exit."""

    _task: asyncio.Task[None] | None = None

    def _run_in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.create_task(coroutine)

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class RssSampler(InBackground):
    """Samples a process's RSS in the background, each sample tagged with `progress()`."""

    def __init__(self, pid: int, progress: Callable[[], int], interval_s: float = 0.1) -> None:
        self._process = psutil.Process(pid)
        self._progress = progress
        self._interval_s = interval_s
        self.samples: list[tuple[int, int]] = []  # (progress, rss bytes)

    async def __aenter__(self) -> RssSampler:
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


async def produce_spread(
    bootstrap: str, topic: str, records: Iterable[Record], partitions: int
) -> None:
    """Produce record i to partition i % partitions: an exactly even load, whatever the keys."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        futures = [
            await producer.send(
                topic, value=value, key=key, headers=headers, partition=i % partitions
            )
            for i, (key, value, headers) in enumerate(records)
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def mib(n: int) -> str:
    return f"{n / MiB:.0f}MiB"


@dataclass
class History:
    """What a chaos test did and saw, checked in the manner of Jepsen's Kafka workload.

    `produced` are the job ids written to the jobs topic, `answers` every job id read back from
    the results topic (in order, repeats kept), `dead_lettered` the job ids copied to the
    dead-letter topic, `kills` the worker processes the test killed. A job is lost when it has
    neither a result nor a dead-letter copy; every answer beyond a job's first is a duplicate.
    """

    produced: set[str] = field(default_factory=set)
    answers: list[str] = field(default_factory=list)
    dead_lettered: set[str] = field(default_factory=set)
    kills: int = 0

    @property
    def lost(self) -> set[str]:
        return self.produced - set(self.answers) - self.dead_lettered

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in Counter(self.answers).values())

    def check(self) -> int:
        """Assert nothing was lost; return the duplicates."""
        assert not self.lost, f"{len(self.lost)} jobs lost, e.g. {sorted(self.lost)[:5]}"
        return self.duplicates
