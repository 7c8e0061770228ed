"""The worker's group consumer as the worker sees it: the calls it makes, and nothing else.

aiokafka's consumer (`worker.core.paced_consumer.PacedConsumer`) stands behind it in
production, the simulation's (`worker.dev.sim.clients.SimConsumer`) under simulation and test
doubles in tests; mypy checks each against it. TigerBeetle and FoundationDB bring the network
into their state machines the same way, through an interface the simulation implements.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from worker.core.clock import Clock

__all__ = ["GroupConsumer"]


class GroupConsumer(Protocol):
    """A member of the jobs topic's consumer group: it fetches records of the partitions the
    group assigns it, remembers a position per partition, and commits offsets (with the
    metadata the worker keeps beside them) as the acknowledgement of what it has answered.

    The model is Kafka's classic group: the acknowledgement is an offset per partition, so
    a record is acknowledged by committing past it, and a record that ran and was not
    committed past runs again for the next owner. Two calls go beyond what aiokafka offers in
    public: the hand-over commit (`commit_hand_over`), which lands the offsets of partitions a
    rebalance has already taken away, and the leave (`leave_on_stop`), which a static member
    (KIP-345) makes only when told to.

    Another consumption model could stand behind the same seams. With Kafka's share groups
    (KIP-932) the acknowledgement is per record (accept, release, reject) and the broker counts
    each record's deliveries: `commit` would acknowledge the records below each offset, the
    hand-over would have no meaning (a share group has no exclusive assignment to hand over),
    `seek` would be refused, and a delivery count would come with each fetched record. None of
    that is built; the worker relies on the classic model's ordering within a partition.
    """

    # -- membership -----------------------------------------------------------------------------

    def subscribe(self, topics: list[str], listener: ConsumerRebalanceListener) -> None:
        """Join the group for `topics` when started, telling `listener` of each revoke and
        assignment."""

    async def start(self) -> None:
        """Connect and begin joining the group."""

    async def stop(self) -> None:
        """Close: a join under way is let finish, then the member leaves the group if it is a
        dynamic one or was told to (`leave_on_stop`). Stopping again does nothing."""

    def assignment(self) -> set[TopicPartition]:
        """The partitions the group assigns this member now."""

    def group_member_id(self) -> str | None:
        """The member id the group gave this consumer, while the consumer holds one (a refused
        commit makes it forget the id until it joins again)."""

    def rejoining(self) -> bool:
        """Whether the consumer has forgotten its generation (the group refused a commit of
        it) and is joining again: a commit made now is refused for the same reason, and one
        made once the join completes is taken in the new generation."""

    def leave_on_stop(
        self, last_member_id: str | None, /, *, within_s: float, clock: Clock
    ) -> None:
        """Have `stop()` leave the group, also as a static member, once its last join is done:
        under the member id the consumer holds then, else `last_member_id`, else (a static
        member) by its instance id; tried again for up to `within_s` on `clock` while the
        coordinator cannot be reached."""

    # -- fetching -------------------------------------------------------------------------------

    async def getmany(
        self, *, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        """Records of the assigned partitions not paused, at most `max_records`, waiting up to
        `timeout_ms` for some; a rebalance may run (its callbacks too) inside this call."""

    def pause(self, *partitions: TopicPartition) -> None:
        """Fetch nothing more of `partitions` until resumed."""

    def resume(self, *partitions: TopicPartition) -> None:
        """Fetch `partitions` again."""

    def paused(self) -> set[TopicPartition]:
        """The partitions paused now."""

    def seek(self, partition: TopicPartition, offset: int, /) -> None:
        """Fetch `partition` (assigned) from `offset` next."""

    # -- lag ------------------------------------------------------------------------------------

    def highwater(self, partition: TopicPartition, /) -> int | None:
        """The partition's end offset as the last fetch saw it; None before any."""

    async def end_offsets(self, partitions: list[TopicPartition], /) -> dict[TopicPartition, int]:
        """The partitions' end offsets, asked of their leaders now."""

    # -- commits --------------------------------------------------------------------------------

    async def commit(self, offsets: dict[TopicPartition, tuple[int, str]], /) -> None:
        """Commit (offset, metadata) for partitions assigned now, in the member's generation;
        a commit of a generation that is over is refused (CommitFailedError)."""

    async def commit_hand_over(self, offsets: Mapping[TopicPartition, tuple[int, str]]) -> None:
        """Commit (offset, metadata) in the member's current generation, also for partitions it
        no longer holds: the hand-over of partitions revoked in a rebalance whose commit was
        refused. The group takes a current generation's commit for any partition (Kafka's
        coordinator checks the generation, not ownership)."""
