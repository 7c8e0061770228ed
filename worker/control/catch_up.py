"""What a worker starting on a fleet takes from the control topic before it serves.

The control topic holds every command the fleet was sent (one partition, kept for ever: see
`create_topics`); the status topic holds what the fleet did with them. A command says what the
trainer asked for, not what happened: an update the fleet refused (a path outside the root, a
checkpoint cut short) or a record produced again after a trim is in the topic just the same.
So the state comes from the fleet's own answers:

- **answered commands** (below the offset up to which a worker the command addresses has
  acknowledged or reported, `WorkerStatus.control_offset`): their outcome is the fleet's. An
  update counts when a worker of the group acknowledged it `ok` or reports serving it
  (`weights_command_id`, or `needs_weights_command_id` for a transfer it could not repeat);
  the newest of those, in topic order, is the state, the older ones the fallbacks when it no
  longer loads. Likewise the latest pause or resume the fleet applied. Nothing older than the
  version the worker starts with counts (an update from an earlier run on the same topic),
  except an update a worker of the group serves now (a heartbeat within three of its
  intervals), and a forced rollback from an update that counts or issued within
  `--command-max-age-s` (it would be obeyed were it sent now; the fleet that applied it may
  all have stopped since): it is this run's state, and the updates after it count from its
  version on.
  A `nccl` / `ipc` transfer cannot be repeated: when the newest applied update was one, the
  plan says so (`transfer`) and the worker reports `needs_weights`.
- **unanswered commands** (at or above that offset: sent while no worker it addresses was
  there to apply them, e.g. one naming a worker that was down): the worker applies them itself,
  in order, as it would live, with every check (freshness among them, so an old record nobody
  answered is not obeyed now). One sent before the newest update (or pause or resume) the
  fleet's state holds is overtaken by it: a worker that had followed the topic would have
  ended past it, so it is acknowledged `failed`, not applied after that state.

A command id is taken once, at its first record, as a following worker takes it: a later
record under the same id (a signed command produced again byte for byte) is a duplicate here
too, so a copy produced after the fleet answered the original is neither unanswered nor the
newest update or pause.

`read_catch_up_plan` reads both topics with a consumer of its own, so a caller can learn the
checkpoints to build an engine on before the engine (and the control plane) exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Final

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from schemas import (
    Command,
    CommandAck,
    Pause,
    Resume,
    SchemaError,
    Target,
    UpdateWeights,
    WorkerStatus,
    decode_command,
    decode_status,
    signature_problem,
)
from worker.control.commands import staleness
from worker.control.policy import WeightsPolicy
from worker.core.clients import AIOKAFKA, KafkaClients
from worker.core.config import Settings
from worker.core.errors import ConfigError, WeightUpdateError
from worker.core.kafka import client_kwargs
from worker.engines.vllm_weights import check_checkpoint, tensor_shapes

__all__ = [
    "CatchUpPlan",
    "ControlLog",
    "FleetState",
    "StartingCheckpoint",
    "check_control_partitions",
    "checkpoints_to_start_on",
    "plan_catch_up",
    "read_catch_up_plan",
    "read_control_topic",
    "read_fleet_state",
]

logger = logging.getLogger(__name__)

#: How far back, in records per partition, the status topic is read for the fleet's answers.
#: Every heartbeat repeats the state (weights, pause, offset), so the newest ones suffice.
STATUS_TAIL_RECORDS: Final = 20_000
#: A status record larger than this is not one a worker wrote: skipped unread.
MAX_STATUS_RECORD_BYTES: Final = 64 * 1024
#: How long reading either topic at start may take before the worker goes on without it.
READ_TIMEOUT_S: Final = 120.0

OnDropped = Callable[[ConsumerRecord[bytes, bytes], str, str], None]


@dataclass
class ControlLog:
    """The control topic as a worker may take it: readable, signed (under a key) commands,
    each id once (see `take`)."""

    #: (offset, command) for every command addressed to this worker, in topic order.
    addressed: list[tuple[int, Command]] = field(default_factory=list)
    #: The id and offset of every such command, addressed to this worker or not.
    ids: dict[str, int] = field(default_factory=dict)
    #: The offset the topic was read up to.
    end: int = 0

    def take(self, offset: int, command: Command, *, addressed: bool) -> bool:
        """Take `command` at `offset`; False for a duplicate: a following worker applies an id
        once, at its first record, so a later record under it (a replayed copy) is no command
        at catch-up either."""
        if command.command_id in self.ids:
            return False
        self.ids[command.command_id] = offset
        if addressed:
            self.addressed.append((offset, command))
        return True


@dataclass
class FleetState:
    """What the status topic says this worker's group did with the control topic."""

    #: Ids of commands a worker of the group acknowledged `ok` or reports in force.
    applied: set[str] = field(default_factory=set)
    #: Per worker of the group, the offset below which it answered every command addressed to
    #: it (acknowledged, or passed as not its own), as its heartbeats say.
    answered_by: dict[str, int] = field(default_factory=dict)
    #: Per offset, the workers of the group that acknowledged the command there. An
    #: acknowledgement says nothing of the commands before it: a starting worker acknowledges
    #: the fleet's state (a newer update) before the older commands it then takes up, and may
    #: die in between.
    acknowledged: dict[int, set[str]] = field(default_factory=dict)

    #: Ids of updates a worker of the group serves now (a heartbeat within three intervals).
    served_now: set[str] = field(default_factory=set)

    def answer(self, worker: str, below: int) -> None:
        self.answered_by[worker] = max(self.answered_by.get(worker, 0), below)

    @property
    def answered_below(self) -> int:
        """Commands below this offset were answered by some worker of the group."""
        return max(self.answered_by.values(), default=0)

    def answered(self, offset: int, target: Target) -> bool:
        """Whether a worker `target` addresses answered the command at `offset`: another
        worker passing over a command meant for a worker that was down answered nothing."""
        if target.workers is None:
            return offset < self.answered_below or offset in self.acknowledged
        acknowledged = self.acknowledged.get(offset, set())
        return any(
            self.answered_by.get(worker, 0) > offset or worker in acknowledged
            for worker in target.workers
        )


