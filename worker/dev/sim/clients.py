"""Simulated Kafka clients: the surface of aiokafka's consumer, producer and admin client that
the worker, its control plane and a trainer call, behaving as aiokafka 0.14 does on top of
`worker.dev.sim.cluster`.

Every request crosses the simulated network (a latency drawn from the run's one random
generator) on behalf of a `Process`; a killed process's requests and responses are lost, and
its calls never return, as a SIGKILLed client goes silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import random
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from aiokafka import ConsumerRecord
from aiokafka.errors import (
    CommitFailedError,
    GroupCoordinatorNotAvailableError,
    IllegalGenerationError,
    IllegalOperation,
    IllegalStateError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotLeaderForPartitionError,
    RebalanceInProgressError,
    UnknownMemberIdError,
    UnknownTopicOrPartitionError,
)
from aiokafka.structs import OffsetAndMetadata, RecordMetadata, TopicPartition

from worker.core.clock import Clock
from worker.core.kafka import leave_trying_again
from worker.dev.sim.cluster import (
    BATCH_OVERHEAD_BYTES,
    COORDINATOR_NODE,
    RECORD_OVERHEAD_BYTES,
    Cluster,
)

__all__ = ["Process", "SimAdmin", "SimBatch", "SimConsumer", "SimProducer"]

T = TypeVar("T")

# aiokafka's retry_backoff_ms default.
_RETRY_BACKOFF_S: Final = 0.1
Headers = list[tuple[str, bytes]]


class Process:
    """One worker process's network endpoint: `kill()` silences every client it made."""

    def __init__(self, name: str, cluster: Cluster, rng: random.Random) -> None:
        self.name = name
        self.cluster = cluster
        self.rng = rng
        self.alive = True
        self._silenced: asyncio.Future[None] | None = None

    def kill(self) -> None:
        self.alive = False

    def now(self) -> float:
        return asyncio.get_running_loop().time() - 1_000.0

    async def silent(self) -> Any:
        """Never returns: what a dead process's calls do."""
        if self._silenced is None:
            self._silenced = asyncio.get_running_loop().create_future()
        await self._silenced

    async def hop(self) -> None:
        """One way across the network."""
        await asyncio.sleep(self.rng.uniform(0.0005, 0.003))
        if not self.alive:
            await self.silent()

    async def request(self, call: Callable[[], T]) -> T:
        """Send `call` to the cluster and bring back its answer (or its error)."""
        await self.hop()
        try:
            answer = call()
        except KafkaError:
            await self.hop()
            raise
        await self.hop()
        return answer


