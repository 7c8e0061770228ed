"""A worker steered by the control plane: what `serve` runs, assembled once for it and tests."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from worker.commits import CommittedReader
from worker.config import Settings
from worker.control import ControlPlane
from worker.engine import ControllableEngine
from worker.errors import BrokerError
from worker.limits import RecordLimits
from worker.metrics import Metrics
from worker.policy import PolicyEngine
from worker.service import Worker

__all__ = ["SteeredWorker"]


class SteeredWorker:
    """The consume loop (`Worker`) on a `PolicyEngine`, with a `ControlPlane` that catches up
    with the control topic after the engine starts and before any job is fetched, then follows
    it while the worker serves."""

    def __init__(
        self,
        settings: Settings,
        *,
        engine: ControllableEngine,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer,
        limits: RecordLimits,
        metrics: Metrics | None = None,
        read_committed: CommittedReader | None = None,
        on_serving: Callable[[], None] | None = None,
        control: ControlPlane | None = None,
    ) -> None:
        self.metrics = metrics or Metrics()
        self.engine = PolicyEngine(engine)
        self.control = control or ControlPlane(settings, self.engine, self.metrics)
        self._following: asyncio.Task[None] | None = None
        self.worker = Worker(
            settings,
            consumer=consumer,
            producer=producer,
            engine=self.engine,
            limits=limits,
            metrics=self.metrics,
            read_committed=read_committed,
            on_serving=on_serving,
            prepare=self._catch_up_then_follow,
            weight_version=lambda: self.engine.weight_version,
        )
        self.control.attach(self.worker)

    @property
    def ready(self) -> bool:
        return self.worker.ready

    def request_stop(self) -> None:
        self.worker.request_stop()

    async def run(self) -> int:
        """Serve until stopped; the worker's exit status."""
        try:
            return await self.worker.run()
        finally:
            if self._following is not None:
                self._following.cancel()
                await asyncio.gather(self._following, return_exceptions=True)
            await self.control.close()

    async def _catch_up_then_follow(self) -> None:
        # Before any job is fetched: a restarted worker serves the fleet's weights.
        await self.control.start()
        await self.control.catch_up()
        self._following = asyncio.create_task(self.control.run(), name="control")
        self._following.add_done_callback(functools.partial(_control_stopped, self.worker))


def _control_stopped(worker: Worker, task: asyncio.Task[None]) -> None:
    """The control plane never ends by itself: if it does, the worker must not go on unsteered."""
    if task.cancelled():
        return
    worker.fail(BrokerError(f"the control plane stopped: {task.exception()!r}"), "control plane")