@dataclass
class CatchUpPlan:
    """The state the control topic and the fleet's answers hold for one worker."""

    #: Checkpoint-path updates the fleet applied, newest first: the first that loads is the
    #: worker's state, the others fall-backs.
    checkpoints: list[UpdateWeights] = field(default_factory=list)
    #: The newest applied update, when it was a weight transfer (newer than every checkpoint).
    transfer: UpdateWeights | None = None
    #: The latest pause or resume the fleet applied.
    pause: Pause | Resume | None = None
    #: Commands no worker they address has answered: applied now, in order, as live.
    unanswered: list[tuple[int, Command]] = field(default_factory=list)
    #: Unanswered commands the fleet's state has overtaken (an update, a pause or a resume
    #: sent before the newest of its kind the fleet applied), with the id of that newer one:
    #: acknowledged `failed`, not applied, as a worker that had followed the topic would have
    #: ended past them.
    superseded: list[tuple[int, Command, str]] = field(default_factory=list)
    #: Ids of the commands for this worker answered already: none is applied again.
    seen: set[str] = field(default_factory=set)
    #: The offset the plan was read up to.
    end: int = 0


def plan_catch_up(
    log: ControlLog,
    state: FleetState,
    start_version: int,
    *,
    fresh: Callable[[Command], bool] = lambda _: False,
) -> CatchUpPlan:
    """The plan for a worker that starts on `start_version` (see the module's docstring);
    `fresh`: whether a command would be obeyed were it sent now (`staleness`)."""
    plan = CatchUpPlan(end=log.end)
    updates: list[UpdateWeights] = []
    floor = start_version
    unanswered: list[tuple[int, Command]] = []
    # Offsets of the newest update and the newest pause or resume the plan takes.
    newest: dict[type, tuple[int, str]] = {}
    for offset, command in log.addressed:
        if not state.answered(offset, command.target):
            unanswered.append((offset, command))
            continue
        plan.seen.add(command.command_id)
        if command.command_id not in state.applied:
            continue  # the fleet refused it, or it was never the fleet's to apply
        if isinstance(command, Pause | Resume):
            plan.pause = command
            newest[Pause] = (offset, command.command_id)
        elif isinstance(command, UpdateWeights):
            if command.version >= floor:
                updates.append(command)
                newest[UpdateWeights] = (offset, command.command_id)
            elif command.command_id in state.served_now or (
                command.force and (updates or fresh(command))
            ):
                # A rollback from weights of this run (an update before it, or the start-up
                # weights of a fleet that stopped serving it too recently for an earlier
                # run's: it would be obeyed were it sent now), or an update a worker of the
                # group serves now (its rollback's answers may have left the status tail): the
                # trainer's state, and what it sends next counts from its version on.
                updates.append(command)
                newest[UpdateWeights] = (offset, command.command_id)
                floor = command.version
    for offset, command in unanswered:
        kind = Pause if isinstance(command, Pause | Resume) else type(command)
        overtaken = newest.get(kind)
        if overtaken is not None and overtaken[0] > offset:
            plan.superseded.append((offset, command, overtaken[1]))
        else:
            plan.unanswered.append((offset, command))
    if updates and updates[-1].backend != "checkpoint":
        plan.transfer = updates[-1]
    plan.checkpoints = [u for u in reversed(updates) if u.backend == "checkpoint"]
    return plan


