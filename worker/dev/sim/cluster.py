"""The simulated cluster: topics and their logs, the group coordinator, the offset store.

Each rule cites where Apache Kafka states it (paths in apache/kafka unless said otherwise).
Only what the worker, its control plane and a trainer use is built. `Flavour` switches the
documented differences of the two brokers the project's integration tests run on
(`noida-db`, `tansu`), so that where those tests and the simulation overlap, they agree.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from aiokafka.errors import (
    GroupCoordinatorNotAvailableError,
    IllegalGenerationError,
    KafkaError,
    MessageSizeTooLargeError,
    NotLeaderForPartitionError,
    OffsetMetadataTooLargeError,
    OutOfOrderSequenceNumber,
    RebalanceInProgressError,
    TopicAuthorizationFailedError,
    UnknownMemberIdError,
    UnknownTopicOrPartitionError,
)
from aiokafka.structs import TopicPartition

from worker.dev.sim.history import History

__all__ = [
    "COORDINATOR_NODE",
    "Cluster",
    "Flavour",
    "Group",
    "GroupState",
    "Member",
    "StoredRecord",
    "Topic",
]

logger = logging.getLogger(__name__)

#: Bytes a record batch adds to its records (v2 batch header, 61 bytes, plus per-record
#: overhead, counted here as a flat 20): `clients/src/main/java/org/apache/kafka/common/record/
#: DefaultRecordBatch.java` RECORD_BATCH_OVERHEAD.
BATCH_OVERHEAD_BYTES: Final = 61
RECORD_OVERHEAD_BYTES: Final = 20
#: The one broker's node id, which FindCoordinator names for every group.
COORDINATOR_NODE: Final = 0


class Flavour(enum.Enum):
    """Whose rules the group follows where brokers differ (`/work/shared/NOTES.md` §4)."""

    #: Apache Kafka.
    KAFKA = "kafka"
    #: noida-db 0.2.3: never evicts a member that died without leaving (a new member then
    #: re-joins for ever), and refuses the old generation's commits from the moment another
    #: member asks to join.
    NOIDA = "noida"
    #: tansu 0.6.0: evicts, but DescribeGroups returns no member metadata, and the idempotent
    #: producer does not work (the tests run it with idempotence off).
    TANSU = "tansu"


class GroupState(enum.Enum):
    """`group-coordinator/.../classic/ClassicGroupState.java`."""

    EMPTY = "Empty"
    PREPARING_REBALANCE = "PreparingRebalance"
    COMPLETING_REBALANCE = "CompletingRebalance"
    STABLE = "Stable"


@dataclass
class StoredRecord:
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    #: Who appended it (a client id), for the trace.
    producer: str
    #: When its producer was handed it (the append comes later when the broker is slow or
    #: away); None for records written straight into the cluster.
    submitted_ms: int | None = None


@dataclass
class Topic:
    name: str
    logs: list[list[StoredRecord]]
    #: `max.message.bytes`: the largest record batch the topic takes, checked on the batch
    #: (`storage/src/main/java/org/apache/kafka/storage/internals/log/UnifiedLog.java`,
    #: analyzeAndValidateRecords: RecordBatchTooLargeException / MESSAGE_TOO_LARGE).
    max_message_bytes: int = 1_048_588
    #: Client ids allowed to write (None: everyone), as an ACL would
    #: (TopicAuthorizationFailed, `clients/.../errors/TopicAuthorizationException.java`).
    writers: frozenset[str] | None = None


@dataclass
class Member:
    member_id: str
    client_id: str
    instance_id: str | None
    metadata: bytes
    session_s: float
    rebalance_s: float
    last_heartbeat: float
    joined: asyncio.Future[tuple[int, str, list[TopicPartition]]] | None = None
    assignment: list[TopicPartition] = field(default_factory=list)


@dataclass
class Group:
    """A classic group (`group-coordinator/.../classic/ClassicGroup.java`)."""

    group_id: str
    state: GroupState = GroupState.EMPTY
    generation: int = 0
    members: dict[str, Member] = field(default_factory=dict)
    #: KIP-345: group.instance.id -> member id.
    static: dict[str, str] = field(default_factory=dict)
    round_deadline: float | None = None
    topics: list[str] = field(default_factory=list)


class Cluster:
    """Topics, one group coordinator, the offset store; the faults the schedule switches on."""

    def __init__(
        self,
        history: History,
        *,
        flavour: Flavour = Flavour.KAFKA,
        auto_create_topics: bool = False,
        offset_metadata_max_bytes: int = 4096,
        default_partitions: int = 1,
    ) -> None:
        self.history = history
        self.flavour = flavour
        #: `auto.create.topics.enable` (a metadata request for an unknown topic creates it).
        self.auto_create_topics = auto_create_topics
        #: `offset.metadata.max.bytes` (broker default 4096; `server/.../config/
        #: ServerConfigs`... GroupCoordinatorConfig.OFFSET_METADATA_MAX_SIZE_CONFIG).
        self.offset_metadata_max_bytes = offset_metadata_max_bytes
        self.default_partitions = default_partitions
        self.topics: dict[str, Topic] = {}
        self.groups: dict[str, Group] = {}
        #: (group, partition) -> (offset, metadata): the `__consumer_offsets` view.
        self.committed: dict[tuple[str, TopicPartition], tuple[int, str]] = {}
        # Faults, switched by the schedule.
        self.coordinator_down = False
        self.leaderless: set[TopicPartition] = set()
        self.broker_down = False
        #: Extra seconds every acknowledgement of a produce takes.
        self.ack_delay_s = 0.0
        #: Produce requests whose response is lost (the records are appended): the producer
        #: times out, not knowing.
        self.lose_acks = False
        # Idempotent producers: (producer id, partition) -> broken (a refused batch left a gap
        # in the sequence: `clients/.../producer/internals/TransactionManager.java`,
        # OutOfOrderSequenceException for every later batch of that producer id).
        self._broken_sequences: set[tuple[int, TopicPartition]] = set()
        self._member_ids = itertools.count(1)
        self._producer_ids = itertools.count(1000)
        self._wakers: list[Callable[[TopicPartition], None]] = []
        #: Each partition's log start offset, moved by `retain` (absent: 0). The records below
        #: it stay in `Topic.logs` for the checker, which judges the whole history; clients
        #: read from it on.
        self.log_start: dict[TopicPartition, int] = {}
        #: Told of each commit the group takes, once it is stored: the group, the committing
        #: member (None outside group management), its client id and the partitions. The
        #: fault schedule acts on some (`worker.dev.sim.run`); nothing may be awaited there.
        self.commit_watchers: list[
            Callable[[Group, Member | None, str, list[TopicPartition]], None]
        ] = []
        #: Extra seconds the answer to a client's next commit takes (client id -> seconds): the
        #: commit is stored, its answer late, as `ack_delay_s` does for a produce.
        self.commit_answer_delay_s: dict[str, float] = {}

    # -- topics ---------------------------------------------------------------------------

    def create_topic(
        self,
        name: str,
        partitions: int,
        *,
        max_message_bytes: int = 1_048_588,
        writers: frozenset[str] | None = None,
    ) -> Topic:
        topic = Topic(name, [[] for _ in range(partitions)], max_message_bytes, writers)
        self.topics[name] = topic
        return topic

    def topic(self, name: str, *, create: bool = False) -> Topic:
        """The topic `name`; created with the default partitions when `create` and the
        cluster creates topics on first use (`auto.create.topics.enable`)."""
        found = self.topics.get(name)
        if found is None:
            if create and self.auto_create_topics:
                return self.create_topic(name, self.default_partitions)
            raise UnknownTopicOrPartitionError(name)
        return found

    def end_offset(self, tp: TopicPartition) -> int:
        return len(self.topic(tp.topic).logs[tp.partition])

    def beginning_offset(self, tp: TopicPartition) -> int:
        return self.log_start.get(tp, 0)

    def read(self, tp: TopicPartition, offset: int, limit: int) -> list[StoredRecord]:
        if self.broker_down or tp in self.leaderless:
            return []  # the fetch fails; the consumer retries it in the background
        log = self.topic(tp.topic).logs[tp.partition]
        # Below the log start, a fetch resets to it (OffsetOutOfRange under
        # auto.offset.reset=earliest, which every reader of a retained topic uses).
        offset = max(offset, self.beginning_offset(tp))
        return log[offset : offset + limit]

    def retain(self, topic: str, older_than_ms: int) -> None:
        """Delete the records of `topic` appended before `older_than_ms`, as `retention.ms`
        does (from the oldest on; a log start never moves back)."""
        for partition, log in enumerate(self.topic(topic).logs):
            tp = TopicPartition(topic, partition)
            start = self.beginning_offset(tp)
            while start < len(log) and log[start].timestamp_ms < older_than_ms:
                start += 1
            if start != self.beginning_offset(tp):
                self.log_start[tp] = start
                self.history.add("retained", tp=_tp(tp), start=start)

    def subscribe_appends(self, wake: Callable[[TopicPartition], None]) -> Callable[[], None]:
        """Call `wake(partition)` after every append; returns the function that stops it."""
        self._wakers.append(wake)
        return lambda: self._wakers.remove(wake)

    def new_producer_id(self) -> int:
        """InitProducerId: a fresh id with sequences starting at 0."""
        return next(self._producer_ids)

    def produce(
        self,
        client_id: str,
        tp: TopicPartition,
        records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]],
        *,
        producer_id: int | None,
        now_ms: int,
        submitted_ms: int | None = None,
    ) -> int:
        """Append one batch; its base offset. Raises as the partition leader would.
        `submitted_ms`: when the producer was handed the batch."""
        topic = self.topic(tp.topic)
        if topic.writers is not None and client_id not in topic.writers:
            raise TopicAuthorizationFailedError(tp.topic)
        if tp.partition >= len(topic.logs):
            raise UnknownTopicOrPartitionError(str(tp))
        if self.broker_down or tp in self.leaderless:
            raise NotLeaderForPartitionError(str(tp))
        if producer_id is not None and (producer_id, tp) in self._broken_sequences:
            raise OutOfOrderSequenceNumber(str(tp))
        size = BATCH_OVERHEAD_BYTES + sum(
            RECORD_OVERHEAD_BYTES
            + len(k or b"")
            + len(v or b"")
            + sum(len(h) + len(b) for h, b in hs)
            for k, v, hs in records
        )
        if size > topic.max_message_bytes:
            if producer_id is not None:
                # The producer numbered this batch already: the next one leaves a gap.
                self._broken_sequences.add((producer_id, tp))
            raise MessageSizeTooLargeError(f"{size} > {topic.max_message_bytes} on {tp.topic}")
        log = topic.logs[tp.partition]
        base = len(log)
        for key, value, headers in records:
            log.append(StoredRecord(len(log), now_ms, key, value, headers, client_id, submitted_ms))
        self.history.add("append", client=client_id, tp=_tp(tp), base=base, count=len(records))
        for wake in list(self._wakers):
            wake(tp)
        return base

    # -- the group coordinator --------------------------------------------------------------

    def find_coordinator(self) -> int:
        """FindCoordinator: the coordinator's node, unless it is away."""
        self._coordinator()
        return COORDINATOR_NODE

    def _coordinator(self) -> None:
        if self.coordinator_down or self.broker_down:
            # `clients/.../errors/CoordinatorNotAvailableException.java`: retriable; the
            # client looks the coordinator up again.
            raise GroupCoordinatorNotAvailableError()

    def group(self, group_id: str) -> Group:
        return self.groups.setdefault(group_id, Group(group_id))

    def join(
        self,
        group_id: str,
        *,
        member_id: str,
        client_id: str,
        instance_id: str | None,
        metadata: bytes,
        topics: list[str],
        session_s: float,
        rebalance_s: float,
        now: float,
    ) -> asyncio.Future[tuple[int, str, list[TopicPartition]]]:
        """JoinGroup and SyncGroup in one: the future resolves, once the round completes, to
        (generation, member id, assignment)."""
        self._coordinator()
        group = self.group(group_id)
        group.topics = sorted(set(group.topics) | set(topics))
        loop = asyncio.get_running_loop()
        member = group.members.get(member_id) if member_id else None
        known_instance = instance_id is not None and instance_id in group.static
        if member is None and member_id and not known_instance:
            # GroupCoordinator.doCurrentMemberJoinGroup: a member id the group does not have
            # (it left, or was removed) is refused; aiokafka then joins afresh without one. (A
            # stale id whose instance another member holds is FENCED_INSTANCE_ID there; here
            # it takes the instance back, as a join without an id would.)
            raise UnknownMemberIdError()
        if member is None and instance_id is not None and known_instance:
            # KIP-345 (GroupMetadataManager.updateStaticMemberThenRebalanceOrCompleteJoin): a
            # known group.instance.id takes the old member's place under a new member id; in
            # a Stable group that keeps the selected protocol, without a rebalance.
            old = group.members.pop(group.static[instance_id])
            member = Member(
                f"{client_id}-{next(self._member_ids)}",
                client_id,
                instance_id,
                metadata,
                session_s,
                rebalance_s,
                now,
                assignment=old.assignment,
            )
            group.members[member.member_id] = member
            group.static[instance_id] = member.member_id
            self.history.add(
                "static_rejoin", group=group_id, member=member.member_id, replaced=old.member_id
            )
            if old.joined is not None and not old.joined.done():
                old.joined.set_exception(UnknownMemberIdError())
            if group.state is GroupState.STABLE:
                done = loop.create_future()
                done.set_result((group.generation, member.member_id, list(member.assignment)))
                return done
        elif member is None:
            member = Member(
                f"{client_id}-{next(self._member_ids)}",
                client_id,
                instance_id,
                metadata,
                session_s,
                rebalance_s,
                now,
            )
            group.members[member.member_id] = member
            if instance_id is not None:
                group.static[instance_id] = member.member_id
        member.metadata = metadata
        member.last_heartbeat = now
        if group.state is not GroupState.PREPARING_REBALANCE:
            self._prepare_rebalance(group, now, f"{member.member_id} joins")
        member.joined = loop.create_future()
        future = member.joined
        self._maybe_complete_round(group, now)
        return future

    def _prepare_rebalance(self, group: Group, now: float, why: str) -> None:
        """ClassicGroup PREPARING_REBALANCE: every member must rejoin within its rebalance
        timeout (the group's is the largest), or is removed when the round ends."""
        group.state = GroupState.PREPARING_REBALANCE
        timeouts = [m.rebalance_s for m in group.members.values()] or [0.0]
        group.round_deadline = now + max(timeouts)
        for member in group.members.values():
            if member.joined is not None and member.joined.done():
                member.joined = None
        self.history.add("rebalance", group=group.group_id, generation=group.generation, why=why)

    def _maybe_complete_round(self, group: Group, now: float) -> None:
        if group.state is not GroupState.PREPARING_REBALANCE:
            return
        waiting = [m for m in group.members.values() if m.joined is None]
        if waiting:
            deadline = group.round_deadline
            if self.flavour is Flavour.NOIDA or deadline is None or now < deadline:
                return
            # GroupMetadataManager.onCompleteJoin: members that did not rejoin in time are
            # removed from the group.
            for member in waiting:
                self._remove(group, member, "did not rejoin within the rebalance timeout")
        if not group.members:
            group.state = GroupState.EMPTY
            group.generation += 1
            return
        group.generation += 1
        group.state = GroupState.COMPLETING_REBALANCE
        group.round_deadline = None
        assignment = self._round_robin(group)
        self.history.add(
            "generation",
            group=group.group_id,
            generation=group.generation,
            members={m: sorted(_tp(tp) for tp in tps) for m, tps in assignment.items()},
        )
        for member_id, member in group.members.items():
            # completeAndScheduleNextHeartbeatExpiration: the session starts again.
            member.last_heartbeat = now
            member.assignment = assignment[member_id]
            if member.joined is not None and not member.joined.done():
                member.joined.set_result((group.generation, member_id, list(member.assignment)))
        # SyncGroup follows the JoinGroup response after a round trip.
        generation = group.generation
        asyncio.get_running_loop().call_later(0.002, self._stable, group, generation)

    def _stable(self, group: Group, generation: int) -> None:
        if group.generation == generation and group.state is GroupState.COMPLETING_REBALANCE:
            group.state = GroupState.STABLE

    def _round_robin(self, group: Group) -> dict[str, list[TopicPartition]]:
        """aiokafka's default assignor (`aiokafka/coordinator/assignors/roundrobin.py`): all
        partitions sorted, dealt to the members sorted by member id."""
        partitions = sorted(
            TopicPartition(name, p)
            for name in group.topics
            if name in self.topics
            for p in range(len(self.topics[name].logs))
        )
        members = sorted(group.members)
        out: dict[str, list[TopicPartition]] = {m: [] for m in members}
        for index, tp in enumerate(partitions):
            out[members[index % len(members)]].append(tp)
        return out

    def _remove(self, group: Group, member: Member, why: str) -> None:
        group.members.pop(member.member_id, None)
        if member.instance_id is not None and group.static.get(member.instance_id) == (
            member.member_id
        ):
            del group.static[member.instance_id]
        if member.joined is not None and not member.joined.done():
            member.joined.set_exception(UnknownMemberIdError())
        self.history.add("member_removed", group=group.group_id, member=member.member_id, why=why)

    def heartbeat(self, group_id: str, member_id: str, generation: int, now: float) -> None:
        """ClassicGroup heartbeat: raises what the client must act on."""
        self._coordinator()
        group = self.group(group_id)
        member = group.members.get(member_id)
        if member is None:
            raise UnknownMemberIdError()
        member.last_heartbeat = now
        if group.state is GroupState.PREPARING_REBALANCE:
            raise RebalanceInProgressError()
        if generation != group.generation:
            raise IllegalGenerationError()

    def leave(self, group_id: str, member_id: str, now: float) -> None:
        """LeaveGroup by member id: its partitions are handed over in a rebalance at once."""
        self._coordinator()
        group = self.group(group_id)
        member = group.members.get(member_id)
        if member is None:
            raise UnknownMemberIdError()
        self._remove(group, member, "left")
        self._after_removal(group, now)

    def leave_instance(self, group_id: str, instance_id: str, now: float) -> None:
        """LeaveGroup v3 naming a static member by its instance id alone: Kafka removes
        whichever member holds that instance now (GroupCoordinator.handleLeaveGroup, KIP-345);
        so does noida-db. tansu 0.6.0 answers UNKNOWN_MEMBER_ID (both measured)."""
        self._coordinator()
        group = self.group(group_id)
        member_id = group.static.get(instance_id)
        member = group.members.get(member_id) if member_id is not None else None
        if member is None or self.flavour is Flavour.TANSU:
            raise UnknownMemberIdError()
        self._remove(group, member, "left")
        self._after_removal(group, now)

    def _after_removal(self, group: Group, now: float) -> None:
        if group.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_round(group, now)
        elif group.members:
            self._prepare_rebalance(group, now, "a member left")
        else:
            group.state = GroupState.EMPTY
            group.generation += 1

    def expire(self, now: float) -> None:
        """Heartbeat expiration and the rebalance timeout (the coordinator's timers)."""
        if self.coordinator_down or self.broker_down:
            return
        for group in self.groups.values():
            if self.flavour is not Flavour.NOIDA:
                for member in list(group.members.values()):
                    if member.joined is not None and not member.joined.done():
                        continue  # awaiting its JoinGroup response: no expiration scheduled
                    if now - member.last_heartbeat > member.session_s:
                        # ClassicGroup: a member not heard from in session.timeout.ms is
                        # removed (GroupMetadataManager.onClassicGroupHeartbeatExpiration).
                        self._remove(group, member, "session timed out")
                        self._after_removal(group, now)
            self._maybe_complete_round(group, now)

    def coordinator_back(self, now: float) -> None:
        """A new coordinator loads the groups and schedules every member's heartbeat
        expiration afresh (GroupMetadataManager.onLoaded)."""
        for group in self.groups.values():
            for member in group.members.values():
                member.last_heartbeat = now

    def commit(
        self,
        group_id: str,
        member_id: str,
        generation: int,
        offsets: dict[TopicPartition, tuple[int, str]],
        *,
        client_id: str,
        now: float,
    ) -> dict[TopicPartition, KafkaError]:
        """OffsetCommit: validated as ClassicGroup.validateOffsetCommit; errors by partition."""
        self._coordinator()
        group = self.group(group_id)
        error: KafkaError | None = None
        if generation < 0 and group.state is GroupState.EMPTY:
            pass  # an admin or a consumer outside group management
        elif generation >= 0 or member_id:
            if member_id not in group.members:
                error = UnknownMemberIdError()
            elif generation != group.generation:
                error = IllegalGenerationError()
            elif group.state is GroupState.COMPLETING_REBALANCE:
                error = RebalanceInProgressError()
            elif self.flavour is Flavour.NOIDA and group.state is GroupState.PREPARING_REBALANCE:
                # noida-db bumps the generation as soon as another member asks to join.
                error = IllegalGenerationError()
        elif group.state is not GroupState.EMPTY:
            error = UnknownMemberIdError()
        if error is not None:
            self.history.add(
                "commit_refused",
                client=client_id,
                error=type(error).__name__,
                tps=sorted(_tp(tp) for tp in offsets),
            )
            return dict.fromkeys(offsets, error)
        errors: dict[TopicPartition, KafkaError] = {}
        for tp, (offset, metadata) in sorted(offsets.items()):
            if len(metadata.encode()) > self.offset_metadata_max_bytes:
                # `group-coordinator/.../OffsetMetadataManager.java` validateOffsetCommit:
                # metadata over offset.metadata.max.bytes is OFFSET_METADATA_TOO_LARGE.
                errors[tp] = OffsetMetadataTooLargeError()
                continue
            previous = self.committed.get((group_id, tp))
            self.committed[(group_id, tp)] = (offset, metadata)
            self.history.add(
                "commit",
                client=client_id,
                tp=_tp(tp),
                offset=offset,
                previous=None if previous is None else previous[0],
                metadata_bytes=len(metadata),
                metadata=metadata,
            )
        if errors:
            self.history.add(
                "commit_refused",
                client=client_id,
                error="OffsetMetadataTooLargeError",
                tps=sorted(_tp(tp) for tp in errors),
            )
        self._watched(group, member_id, client_id, sorted(tp for tp in offsets if tp not in errors))
        return errors

    def _watched(
        self, group: Group, member_id: str, client_id: str, stored: list[TopicPartition]
    ) -> None:
        if stored:
            for watcher in self.commit_watchers:
                watcher(group, group.members.get(member_id), client_id, stored)

    def fetch_committed(
        self, group_id: str, partitions: list[TopicPartition]
    ) -> dict[TopicPartition, tuple[int, str]]:
        """OffsetFetch: (-1, "") for a partition without a commit."""
        self._coordinator()
        return {tp: self.committed.get((group_id, tp), (-1, "")) for tp in partitions}

    def describe(self, group_id: str) -> dict[str, Any]:
        """DescribeGroups: member metadata only while Stable
        (GroupMetadataManager.describeGroups: `describeNoMetadata` otherwise); tansu never
        returns it."""
        self._coordinator()
        group = self.group(group_id)
        with_metadata = group.state is GroupState.STABLE and self.flavour is not Flavour.TANSU
        return {
            "groups": [
                {
                    "error_code": 0,
                    "group": group_id,
                    "state": group.state.value,
                    "members": [
                        {
                            "member_id": m.member_id,
                            "member_metadata": m.metadata if with_metadata else b"",
                        }
                        for m in group.members.values()
                    ],
                }
            ]
        }


def _tp(tp: TopicPartition) -> str:
    return f"{tp.topic}-{tp.partition}"
