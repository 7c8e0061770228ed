"""One place that wires a worker: settings -> record limits -> Kafka clients -> engine, control
plane and consume loop. The CLI, the tests and the benchmarks all build through `build_worker`."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Final

from aiokafka import AIOKafkaProducer

from worker.control.plane import ControlPlane
from worker.core.clients import AIOKAFKA, KafkaClients
from worker.core.clock import SYSTEM_CLOCK, Clock
from worker.core.config import Settings
from worker.core.errors import BrokerError, ConfigError
from worker.core.incarnation import new_incarnation
from worker.core.kafka import make_consumer, make_producer, read_record_limits
from worker.core.limits import RecordLimits
from worker.core.metrics import Metrics
from worker.core.shutdown import bounded
from worker.delivery.commits import GroupOffsetsReader
from worker.engines.protocol import ControllableEngine, Engine
from worker.engines.steerable import SteerableEngine
from worker.loop.worker import Worker

__all__ = ["GC_YOUNG_THRESHOLD", "Service", "build_engine", "build_worker", "tune_gc_for_serving"]

logger = logging.getLogger(__name__)

#: Allocations between young-generation collections while serving (CPython's default: 700);
#: see `tune_gc_for_serving`.
GC_YOUNG_THRESHOLD: Final = 20_000


class Service:
    """A worker as `serve` runs it: the engine, the control plane (when steered), the consume
    loop, and the offset-map reader they share.

    `run()` starts the engine, lets the control plane catch up with the control topic before
    any job is fetched (a restarted worker serves the fleet's weights from its first job),
    tunes the process (`on_serving`), serves until `request_stop()` or a fatal error, and closes
    everything in reverse order, however far the start got. It returns the exit status.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine,
        worker: Worker,
        control: ControlPlane | None,
        read_committed: GroupOffsetsReader,
        on_serving: Callable[[], None] | None = None,
        owns_engine: bool = True,
    ) -> None:
        self.engine = engine
        self.worker = worker
        self.control = control
        self.metrics = worker.metrics
        self._settings = settings
        self._read_committed = read_committed
        self._on_serving = on_serving
        self._owns_engine = owns_engine

    @property
    def steerable(self) -> SteerableEngine:
        """The engine behind the control plane (only a steered service has one)."""
        if not isinstance(self.engine, SteerableEngine):
            raise TypeError("this worker was built without a control plane (steered=False)")
        return self.engine

    @property
    def ready(self) -> bool:
        """What /readyz reports: the engine is up and the worker holds partitions."""
        return self.worker.ready

    def request_stop(self) -> None:
        self.worker.request_stop()

    async def run(self) -> int:
        timeout_s = self._settings.close_timeout_s
        async with AsyncExitStack() as stack:
            stack.push_async_callback(self._read_committed.close)
            # Built before anything started: closed even when the engine fails to start.
            stack.push_async_callback(self.worker.close_clients)
            if self._owns_engine:
                await self.engine.start()
                # An engine that failed to start has released what it took; one that started
                # is closed last, after the consumer has left the group.
                stack.push_async_callback(bounded, self.engine.close, "engine close", timeout_s)
            if self.control is not None:
                stack.push_async_callback(self.control.close)
                await self.control.start()
                await self.control.catch_up()
                following = asyncio.create_task(self.control.run(), name="control")
                following.add_done_callback(functools.partial(_control_stopped, self.worker))
                stack.push_async_callback(_cancel, following)
            if self._on_serving is not None:
                self._on_serving()
            status = await self.worker.run()
        return status


