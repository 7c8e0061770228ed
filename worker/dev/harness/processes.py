"""`python -m worker serve` as a real process, started and stopped the way a user would."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

import psutil

from worker.dev.harness.topics import Topics

#: The in-flight cap of spawned workers: what one crash may repeat at most.
MAX_IN_FLIGHT: Final = 32

#: The flags a test worker starts with unless told otherwise: the mock engine, quick polls,
#: commits and group timing.
MOCK_WORKER_FLAGS: Final[Mapping[str, object]] = {
    "engine": "mock",
    "max-in-flight": MAX_IN_FLIGHT,
    "commit-interval-ms": 0,
    "poll-timeout-ms": 50,
    "session-timeout-ms": 6000,
    "heartbeat-interval-ms": 500,
    "shutdown-grace-s": 10,
    "mock-per-token-latency-ms": 50,
    "mock-num-layers": 4,
}

_REPO: Final = Path(__file__).resolve().parents[3]
_METRICS_LINE: Final = re.compile(rb"metrics on http://[^:/]+:(\d+)/metrics")


class WorkerProcess:
    """`python -m worker serve ...` in a subprocess, its output to `log`.

    `flags` (Python names: `max_in_flight=4` is `--max-in-flight 4`; True and False are
    `--x`/`--no-x`; None leaves a setting at its default) go over `base_flags`. `engine_args`
    follow a `--` (vLLM's own arguments). With `fetch_hold_s` the worker runs through
    `worker.dev.held_fetches`, its empty fetches held that long (`wake_held_fetches` ends the
    holds). The worker's environment drops this process's `VKW_*` settings unless
    `inherit_settings`, so a developer's shell does not change what a test runs.
    """

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        log: Path,
        env: Mapping[str, str] | None = None,
        *,
        base_flags: Mapping[str, object] = MOCK_WORKER_FLAGS,
        engine_args: Sequence[str] = (),
        fetch_hold_s: float | None = None,
        inherit_settings: bool = False,
        **flags: object,
    ) -> None:
        args: dict[str, object] = {
            "bootstrap-servers": bootstrap,
            "jobs-topic": topics.jobs,
            "results-topic": topics.results,
            "dead-letter-topic": topics.dlq,
            "group-id": topics.group,
            "group-instance-id": topics.instance,
            **base_flags,
        }
        args.update({k.replace("_", "-"): v for k, v in flags.items()})
        argv = [sys.executable, "-m", "worker", "serve"]
        if fetch_hold_s is not None:
            argv[2:3] = ["worker.dev.held_fetches", str(fetch_hold_s)]
        for name, value in args.items():
            if value is None:  # None leaves a setting at its default (e.g. no instance id)
                continue
            if isinstance(value, bool):
                argv.append(f"--{name}" if value else f"--no-{name}")
            else:
                argv += [f"--{name}", str(value)]
        if engine_args:
            argv += ["--", *engine_args]
        inherited = {
            k: v for k, v in os.environ.items() if inherit_settings or not k.startswith("VKW_")
        }
        self.log = log
        self.holds_fetches = fetch_hold_s is not None
        self._fixed_metrics_port = _fixed_port(args.get("metrics-port"))
        self._metrics_port: int | None = None
        self._log_file = log.open("ab")
        self.proc = subprocess.Popen(
            argv,
            cwd=_REPO,
            env={**inherited, **(env or {})},
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        #: The process, for its CPU times, threads, nice value and children.
        self.ps = psutil.Process(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wake_held_fetches(self) -> None:
        """Records were produced: a Kafka broker would answer the held fetches now."""
        if self.holds_fetches:
            self.signal(signal.SIGUSR1)

    async def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while (rc := self.proc.poll()) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"worker still running after {timeout_s}s; log {self.log}")
            await asyncio.sleep(0.02)
        self._log_file.close()
        return rc

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    async def metrics_port(self, timeout_s: float = 30.0) -> int:
        """The port of its /metrics: the one it was given, or the one it bound with
        `--metrics-port 0`, read from its log (and kept: it is this process's)."""
        if self._fixed_metrics_port is not None:
            return self._fixed_metrics_port
        if self._metrics_port is None:
            deadline = time.monotonic() + timeout_s
            while not (match := _METRICS_LINE.search(await asyncio.to_thread(self._log_bytes))):
                if time.monotonic() > deadline:
                    raise AssertionError(f"no metrics port in {self.log} after {timeout_s}s")
                await asyncio.sleep(0.05)
            self._metrics_port = int(match[1])
        return self._metrics_port

    async def metrics_url(self, timeout_s: float = 30.0) -> str:
        return f"http://127.0.0.1:{await self.metrics_port(timeout_s)}/metrics"

    def stop_now(self) -> None:
        """Kill it and whatever it started (vLLM's engine processes) at once."""
        if self.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                for child in self.ps.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM, `timeout_s` to drain and exit, then kill what is left."""
        await stop_all([self], timeout_s)

    def _log_bytes(self) -> bytes:
        return self.log.read_bytes() if self.log.exists() else b""


async def stop_all(workers: Iterable[WorkerProcess], timeout_s: float) -> None:
    """SIGTERM every worker still running, give each `timeout_s` to drain and exit, then kill
    whatever is left."""
    workers = list(workers)
    for worker in workers:
        if worker.alive():
            worker.signal(signal.SIGTERM)
    for worker in workers:
        with contextlib.suppress(AssertionError):
            await worker.wait(timeout_s)
        worker.stop_now()


def _fixed_port(value: object) -> int | None:
    port = int(str(value)) if value is not None else 0
    return port or None
