"""What a worker starting on a fleet takes from the control topic before it serves.

The topic holds every command the fleet was sent (one partition, kept for ever: see
`create_topics`). Of those addressed to this worker and properly signed, the catch-up keeps:

- the weight updates the running fleet applied, replayed as the fleet saw them: an update
  older than the version before it was refused unless it said `force`, and nothing older than
  the version the worker starts with counts (an update from an earlier run on the same topic);
- of those, only checkpoint-path updates can be repeated: a `nccl` / `ipc` transfer needs the
  trainer at the rendezvous, which it left long ago. When the latest update was a transfer,
  the plan says so (`transfer`): the worker then reports `needs_weights` and holds its jobs
  (or serves the newest checkpoint, `--stale-weights-at-start serve`) until the next update;
- the latest pause or resume.

`read_catch_up_plan` reads the topic with a consumer of its own, so a caller can learn the
checkpoint to build an engine on before the engine (and the control plane) exists.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from schemas import (
    Command,
    Pause,
    Resume,
    SchemaError,
    UpdateWeights,
    decode_command,
    signature_problem,
)
from worker.control.policy import WeightsPolicy
from worker.core.config import Settings
from worker.core.errors import ConfigError, WeightUpdateError
from worker.core.kafka import client_kwargs
from worker.engines.vllm_weights import check_checkpoint, tensor_shapes

__all__ = [
    "CatchUpPlan",
    "CatchUpPlanner",
    "StartingCheckpoint",
    "check_control_partitions",
    "checkpoint_to_start_on",
    "read_catch_up_plan",
    "read_control_topic",
]

logger = logging.getLogger(__name__)

OnUnreadable = Callable[[ConsumerRecord[bytes, bytes], SchemaError], Awaitable[None]]


@dataclass
class CatchUpPlan:
    """The state the control topic holds for one worker."""

    #: Checkpoint-path updates the fleet applied, newest first: the first that loads is the
    #: worker's state (one that failed for this worker failed for the fleet too, which went on
    #: with the weights before it).
    checkpoints: list[UpdateWeights] = field(default_factory=list)
    #: The latest update, when it was a weight transfer (newer than every checkpoint).
    transfer: UpdateWeights | None = None
    #: The latest pause or resume.
    pause: Pause | Resume | None = None
    #: Every command id in the topic (signed ones, under a key): none is applied again.
    seen: set[str] = field(default_factory=set)
    #: The offset the plan was read up to.
    end: int = 0


class CatchUpPlanner:
    """Builds a `CatchUpPlan` from the commands addressed to a worker, in topic order."""

    def __init__(self, start_version: int) -> None:
        self._start = start_version
        self._version = start_version
        self._plan = CatchUpPlan()

    def add(self, command: Command) -> None:
        if isinstance(command, Pause | Resume):
            self._plan.pause = command
        if not isinstance(command, UpdateWeights):
            return
        if command.version < self._start:
            return  # older than what this worker was started on: another run's state
        if command.version < self._version and not command.force:
            return  # the fleet refused it: versions only move forward
        self._version = command.version
        if command.backend == "checkpoint":
            self._plan.checkpoints.insert(0, command)
            self._plan.transfer = None
        else:
            self._plan.transfer = command

    def plan(self, seen: set[str], end: int) -> CatchUpPlan:
        self._plan.seen, self._plan.end = seen, end
        return self._plan


async def check_control_partitions(consumer: AIOKafkaConsumer, topic: str) -> None:
    """Raise `ConfigError` for a control topic of more than one partition: every worker reads
    partition 0, so commands produced to the others (keyed by id) would never be seen."""
    partitions = consumer.partitions_for_topic(topic)
    if partitions is not None and len(partitions) > 1:
        raise ConfigError(
            f"control topic {topic} has {len(partitions)} partitions: it must have exactly one "
            "(recreate it with one partition; --create-topics does)"
        )


async def read_control_topic(
    consumer: AIOKafkaConsumer,
    settings: Settings,
    start_version: int,
    *,
    on_unreadable: OnUnreadable | None = None,
) -> CatchUpPlan:
    """Read the control topic (assigned to `consumer`, positioned at 0) up to its end."""
    tp = TopicPartition(settings.control_topic, 0)
    end = (await consumer.end_offsets([tp]))[tp]
    key = None if settings.control_hmac_key is None else settings.control_hmac_key.encode()
    planner = CatchUpPlanner(start_version)
    seen: set[str] = set()
    while await consumer.position(tp) < end:
        try:
            batch = await consumer.getmany(tp, timeout_ms=500)
        except KafkaError as exc:
            logger.warning("control topic fetch failed (%r); retrying", exc)
            await asyncio.sleep(1.0)
            continue
        for record in batch.get(tp, []):
            value = record.value or b""
            try:
                command = decode_command(value)
            except SchemaError as exc:
                if on_unreadable is not None:
                    await on_unreadable(record, exc)
                continue
            if key is not None and (problem := signature_problem(value, key)) is not None:
                # Not even its id is taken: a forged record must not shadow the real command
                # that comes later under the same id.
                logger.warning(
                    "control record at offset %d not taken at catch-up: %s", record.offset, problem
                )
                continue
            seen.add(command.command_id)
            if command.target.matches(settings.group_id, settings.worker_id):
                planner.add(command)
    return planner.plan(seen, end)


async def read_catch_up_plan(settings: Settings, start_version: int) -> CatchUpPlan:
    """The plan for the worker `settings` describe, read with a consumer of its own (an empty
    plan when the control topic does not exist). The checkpoint to build an engine on is the
    first of `plan.checkpoints` that `WeightsPolicy(settings).check` lets through."""
    consumer = AIOKafkaConsumer(
        **client_kwargs(settings),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        if settings.control_topic not in await consumer.topics():
            return CatchUpPlan()
        await check_control_partitions(consumer, settings.control_topic)
        tp = TopicPartition(settings.control_topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        return await read_control_topic(consumer, settings, start_version)
    finally:
        await consumer.stop()


@dataclass(frozen=True)
class StartingCheckpoint:
    """The checkpoint the control topic names for a worker that has not built its engine."""

    update: UpdateWeights
    path: str


async def checkpoint_to_start_on(
    settings: Settings, served: Path | None
) -> StartingCheckpoint | None:
    """The newest checkpoint-path update the control topic holds for this worker that passes
    every check made before a load (the update policy, and against the start-up checkpoint
    `served`: architecture and tensor shapes); None when there is none. A worker builds its
    engine on it directly instead of on its start-up checkpoint and then again on this one."""
    if served is None:
        return None
    plan = await read_catch_up_plan(settings, settings.weight_version)
    if not plan.checkpoints:
        return None
    policy = WeightsPolicy(settings)
    try:
        config = json.loads((served / "config.json").read_text(encoding="utf-8"))
        shapes = await asyncio.to_thread(tensor_shapes, served)
    except (OSError, ValueError, WeightUpdateError):
        return None  # the engine's own start reports what is wrong with it
    for update in plan.checkpoints:
        assert update.path is not None  # noqa: S101 - checkpoint updates carry a path
        try:
            await asyncio.to_thread(policy.check, update)
            checked = await asyncio.to_thread(
                check_checkpoint, Path(update.path), SimpleNamespace(**config), shapes
            )
        except WeightUpdateError as exc:
            logger.info("not starting on %s: %s", update.path, exc)
            continue
        return StartingCheckpoint(update=update, path=str(checked))
    return None