async def build_worker(
    settings: Settings,
    engine: Engine,
    *,
    metrics: Metrics | None = None,
    steered: bool = True,
    topic_limits: dict[str, int | None] | None = None,
    wrap_producer: Callable[[AIOKafkaProducer], AIOKafkaProducer] | None = None,
    on_serving: Callable[[], None] | None = None,
    owns_engine: bool = True,
    built_on: str | None = None,
    passed_over: dict[str, str] | None = None,
    kafka_clients: KafkaClients = AIOKAFKA,
    incarnation: int | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> Service:
    """Build the worker `settings` describe around `engine`.

    `steered`: put the engine behind a `SteerableEngine` and follow the control topic (what
    `serve` does; the engine must then be a `ControllableEngine`). `topic_limits` replaces the
    answer topics' `max.message.bytes` read from the broker; `wrap_producer` lets a test put a
    producer that misbehaves on purpose in front of the real one. `owns_engine=False`: the
    engine is running already and outlives this worker (one expensive engine shared by several
    workers in tests and benchmarks): it is neither started nor closed here. `built_on`: the
    control command whose checkpoint `engine` was built on (see
    `worker.control.catch_up.checkpoints_to_start_on`), acknowledged at catch-up without a load;
    `passed_over`: the fleet's newer checkpoints that did not start an engine, with why.
    `kafka_clients`: where every Kafka client of the worker comes from (aiokafka's; the
    simulation's). `incarnation`: this process's, drawn afresh when not given. `clock`:
    what every part of the worker reads the time from (the system's; the simulation's).
    """
    served: Engine = engine
    if steered:
        if not isinstance(engine, ControllableEngine):
            raise ConfigError(f"engine {engine.model_name} cannot be steered by a control plane")
        served = SteerableEngine(engine, clock=clock)
    limits = (
        await read_record_limits(settings, kafka_clients=kafka_clients)
        if topic_limits is None
        else RecordLimits.from_topic_limits(settings, topic_limits)
    )
    metrics = metrics or Metrics()

    # The producer first: its settings can still be refused (a missing codec), and a client
    # built before that would be left unclosed.
    def new_producer() -> AIOKafkaProducer:
        producer = make_producer(settings, limits, kafka_clients=kafka_clients)
        return producer if wrap_producer is None else wrap_producer(producer)

    producer = new_producer()
    read_committed = GroupOffsetsReader(settings, kafka_clients)
    incarnation = new_incarnation() if incarnation is None else incarnation
    worker = Worker(
        settings,
        consumer=make_consumer(
            settings, limits, incarnation=incarnation, kafka_clients=kafka_clients
        ),
        producer=producer,
        engine=served,
        limits=limits,
        metrics=metrics,
        read_committed=read_committed,
        live_incarnations=read_committed.live_incarnations,
        incarnation=incarnation,
        producer_factory=new_producer,
        # The reply topics' config reader stays on aiokafka's admin client: under the
        # simulation it cannot reach the cluster, and the recorded histories were made so; the
        # simulated one's timers reorder their events that fall on one instant.
        clock=clock,
    )
    control = (
        ControlPlane(
            settings,
            served,
            metrics,
            worker,
            built_on=built_on,
            passed_over=passed_over,
            kafka_clients=kafka_clients,
            clock=clock,
        )
        if isinstance(served, SteerableEngine)
        else None
    )
    return Service(
        settings,
        engine=served,
        worker=worker,
        control=control,
        read_committed=read_committed,
        on_serving=on_serving,
        owns_engine=owns_engine,
    )


def build_engine(settings: Settings, engine_args: list[str]) -> ControllableEngine:
    """The engine named by the settings; vLLM is imported only when asked for."""
    if settings.engine == "mock":
        if engine_args:
            raise ConfigError(f"the mock engine takes no engine arguments, got {engine_args}")
        from worker.engines.mock import MockEngine, mock_engine_settings  # noqa: PLC0415

        return MockEngine(mock_engine_settings(settings))
    try:
        from worker.engines.vllm_engine import build_vllm_engine  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigError(
            f"--engine vllm needs vLLM installed (extras `cpu` or `gpu`): {exc}; "
            "or use --engine mock"
        ) from None
    return build_vllm_engine(
        engine_args, weight_version=settings.weight_version, weight_reload=settings.weight_reload
    )


def tune_gc_for_serving() -> None:
    """Keep the cyclic garbage collector off the hot path once everything is loaded.

    Freezing moves what exists now (modules, the engine, its model: with vLLM, millions of
    objects) out of the collector's reach, as vLLM does after start-up. A higher first
    threshold lets a job's short-lived objects die young instead of being promoted and
    scanned again: on a busy worker the collector is otherwise a visible share of the time.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _control_stopped(worker: Worker, task: asyncio.Task[None]) -> None:
    """The control plane never ends by itself: if it does, the worker must not go on unsteered."""
    if task.cancelled():
        return
    worker.fail(BrokerError(f"the control plane stopped: {task.exception()!r}"), "control plane")


async def _cancel(task: asyncio.Task[None]) -> None:
    # A task that failed has told the worker already (`_control_stopped`).
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
