"""Fakes for unit tests: a scripted engine, an in-memory producer and consumer, and an event
loop on a simulated clock."""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import (
    IllegalStateError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OffsetMetadataTooLargeError,
    UnknownTopicOrPartitionError,
)
from aiokafka.producer.message_accumulator import BatchBuilder

from schemas import Job
from worker.core.errors import EngineDeadError, EngineError, InvalidJobError
from worker.core.paced_consumer import GroupCallsThroughKafka
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.protocol import EngineOutput

T = TypeVar("T")


class ScriptedEngine:
    """The mock engine's outputs, with behaviour scripted by `job.metadata`:

    - `delay_s`: sleep that long first;
    - `gate`: wait until `release(name)` is called;
    - `fail`: `engine_error` | `engine_error_final` | `invalid` | `dead` | `bug`.

    It records what the worker did to it: peak concurrency, cancelled request ids, calls, the
    trace headers each job's request came with.
    """

    def __init__(
        self, settings: MockEngineSettings | None = None, max_concurrency: int = 8
    ) -> None:
        self._inner = MockEngine(
            settings or MockEngineSettings(num_layers=4, top_k=2, num_experts=8)
        )
        self._max_concurrency = max_concurrency
        self._gates: dict[str, asyncio.Event] = {}
        self.running = 0
        self.peak_running = 0
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.trace_headers: dict[str, Mapping[str, str] | None] = {}
        self.closed = False
        self.healthy = True
        self.on_start: Callable[[Job], None] | None = None

    @property
    def model_name(self) -> str:
        return "scripted"

    @property
    def max_concurrency(self) -> int:
        return self._max_concurrency

    @property
    def supports_routed_experts(self) -> bool:
        return True

    @property
    def weight_version(self) -> int:
        return 0

    def gate(self, name: str) -> asyncio.Event:
        return self._gates.setdefault(name, asyncio.Event())

    def release(self, name: str) -> None:
        self.gate(name).set()

    async def start(self) -> None:
        await self._inner.start()

    async def generate(
        self, job: Job, request_id: str, *, trace_headers: Mapping[str, str] | None = None
    ) -> EngineOutput:
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        self.started.append(job.job_id)
        self.trace_headers[job.job_id] = trace_headers
        if self.on_start is not None:
            self.on_start(job)
        try:
            meta = job.metadata
            if "delay_s" in meta:
                await asyncio.sleep(float(meta["delay_s"]))
            if "gate" in meta:
                await self.gate(meta["gate"]).wait()
            match meta.get("fail"):
                case "engine_error":
                    raise EngineError("scripted transient failure")
                case "engine_error_final":
                    raise EngineError("scripted permanent failure", retryable=False)
                case "invalid":
                    raise InvalidJobError("scripted validation failure")
                case "dead":
                    raise EngineDeadError("scripted engine death")
                case "bug":
                    raise RuntimeError("scripted bug")
            return await self._inner.generate(job, request_id, trace_headers=trace_headers)
        except asyncio.CancelledError:
            self.cancelled.append(job.job_id)
            raise
        finally:
            self.running -= 1

    async def check_health(self) -> None:
        if not self.healthy:
            raise EngineDeadError("scripted: engine reported unhealthy")

    async def close(self) -> None:
        self.closed = True


class BatchProducer:
    """The producer's batch API, in memory: each submitted batch is kept with a future the test
    resolves. `batch_bytes` sizes the batches as the producer's `max_batch_size` would."""

    def __init__(self, partitions: dict[str, int], batch_bytes: int = 1 << 20) -> None:
        self.partitions = partitions
        self.batch_bytes = batch_bytes
        self.submitted: list[tuple[str, int, int, asyncio.Future[Any]]] = []
        self.refuse: BaseException | None = None

    async def partitions_for(self, topic: str) -> set[int]:
        if topic not in self.partitions:
            raise UnknownTopicOrPartitionError()
        return set(range(self.partitions[topic]))

    def create_batch(self) -> BatchBuilder:
        return BatchBuilder(self.batch_bytes, 0)

    async def send_batch(self, batch: BatchBuilder, topic: str, *, partition: int) -> Any:
        if self.refuse is not None:
            raise self.refuse
        assert batch._closed, "a batch is closed before it is submitted"
        delivery: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.submitted.append((topic, partition, batch._relative_offset, delivery))
        return delivery