async def check_control_partitions(consumer: AIOKafkaConsumer, topic: str) -> None:
    """Raise `ConfigError` for a control topic of more than one partition: every worker reads
    partition 0, so commands produced to the others (keyed by id) would never be seen."""
    partitions = consumer.partitions_for_topic(topic)
    if partitions is not None and len(partitions) > 1:
        raise ConfigError(
            f"control topic {topic} has {len(partitions)} partitions: it must have exactly one "
            "(recreate it with one partition; --create-topics does)"
        )


def take_command(value: bytes, key: bytes | None) -> tuple[Command | None, str, str]:
    """The command a control record holds, or None with why it is dropped (`unreadable` or
    `unsigned`) and the detail: under a key, an unsigned or badly signed record is nobody's
    command, so not even its id is taken (a forgery must not shadow the real command that
    comes later under the same id)."""
    try:
        command = decode_command(value)
    except SchemaError as exc:
        return None, "unreadable", str(exc)
    if key is not None and (problem := signature_problem(value, key)) is not None:
        return None, "unsigned", problem
    return command, "", ""


async def read_control_topic(
    consumer: AIOKafkaConsumer,
    settings: Settings,
    *,
    on_dropped: OnDropped | None = None,
) -> ControlLog:
    """Read the control topic (assigned to `consumer`, positioned at 0) up to its end."""
    tp = TopicPartition(settings.control_topic, 0)
    end = (await consumer.end_offsets([tp]))[tp]
    key = None if settings.control_hmac_key is None else settings.control_hmac_key.encode()
    log = ControlLog(end=end)
    while await consumer.position(tp) < end:
        try:
            batch = await consumer.getmany(tp, timeout_ms=500)
        except KafkaError as exc:
            logger.warning("control topic fetch failed (%r); retrying", exc)
            await asyncio.sleep(1.0)
            continue
        for record in batch.get(tp, []):
            command, reason, detail = take_command(record.value or b"", key)
            if command is None:
                if on_dropped is not None:
                    on_dropped(record, reason, detail)
                continue
            addressed = command.target.matches(settings.group_id, settings.worker_id)
            log.take(record.offset, command, addressed=addressed)
    return log


async def read_fleet_state(
    consumer: AIOKafkaConsumer, settings: Settings, *, now: float | None = None
) -> FleetState:
    """What the tail of the status topic says this worker's group did with the control
    topic; `consumer` is assigned the status topic's partitions for it. `now` (default: the
    clock's) dates the heartbeats that say what the fleet serves now."""
    now = time.time() if now is None else now
    state = FleetState()
    topic = settings.status_topic
    partitions = consumer.partitions_for_topic(topic)
    if partitions is None:
        await consumer.topics()
        partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        return state
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(tps)
    end = await consumer.end_offsets(tps)
    begin = await consumer.beginning_offsets(tps)
    for tp in tps:
        consumer.seek(tp, max(end[tp] - STATUS_TAIL_RECORDS, begin[tp]))
    while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
        try:
            batch = await consumer.getmany(*tps, timeout_ms=500)
        except KafkaError as exc:
            logger.warning("status topic fetch failed (%r); retrying", exc)
            await asyncio.sleep(1.0)
            continue
        for records in batch.values():
            for record in records:
                _take_answer(state, record.value, settings.group_id, now)
    return state


