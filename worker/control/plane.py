"""The control plane: commands from the control topic applied to this worker, answers on the
status topic.

Every worker reads the whole control topic (one partition, assigned, no group: a command is
for the fleet, not for one member), applies each command addressed to it once (by
`command_id`), in topic order, and acknowledges it with its outcome, its duration and the
weight version after it. A heartbeat says what the worker is doing every `status_interval_s`.

At start, before any job is fetched, the worker catches up: of the commands already in the
topic it applies the latest weight update addressed to it that loads (so a restarted worker
never serves weights older than the fleet's) and the latest pause or resume, and only marks
the rest as done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

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
)
from worker.core.config import Settings
from worker.core.errors import FatalError, WeightUpdateError
from worker.core.kafka import client_kwargs
from worker.core.metrics import Metrics
from worker.core.shutdown import bounded
from worker.engines.steerable import SteerableEngine

__all__ = ["ControlPlane", "WorkerView"]

logger = logging.getLogger(__name__)

_SEND_TIMEOUT_S: Final = 10.0
# How long a `restart` update waits for the answers of jobs that finished on the old weights to
# be acknowledged before it acknowledges itself.
_SETTLE_TIMEOUT_S: Final = 30.0


class WorkerView(Protocol):
    """What the control plane reads from, and tells, the worker it steers."""

    @property
    def jobs_in_flight(self) -> int: ...

    def lag(self) -> int | None: ...

    async def answers_acknowledged(self, timeout_s: float) -> bool: ...

    def fail(self, exc: FatalError, where: str) -> None: ...


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
    ) -> None:
        self._settings = settings
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

    async def start(self) -> None:
        consumer, producer = self._given
        self._consumer = consumer or AIOKafkaConsumer(
            **client_kwargs(self._settings),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
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
        end = (await self._consumer.end_offsets([self._tp]))[self._tp]
        updates: list[UpdateWeights] = []
        pause: Pause | Resume | None = None
        while await self._consumer.position(self._tp) < end:
            for record in await self._fetch():
                command = await self._decode(record)
                if command is None:
                    continue
                self._applied.add(command.command_id)
                if not self._addressed(command):
                    continue
                if isinstance(command, UpdateWeights):
                    updates.append(command)
                elif isinstance(command, Pause | Resume):
                    pause = command
        # The newest update that loads: one that failed for this worker failed for the fleet
        # too, which went on with the weights before it.
        for update in reversed(updates):
            ack = await self._apply(update, catching_up=True)
            if ack.outcome == "ok":
                break
        if isinstance(pause, Pause):
            await self._apply(Pause(command_id=pause.command_id, mode="wait"), catching_up=True)
        logger.info(
            "control plane caught up at %s-0@%d: weight version %d%s",
            self._settings.control_topic,
            end,
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
                    self._follow_from_beginning()
                continue
            for record in await self._fetch():
                command = await self._decode(record)
                if command is None or command.command_id in self._applied:
                    continue
                self._applied.add(command.command_id)
                if self._addressed(command):
                    await self._apply(command)

    def _follow_from_beginning(self) -> None:
        self._consumer.assign([self._tp])
        self._consumer.seek(self._tp, 0)
        self._following = True

    async def _fetch(self) -> list[ConsumerRecord[bytes, bytes]]:
        try:
            batch = await self._consumer.getmany(self._tp, timeout_ms=500)
        except KafkaError as exc:
            logger.warning("control topic fetch failed (%r); retrying", exc)
            await asyncio.sleep(1.0)
            return []
        return list(batch.get(self._tp, []))

    async def _decode(self, record: ConsumerRecord[bytes, bytes]) -> Command | None:
        try:
            return decode_command(record.value or b"")
        except SchemaError as exc:
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
            return None

    def _addressed(self, command: Command) -> bool:
        return command.target.matches(self._settings.group_id, self._settings.worker_id)

    async def _apply(self, command: Command, *, catching_up: bool = False) -> CommandAck:
        kind = type(command).__name__
        t0 = time.monotonic()
        outcome, detail = "ok", ""
        try:
            detail = await self._run(command, catching_up=catching_up)
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

    async def _run(self, command: Command, *, catching_up: bool) -> str:
        """Apply one command; a detail for the acknowledgement."""
        engine = self._engine
        if isinstance(command, Pause):
            await engine.pause(command.mode)
            return ""
        if isinstance(command, Resume):
            await engine.resume()
            return ""
        if isinstance(command, ResetPrefixCache):
            await engine.reset_prefix_cache()
            return ""
        if isinstance(command, Abort):
            matched = await engine.abort(command)
            return f"aborted {len(matched)} jobs in flight" + (
                f": {', '.join(sorted(matched)[:20])}" if matched else ""
            )
        t0 = time.monotonic()
        if command.backend == "checkpoint":
            assert command.path is not None  # noqa: S101 - the schema requires it
            await engine.load_checkpoint(command.path, command.version, command.on_inflight)
        else:
            assert command.update_info is not None  # noqa: S101 - the schema requires it
            await engine.transfer(
                command.backend,
                command.init_info,
                command.update_info,
                command.version,
                command.on_inflight,
            )
        self._metrics.weight_update_time.observe(time.monotonic() - t0)
        if command.on_inflight == "restart" and not catching_up:
            # Answers of jobs that finished on the old weights go out before this says done.
            settled = await self._settled_answers()
            if not settled:
                return "some answers of jobs finished on the old weights were still unacknowledged"
        return f"serving {command.path or command.backend} as version {command.version}"

    async def _settled_answers(self) -> bool:
        worker = self._worker
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        # Jobs whose engine call has returned, with their answers still being built.
        while worker.jobs_in_flight > self._engine.inside and time.monotonic() < deadline:  # noqa: ASYNC110 - a count, not an event: polled for a few ms
            await asyncio.sleep(0.01)
        return await worker.answers_acknowledged(max(deadline - time.monotonic(), 0))

    def _publish_version(self) -> None:
        self._metrics.weight_version.set(self._engine.weight_version)
        self._metrics.paused.set(1 if self._engine.paused else 0)

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self._engine.check_health()
                healthy = True
            except FatalError:
                healthy = False  # the worker's own check stops it; the status says why first
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
        )

    async def _send(self, message: StatusMessage) -> None:
        if not self._status_on:
            return
        try:
            await asyncio.wait_for(
                self._producer.send_and_wait(
                    self._settings.status_topic,
                    value=encode(message),
                    key=self._settings.worker_id.encode(),
                ),
                _SEND_TIMEOUT_S,
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
