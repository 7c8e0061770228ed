"""The control plane: commands from the control topic applied to this worker, answers on the
status topic.

Every worker reads the whole control topic (one partition, assigned, no group: a command is
for the fleet, not for one member), applies each command addressed to it once (by
`command_id`), in topic order, and acknowledges it with its outcome, its duration and the
weight version after it. A heartbeat says what the worker is doing every `status_interval_s`.

At start, before any job is fetched, the worker catches up (`worker.control.catch_up`): of the
commands the fleet answered it takes the fleet's outcome (the newest checkpoint the fleet
applied that loads here, falling back to older applied ones, then to its start-up weights;
the latest pause or resume the fleet applied), and it applies the commands nobody answered
itself, as it would live. A newest update it cannot repeat (a weight transfer) leaves it
`needs_weights` until the next update, holding its jobs unless told to serve. Heartbeats say
which update's weights it serves (and which transfer it lacks), which pause holds it and how
far it has read the control topic, so the next worker to start can do the same.

Every command is checked before anything changes: its signature (`--control-hmac-key`: a
record that is not signed is dropped unanswered, counted in `vkw_control_records_dropped`),
that it is fresh (`issued_at`), what an update may load (`worker.control.policy`), and that
versions move forward (a fresh `force` rolls back). A refused command is acknowledged `failed`
with the reason. Unreadable records cost one status record per heartbeat interval at most.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from schemas import Pause, WorkerStatus
from worker.control.applying import CommandApplier
from worker.control.catch_up import (
    FleetState,
    check_control_partitions,
    plan_catch_up,
    read_control_topic,
    read_fleet_state,
    take_command,
)
from worker.control.commands import WorkerView, staleness
from worker.control.status import StatusSender
from worker.core.clients import AIOKAFKA, KafkaClients
from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.errors import FatalError
from worker.core.kafka import FETCHER_FALLBACK_WAKE_MS, client_kwargs
from worker.core.metrics import Metrics
from worker.core.shutdown import bounded
from worker.engines.steerable import SteerableEngine

__all__ = ["ControlPlane", "WorkerView"]

logger = logging.getLogger(__name__)

# A command is returned the moment it is fetched, and a stop cancels the wait: the timeout only
# ends an empty wait, and each such end is a wake-up with nothing to do.
_FOLLOW_WAIT_MS: Final = 10_000
# How long the status topic's tail may take to read at start before the worker goes on as if
# the fleet had answered nothing.
_FLEET_STATE_TIMEOUT_S: Final = 60.0


class ControlPlane:
    """Applies the control topic's commands to `engine`; see the module's docstring. The
    status topic's side is `StatusSender`'s, applying and acknowledging `CommandApplier`'s."""

    def __init__(
        self,
        settings: Settings,
        engine: SteerableEngine,
        metrics: Metrics,
        worker: WorkerView,
        *,
        consumer: AIOKafkaConsumer | None = None,
        producer: AIOKafkaProducer | None = None,
        status_consumer: AIOKafkaConsumer | None = None,
        clock: Clock,
        built_on: str | None = None,
        passed_over: dict[str, str] | None = None,
        kafka_clients: KafkaClients = AIOKAFKA,
    ) -> None:
        """`built_on`: the id of the update whose checkpoint the engine was built on
        (`worker.control.catch_up.checkpoints_to_start_on`): acknowledged, not loaded again.
        `passed_over`: updates the fleet applied whose checkpoint failed to start an engine
        here, with why: acknowledged `failed`, not tried again. `status_consumer` reads the
        fleet's answers at catch-up (built and closed there when not given)."""
        self._settings = settings
        self._built_on = built_on
        self._passed_over = passed_over or {}
        self._status_consumer = status_consumer
        self._kafka_clients = kafka_clients
        self._engine = engine
        self._metrics = metrics
        self._clock = clock
        # Built in start(): a client made and never started still warns when collected.
        self._given = (consumer, producer)
        self._consumer: AIOKafkaConsumer = None
        self._producer: AIOKafkaProducer = None
        self._tp = TopicPartition(settings.control_topic, 0)
        self._following = False
        self._status_on = False
        self._worker = worker
        self._started = self._clock.monotonic()
        self._started_clients = False
        self._status = StatusSender(settings, engine, metrics, clock=clock)
        self._commands = CommandApplier(
            settings, engine, metrics, worker, self._status, clock=clock
        )
        self._runner = self._commands.runner
        key = settings.control_hmac_key
        self._key = None if key is None else key.encode()
        # The control topic's offset every command below has been applied or passed over.
        self._next_offset = 0

    async def start(self) -> None:
        consumer, producer = self._given
        self._consumer = consumer or self._kafka_clients.consumer(
            **client_kwargs(self._settings),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            consumer_timeout_ms=FETCHER_FALLBACK_WAKE_MS,
        )
        self._producer = producer or self._kafka_clients.producer(
            **client_kwargs(self._settings), acks="all"
        )
        self._started_clients = True
        await self._producer.start()
        await self._consumer.start()
        topics = await self._consumer.topics()
        self._status_on = self._settings.status_topic in topics
        if self._status_on:
            self._status.attach(self._producer)
        else:
            logger.warning(
                "status topic %s does not exist: acknowledgements and heartbeats go to the log "
                "only (create it, or start with --create-topics)",
                self._settings.status_topic,
            )
        if self._settings.control_topic in topics:
            await check_control_partitions(self._consumer, self._settings.control_topic)
            self._follow_from_beginning()
        else:
            logger.warning(
                "control topic %s does not exist: no commands until it is created",
                self._settings.control_topic,
            )

    async def close(self) -> None:
        if not self._started_clients:
            return
        timeout = self._settings.close_timeout_s
        await bounded(self._consumer.stop, "control consumer stop", timeout)
        await bounded(self._producer.stop, "status producer stop", timeout)

    async def catch_up(self) -> None:
        """Apply the state the control topic and the fleet's answers hold for this worker;
        before jobs are fetched."""
        commands = self._commands
        commands.publish_version()
        if not self._following:
            return
        log = await read_control_topic(self._consumer, self._settings, on_dropped=self._status.drop)
        # No command for this worker: nothing the fleet's answers could say about it.
        state = await self._fleet_state() if log.addressed else FleetState()
        plan = plan_catch_up(
            log,
            state,
            self._engine.weight_version,
            fresh=lambda c: staleness(c, self._clock.wall(), self._settings) is None,
        )
        # Every id in the log is taken, as by a worker that followed it: a later copy is a
        # duplicate, whoever it addresses.
        commands.applied |= log.ids.keys()
        await commands.take_checkpoint(
            plan.checkpoints, log.ids, built_on=self._built_on, passed_over=self._passed_over
        )
        if isinstance(plan.pause, Pause):
            ack = await commands.apply(
                Pause(command_id=plan.pause.command_id, mode="wait"),
                catching_up=True,
                offset=log.ids.get(plan.pause.command_id),
            )
            if ack.outcome == "ok":
                commands.pause_command_id = plan.pause.command_id
        if plan.transfer is not None:
            hold = await self._runner.lack_weights(plan.transfer.command_id)
            logger.warning(
                "the fleet's latest update (%s, version %d over %s) cannot be repeated after a "
                "restart: %s until the next update_weights",
                plan.transfer.command_id,
                plan.transfer.version,
                plan.transfer.backend,
                "jobs are held" if hold else f"serving version {self._engine.weight_version}",
            )
        for offset, command, newer in plan.superseded:
            detail = f"superseded: the fleet applied {newer}, sent after it"
            await commands.acknowledge(command, "failed", detail, 0.0, offset)
        stale = 0
        for offset, command in plan.unanswered:
            if staleness(command, self._clock.wall(), self._settings) is not None:
                stale += 1  # nobody answered it when it was fresh: not obeyed now
                continue
            await commands.apply(command, offset=offset)
        if stale:
            logger.warning(
                "%d commands nobody in group %s answered are older than --command-max-age-s "
                "(or dated ahead): not applied",
                stale,
                self._settings.group_id,
            )
        self._next_offset = plan.end
        await self._status.report_dropped(force=True)
        logger.info(
            "control plane caught up at %s-0@%d: weight version %d%s",
            self._settings.control_topic,
            plan.end,
            self._engine.weight_version,
            ", paused" if self._engine.paused else "",
        )

    async def _fleet_state(self) -> FleetState:
        """The status topic's word on the control topic, read with a consumer used for this
        only; nothing (every command unanswered) when it cannot be read in time."""
        if not self._status_on:
            return FleetState()
        consumer = self._status_consumer or self._kafka_clients.consumer(
            **client_kwargs(self._settings),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        await consumer.start()
        try:
            async with asyncio.timeout(_FLEET_STATE_TIMEOUT_S):
                return await read_fleet_state(consumer, self._settings, now=self._clock.wall())
        except TimeoutError:
            logger.warning(
                "status topic %s could not be read in %.0f s: every command in the control "
                "topic is taken as unanswered",
                self._settings.status_topic,
                _FLEET_STATE_TIMEOUT_S,
            )
            return FleetState()
        finally:
            await bounded(consumer.stop, "status consumer stop", self._settings.close_timeout_s)

    async def run(self) -> None:
        """Follow the control topic and send heartbeats, until cancelled. Neither ends by
        itself: if one fails, the other is stopped and the failure raised at once."""
        tasks = {
            asyncio.create_task(self._follow(), name="control-follow"),
            asyncio.create_task(self._heartbeats(), name="control-heartbeats"),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises what ended it
            raise RuntimeError(f"{', '.join(t.get_name() for t in done)} ended by itself")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self) -> None:
        while True:
            if not self._following:
                await asyncio.sleep(self._settings.status_interval_s)
                if self._settings.control_topic in await self._consumer.topics():
                    logger.info("control topic %s appeared", self._settings.control_topic)
                    await check_control_partitions(self._consumer, self._settings.control_topic)
                    self._follow_from_beginning()
                continue
            for record in await self._fetch():
                await self._take(record)
                # Only once it is done: a worker starting meanwhile applies it itself.
                self._next_offset = record.offset + 1
            await self._status.report_dropped()

    async def _take(self, record: ConsumerRecord[bytes, bytes]) -> None:
        command, reason, detail = take_command(record.value or b"", self._key)
        commands = self._commands
        if command is None:
            self._status.drop(record, reason, detail)
        elif command.command_id not in commands.applied:
            commands.applied.add(command.command_id)
            if commands.addressed(command):
                await commands.apply(command, offset=record.offset)

    def _follow_from_beginning(self) -> None:
        self._consumer.assign([self._tp])
        self._consumer.seek(self._tp, 0)
        self._next_offset = 0
        self._following = True

    async def _fetch(self) -> list[ConsumerRecord[bytes, bytes]]:
        try:
            batch = await self._consumer.getmany(self._tp, timeout_ms=_FOLLOW_WAIT_MS)
        except KafkaError as exc:
            logger.warning("control topic fetch failed (%r); retrying", exc)
            await asyncio.sleep(1.0)
            return []
        return list(batch.get(self._tp, []))

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self._engine.check_health()
                healthy = True
            except FatalError:
                healthy = False  # the worker's own check stops it; the status says why first
            self._commands.publish_version()
            await self._status.send(self.status(engine_healthy=healthy))
            await self._status.report_dropped()
            await asyncio.sleep(self._settings.status_interval_s)

    def status(self, *, engine_healthy: bool = True) -> WorkerStatus:
        worker = self._worker
        s = self._settings
        commands = self._commands
        return WorkerStatus(
            worker=s.worker_id,
            group=s.group_id,
            model=self._engine.model_name,
            weight_version=self._engine.weight_version,
            paused=self._engine.paused,
            in_flight=worker.jobs_in_flight,
            lag=worker.lag(),
            engine_healthy=engine_healthy,
            uptime_s=self._clock.monotonic() - self._started,
            at=self._clock.wall(),
            interval_s=s.status_interval_s,
            weight_reload=self._engine.weight_reload,
            needs_weights=commands.needs_weights,
            weights_command_id=commands.weights_command_id,
            pause_command_id=commands.pause_command_id if self._engine.paused else None,
            needs_weights_command_id=self._runner.lacking,
            control_offset=self._next_offset if self._following else None,
        )