class MemoryProducer(BatchProducer):
    """A whole producer in memory that acknowledges at once.

    Batches are acknowledged as submitted; `send()` keeps each record in `sent`. A record whose
    value is larger than `broker_limit` is refused the way a broker refuses it: its delivery
    fails with `MessageSizeTooLargeError` (batches are decoded to check their records).
    """

    def __init__(self, partitions: dict[str, int], broker_limit: int | None = None) -> None:
        super().__init__(partitions)
        self.broker_limit = broker_limit
        self.sent: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]] = []
        self.refusals = 0
        #: Deliveries still to expire unacknowledged, as aiokafka expires a batch whose
        #: acknowledgement does not come within request_timeout_ms (KafkaTimeoutError).
        self.expire_next = 0
        #: Deliveries still to leave unanswered (a broker or a leader away); they wait in
        #: `held` for the test to settle them.
        self.hold_next = 0
        self.held: list[asyncio.Future[Any]] = []
        #: While clear, `send_batch` waits, as aiokafka's does while a batch for the partition
        #: is still unsent (a broker away).
        self.taking_batches = asyncio.Event()
        self.taking_batches.set()

    async def start(self) -> None:
        return

    async def stop(self) -> None:
        return

    async def flush(self) -> None:
        return

    def create_batch(self) -> Any:
        return RecordingBatch(super().create_batch())

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> Any:
        await self.taking_batches.wait()
        delivery = await super().send_batch(batch, topic, partition=partition)
        self._deliver(delivery, [(topic, *record) for record in batch.records])
        return delivery

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        delivery: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._deliver(delivery, [(topic, key, value, list(headers or []))])
        return delivery

    def _deliver(
        self,
        delivery: asyncio.Future[Any],
        records: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]],
    ) -> None:
        if self.hold_next:
            self.hold_next -= 1
            self.held.append(delivery)
            return
        if self.expire_next:
            self.expire_next -= 1
            delivery.set_exception(KafkaTimeoutError())
            return
        limit = self.broker_limit
        if limit is not None and any(len(r[2] or b"") > limit for r in records):
            self.refusals += 1
            delivery.set_exception(MessageSizeTooLargeError())
            return
        self.sent.extend(records)
        delivery.set_result(None)


class RecordingBatch:
    """A producer's batch that remembers what was appended to it."""

    def __init__(self, inner: BatchBuilder) -> None:
        self.inner = inner
        self.records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = []

    @property
    def _closed(self) -> bool:
        return bool(self.inner._closed)

    @property
    def _relative_offset(self) -> int:
        return int(self.inner._relative_offset)

    def append(self, *, timestamp: int | None, key: bytes | None, value: Any, headers: Any) -> Any:
        metadata = self.inner.append(timestamp=timestamp, key=key, value=value, headers=headers)
        if metadata is not None:
            self.records.append((key, value, list(headers or [])))
        return metadata

    def close(self) -> None:
        self.inner.close()


