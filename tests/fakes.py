"""A scripted engine for service tests: each job's metadata says how it behaves."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from schemas import Job
from worker.engine import EngineOutput
from worker.errors import EngineDeadError, EngineError, InvalidJobError
from worker.mock_engine import MockEngine, MockEngineSettings


class ScriptedEngine:
    """The mock engine's outputs, with behaviour scripted by `job.metadata`:

    - `delay_s`: sleep that long first;
    - `gate`: wait until `release(name)` is called;
    - `fail`: `engine_error` | `engine_error_final` | `invalid` | `dead` | `bug`.

    It records what the worker did to it: peak concurrency, cancelled request ids, calls.
    """

    def __init__(
        self, settings: MockEngineSettings | None = None, max_concurrency: int = 8
    ) -> None:
        self._inner = MockEngine(
            settings or MockEngineSettings(num_layers=4, top_k=2, num_experts=8)
        )
        self._max_concurrency = max_concurrency
        self._gates: dict[str, asyncio.Event] = {}
        self.running = 0
        self.peak_running = 0
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.closed = False
        self.healthy = True
        self.on_start: Callable[[Job], None] | None = None

    @property
    def model_name(self) -> str:
        return "scripted"

    @property
    def max_concurrency(self) -> int:
        return self._max_concurrency

    @property
    def supports_routed_experts(self) -> bool:
        return True

    def gate(self, name: str) -> asyncio.Event:
        return self._gates.setdefault(name, asyncio.Event())

    def release(self, name: str) -> None:
        self.gate(name).set()

    async def start(self) -> None:
        await self._inner.start()

    async def generate(self, job: Job, request_id: str) -> EngineOutput:
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        self.started.append(job.job_id)
        if self.on_start is not None:
            self.on_start(job)
        try:
            meta = job.metadata
            if "delay_s" in meta:
                await asyncio.sleep(float(meta["delay_s"]))
            if "gate" in meta:
                await self.gate(meta["gate"]).wait()
            match meta.get("fail"):
                case "engine_error":
                    raise EngineError("scripted transient failure")
                case "engine_error_final":
                    raise EngineError("scripted permanent failure", retryable=False)
                case "invalid":
                    raise InvalidJobError("scripted validation failure")
                case "dead":
                    raise EngineDeadError("scripted engine death")
                case "bug":
                    raise RuntimeError("scripted bug")
            return await self._inner.generate(job, request_id)
        except asyncio.CancelledError:
            self.cancelled.append(job.job_id)
            raise
        finally:
            self.running -= 1

    async def abort(self, request_id: str) -> None:
        return

    async def check_health(self) -> None:
        if not self.healthy:
            raise EngineDeadError("scripted: engine reported unhealthy")

    async def close(self) -> None:
        self.closed = True