def _take_answer(state: FleetState, value: bytes | None, group: str, now: float) -> None:
    if value is None or len(value) > MAX_STATUS_RECORD_BYTES:
        return
    try:
        message = decode_status(value)
    except SchemaError:
        return
    if message.group != group:
        return
    if isinstance(message, CommandAck):
        if message.offset is not None:
            state.acknowledged.setdefault(message.offset, set()).add(message.worker)
        if message.outcome == "ok":
            state.applied.add(message.command_id)
    elif isinstance(message, WorkerStatus):
        if message.control_offset is not None:
            state.answer(message.worker, message.control_offset)
        in_force = (
            message.weights_command_id,
            message.pause_command_id,
            message.needs_weights_command_id,
        )
        state.applied |= {cid for cid in in_force if cid}
        # Live as the Fleet reader counts it: dated within three intervals of now, either way.
        if message.weights_command_id and abs(message.at - now) <= 3 * message.interval_s:
            state.served_now.add(message.weights_command_id)


async def read_catch_up_plan(
    settings: Settings, start_version: int, *, kafka_clients: KafkaClients = AIOKAFKA
) -> CatchUpPlan:
    """The plan for the worker `settings` describe, read with consumers of its own from
    `kafka_clients` (an empty plan when the control topic does not exist, or cannot be read in
    `READ_TIMEOUT_S`)."""
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            async with _reader(settings, kafka_clients) as consumer:
                if settings.control_topic not in await consumer.topics():
                    return CatchUpPlan()
                await check_control_partitions(consumer, settings.control_topic)
                tp = TopicPartition(settings.control_topic, 0)
                consumer.assign([tp])
                consumer.seek(tp, 0)
                log = await read_control_topic(consumer, settings)
            state = FleetState()
            if log.addressed:
                async with _reader(settings, kafka_clients) as consumer:
                    state = await read_fleet_state(consumer, settings)
        return plan_catch_up(
            log, state, start_version, fresh=lambda c: staleness(c, time.time(), settings) is None
        )
    except TimeoutError:
        logger.warning(
            "the control and status topics could not be read in %.0f s: starting on the "
            "configured checkpoint (the control plane catches up once it runs)",
            READ_TIMEOUT_S,
        )
        return CatchUpPlan()


@contextlib.asynccontextmanager
async def _reader(
    settings: Settings, kafka_clients: KafkaClients
) -> AsyncIterator[AIOKafkaConsumer]:
    consumer = kafka_clients.consumer(
        **client_kwargs(settings),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


@dataclass(frozen=True)
class StartingCheckpoint:
    """A checkpoint the fleet applied, for a worker that has not built its engine."""

    update: UpdateWeights
    path: str


async def checkpoints_to_start_on(
    settings: Settings, served: Path | None, *, kafka_clients: KafkaClients = AIOKAFKA
) -> list[StartingCheckpoint]:
    """The checkpoint-path updates the fleet applied for this worker that pass every check
    made before a load (the update policy, and against the start-up checkpoint `served`:
    architecture and tensor shapes), newest first. A worker builds its engine on the first
    that starts, instead of on its start-up checkpoint and then again on that one; when none
    starts, on its start-up checkpoint."""
    if served is None:
        return []
    plan = await read_catch_up_plan(settings, settings.weight_version, kafka_clients=kafka_clients)
    if not plan.checkpoints:
        return []
    policy = WeightsPolicy(settings)
    try:
        config = json.loads((served / "config.json").read_text(encoding="utf-8"))
        shapes = await asyncio.to_thread(tensor_shapes, served)
    except (OSError, ValueError, WeightUpdateError):
        return []  # the engine's own start reports what is wrong with it
    starts = []
    for update in plan.checkpoints:
        assert update.path is not None  # noqa: S101 - checkpoint updates carry a path
        try:
            await asyncio.to_thread(policy.check, update)
            checked = await asyncio.to_thread(
                check_checkpoint, Path(update.path), SimpleNamespace(**config), shapes
            )
        except WeightUpdateError as exc:
            logger.error(  # noqa: TRY400 - the reason is the message; no traceback to show
                "the fleet applied %s (version %d, command %s) but it no longer passes the "
                "checks: %s",
                update.path,
                update.version,
                update.command_id,
                exc,
            )
            continue
        starts.append(StartingCheckpoint(update=update, path=str(checked)))
    return starts
