"""The one owner of fetching: which partitions are paused and why, and where each is rewound.

The crash-loop breaker, the version holds and the committer each decide which partitions must
not be fetched for now (`HoldReason`, `worker.loop.partition_states`); the gate asks them
afresh before every fetch, so no hold outlives its reason, and it alone pauses, resumes and
seeks the consumer. The loop keeps polling while partitions are held, so the group never
evicts the worker for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeAlias

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from worker.core.clock import Clock
from worker.core.consumer_port import GroupConsumer

__all__ = ["Batch", "HoldReason", "PartitionGate"]

Batch: TypeAlias = "dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]"


class HoldReason(Protocol):
    """Something that keeps partitions from being fetched until its reason is gone."""

    def held(self) -> set[TopicPartition]:
        """The partitions held now; asked before every fetch, so it may re-examine them."""
        ...


class PartitionGate:
    """Fetches from the consumer what no `HoldReason` holds back. At the in-flight cap it polls
    every `keepalive_s` at least (see `poll_paused`)."""

    def __init__(
        self,
        consumer: GroupConsumer,
        reasons: Sequence[HoldReason],
        *,
        keepalive_s: float,
        clock: Clock,
    ) -> None:
        self._consumer = consumer
        self._reasons = reasons
        self._keepalive_s = keepalive_s
        self._clock = clock
        self._polled = clock.monotonic()
        self._member_id: str | None = None
        self._left = False

    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment())

    async def start(self, topic: str, listener: ConsumerRebalanceListener) -> None:
        self._consumer.subscribe([topic], listener=listener)
        await self._consumer.start()

    def joined(self) -> None:
        """The group assigned partitions: note the member id it gave, to leave under it."""
        self._member_id = self._consumer.group_member_id() or self._member_id

    async def stop(self, *, leave: bool = False, leave_within_s: float = 0.0) -> None:
        """Close the consumer: a dynamic member leaves the group; a static member only when
        told to `leave` (it is scaled in, not restarted), trying for up to `leave_within_s`
        while the coordinator cannot be reached. Once: stopping again leaves no more."""
        if leave and not self._left:
            # Also before any join completed: a JoinGroup may be under way, and the group then
            # holds the instance for this process (a static member leaves by its instance id).
            # Left as the consumer closes, after its last join, not before it.
            self._left = True
            self._consumer.leave_on_stop(
                self._member_id, within_s=leave_within_s, clock=self._clock
            )
        await self._consumer.stop()

    async def fetch(self, max_records: int, timeout_ms: int) -> Batch:
        """Records of the partitions nothing holds, at most `max_records`."""
        consumer = self._consumer
        held = self.held()
        if resumable := consumer.paused() - held:
            consumer.resume(*resumable)
        if held:
            consumer.pause(*(held & consumer.assignment()))
        batch: Batch = await consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        self._polled = self._clock.monotonic()
        return batch

    async def poll_paused(self) -> Batch:
        """At the in-flight cap: pause everything, and poll anyway once `keepalive_s` has passed
        since the last poll, so the group does not evict the worker for exceeding
        `max_poll_interval_ms` (counted client-side between fetches) and coordinator errors
        still surface. Not on every call: asked for records while a partition is paused,
        aiokafka drops those it has fetched for it and fetches them again after the resume.
        A rebalance can complete inside this call; the records it returns are jobs like any
        other (dropping them would skip their offsets)."""
        consumer = self._consumer
        consumer.pause(*consumer.assignment())
        if self._clock.monotonic() - self._polled < self._keepalive_s:
            return {}
        batch: Batch = await consumer.getmany(timeout_ms=0)
        self._polled = self._clock.monotonic()
        return batch

    def pause(self, partitions: set[TopicPartition]) -> None:
        if partitions:
            self._consumer.pause(*partitions)

    def resume(self, partitions: set[TopicPartition]) -> None:
        """Let `partitions` be fetched again, those no reason holds."""
        if resumable := partitions - self.held():
            self._consumer.resume(*resumable)

    def rewind(self, tp: TopicPartition, offset: int) -> None:
        """Fetch `tp` from `offset` next: records fetched past it are fetched again later."""
        self._consumer.seek(tp, offset)

    def holds_everything(self) -> bool:
        """Every assigned partition is held (and there is at least one): a fetch would only
        wait out its timeout."""
        assigned = self.assignment()
        return bool(assigned) and self.held() >= assigned

    def held(self) -> set[TopicPartition]:
        held: set[TopicPartition] = set()
        for reason in self._reasons:
            held |= reason.held()
        return held
