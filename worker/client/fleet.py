"""The fleet as a controller sees it: send a command, find the live workers, collect acks.

Used by `vllm-kafka-worker control` and `status`, and usable from a trainer's own code. Only
aiokafka: no engine here. Every call that reads or writes takes a `timeout_s` and raises
`TimeoutError` past it: a status partition without a leader would otherwise keep a reader
waiting for records that never come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, TypeVar

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from schemas import (
    Command,
    CommandAck,
    SchemaError,
    Target,
    WorkerStatus,
    decode_status,
    encode,
    sign_command,
)
from worker.core.clients import AIOKAFKA, KafkaClients
from worker.core.clock import SYSTEM_CLOCK, Clock
from worker.core.config import Settings
from worker.core.errors import BrokerError
from worker.core.kafka import client_kwargs

__all__ = ["Fleet", "aiokafka_quiet", "new_command_id", "start_clients"]

T = TypeVar("T")

#: How far back, in records per partition, the status topic is read for live workers.
STATUS_TAIL_RECORDS: Final = 5000
#: A worker silent for this many of its heartbeat intervals is taken for gone.
MISSED_HEARTBEATS: Final = 3
#: A status record larger than this is not one a worker wrote (an acknowledgement's detail is
#: cut at 2000 characters): skipped unread, so hostile records cannot fill the reader's memory.
MAX_STATUS_RECORD_BYTES: Final = 64 * 1024


def new_command_id() -> str:
    return f"cmd-{uuid.uuid4().hex[:12]}"


async def start_clients(
    clients: Sequence[AIOKafkaProducer | AIOKafkaConsumer],
    servers: str,
    what: str,
    *,
    quiet: bool = False,
) -> None:
    """Start `clients` in order, for `what`. A broker that cannot be reached (or refuses them)
    is a `BrokerError` saying what was tried, and leaves none of them open: an aiokafka client
    not stopped, even one never started, is reported unclosed when it is collected. `quiet`:
    aiokafka logs nothing below CRITICAL meanwhile (a command line, whose one line of error
    says it all, and which runs nothing else while it connects)."""
    try:
        with aiokafka_quiet(quiet):
            for client in clients:
                await client.start()
    except (KafkaError, OSError) as exc:
        for client in reversed(clients):
            with contextlib.suppress(Exception):  # stopping a half-started client may fail too
                await client.stop()
        raise BrokerError(f"{what}: cannot reach Kafka at {servers} ({exc})") from None


@contextlib.contextmanager
def aiokafka_quiet(quiet: bool = True) -> Iterator[None]:
    """aiokafka logs nothing below CRITICAL within (when `quiet`): for a command line that
    reports a broker it cannot reach in one line of its own."""
    aiokafka_logger = logging.getLogger("aiokafka")
    level = aiokafka_logger.level
    if quiet:
        aiokafka_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        aiokafka_logger.setLevel(level)


class Fleet:
    """A connection to the control and status topics (`async with Fleet(...) as fleet`).

    `connection`: aiokafka's connection and security arguments (`bootstrap_servers`,
    `security_protocol`, `ssl_context`, `sasl_*`, ...), given to every client it opens.
    `control_hmac_key`: the fleet's `--control-hmac-key`; every command sent is signed with it.
    `clock`: what heartbeats are judged live on, commands dated and waits bounded by (the
    system's by default).

    Anyone who can write to the status topic is read here: records that are not status
    messages, or too large to be one, are skipped, and a heartbeat dated further ahead than
    its own liveness window does not count (one forged record cannot keep a phantom worker
    "live", and every update waiting for it, for long).
    """

    def __init__(
        self,
        connection: Mapping[str, Any],
        *,
        control_topic: str,
        status_topic: str,
        control_hmac_key: str | None = None,
        quiet_start: bool = False,
        kafka_clients: KafkaClients = AIOKAFKA,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._clock = clock
        self._control_topic = control_topic
        self._quiet_start = quiet_start
        self._status_topic = status_topic
        self._key = None if control_hmac_key is None else control_hmac_key.encode()
        self._servers = str(connection.get("bootstrap_servers"))
        self._producer = kafka_clients.producer(**connection, acks="all")
        # Beyond the worker's port: the client assigns, positions and lists topics itself.
        self._consumer: AIOKafkaConsumer = kafka_clients.consumer(
            **connection, group_id=None, enable_auto_commit=False
        )
        self._partitions: list[TopicPartition] = []

    @classmethod
    def from_settings(cls, settings: Settings, *, quiet_start: bool = False) -> Fleet:
        """The fleet `settings` name, connected as the worker's own clients are; `quiet_start`:
        see `start_clients`."""
        return cls(
            client_kwargs(settings),
            control_topic=settings.control_topic,
            status_topic=settings.status_topic,
            control_hmac_key=settings.control_hmac_key,
            quiet_start=quiet_start,
        )

    async def __aenter__(self) -> Fleet:
        await start_clients(
            (self._producer, self._consumer),
            self._servers,
            f"reading {self._status_topic} and writing {self._control_topic}",
            quiet=self._quiet_start,
        )
        topic = self._status_topic
        partitions = self._consumer.partitions_for_topic(topic)
        if partitions is None:
            await self._consumer.topics()
            partitions = self._consumer.partitions_for_topic(topic)
        if not partitions:
            await self.close()
            raise BrokerError(
                f"status topic {topic} does not exist (workers create it with --create-topics)"
            )
        self._partitions = [TopicPartition(topic, p) for p in sorted(partitions)]
        self._consumer.assign(self._partitions)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._consumer.stop()
        await self._producer.stop()

    async def status_end(self, *, timeout_s: float | None = None) -> dict[TopicPartition, int]:
        """The status topic's end offsets (where acknowledgements of a command sent now
        start)."""
        return await self._within(
            self._consumer.end_offsets(self._partitions), timeout_s, "the status topic's end"
        )

    async def live_workers(
        self, target: Target | None = None, *, timeout_s: float | None = None
    ) -> dict[str, WorkerStatus]:
        """The latest heartbeat of each worker heard from within a few of its intervals."""
        return await self._within(self._live_workers(target), timeout_s, "the live workers")

    async def _live_workers(self, target: Target | None) -> dict[str, WorkerStatus]:
        end = dict(await self._consumer.end_offsets(self._partitions))
        begin = await self._consumer.beginning_offsets(self._partitions)
        latest: dict[str, WorkerStatus] = {}
        for tp in self._partitions:
            start = max(end[tp] - STATUS_TAIL_RECORDS, begin[tp])
            self._consumer.seek(tp, start)
        now = self._clock.wall()
        async for message in self._read_until(end):
            if isinstance(message, WorkerStatus) and _live(message, now):
                latest[message.worker] = message
        return {
            worker: status
            for worker, status in latest.items()
            if target is None or target.matches(status.group, status.worker)
        }

    async def send(self, command: Command, *, timeout_s: float | None = None) -> None:
        """Produce `command` to the control topic and wait for the broker's acknowledgement.
        It is stamped `issued_at` now when it has none: workers refuse stale commands."""
        if command.issued_at is None:
            command = msgspec.structs.replace(command, issued_at=self._clock.wall())
        if self._key is not None:
            command = sign_command(command, self._key)
        await self._within(
            self._producer.send_and_wait(
                self._control_topic, value=encode(command), key=command.command_id.encode()
            ),
            timeout_s,
            f"the broker's acknowledgement of {command.command_id}",
        )

    async def _within(self, call: Awaitable[T], timeout_s: float | None, what: str) -> T:
        try:
            async with asyncio.timeout(timeout_s):
                return await call
        except TimeoutError:
            raise TimeoutError(
                f"{what}: nothing within {timeout_s:.1f} s (a partition of {self._status_topic} "
                f"or {self._control_topic} without a leader, or the broker unreachable?)"
            ) from None

    async def acks(
        self,
        command_id: str,
        workers: Iterable[str],
        since: dict[TopicPartition, int],
        timeout_s: float,
    ) -> dict[str, CommandAck]:
        """Acknowledgements of `command_id` from `workers`, read from `since`, until all are in
        or `timeout_s` passes (then the ones that came)."""
        wanted = set(workers)
        got: dict[str, CommandAck] = {}
        for tp, offset in since.items():
            self._consumer.seek(tp, offset)
        deadline = self._clock.monotonic() + timeout_s
        while wanted - set(got) and self._clock.monotonic() < deadline:
            # Rounded up: the last fraction of a millisecond, rounded down, asked for no wait
            # at all, and the loop spun without time passing for it (for ever on a clock that
            # moves only while everything waits, as the simulation's does).
            left_ms = math.ceil((deadline - self._clock.monotonic()) * 1000)
            try:
                async with asyncio.timeout(left_ms / 1000 + 1.0):
                    batch = await self._consumer.getmany(timeout_ms=min(200, left_ms))
            except TimeoutError:
                break
            for records in batch.values():
                for record in records:
                    message = _decode(record.value)
                    if (
                        isinstance(message, CommandAck)
                        and message.command_id == command_id
                        and message.worker in wanted
                    ):
                        got[message.worker] = message
        return got

    async def _read_until(self, end: dict[TopicPartition, int]) -> AsyncIterator[object]:
        while True:
            positions = {tp: await self._consumer.position(tp) for tp in self._partitions}
            if all(positions[tp] >= end[tp] for tp in self._partitions):
                return
            batch = await self._consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    if (message := _decode(record.value)) is not None:
                        yield message


def _live(status: WorkerStatus, now: float) -> bool:
    """Heard from within a few of its intervals, and not dated beyond them."""
    window = MISSED_HEARTBEATS * status.interval_s
    return -window <= now - status.at <= window


def _decode(value: bytes | None) -> object | None:
    """The status message `value` holds; None for anything else (skipped)."""
    if value is None or len(value) > MAX_STATUS_RECORD_BYTES:
        return None
    try:
        return decode_status(value)
    except SchemaError:
        return None
