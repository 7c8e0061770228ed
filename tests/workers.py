"""Fixtures for workers on a real broker: in-process (`start_worker`, `start_steered`) and as a
real process (`spawn`, a `worker.dev.harness.processes.WorkerProcess`).

The fixtures are registered in `conftest.py`, so any test module can ask for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from tests.fakes import ScriptedEngine
from worker.build import Service, build_worker
from worker.core.config import Settings, settings_from
from worker.dev.harness.processes import WorkerProcess
from worker.dev.harness.topics import Fleet, Topics
from worker.dev.harness.waiting import wait_for
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.protocol import ControllableEngine
from worker.loop.worker import Worker


@dataclass
class Running:
    """A worker built as `serve` builds it (`build_worker`), running in this process."""

    service: Service
    #: The engine the test gave (a ScriptedEngine unless the test gave another).
    engine: Any
    task: asyncio.Task[int]
    settings: Settings

    @property
    def worker(self) -> Worker:
        return self.service.worker

    async def serving(self, timeout_s: float = 300) -> None:
        """Until the engine is up and the worker holds its partitions. A vLLM engine is built
        on the event loop the test shares: a client started meanwhile may time out."""
        await wait_for(lambda: self.service.ready, timeout_s, "the worker to serve")

    async def stop(self) -> int:
        self.service.request_stop()
        return await asyncio.wait_for(self.task, 60)


def worker_settings(bootstrap: str, topics: Topics, **overrides: Any) -> Settings:
    """A test worker's settings: the mock engine, quick polls, commits and group timing."""
    values: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "jobs_topic": topics.jobs,
        "results_topic": topics.results,
        "dead_letter_topic": topics.dlq,
        "group_id": topics.group,
        "engine": "mock",
        "commit_interval_ms": 0,
        "poll_timeout_ms": 50,
        "shutdown_grace_s": 5,
        "revoke_grace_s": 2,
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 500,
        **overrides,
    }
    return settings_from(values, {})


@pytest.fixture
async def start_worker(kafka_bootstrap_servers: str) -> AsyncIterator[Callable[..., Any]]:
    """Start a worker without a control plane, on a `ScriptedEngine` unless given another."""
    running: list[Running] = []

    async def start(
        topics: Topics,
        engine: Any = None,
        wrap_producer: Callable[[AIOKafkaProducer], Any] | None = None,
        topic_limits: dict[str, int | None] | None = None,
        **overrides: Any,
    ) -> Running:
        settings = worker_settings(kafka_bootstrap_servers, topics, **overrides)
        engine = engine or ScriptedEngine()
        service = await build_worker(
            settings,
            engine,
            steered=False,
            topic_limits=topic_limits,
            wrap_producer=wrap_producer,
        )
        handle = Running(service, engine, asyncio.create_task(service.run()), settings)
        running.append(handle)
        return handle

    yield start
    await _stop_all(running, 60)


@dataclass
class Steered(Running):
    """A worker with a control plane, as `serve` runs it: `engine` is the `SteerableEngine`."""

    #: The engine under the control plane (a MockEngine unless the test gave another).
    inner: Any


@pytest.fixture
async def start_steered(
    kafka_bootstrap_servers: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Callable[..., Any]]:
    """Start a worker with a control plane, as `serve` runs it, on the mock engine. Weight
    updates may load checkpoints under the session's temporary directory (`--weights-root`),
    where `tmp_path` and `tmp_path_factory` put them."""
    weights_root = str(tmp_path_factory.getbasetemp())
    running: list[Steered] = []

    async def start(
        fleet: Fleet,
        worker_id: str,
        *,
        group: str | None = None,
        jobs_topic: str | None = None,
        mock: MockEngineSettings | None = None,
        engine: ControllableEngine | None = None,
        **overrides: Any,
    ) -> Steered:
        settings = worker_settings(
            kafka_bootstrap_servers,
            fleet.topics,
            **{
                "jobs_topic": jobs_topic or fleet.topics.jobs,
                "control_topic": fleet.control,
                "status_topic": fleet.status,
                "group_id": group or fleet.topics.group,
                "worker_id": worker_id,
                "status_interval_s": 0.5,
                **(
                    {}
                    if "allow_any_weights_path" in overrides
                    else {"weights_root": [weights_root]}
                ),
                **overrides,
            },
        )
        inner = engine or MockEngine(
            mock or MockEngineSettings(num_layers=4, top_k=2, num_experts=8)
        )
        service = await build_worker(settings, inner)
        task = asyncio.create_task(service.run())
        handle = Steered(service, service.engine, task, settings, inner)
        running.append(handle)
        return handle

    yield start
    await _stop_all(running, 120)


async def _stop_all(running: Sequence[Running], timeout_s: float) -> None:
    """Stop every worker still running, all at once: stopped one after another, each leave is
    a rebalance the next worker stops in the middle of, and on a loaded machine its close
    outlasted --close-timeout-s and left the consumer's connections open."""
    live = [handle for handle in running if not handle.task.done()]
    for handle in live:
        handle.service.request_stop()
    await asyncio.wait_for(asyncio.gather(*(handle.task for handle in live)), timeout_s)


@pytest.fixture
def spawn(kafka_bootstrap_servers: str, tmp_path: Path) -> Iterator[Any]:
    started: list[WorkerProcess] = []

    def start(
        topics: Topics,
        bootstrap: str | None = None,
        env: dict[str, str] | None = None,
        **flags: Any,
    ) -> WorkerProcess:
        worker = WorkerProcess(
            bootstrap or kafka_bootstrap_servers,
            topics,
            tmp_path / f"worker-{len(started)}.log",
            env,
            **flags,
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop_now()