class FakeConsumer(GroupCallsThroughKafka):
    """A consumer-group member in memory, for tests of the consume loop. Its group calls
    beyond aiokafka's public ones are `PacedConsumer`'s, so a test giving it a `_coordinator`
    runs `worker.core.kafka`'s helpers.

    `assign(tps)` schedules a rebalance that the next `getmany` carries out, calling the
    listener; like aiokafka, every partition of the new assignment starts unpaused.
    `commit` waits for `commit_gate` when one is set and refuses metadata over `metadata_limit`
    as a broker does.
    """

    def __init__(self) -> None:
        self.records: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {}
        self._positions: dict[TopicPartition, int] = {}
        self._assigned: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self._listener: Any = None
        self._next_assignment: set[TopicPartition] | None = None
        self.commits: list[dict[TopicPartition, int]] = []
        self.commit_gate: asyncio.Event | None = None
        self.commits_started = 0
        #: Each commit's metadata by partition; the broker's offset.metadata.max.bytes.
        self.metadata: list[dict[TopicPartition, str]] = []
        self.metadata_limit: int | None = None
        #: An empty fetch waits at most this long (a real consumer waits its whole timeout:
        #: None), so tests with long poll timeouts stay quick.
        self.empty_wait_cap_ms: int | None = 10
        #: Calls of getmany, and of pause: the consume loop's turns, seen from the consumer
        #: (at the in-flight cap, or with every partition held, a turn pauses instead of
        #: polling). A test that checks nothing happens waits for turns, not for a time.
        self.getmany_calls = 0
        self.pause_calls = 0
        self.closed = False

    def add(self, tp: TopicPartition, value: bytes, key: bytes | None = None) -> None:
        records = self.records.setdefault(tp, [])
        records.append(
            ConsumerRecord(
                tp.topic,
                tp.partition,
                len(records),
                int(time.time() * 1000),
                0,
                key,
                value,
                None,
                len(key or b""),
                len(value),
                (),
            )
        )

    def assign(self, tps: set[TopicPartition]) -> None:
        self._next_assignment = set(tps)

    def subscribe(self, topics: list[str], listener: Any) -> None:
        self._listener = listener

    async def start(self) -> None:
        return

    async def stop(self) -> None:
        """aiokafka's close ends with its coordinator's `_maybe_leave_group` (a test may give
        the consumer a `_coordinator`); closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        coordinator = getattr(self, "_coordinator", None)
        if coordinator is not None:
            await coordinator._maybe_leave_group()

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    def pause(self, *tps: TopicPartition) -> None:
        self.pause_calls += 1
        self._paused.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self._paused.difference_update(tps)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def start_at(self, tp: TopicPartition, offset: int) -> None:
        """Set up: where `tp` is fetched from once assigned (`seek` needs it assigned)."""
        self._positions[tp] = offset

    def seek(self, tp: TopicPartition, offset: int) -> None:
        # aiokafka: SubscriptionState._assigned_state.
        if tp not in self._assigned:
            raise IllegalStateError(f"No current assignment for partition {tp}")
        self._positions[tp] = offset

    def highwater(self, tp: TopicPartition) -> int:
        return len(self.records.get(tp, []))

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.highwater(tp) for tp in tps}

    async def getmany(
        self, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        self.getmany_calls += 1
        if self._next_assignment is not None:
            new, self._next_assignment = self._next_assignment, None
            await self.rebalance_now(new)
        out: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {}
        budget = max_records if max_records is not None else 1 << 30
        for tp in sorted(self._assigned - self._paused):
            position = self._positions[tp]
            taken = self.records.get(tp, [])[position : position + budget]
            if taken:
                out[tp] = taken
                self._positions[tp] = position + len(taken)
                budget -= len(taken)
        if not out:
            cap = self.empty_wait_cap_ms
            await asyncio.sleep((timeout_ms if cap is None else min(timeout_ms, cap)) / 1000)
        return out

    async def rebalance_now(self, new: set[TopicPartition]) -> None:
        """A rebalance to `new`, carried out at once (aiokafka's coordinator task runs one
        beside whatever the loop awaits). Incremental, as in Kafka's cooperative protocol: only
        lost partitions are revoked, so jobs of kept partitions are still running when the
        assignment arrives."""
        if (revoked := self._assigned - new) and self._listener is not None:
            await self._listener.on_partitions_revoked(revoked)
        self._assigned, self._paused = set(new), set()
        for tp in new:
            self._positions.setdefault(tp, 0)
        if self._listener is not None:
            await self._listener.on_partitions_assigned(set(new))

    async def commit(self, offsets: dict[TopicPartition, tuple[int, str]]) -> None:
        self.commits_started += 1
        if self.commit_gate is not None:
            await self.commit_gate.wait()
        limit = self.metadata_limit
        if limit is not None and any(len(meta) > limit for _, meta in offsets.values()):
            raise OffsetMetadataTooLargeError()
        self.commits.append({tp: position for tp, (position, _) in offsets.items()})
        self.metadata.append({tp: meta for tp, (_, meta) in offsets.items()})


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when every task waits, and then jumps straight to
    the next timer instead of sleeping until it.

    Sleeps, timeouts, poll waits and commit intervals take no real time, and how many loop
    turns fit in a simulated second does not depend on how fast or busy the machine is: a test
    that advances it by steps runs the same schedule everywhere. While the loop runs,
    `time.monotonic()` reads the same clock, so deadlines and intervals the code measures
    itself agree with its waits (a clock captured before, such as a default argument bound at
    import, stays real). For code that does no real I/O and runs nothing in threads: their
    wake-ups would arrive after the clock had jumped past their timeouts.

    A task that never waits for time (a callback chain that re-arms itself at once) stops the
    clock, and every timeout would then wait for ever, where a real loop would only burn CPU:
    after `STILL_TURNS_LIMIT` turns in a row without a wait, the loop raises
    `ClockStandsStillError` instead.
    """

    STILL_TURNS_LIMIT = 200_000

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def run_forever(self) -> None:
        real_monotonic = time.monotonic
        time.monotonic = self.time
        try:
            super().run_forever()
        finally:
            time.monotonic = real_monotonic

    def advance(self, seconds: float) -> None:
        self._now += seconds


def run_on_virtual_time(body: Coroutine[Any, Any, T]) -> T:
    """Run `body` to its end on a fresh `VirtualClockLoop` and return its result."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(body)
    finally:
        loop.close()


class ClockStandsStillError(RuntimeError):
    """A `VirtualClockLoop` turned `STILL_TURNS_LIMIT` times without any task waiting."""


class _JumpingSelector(selectors.DefaultSelector):
    """The loop's selector: where it would block for `timeout`, it moves the clock instead."""

    def __init__(self, clock: VirtualClockLoop) -> None:
        super().__init__()
        self._clock = clock
        self._still_turns = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if timeout == 0:
            self._still_turns += 1
            if self._still_turns > self._clock.STILL_TURNS_LIMIT:
                raise ClockStandsStillError(
                    f"{self._still_turns} loop turns without a wait: a task re-arms itself at "
                    f"once, and the simulated clock stands still at {self._clock.time():.3f} s"
                )
            return ready
        self._still_turns = 0
        if ready:
            return ready
        if timeout is None:
            # No timer is pending: only a wake-up from outside the loop can end this wait.
            return super().select(None)
        self._clock.advance(timeout)
        return []


class ManualClock:
    """A `worker.core.clock.Clock` that moves only when a test moves `now`; its wall reading
    moves with it, `wall` seconds since the epoch at `monotonic`."""

    def __init__(self, *, monotonic: float = 100.0, wall: float = 1_800_000_000.0) -> None:
        self.now = monotonic
        self._wall_offset = wall - monotonic

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self._wall_offset
