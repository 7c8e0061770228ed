"""Workers for tests on a real broker: in-process (`start_worker`) and as a real process (`spawn`).

The fixtures are registered in `conftest.py`, so any test module can ask for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from tests.fakes import ScriptedEngine
from tests.kafka_helpers import committed, wait_for
from worker.build import Service, build_worker
from worker.core.config import Settings, settings_from
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.protocol import ControllableEngine
from worker.loop.worker import Worker

#: The in-flight cap of spawned workers: what one crash may repeat at most.
MAX_IN_FLIGHT = 32
_REPO = Path(__file__).resolve().parent.parent


@dataclass
class Topics:
    jobs: str
    results: str
    dlq: str
    group: str = field(default_factory=lambda: f"group-{uuid.uuid4().hex[:8]}")
    #: The static member id of spawned workers: a restart with it takes the partitions back.
    instance: str = field(default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}")


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


async def make_topics(
    new_topic: Any,
    *,
    jobs_partitions: int = 1,
    results_partitions: int = 1,
    results_configs: dict[str, str] | None = None,
    bootstrap_servers: str | None = None,
) -> Topics:
    """Fresh jobs, results and dead-letter topics (on the shared broker unless told otherwise)."""
    on = {"bootstrap_servers": bootstrap_servers}
    return Topics(
        jobs=await new_topic(jobs_partitions, **on),
        results=await new_topic(results_partitions, configs=results_configs, **on),
        dlq=await new_topic(1, **on),
    )


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
class Fleet:
    """Topics for workers steered by a control plane: jobs, results, dead letters, control,
    status (one partition each)."""

    topics: Topics
    control: str
    status: str


async def make_fleet(new_topic: Any, jobs_partitions: int = 1) -> Fleet:
    return Fleet(
        topics=await make_topics(new_topic, jobs_partitions=jobs_partitions),
        control=await new_topic(1),
        status=await new_topic(1),
    )


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
    for handle in running:
        if not handle.task.done():
            handle.service.request_stop()
            await asyncio.wait_for(handle.task, timeout_s)


async def committed_is(bs: str, topics: Topics, expected: dict[int, int]) -> bool:
    return await committed(bs, topics.group, topics.jobs) == expected


class WorkerProcess:
    """`python -m worker serve --engine mock ...` in a subprocess, stderr to a file."""

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        log: Path,
        env: dict[str, str] | None = None,
        **flags: Any,
    ) -> None:
        args = {
            "bootstrap-servers": bootstrap,
            "jobs-topic": topics.jobs,
            "results-topic": topics.results,
            "dead-letter-topic": topics.dlq,
            "group-id": topics.group,
            "group-instance-id": topics.instance,
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
        args.update({k.replace("_", "-"): v for k, v in flags.items()})
        argv = [sys.executable, "-m", "worker", "serve"]
        for name, value in args.items():
            if value is None:  # None leaves a setting at its default (e.g. no instance id)
                continue
            if isinstance(value, bool):
                argv.append(f"--{name}" if value else f"--no-{name}")
            else:
                argv += [f"--{name}", str(value)]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("VKW_")}
        env = {**clean, **(env or {})}
        self.log = log
        self._log_file = log.open("ab")
        self.proc = subprocess.Popen(
            argv, cwd=_REPO, env=env, stdout=self._log_file, stderr=subprocess.STDOUT
        )

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

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

    def stop_now(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()


async def stop_all(workers: Iterable[WorkerProcess], timeout_s: float) -> None:
    """SIGTERM every worker still running, give each `timeout_s` to drain and exit, then kill
    whatever is left."""
    workers = list(workers)
    for worker in workers:
        if worker.proc.poll() is None:
            worker.signal(signal.SIGTERM)
    for worker in workers:
        with contextlib.suppress(AssertionError):
            await worker.wait(timeout_s)
        worker.stop_now()


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
