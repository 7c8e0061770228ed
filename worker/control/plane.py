"""The control plane: commands from the control topic applied to this worker, answers on the
status topic.

Every worker reads the whole control topic (one partition, assigned, no group: a command is
for the fleet, not for one member), applies each command addressed to it once (by
`command_id`), in topic order, and acknowledges it with its outcome, its duration and the
weight version after it. A heartbeat says what the worker is doing every `status_interval_s`.

At start, before any job is fetched, the worker catches up (`worker.control.catch_up`): of the
commands already in the topic it applies the latest checkpoint update addressed to it that
loads (so a restarted worker never serves weights older than the fleet's) and the latest pause
or resume, and only marks the rest as done. A latest update it cannot repeat (a weight
transfer) leaves it `needs_weights` until the next update, holding its jobs unless told to
serve.

Every command is checked before anything changes: its signature (`--control-hmac-key`), what
an update may load (`worker.control.policy`), and that versions move forward (`force` rolls
back). A refused command is acknowledged `failed` with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from schemas import (
    Abort,
    Command,
    CommandAck,
    ControlRecordError,
    Pause,
    ResetPrefixCache,
    Resume,
    SchemaError,
    StatusMessage,
    UpdateWeights,
    WorkerStatus,
    decode_command,
    encode,
    signature_problem,
)
from worker.control.catch_up import check_control_partitions, read_control_topic
from worker.control.commands import CommandRunner, WorkerView
from worker.core.config import Settings
from worker.core.errors import FatalError, WeightUpdateError
from worker.core.kafka import FETCHER_FALLBACK_WAKE_MS, client_kwargs
from worker.core.metrics import Metrics
from worker.core.shutdown import bounded
from worker.engines.steerable import SteerableEngine

__all__ = ["ControlPlane", "WorkerView"]

logger = logging.getLogger(__name__)

_SEND_TIMEOUT_S: Final = 10.0
# A command is returned the moment it is fetched, and a stop cancels the wait: the timeout only
# ends an empty wait, and each such end is a wake-up with nothing to do.
_FOLLOW_WAIT_MS: Final = 10_000


class ControlPlane:
    """Applies the control topic's commands to `engine`; see the module's docstring."""

    def __init__(
        self,
        settings: Settings,
        engine: SteerableEngine,
        metrics: Metrics,
        worker: WorkerView,
        *,
        consumer: AIOKafkaConsumer | None = None,
        producer: AIOKafkaProducer | None = None,
        clock: Callable[[], float] = time.time,
        built_on: str | None = None,
    ) -> None:
        """`built_on`: the id of the update whose checkpoint the engine was built on
        (`worker.control.catch_up.checkpoint_to_start_on`): acknowledged, not loaded again."""
        self._settings = settings
        self._built_on = built_on
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
        self._applied: set[str] = set()
        self._worker = worker
        self._started = time.monotonic()
        self._started_clients = False
        self._runner = CommandRunner(settings, engine, metrics, worker)
        key = settings.control_hmac_key
        self._key = None if key is None else key.encode()

    async def start(self) -> None:
        consumer, producer = self._given
        self._consumer = consumer or AIOKafkaConsumer(
            **client_kwargs(self._settings),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            consumer_timeout_ms=FETCHER_FALLBACK_WAKE_MS,
        )
        self._producer = producer or AIOKafkaProducer(**client_kwargs(self._settings), acks="all")
        self._started_clients = True
        await self._producer.start()
        await self._consumer.start()
        topics = await self._consumer.topics()
        self._status_on = self._settings.status_topic in topics
        if not self._status_on:
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
        """Apply the state the control topic holds for this worker; before jobs are fetched."""
        self._publish_version()
        if not self._following:
            return
        plan = await read_control_topic(
            self._consumer,
            self._settings,
            self._engine.weight_version,
            on_unreadable=self._report_unreadable,
        )
        self._applied |= plan.seen
        for update in plan.checkpoints:
            ack = await self._apply(
                update, catching_up=True, loaded=update.command_id == self._built_on
            )
            if ack.outcome == "ok":
                break
        if isinstance(plan.pause, Pause):
            await self._apply(
                Pause(command_id=plan.pause.command_id, mode="wait"), catching_up=True
            )
        if plan.transfer is not None:
            hold = await self._runner.lack_weights()
            logger.warning(
                "the control topic's latest update (%s, version %d over %s) cannot be repeated "
                "after a restart: %s until the next update_weights",
                plan.transfer.command_id,
                plan.transfer.version,
                plan.transfer.backend,
                "jobs are held" if hold else f"serving version {self._engine.weight_version}",
            )
        logger.info(
            "control plane caught up at %s-0@%d: weight version %d%s",
            self._settings.control_topic,
            plan.end,
            self._engine.weight_version,
            ", paused" if self._engine.paused else "",
        )

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
                command = await self._decode(record)
                if command is None or command.command_id in self._applied:
                    continue
                unauthorized = self._unauthorized(record)
                if unauthorized is None:
                    # A forged record's id is not taken: it must not shadow the real command.
                    self._applied.add(command.command_id)
                if self._addressed(command):
                    await self._apply(command, unauthorized=unauthorized)

    def _follow_from_beginning(self) -> None:
        self._consumer.assign([self._tp])
        self._consumer.seek(self._tp, 0)
        self._following = True

    async def _fetch(self) -> list[ConsumerRecord[bytes, bytes]]:
        try:
            batch = await self._consumer.getmany(self._tp, timeout_ms=_FOLLOW_WAIT_MS)
        except KafkaError as exc:
            logger.warning("control topic fetch failed (%r); retrying", exc)
            await asyncio.sleep(1.0)
            return []
        return list(batch.get(self._tp, []))

    async def _decode(self, record: ConsumerRecord[bytes, bytes]) -> Command | None:
        try:
            return decode_command(record.value or b"")
        except SchemaError as exc:
            await self._report_unreadable(record, exc)
            return None

    async def _report_unreadable(
        self, record: ConsumerRecord[bytes, bytes], exc: SchemaError
    ) -> None:
        where = f"{record.topic}-{record.partition}@{record.offset}"
        logger.warning("unreadable control record at %s skipped: %s", where, exc)
        await self._send(
            ControlRecordError(
                worker=self._settings.worker_id,
                group=self._settings.group_id,
                offset=record.offset,
                detail=str(exc)[:1000],
                at=self._clock(),
            )
        )

    def _unauthorized(self, record: ConsumerRecord[bytes, bytes]) -> str | None:
        """Why `record` may not be applied under the fleet's key (None: it may)."""
        if self._key is None:
            return None
        return signature_problem(record.value or b"", self._key)

    def _addressed(self, command: Command) -> bool:
        return command.target.matches(self._settings.group_id, self._settings.worker_id)

    async def _apply(
        self,
        command: Command,
        *,
        catching_up: bool = False,
        unauthorized: str | None = None,
        loaded: bool = False,
    ) -> CommandAck:
        """Run `command` and acknowledge it; `loaded`: the engine was built on its checkpoint,
        so there is nothing to run."""
        kind = type(command).__name__
        t0 = time.monotonic()
        outcome, detail = "ok", ""
        try:
            if loaded:
                detail = "the engine was built on this checkpoint at start"
            else:
                detail = await self._runner.run(
                    command, catching_up=catching_up, unauthorized=unauthorized
                )
        except WeightUpdateError as exc:
            outcome, detail = "failed", str(exc)
        except FatalError as exc:
            outcome, detail = "failed", f"the engine stopped: {exc}"
            self._worker.fail(exc, f"control command {command.command_id}")
        duration = time.monotonic() - t0
        ack = CommandAck(
            worker=self._settings.worker_id,
            group=self._settings.group_id,
            command_id=command.command_id,
            kind=_KINDS.get(type(command), kind),
            outcome=outcome,  # type: ignore[arg-type]
            detail=detail[:2000],
            duration_s=duration,
            weight_version=self._engine.weight_version,
            at=self._clock(),
        )
        log = logger.info if outcome == "ok" else logger.warning
        log(
            "command %s (%s) %s in %.2fs%s",
            command.command_id,
            ack.kind,
            outcome,
            duration,
            f": {detail}" if detail else "",
        )
        self._metrics.commands.labels(ack.kind, outcome).inc()
        self._publish_version()
        await self._send(ack)
        return ack

    def _publish_version(self) -> None:
        self._metrics.weight_version.set(self._engine.weight_version)
        self._metrics.paused.set(1 if self._engine.paused else 0)
        self._metrics.needs_weights.set(1 if self._needs_weights else 0)

    @property
    def _needs_weights(self) -> bool:
        # The engine's own: an update failed and the weights before it could not be put back.
        return self._runner.needs_weights or self._engine.needs_weights

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self._engine.check_health()
                healthy = True
            except FatalError:
                healthy = False  # the worker's own check stops it; the status says why first
            self._publish_version()
            await self._send(self.status(engine_healthy=healthy))
            await asyncio.sleep(self._settings.status_interval_s)

    def status(self, *, engine_healthy: bool = True) -> WorkerStatus:
        worker = self._worker
        s = self._settings
        return WorkerStatus(
            worker=s.worker_id,
            group=s.group_id,
            model=self._engine.model_name,
            weight_version=self._engine.weight_version,
            paused=self._engine.paused,
            in_flight=worker.jobs_in_flight,
            lag=worker.lag(),
            engine_healthy=engine_healthy,
            uptime_s=time.monotonic() - self._started,
            at=self._clock(),
            interval_s=s.status_interval_s,
            weight_reload=self._engine.weight_reload,
            needs_weights=self._needs_weights,
        )

    async def _send(self, message: StatusMessage) -> None:
        if not self._status_on:
            return
        try:
            async with asyncio.timeout(_SEND_TIMEOUT_S):
                await self._producer.send_and_wait(
                    self._settings.status_topic,
                    value=encode(message),
                    key=self._settings.worker_id.encode(),
                )
        except (TimeoutError, KafkaError) as exc:
            logger.warning("status topic: %s not sent (%r)", type(message).__name__, exc)


_KINDS: Final[dict[type[Any], str]] = {
    Pause: "pause",
    Resume: "resume",
    UpdateWeights: "update_weights",
    Abort: "abort",
    ResetPrefixCache: "reset_prefix_cache",
}
