"""The fleet: worker processes built as `worker.build.build_worker` builds them, on simulated
clients and the mock engine, started, stopped, killed and restarted on the virtual clock.

The worker code is the real one. What differs from `serve`: the clients (`worker.dev.sim.
clients`), the clocks (`worker.dev.sim.clock`), the process's random incarnation (drawn from the
run's generator), and a kill, which silences the process's clients and cancels its tasks
without letting it run anything more against the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import random
import zlib
from collections.abc import Mapping
from typing import Any, Final

from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata  # noqa: F401

from schemas import Job
from worker.build import Service, build_worker
from worker.core.config import Settings
from worker.core.errors import EngineDeadError, WeightUpdateError
from worker.dev.sim.clients import Process
from worker.dev.sim.clock import VirtualClock
from worker.dev.sim.cluster import Cluster
from worker.dev.sim.kafka_clients import SimKafkaClients
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.protocol import EngineOutput

__all__ = ["CLIENT_PREFIX", "KILLS_ENGINE", "Fleet", "SimEngine"]

logger = logging.getLogger(__name__)

#: A checkpoint directory whose load kills the engine.
KILLS_ENGINE: Final = "kills-engine"

#: `worker.core.kafka.client_kwargs` names every client of a worker after its worker_id.
CLIENT_PREFIX: Final = "vllm-kafka-worker-"


class SimEngine(MockEngine):
    """The mock engine, whose crash token kills the simulated process instead of this one."""

    def __init__(self, settings: MockEngineSettings, fleet: Fleet, worker_id: str) -> None:
        super().__init__(settings)
        self._fleet = fleet
        self._worker_id = worker_id

    async def generate(
        self, job: Job, request_id: str, *, trace_headers: Mapping[str, str] | None = None
    ) -> EngineOutput:
        crash = self._settings.crash_token_id
        if crash is not None and job.prompt_token_ids and crash in job.prompt_token_ids:
            fleet = self._fleet
            fleet.kill(self._worker_id, why=f"job {job.job_id} crashes the engine")
            # The supervisor (Kubernetes, systemd) starts the process again after a back-off.
            fleet.restart_later(self._worker_id, fleet.rng.uniform(1.0, 5.0))
            await asyncio.get_running_loop().create_future()  # the process is gone
        while self._worker_id in self._fleet.hung_engines:  # noqa: ASYNC110 - virtual time
            # An engine that stopped answering (a wedged kernel, a lost device): the process
            # lives on and nothing it runs ends.
            await asyncio.sleep(1.0)
        return await super().generate(job, request_id, trace_headers=trace_headers)

    async def load_weights(self, path: str, version: int) -> None:
        if path.endswith(KILLS_ENGINE):
            # The engine process dies while loading (out of memory, a bad kernel): every
            # later call fails as a dead engine's would.
            self._dead = True
            raise EngineDeadError(f"the engine died loading {path}")
        await super().load_weights(path, version)

    async def transfer_weights(
        self,
        backend: str,
        init_info: dict[str, Any] | None,
        update_info: dict[str, Any],
        version: int,
    ) -> None:
        """Weights the trainer streams: taken while its rendezvous is open (`Fleet.transfers`),
        refused after, as a real transfer fails once the trainer has left the group it named.
        A worker started later cannot take them."""
        rendezvous = str(update_info.get("rendezvous", ""))
        closes = self._fleet.transfers.get(rendezvous)
        if closes is None or self._fleet.clock.now >= closes:
            raise WeightUpdateError(f"{backend} rendezvous {rendezvous!r} is not open")
        if self._running and not self._settings.in_place_updates:
            raise WeightUpdateError(
                f"{len(self._running)} requests are running; this engine loads weights idle"
            )
        self._weights_seed = zlib.crc32(rendezvous.encode())
        self._version = version
        process = self._fleet.processes.get(self._worker_id)
        if process is not None:
            self._fleet.history.add("transferred", worker=process.name, version=version)


class Fleet:
    """Worker processes by worker id; at most one process alive per id."""

    def __init__(
        self,
        cluster: Cluster,
        rng: random.Random,
        clock: VirtualClock,
        base: Settings,
        engine_settings: MockEngineSettings,
    ) -> None:
        self.cluster = cluster
        self.rng = rng
        self.clock = clock
        self.base = base
        self.engine_settings = engine_settings
        self.history = cluster.history
        self.processes: dict[str, Process] = {}
        self.services: dict[str, Service] = {}
        self.tasks: dict[str, asyncio.Task[int]] = {}
        #: Exits nobody asked for: (worker id, status).
        self.stopping: set[str] = set()
        self._generation: dict[str, int] = {}
        #: The run is over: nothing is restarted any more.
        self.ended = False
        #: Every worker's Kafka clients: simulated, of the process its client id names.
        self.kafka_clients = SimKafkaClients(self.process_of, linger=False)
        #: Workers whose engine answers nothing until they leave the set (`SimEngine.generate`).
        self.hung_engines: set[str] = set()
        self._starting: set[asyncio.Task[None]] = set()
        #: Weight transfers the trainer streams: rendezvous name -> when it closes.
        self.transfers: dict[str, float] = {}

    def settings_of(self, worker_id: str) -> Settings:
        fields: dict[str, Any] = {"worker_id": worker_id}
        if self.base.group_instance_id is not None:
            fields["group_instance_id"] = f"instance-{worker_id}"
        return _replace(self.base, **fields)

    def process_of(self, client_id: str) -> Process:
        return self.processes[client_id.removeprefix(CLIENT_PREFIX)]

    def alive(self) -> list[str]:
        return sorted(w for w, p in self.processes.items() if p.alive)

    async def start(self, worker_id: str) -> None:
        """Start a process for `worker_id` (a restart when one ran before)."""
        if worker_id in self.processes and self.processes[worker_id].alive:
            return
        self._generation[worker_id] = self._generation.get(worker_id, 0) + 1
        process = Process(f"{worker_id}#{self._generation[worker_id]}", self.cluster, self.rng)
        self.processes[worker_id] = process
        settings = self.settings_of(worker_id)
        engine = SimEngine(self.engine_settings, self, worker_id)
        limits = {
            name: self.cluster.topics[name].max_message_bytes
            for name in (settings.results_topic, settings.dead_letter_topic)
            if name in self.cluster.topics
        }
        service = await build_worker(
            settings,
            engine,
            topic_limits=dict(limits),
            kafka_clients=self.kafka_clients,
            incarnation=self.rng.getrandbits(48) or 1,
            clock=self.clock,
        )
        self.services[worker_id] = service
        self.stopping.discard(worker_id)
        self.history.add("start", worker=process.name)
        task = asyncio.create_task(service.run(), name=f"worker {process.name}")
        task.add_done_callback(lambda t, p=process: self._exited(p, t))  # type: ignore[misc]
        self.tasks[worker_id] = task

    def _exited(self, process: Process, task: asyncio.Task[int]) -> None:
        if not process.alive:
            return  # killed: its exit is the kill
        process.kill()
        if task.cancelled():
            self.history.add("exit", worker=process.name, status="cancelled", asked=False)
            return
        exc = task.exception()
        status: Any = repr(exc) if exc is not None else task.result()
        worker_id = process.name.split("#")[0]
        fatal = getattr(self.services[worker_id].worker, "_fatal", None)
        self.history.add(
            "exit",
            worker=process.name,
            status=status,
            asked=worker_id in self.stopping,
            fatal=None if fatal is None else str(fatal)[:200],
            coordinator_away=self.cluster.coordinator_down or self.cluster.broker_down,
        )
        if worker_id not in self.stopping and not self.ended:
            # Its supervisor starts it again after a back-off.
            self.restart_later(worker_id, self.rng.uniform(1.0, 5.0))

    def kill(self, worker_id: str, *, why: str) -> None:
        """SIGKILL: the process's clients go silent at once and its tasks stop; nothing of its
        shutdown reaches the cluster. Its membership ends by the session timeout (a static
        member's, when it comes back under its instance id)."""
        process = self.processes.get(worker_id)
        if process is None or not process.alive:
            return
        process.kill()
        self.history.add("kill", worker=process.name, why=why)
        task = self.tasks.get(worker_id)
        if task is not None:
            asyncio.get_running_loop().call_soon(task.cancel)

    def restart_later(self, worker_id: str, delay_s: float) -> None:
        """Start `worker_id` again in `delay_s` unless it is running by then."""
        loop = asyncio.get_running_loop()

        def start() -> None:
            if not self.ended:
                task = loop.create_task(self.start(worker_id))
                self._starting.add(task)
                task.add_done_callback(self._starting.discard)

        loop.call_later(delay_s, start)

    def terminate(self, worker_id: str, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after `grace_s` if it has not exited (a supervisor's grace)."""
        process = self.processes.get(worker_id)
        if process is None or not process.alive:
            return
        self.stopping.add(worker_id)
        self.history.add("sigterm", worker=process.name, grace_s=grace_s)
        self.services[worker_id].request_stop()

        def overdue() -> None:
            if self.processes.get(worker_id) is process and process.alive:
                self.kill(worker_id, why=f"still running {grace_s:.1f}s after SIGTERM")

        asyncio.get_running_loop().call_later(grace_s, overdue)


def _replace(settings: Settings, **fields: Any) -> Settings:
    import msgspec  # noqa: PLC0415

    return msgspec.structs.replace(settings, **fields)