class SimConsumer:
    """aiokafka's AIOKafkaConsumer as the worker uses it (`worker.core.consumer_port`): a
    classic group member (subscribe, eager rebalances with the listener's callbacks,
    heartbeats in the background, `max_poll_interval_ms` enforced client side) or, without a
    group, assigned partitions."""

    def __init__(
        self,
        process: Process,
        *,
        client_id: str,
        group_id: str | None,
        group_instance_id: str | None = None,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 3_000,
        max_poll_interval_ms: int = 300_000,
        rebalance_timeout_ms: int | None = None,
        assignor: Any = None,
    ) -> None:
        """`assignor`: the group's partition assignor as aiokafka takes it; only the member
        metadata it announces is used (the simulated coordinator assigns round robin)."""
        self.process = process
        self.cluster = process.cluster
        self.client_id = client_id
        self.group_id = group_id
        self.instance_id = group_instance_id
        self._session_s = session_timeout_ms / 1000
        self._heartbeat_s = heartbeat_interval_ms / 1000
        self._max_poll_s = max_poll_interval_ms / 1000
        self._rebalance_s = (rebalance_timeout_ms or session_timeout_ms) / 1000
        self._assignor = assignor
        self._metadata = b""
        self.generation = -1
        self.member_id = ""
        self._topics: list[str] = []
        self._listener: Any = None
        self._assigned: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._wake = asyncio.Event()
        self._rejoin = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_poll = 0.0
        self._poll_expired = False
        self._joining = False
        #: The coordinator's node as aiokafka holds it; None once an error reaching it marked
        #: it dead, until aiokafka's own tasks find it again (`_to_coordinator`).
        self.coordinator_id: int | None = COORDINATOR_NODE
        #: A join is under way, from the revoke callback to the assign callback: a close lets
        #: it finish. Set once closing: no join is begun.
        self._in_join = False
        self._closing = False
        self._unsubscribe: Callable[[], None] | None = None
        #: What the close does once its join is done: aiokafka's `_maybe_leave_group`, or the
        #: leave the worker asked for (`leave_on_stop`).
        self._leave_at_close: Callable[[], Awaitable[None]] = self._leave_as_aiokafka_does
        #: Clear while a JoinGroup is on its way or waits for the round: the member's next
        #: request to the coordinator goes on the same connection, and the broker reads it only
        #: once the JoinGroup is answered (Kafka's SocketServer mutes a channel until then).
        self._join_idle = asyncio.Event()
        self._join_idle.set()
        self._commit_lock = asyncio.Lock()

    # -- lifecycle --------------------------------------------------------------------------

    def subscribe(self, topics: list[str], listener: Any = None) -> None:
        self._topics = list(topics)
        self._listener = listener
        if self._assignor is not None:
            self._metadata = self._assignor.metadata(self._topics).encode()

    async def start(self) -> None:
        await self.process.hop()
        self._unsubscribe = self.cluster.subscribe_appends(self._appended)
        self._last_poll = self.process.now()
        if self.group_id is not None and self._topics:
            self._rejoin.set()
            self._tasks = [
                asyncio.create_task(self._coordinate(), name=f"{self.client_id} coordinator"),
                asyncio.create_task(self._heartbeat(), name=f"{self.client_id} heartbeat"),
            ]

    async def stop(self) -> None:
        """aiokafka's close (`GroupCoordinator.close`): no join is begun once closing, and one
        on its way is let finish, callbacks and all; then `_leave_at_close`: aiokafka's
        `_maybe_leave_group`, where a dynamic member leaves the group and a static one does not
        (KIP-345: it is expected back under its instance id), unless the worker asked for its
        own leave (`leave_on_stop`)."""
        if self._closing:
            return  # aiokafka's stop, called again, does nothing
        self._closing = True
        coordinate, heartbeat = self._tasks or (None, None)
        self._tasks = []
        if coordinate is not None and heartbeat is not None:
            heartbeat.cancel()
            if not self._in_join:
                coordinate.cancel()
            await asyncio.gather(coordinate, heartbeat, return_exceptions=True)
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self.group_id is not None:
            await self._leave_at_close()
        self.left_group()

    def _appended(self, tp: TopicPartition) -> None:
        if tp in self._assigned and tp not in self._paused:
            self._wake.set()

    def left_group(self) -> None:
        self.generation, self.member_id = -1, ""

    def group_member_id(self) -> str | None:
        """aiokafka's coordinator's member id, while it holds one of a generation."""
        if self.group_id is None or self.generation < 0 or not self.member_id:
            return None
        return self.member_id

    def rejoining(self) -> bool:
        return self.group_id is not None and self.generation < 0

    # -- leaving ------------------------------------------------------------------------------

    def leave_on_stop(
        self, last_member_id: str | None, /, *, within_s: float, clock: Clock
    ) -> None:
        """As `worker.core.kafka.leave_group_on_close` on aiokafka's consumer: the close leaves
        (`_leave_for_good`) where aiokafka's would call `_maybe_leave_group`."""
        if self.group_id is None:
            return
        self._leave_at_close = functools.partial(
            self._leave_for_good, last_member_id, within_s, clock
        )

    async def _leave_as_aiokafka_does(self) -> None:
        """aiokafka's `_maybe_leave_group`: a dynamic member of a generation leaves (once,
        errors ignored); every member forgets its generation."""
        if self.generation > 0 and self.instance_id is None:
            with contextlib.suppress(KafkaError):
                await self._send_req(functools.partial(self._send_leave, self.member_id, None))
        self.left_group()

    async def _leave_for_good(
        self, last_member_id: str | None, within_s: float, clock: Clock
    ) -> None:
        """`worker.core.kafka.leave_group`, then the generation forgotten."""
        await leave_trying_again(
            lambda: self._leave_once(self.group_member_id() or last_member_id),
            group_id=self.group_id or "",
            within_s=within_s,
            clock=clock,
        )
        self.left_group()

    async def _leave_once(self, leaving_as: str | None) -> KafkaError | None:
        """`worker.core.kafka._leave_once`: by member id, else (a static member the group
        knows under no such id) by instance id."""
        error: KafkaError | None = UnknownMemberIdError()
        if leaving_as:
            error = await self._leave(leaving_as, None)
        if self.instance_id is not None and isinstance(error, UnknownMemberIdError):
            error = await self._leave(None, self.instance_id)
        return error

    async def _leave(self, member_id: str | None, instance_id: str | None) -> KafkaError | None:
        """One LeaveGroup sent as `worker.core.kafka._send_to_coordinator` sends it: through
        aiokafka's `_send_req` while aiokafka holds a coordinator, else to the coordinator it
        looks up itself; the error it ended with, or None."""
        send = functools.partial(self._send_leave, member_id, instance_id)
        try:
            if self.coordinator_id is not None:
                await self._send_req(send)
            else:
                await self.process.request(self.cluster.find_coordinator)
                await send()
        except UnknownMemberIdError:
            return UnknownMemberIdError()  # as read from the answer's error code
        except KafkaError as exc:
            return exc
        return None

    async def _send_req(self, send: Callable[[], Awaitable[None]]) -> None:
        """aiokafka's `GroupCoordinator._send_req`: refused at once while the coordinator is
        held for dead, and an error reaching it marks it dead."""
        if self.coordinator_id is None:
            raise GroupCoordinatorNotAvailableError()
        try:
            await send()
        except GroupCoordinatorNotAvailableError:
            self.coordinator_id = None
            raise

    async def _send_leave(self, member_id: str | None, instance_id: str | None) -> None:
        """LeaveGroup by `member_id`, or (v3) by `instance_id`; UnknownMemberIdError when the
        group knows no such member. It waits behind a JoinGroup on its way."""
        group_id = self.group_id or ""
        await self._join_idle.wait()

        def leave() -> None:
            now = self.process.now()
            if instance_id is not None:
                self.cluster.leave_instance(group_id, instance_id, now)
            else:
                self.cluster.leave(group_id, member_id or "", now)

        await self.process.request(leave)
        self.left_group()

    # -- group membership ---------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            if not self.member_id or self.generation < 0:
                continue
            if self.process.now() - self._last_poll > self._max_poll_s:
                # aiokafka's heartbeat routine: "consumer poll timeout has expired"; the
                # member leaves and joins again at the next poll.
                self.cluster.history.add("poll_timeout", client=self.client_id)
                member_id = self.member_id
                self.left_group()
                self._poll_expired = True
                self._rejoin.set()
                with contextlib.suppress(KafkaError):
                    await self._to_coordinator(
                        functools.partial(
                            self.cluster.leave, self.group_id or "", member_id, self.process.now()
                        )
                    )
                continue
            if self._joining:
                continue  # aiokafka stops its heartbeat task while it joins
            member_id, generation = self.member_id, self.generation
            try:
                await self._to_coordinator(
                    functools.partial(
                        self.cluster.heartbeat,
                        self.group_id or "",
                        member_id,
                        generation,
                        self.process.now(),
                    )
                )
            except RebalanceInProgressError:
                self._rejoin.set()
            except (IllegalGenerationError, UnknownMemberIdError):
                if self._joining or (self.member_id, self.generation) != (member_id, generation):
                    continue  # the answer to a beat of a generation left since
                # aiokafka's reset_generation: join afresh, as a new member.
                self.left_group()
                self._rejoin.set()
            except GroupCoordinatorNotAvailableError:
                pass  # looked up again at the next beat

    async def _coordinate(self) -> None:
        while not self._closing:
            await self._rejoin.wait()
            while self._poll_expired:  # noqa: ASYNC110 - aiokafka rejoins at the next poll
                await asyncio.sleep(self._heartbeat_s)
            self._rejoin.clear()
            self._in_join = True
            try:
                await self._join()
            finally:
                self._in_join = False

    async def _join(self) -> None:
        # aiokafka's _on_join_prepare: the whole assignment is revoked first (eager protocol),
        # the callback awaited while the member still heartbeats.
        revoked = set(self._assigned)
        if self._listener is not None and revoked:
            await self._listener.on_partitions_revoked(revoked)
        self._assigned, self._paused = set(), set()
        self._positions = {}
        self._joining = True
        while True:
            self._join_idle.clear()
            try:
                joined = await self._to_coordinator(
                    lambda: self.cluster.join(
                        self.group_id or "",
                        member_id=self.member_id,
                        client_id=self.client_id,
                        instance_id=self.instance_id,
                        metadata=self._metadata,
                        topics=self._topics,
                        session_s=self._session_s,
                        rebalance_s=self._rebalance_s,
                        now=self.process.now(),
                    )
                )
                generation, member_id, assignment = await joined
                # aiokafka resets its rejoin flag as it sends SyncGroup: a rejoin asked for
                # while the join was under way (a commit refused meanwhile) is dropped.
                self._rejoin.clear()
                await self.process.hop()
            except UnknownMemberIdError:
                self.left_group()
                if await self._closed_after_backoff():
                    return
                continue
            except GroupCoordinatorNotAvailableError:
                if await self._closed_after_backoff():
                    return
                continue
            finally:
                self._join_idle.set()
            break
        self.generation, self.member_id = generation, member_id
        self._joining = False
        self.cluster.history.add(
            "joined",
            client=self.client_id,
            process=self.process.name,
            member=member_id,
            generation=generation,
            tps=sorted(f"{tp.topic}-{tp.partition}" for tp in assignment),
        )
        # The fetcher looks the committed positions up before fetching.
        while True:
            try:
                committed = await self._to_coordinator(
                    lambda: self.cluster.fetch_committed(self.group_id or "", assignment)
                )
            except GroupCoordinatorNotAvailableError:
                if await self._closed_after_backoff():
                    return
                continue
            break
        self._assigned = set(assignment)
        self._positions = {tp: max(offset, 0) for tp, (offset, _) in committed.items()}
        self._wake.set()
        if self._listener is not None:
            await self._listener.on_partitions_assigned(set(assignment))

    async def _to_coordinator(self, call: Callable[[], T]) -> T:
        """A request of aiokafka's own tasks to the group coordinator. An answer that it is
        away marks it dead (`GroupCoordinator.coordinator_dead`); any other answer means it
        was found (those tasks look it up before their next request while it is held for
        dead, `ensure_coordinator_known`; the lookup fails while it is away)."""
        try:
            answer = await self.process.request(call)
        except GroupCoordinatorNotAvailableError:
            self.coordinator_id = None
            raise
        except KafkaError:
            self.coordinator_id = COORDINATOR_NODE
            raise
        self.coordinator_id = COORDINATOR_NODE
        return answer

    async def _closed_after_backoff(self) -> bool:
        """After a failed try: whether the consumer is closing (aiokafka tries a join once per
        turn of its coordination loop, which ends once closing)."""
        self._join_idle.set()  # no JoinGroup is on its way during the backoff
        if not self._closing:
            await asyncio.sleep(_RETRY_BACKOFF_S)
        if self._closing:
            self._joining = False
        return self._closing

    # -- fetching ---------------------------------------------------------------------------

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        self._assigned = set(partitions)
        for tp in self._assigned:
            self._positions.setdefault(tp, 0)
        self._wake.set()

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    def pause(self, *partitions: TopicPartition) -> None:
        self._paused |= set(partitions) & self._assigned

    def resume(self, *partitions: TopicPartition) -> None:
        self._paused -= set(partitions)
        self._wake.set()

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if tp not in self._assigned:
            raise IllegalStateError(f"No current assignment for partition {tp}")
        self._positions[tp] = offset
        self._wake.set()

    async def position(self, tp: TopicPartition) -> int:
        return self._positions[tp]

    async def seek_to_end(self, *partitions: TopicPartition) -> None:
        """aiokafka's: each partition (all assigned when none is named) positioned at its end,
        looked up (ListOffsets) again after a backoff while its leader is away."""
        tps = list(partitions) or sorted(self._assigned)
        for tp in tps:
            if tp not in self._assigned:
                raise IllegalStateError(f"No current assignment for partition {tp}")
        while True:
            try:
                ends = await self.process.request(lambda: self._end_offsets_from_leaders(tps))
            except KafkaError:
                await asyncio.sleep(_RETRY_BACKOFF_S)
                continue
            break
        self._positions.update(ends)
        self._wake.set()

    def _end_offsets_from_leaders(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        for tp in tps:
            if self.cluster.broker_down or tp in self.cluster.leaderless:
                raise NotLeaderForPartitionError(str(tp))
        return {tp: self.cluster.end_offset(tp) for tp in tps}

    def highwater(self, tp: TopicPartition) -> int | None:
        if tp not in self._assigned:
            return None
        return self.cluster.end_offset(tp)

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        return await self.process.request(
            lambda: {tp: self.cluster.end_offset(tp) for tp in partitions}
        )

    async def beginning_offsets(
        self, partitions: list[TopicPartition]
    ) -> dict[TopicPartition, int]:
        return await self.process.request(
            lambda: {tp: self.cluster.beginning_offset(tp) for tp in partitions}
        )

    async def topics(self) -> set[str]:
        return await self.process.request(lambda: set(self.cluster.topics))

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        found = self.cluster.topics.get(topic)
        return None if found is None else set(range(len(found.logs)))

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        if not self.process.alive:
            await self.process.silent()
        self._last_poll = self.process.now()
        if self._poll_expired:
            self._poll_expired = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        while True:
            self._wake.clear()
            batch = self._collect(set(partitions), max_records or 1 << 30)
            if batch:
                await self.process.hop()
                # Records of partitions revoked meanwhile are dropped, as aiokafka's fetcher
                # drops those of partitions no longer assigned.
                return {tp: rs for tp, rs in batch.items() if tp in self._assigned}
            remaining = deadline - loop.time()
            if remaining <= 0:
                return {}
            try:
                async with asyncio.timeout(remaining):
                    await self._wake.wait()
            except TimeoutError:
                return {}

    def _collect(
        self, only: set[TopicPartition], budget: int
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        out: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {}
        for tp in sorted(self._assigned - self._paused):
            if (only and tp not in only) or tp not in self._positions or budget <= 0:
                continue
            position = self._positions[tp]
            stored = self.cluster.read(tp, position, min(budget, 500))
            if not stored:
                continue
            out[tp] = [
                ConsumerRecord(
                    tp.topic,
                    tp.partition,
                    r.offset,
                    r.timestamp_ms,
                    0,
                    r.key,
                    r.value,
                    None,
                    len(r.key or b""),
                    len(r.value or b""),
                    tuple(r.headers),
                )
                for r in stored
            ]
            self._positions[tp] = stored[-1].offset + 1
            budget -= len(stored)
        return out

    # -- commits ----------------------------------------------------------------------------

    async def commit_hand_over(self, offsets: Mapping[TopicPartition, tuple[int, str]]) -> None:
        """As `worker.core.kafka.commit_handed_over`: aiokafka's coordinator's commit, which
        checks no assignment; the plain commit without a group."""
        if self.group_id is None:
            await self.commit(dict(offsets))
            return
        await self.commit_offsets(dict(offsets))

    async def commit(self, offsets: dict[TopicPartition, Any]) -> None:
        """aiokafka's AIOKafkaConsumer.commit: assigned partitions only."""
        if self.group_id is None:
            raise IllegalOperation("Requires group_id")
        if not self._assigned:
            raise IllegalStateError("No partitions assigned")
        for tp in offsets:
            if tp not in self._assigned:
                raise IllegalStateError(f"Partition {tp} is not assigned")
        await self.commit_offsets(offsets)

    async def commit_offsets(self, offsets: dict[TopicPartition, Any]) -> None:
        """aiokafka's GroupCoordinator.commit_offsets: retries while the coordinator is away;
        a group error ends in CommitFailedError. The request is shielded: a caller that gives
        up does not stop it reaching the broker."""
        plain = {tp: _offset_and_metadata(value) for tp, value in offsets.items()}
        while True:
            try:
                async with self._commit_lock:
                    errors = await asyncio.shield(self._send_commit(plain))
            except GroupCoordinatorNotAvailableError:
                await asyncio.sleep(_RETRY_BACKOFF_S)
                continue
            if not errors:
                return
            first = next(iter(errors.values()))
            if isinstance(first, (UnknownMemberIdError, IllegalGenerationError)):
                # aiokafka's reset_generation: member id and generation both forgotten.
                self.left_group()
                self._rejoin.set()
            elif isinstance(first, RebalanceInProgressError):
                self._rejoin.set()
            else:
                raise first
            raise CommitFailedError(
                "Commit cannot be completed since the group has already rebalanced"
            ) from first

    async def _send_commit(
        self, offsets: dict[TopicPartition, tuple[int, str]]
    ) -> dict[TopicPartition, KafkaError]:
        member_id, generation = self.member_id, self.generation
        errors = await self._to_coordinator(
            lambda: self.cluster.commit(
                self.group_id or "",
                member_id,
                generation,
                offsets,
                client_id=self.client_id,
                now=self.process.now(),
            )
        )
        if delay_s := self.cluster.commit_answer_delay_s.pop(self.client_id, 0.0):
            await asyncio.sleep(delay_s)
            if not self.process.alive:
                await self.process.silent()
        return errors


def _offset_and_metadata(value: Any) -> tuple[int, str]:
    if isinstance(value, OffsetAndMetadata):
        return int(value.offset), str(value.metadata or "")
    if isinstance(value, tuple):
        return int(value[0]), str(value[1] if len(value) > 1 else "")
    return int(value), ""


class SimBatch:
    """aiokafka's BatchBuilder: records appended until `max_bytes` (the first always fits)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._size = BATCH_OVERHEAD_BYTES
        self.records: list[tuple[bytes | None, bytes | None, Headers]] = []
        self._closed = False

    def append(
        self, *, timestamp: int | None, key: bytes | None, value: bytes | None, headers: Any
    ) -> Any:
        size = _record_bytes(key, value, list(headers or []))
        if self.records and self._size + size > self._max_bytes:
            return None
        self._size += size
        self.records.append((key, value, list(headers or [])))
        return object()

    def close(self) -> None:
        self._closed = True

    @property
    def _relative_offset(self) -> int:
        return len(self.records)


def _record_bytes(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    return (
        RECORD_OVERHEAD_BYTES
        + len(key or b"")
        + len(value or b"")
        + sum(len(h) + len(v) for h, v in headers)
    )


@dataclass
class _MetadataResponse:
    topics: list[tuple[int, str, bool, list[Any]]]


class _ProducerClient:
    """`producer.client` as `worker.core.kafka.broker_has_topic` uses it."""

    def __init__(self, producer: SimProducer) -> None:
        self._producer = producer

    def get_random_node(self) -> int:
        return 0

    async def send(self, node: int, request: Any) -> _MetadataResponse:
        cluster = self._producer.process.cluster

        def metadata() -> _MetadataResponse:
            answers: list[tuple[int, str, bool, list[Any]]] = []
            for name in request._topics:
                try:
                    cluster.topic(name, create=True)
                    answers.append((0, name, False, []))
                except UnknownTopicOrPartitionError:
                    answers.append((UnknownTopicOrPartitionError.errno, name, False, []))
            return _MetadataResponse(answers)

        return await self._producer.process.request(metadata)


class _Lingering:
    """A batch that `send()` appends records to until the sender takes it (aiokafka's
    `MessageBatch` with an open builder), and each record's future."""

    __slots__ = ("created", "futures", "open", "records", "size")

    def __init__(self, created: float) -> None:
        self.created = created
        self.records: list[tuple[bytes | None, bytes | None, Headers]] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.size = BATCH_OVERHEAD_BYTES
        self.open = True


class SimProducer:
    """aiokafka's AIOKafkaProducer as the worker uses it: `send`, the batch API, and
    idempotence (`enable_idempotence`: a batch refused by the broker breaks the partition's
    sequence, so every later batch there fails, until the producer is rebuilt).

    `send()` batches as aiokafka's `MessageAccumulator.add_message` does: a record joins its
    partition's last batch while the sender has not taken it (it lingers `linger_ms`, or waits
    behind the batch in flight) and it has room (`max_batch_size`; its first record always
    fits). The broker checks `max.message.bytes` on the whole batch, so records each small
    enough can be refused together."""

    def __init__(
        self,
        process: Process,
        *,
        client_id: str,
        enable_idempotence: bool = False,
        max_request_size: int = 1_048_576,
        max_batch_size: int = 16_384,
        request_timeout_ms: int = 40_000,
        linger_ms: int = 0,
    ) -> None:
        self.process = process
        self.client_id = client_id
        self._idempotent = enable_idempotence
        self._max_request_size = max_request_size
        self._max_batch_size = max_batch_size
        self._request_timeout_s = request_timeout_ms / 1000
        self._linger_s = linger_ms / 1000
        # Per partition, the batch `send()` appends to until the sender takes it.
        self._lingering: dict[TopicPartition, _Lingering] = {}
        # Partitions per topic, as the producer's metadata knows them.
        self._partition_counts: dict[str, int] = {}
        self._producer_id: int | None = None
        self._locks: dict[TopicPartition, asyncio.Lock] = {}
        # Batches waiting for their partition's batch in flight, and the event set whenever a
        # partition has none waiting.
        self._undrained: dict[TopicPartition, int] = {}
        self._drained: dict[TopicPartition, asyncio.Event] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self._round_robin = 0
        self.client = _ProducerClient(self)

    async def start(self) -> None:
        if self._idempotent:
            self._producer_id = await self.process.request(self.process.cluster.new_producer_id)

    async def flush(self) -> None:
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def stop(self) -> None:
        await self.flush()

    async def partitions_for(self, topic: str) -> set[int]:
        found = await self.process.request(lambda: self.process.cluster.topic(topic, create=True))
        return set(range(len(found.logs)))

    def create_batch(self) -> SimBatch:
        return SimBatch(self._max_batch_size)

    async def send_batch(self, batch: SimBatch, topic: str, *, partition: int) -> Any:
        tp = TopicPartition(topic, partition)
        # aiokafka's `MessageAccumulator.add_batch`: while a batch of the partition still waits
        # to be sent (one is in flight, a broker is away), the next waits for it to drain, for
        # at most request_timeout_ms, then fails with KafkaTimeoutError.
        if self._undrained.get(tp):
            drained = self._drained.setdefault(tp, asyncio.Event())
            try:
                async with asyncio.timeout(self._request_timeout_s):
                    while self._undrained.get(tp):
                        drained.clear()
                        await drained.wait()
            except TimeoutError:
                raise KafkaTimeoutError() from None
        return self._submit(tp, list(batch.records))

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Any = None,
        **_: Any,
    ) -> asyncio.Future[Any]:
        headers = list(headers or [])
        if _record_bytes(key, value, headers) > self._max_request_size:
            # Checked client side on the record (aiokafka's _serialize).
            raise MessageSizeTooLargeError("larger than max_request_size")
        if partition is None:
            # aiokafka asks the cluster only for a topic it has no metadata for: later sends
            # append at once, so sends made together batch together.
            count = self._partition_counts.get(topic) or len(await self.partitions_for(topic))
            self._partition_counts[topic] = count
            if key is not None:
                partition = zlib.crc32(key) % count
            else:
                partition, self._round_robin = self._round_robin % count, self._round_robin + 1
        tp = TopicPartition(topic, partition)
        size = _record_bytes(key, value, headers)
        batch = self._lingering.get(tp)
        if batch is None or not batch.open or batch.size + size > self._max_batch_size:
            batch = self._lingering[tp] = _Lingering(self.process.now())
            delivery = self._submit(tp, batch.records, batch)
            delivery.add_done_callback(functools.partial(_settle_records, tp, batch.futures))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        batch.records.append((key, value, headers))
        batch.futures.append(future)
        batch.size += size
        return future

    async def send_and_wait(self, topic: str, **kwargs: Any) -> Any:
        return await (await self.send(topic, **kwargs))

    def _submit(
        self,
        tp: TopicPartition,
        records: list[tuple[bytes | None, bytes | None, Headers]],
        lingering: _Lingering | None = None,
    ) -> asyncio.Future[Any]:
        delivery: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        submitted_ms = int(self.process.now() * 1000)
        self._undrained[tp] = self._undrained.get(tp, 0) + 1
        task = asyncio.create_task(self._deliver(tp, records, delivery, submitted_ms, lingering))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return delivery

    async def _deliver(
        self,
        tp: TopicPartition,
        records: list[tuple[bytes | None, bytes | None, Headers]],
        delivery: asyncio.Future[Any],
        submitted_ms: int,
        lingering: _Lingering | None = None,
    ) -> None:
        process, cluster = self.process, self.process.cluster
        lock = self._locks.setdefault(tp, asyncio.Lock())
        # With idempotence, one batch per partition in flight: they land in order.
        async with lock:
            if lingering is not None:
                # Taken by the sender once its linger is over (at once, when the batch waited
                # that long behind the one in flight): `send()` appends to it no more.
                await asyncio.sleep(max(lingering.created + self._linger_s - process.now(), 0))
                lingering.open = False
                if self._lingering.get(tp) is lingering:
                    del self._lingering[tp]
            self._undrained[tp] -= 1
            if not self._undrained[tp] and (drained := self._drained.get(tp)) is not None:
                drained.set()
            deadline = process.now() + self._request_timeout_s
            while True:
                await process.hop()
                if cluster.ack_delay_s:
                    await asyncio.sleep(cluster.ack_delay_s)
                try:
                    base = cluster.produce(
                        self.client_id,
                        tp,
                        records,
                        producer_id=self._producer_id,
                        now_ms=int(process.now() * 1000),
                        submitted_ms=submitted_ms,
                    )
                except KafkaError as exc:
                    if exc.retriable and process.now() < deadline:
                        await asyncio.sleep(_RETRY_BACKOFF_S)
                        continue
                    await process.hop()
                    _settle(delivery, exc if not exc.retriable else KafkaTimeoutError())
                    return
                if cluster.lose_acks:
                    # Appended, but the response never comes: the batch expires.
                    await asyncio.sleep(max(deadline - process.now(), 0))
                    _settle(delivery, KafkaTimeoutError())
                    return
                await process.hop()
                _settle(delivery, RecordMetadata(tp.topic, tp.partition, tp, base, 0, -1, 0))
                return


def _settle_records(
    tp: TopicPartition, futures: list[asyncio.Future[Any]], delivery: asyncio.Future[Any]
) -> None:
    """Settle each record of a `send()` batch as its batch was: its own offset, or the batch's
    error (aiokafka's `MessageBatch.done` and `failure`)."""
    if delivery.cancelled():
        for future in futures:
            future.cancel()
        return
    error = delivery.exception()
    for index, future in enumerate(futures):
        if error is not None:
            _settle(future, copy.copy(error))
        else:
            base = delivery.result().offset
            _settle(future, RecordMetadata(tp.topic, tp.partition, tp, base + index, 0, -1, 0))


def _settle(delivery: asyncio.Future[Any], outcome: Any) -> None:
    if delivery.done():
        return
    if isinstance(outcome, BaseException):
        delivery.set_exception(outcome)
    else:
        delivery.set_result(outcome)


@dataclass
class _Described:
    body: dict[str, Any]

    def to_object(self) -> dict[str, Any]:
        return self.body


@dataclass
class _DescribedConfigs:
    #: (error code, error message, resource type, name, config entries), as aiokafka's
    #: DescribeConfigsResponse holds them.
    resources: list[tuple[int, str | None, int, str, list[tuple[Any, ...]]]]


class SimAdmin:
    """aiokafka's AIOKafkaAdminClient: committed offsets with metadata, DescribeGroups, and
    DescribeConfigs of topics."""

    def __init__(self, process: Process) -> None:
        self.process = process

    async def start(self) -> None:
        await self.process.hop()

    async def close(self) -> None:
        return

    async def list_consumer_group_offsets(
        self, group_id: str, partitions: list[TopicPartition] | None = None
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        committed = await self.process.request(
            lambda: self.process.cluster.fetch_committed(group_id, list(partitions or []))
        )
        return {
            tp: OffsetAndMetadata(offset, metadata) for tp, (offset, metadata) in committed.items()
        }

    async def describe_consumer_groups(self, group_ids: list[str]) -> list[_Described]:
        return [
            _Described(await self.process.request(lambda g=g: self.process.cluster.describe(g)))  # type: ignore[misc]
            for g in group_ids
        ]

    async def describe_configs(self, config_resources: list[Any]) -> list[_DescribedConfigs]:
        """DescribeConfigs of topics, answering `max.message.bytes` (the one config the
        worker reads); a topic the cluster lacks answers UNKNOWN_TOPIC_OR_PARTITION."""

        def described() -> list[_DescribedConfigs]:
            topics = self.process.cluster.topics
            rows: list[tuple[int, str | None, int, str, list[tuple[Any, ...]]]] = []
            for resource in config_resources:
                topic = topics.get(resource.name)
                if topic is None:
                    missing = UnknownTopicOrPartitionError.errno
                    rows.append((missing, "unknown topic", 2, resource.name, []))
                    continue
                entry = ("max.message.bytes", str(topic.max_message_bytes), False, False, False)
                rows.append((0, None, 2, resource.name, [entry]))
            return [_DescribedConfigs(rows)]

        return await self.process.request(described)


def noop(*_: Any) -> Awaitable[None]:
    return asyncio.sleep(0)
