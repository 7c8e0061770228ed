"""Kafka clients built from the settings: security, sizes for large results, topic creation."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.client import ConnectionGroup, CoordinationType
from aiokafka.errors import (
    InvalidTopicError,
    KafkaConnectionError,
    KafkaError,
    RequestTimedOutError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    UnknownMemberIdError,
    UnknownTopicOrPartitionError,
    UnsupportedVersionError,
    for_code,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.group import LeaveGroupRequest
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.protocol.types import Array, Int16, Int32, Schema, String
from aiokafka.structs import TopicPartition
from aiokafka.util import commit_structure_validate

from worker.core.clients import AIOKAFKA, KafkaClients
from worker.core.clock import SYSTEM_CLOCK, Clock
from worker.core.config import Settings
from worker.core.errors import BrokerError, ConfigError
from worker.core.incarnation import incarnation_assignor
from worker.core.limits import RECORD_OVERHEAD_BYTES, RecordLimits, record_size_limit

# How often a stopping worker tries again to leave while the coordinator cannot be reached.
_LEAVE_RETRY_S: Final = 0.5

__all__ = [
    "CONTROL_TOPIC_CONFIGS",
    "RECORD_OVERHEAD_BYTES",
    "LeaveGroupByInstanceId",
    "TopicConfigReader",
    "broker_has_topic",
    "client_kwargs",
    "commit_handed_over",
    "create_topics",
    "ensure_topics",
    "leave_group",
    "leave_group_on_close",
    "leave_trying_again",
    "make_consumer",
    "make_producer",
    "member_id",
    "read_record_limits",
    "record_size_limit",
    "rejoining",
    "topics_max_message_bytes",
]

logger = logging.getLogger(__name__)

#: The control topic keeps every command for ever: a worker restarted after a quiet week must
#: still find the fleet's latest weights, and its catch-up replays the history (a refused
#: update, a rollback with `force`, the update before one that fails to load), which
#: compaction would cut down to one record per key. Compaction would also refuse the keyless
#: records other producers send. Commands are a few hundred bytes, one per trainer step.
CONTROL_TOPIC_CONFIGS: Final = {
    "cleanup.policy": "delete",
    "retention.ms": "-1",
    "retention.bytes": "-1",
}


# aiokafka's fetcher task wakes at least this often even when nothing happened (its own default
# is 200 ms). Every event it serves wakes it at once (a response, records consumed, a resume, a
# seek, an assignment change, a backoff ending), so the timeout is only a fallback; at 200 ms
# it was the largest source of an idle worker's wake-ups, each of which costs CPU beside the
# engine.
FETCHER_FALLBACK_WAKE_MS: Final = 2_000


def client_kwargs(settings: Settings) -> dict[str, Any]:
    """Connection and security arguments shared by every aiokafka client."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap_servers,
        "security_protocol": settings.security_protocol,
        "client_id": f"vllm-kafka-worker-{settings.worker_id}",
    }
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        try:
            kwargs["ssl_context"] = create_ssl_context(
                cafile=settings.ssl_cafile,
                certfile=settings.ssl_certfile,
                keyfile=settings.ssl_keyfile,
                password=settings.ssl_key_password,
            )
        except (OSError, ValueError) as exc:
            # ssl.SSLError is an OSError; the message names the file, never the password.
            raise ConfigError(f"cannot load TLS files: {exc}") from None
    if settings.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = settings.sasl_mechanism
        kwargs["sasl_plain_username"] = settings.sasl_username
        kwargs["sasl_plain_password"] = settings.sasl_password
    return kwargs


# Metadata error codes that say a producer cannot write to the topic at all.
_NO_SUCH_TOPIC: Final = frozenset(
    {
        UnknownTopicOrPartitionError.errno,
        InvalidTopicError.errno,
        TopicAuthorizationFailedError.errno,
    }
)


async def broker_has_topic(producer: AIOKafkaProducer, topic: str) -> bool:
    """Whether the broker has `topic` for this producer to write to, from one metadata
    request for that topic alone; KafkaError when no broker answers.

    Not `producer.partitions_for`: that adds the topic to those the producer tracks for good
    and, for a topic that does not exist, retries until `request_timeout_ms`. The request asks
    the broker not to create the topic (`allow_auto_topic_creation`, Metadata v4+, KIP-204):
    on Apache Kafka's default `auto.create.topics.enable=true`, a job naming a new `reply_to`
    each time would otherwise create a topic each time, which the producer would then track
    for good. (A broker older than v4 may still create it: that is its own setting.)
    """
    client = producer.client
    node = client.get_random_node()
    if node is None:
        raise KafkaConnectionError("no broker is known to ask for topic metadata")
    request = MetadataRequest([topic], allow_auto_topic_creation=False)
    response = await client.send(node, request)
    for error_code, name, *_ in response.topics:
        if name == topic:
            return error_code not in _NO_SUCH_TOPIC
    return False


def make_consumer(
    settings: Settings,
    limits: RecordLimits | None = None,
    *,
    incarnation: int | None = None,
    kafka_clients: KafkaClients = AIOKAFKA,
    **overrides: Any,
) -> AIOKafkaConsumer:
    """The jobs consumer: manual commits, fetches sized for the largest record; announcing
    the worker process's `incarnation` to the group when given (`worker.core.incarnation`)."""
    limits = limits or RecordLimits.from_topic_limits(settings, {})
    kwargs: dict[str, Any] = {
        **client_kwargs(settings),
        "group_id": settings.group_id,
        "group_instance_id": settings.group_instance_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": limits.fetch_partition_bytes,
        "fetch_max_bytes": limits.fetch_max_bytes,
        "session_timeout_ms": settings.session_timeout_ms,
        "heartbeat_interval_ms": settings.heartbeat_interval_ms,
        "max_poll_interval_ms": settings.max_poll_interval_ms,
        # A revoke takes up to revoke_grace_s plus a commit; aiokafka's default (the session
        # timeout) would have the group drop a member that is still draining.
        "rebalance_timeout_ms": settings.rebalance_timeout_ms,
        "isolation_level": "read_committed",
        "consumer_timeout_ms": FETCHER_FALLBACK_WAKE_MS,
    }
    if incarnation is not None:
        kwargs["partition_assignment_strategy"] = (incarnation_assignor(incarnation),)
    kwargs.update(overrides)
    return kafka_clients.consumer(**kwargs)


async def commit_handed_over(
    consumer: AIOKafkaConsumer, offsets: Mapping[TopicPartition, tuple[int, str]]
) -> None:
    """Commit `offsets` in the member's current generation, also for partitions it no longer
    holds: the hand-over of partitions revoked in a rebalance whose commit was refused.

    `AIOKafkaConsumer.commit` refuses, client-side, partitions that are not assigned; the group
    takes a current generation's commit for any partition (measured on noida-db and tansu:
    bench/rebalance_probe.py; Kafka's coordinator checks the generation, not ownership).
    """
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None:  # not a group member (or a test double): the plain commit
        await consumer.commit(dict(offsets))
        return
    await coordinator.commit_offsets(None, commit_structure_validate(dict(offsets)))


def member_id(consumer: AIOKafkaConsumer) -> str | None:
    """The member id the group gave this consumer, while aiokafka holds one."""
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or coordinator.generation < 0 or not coordinator.member_id:
        return None
    return str(coordinator.member_id)


def rejoining(consumer: AIOKafkaConsumer) -> bool:
    """Whether aiokafka has forgotten this member's generation (the group refused a commit of
    it) and a join is under way: a commit made now is refused for the same reason, and one made
    once the join completes is taken in the new generation."""
    coordinator = getattr(consumer, "_coordinator", None)
    return coordinator is not None and coordinator.generation < 0


def leave_group_on_close(
    consumer: AIOKafkaConsumer,
    last_member_id: str | None = None,
    *,
    within_s: float = 0.0,
    clock: Clock = SYSTEM_CLOCK,
) -> None:
    """Make the consumer's `stop()` leave the group (`leave_group`), also as a static member.

    The leave is made where aiokafka makes its own (`GroupCoordinator.close` calls
    `_maybe_leave_group` once its coordination task has finished): no JoinGroup is on its way
    then and none is sent after, so the leave removes the member this process finally became.
    A leave made before the close is not final: aiokafka, finding its member gone or its
    coordinator back, joins again, and the group holds the new member until its session times
    out (on a broker that never evicts, for ever; `bench/sim.py --flavour noida --static`
    seed 99100). A consumer never started has no coordinator and is no member: nothing to do.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None:
        return

    async def leave_then_forget() -> None:
        await leave_group(consumer, last_member_id, within_s=within_s, clock=clock)
        coordinator.reset_generation()

    coordinator._maybe_leave_group = leave_then_forget


async def leave_group(
    consumer: AIOKafkaConsumer,
    last_member_id: str | None = None,
    *,
    within_s: float = 0.0,
    clock: Clock = SYSTEM_CLOCK,
) -> None:
    """Leave the group now, also as a static member, whose partitions the group otherwise
    keeps for it until its session times out (or, on a broker that never evicts, for ever).

    aiokafka sends LeaveGroup only for dynamic members: a static member is meant to come back
    under its instance id (a restart) without a rebalance. A worker scaled in does not come
    back; its LeaveGroup by member id (v0/v1, which aiokafka speaks) hands its partitions over
    at once. Tried again while the coordinator cannot be reached, for up to `within_s` on
    `clock`; then given up with a warning, like aiokafka's own leave.

    `last_member_id`: the id it last held. A commit refused because the generation moved on
    (another member joining) makes aiokafka forget its member id, although the group keeps the
    member and waits for it to rejoin; a worker stopping just then leaves under that id. When
    the group knows that id no more (aiokafka rejoined under the instance id meanwhile, and the
    group gave the instance a new member id whose JoinGroup answer has not come back), a
    static member leaves by its instance id (LeaveGroup v3, KIP-345), which removes whichever
    member holds that instance now.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None:
        return
    await leave_trying_again(
        lambda: _leave_once(coordinator, member_id(consumer) or last_member_id),
        group_id=coordinator.group_id,
        within_s=within_s,
        clock=clock,
    )


async def leave_trying_again(
    leave_once: Callable[[], Awaitable[KafkaError | None]],
    *,
    group_id: str,
    within_s: float,
    clock: Clock,
) -> None:
    """Call `leave_once` (the error its LeaveGroup ended with, or None), again after a pause
    while it fails retriably and `within_s` on `clock` has not run out; a leave that failed
    is given up with a warning, like aiokafka's own. Each try is bounded by the time left."""
    deadline = clock.monotonic() + within_s
    while True:
        try:
            # A request waits behind a JoinGroup on its way on the same connection, which the
            # broker answers only when the round completes: bounded by the time left.
            async with asyncio.timeout(max(deadline - clock.monotonic(), _LEAVE_RETRY_S)):
                error = await leave_once()
        except TimeoutError:
            error = RequestTimedOutError()
        if error is None or not error.retriable or clock.monotonic() + _LEAVE_RETRY_S > deadline:
            break
        await asyncio.sleep(_LEAVE_RETRY_S)
    if error is None:
        logger.info("left the group %s", group_id)
    else:
        logger.warning("could not leave the group (%r); it waits for the session timeout", error)


async def _leave_once(coordinator: Any, leaving_as: str | None) -> KafkaError | None:
    instance_id: str | None = getattr(coordinator, "_group_instance_id", None)
    error: KafkaError | None = UnknownMemberIdError()
    if leaving_as:
        error = await _leave(coordinator, LeaveGroupRequest(coordinator.group_id, leaving_as))
    if instance_id is not None and isinstance(error, UnknownMemberIdError):
        error = await _leave(coordinator, LeaveGroupByInstanceId(coordinator.group_id, instance_id))
    return error


async def _leave(coordinator: Any, request: Any) -> KafkaError | None:
    """Send a LeaveGroup; the error it ended with (sending it, or in its answer), or None."""
    try:
        response = await _send_to_coordinator(coordinator, request)
    except (KafkaError, NotImplementedError) as exc:
        # NotImplementedError: the broker speaks none of the request's versions (aiokafka's
        # Request.prepare).
        return exc if isinstance(exc, KafkaError) else UnsupportedVersionError(str(exc))
    codes = [response.error_code] + [m[-1] for m in getattr(response, "members", [])]
    code = next((c for c in codes if c), 0)
    return for_code(code)() if code else None


async def _send_to_coordinator(coordinator: Any, request: Any) -> Any:
    """Send `request` to the group's coordinator. aiokafka refuses to while it holds the
    coordinator for dead (after an error reaching it), and only its coordination task looks
    the coordinator up again, which a close has ended: a leave made in the close, after a
    coordinator outage, would be refused for its whole window even once the coordinator is
    back. It looks the coordinator up itself (FindCoordinator) and sends there."""
    if coordinator.coordinator_id is not None:
        return await coordinator._send_req(request)
    client = coordinator._client
    node_id = await client.coordinator_lookup(CoordinationType.GROUP, coordinator.group_id)
    return await client.send(node_id, request, group=ConnectionGroup.COORDINATION)


# aiokafka's protocol classes are untyped (Any to mypy).
class _LeaveGroupResponseV3(Response):  # type: ignore[misc]
    API_KEY = 13
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("error_code", Int16),
        (
            "members",
            Array(
                ("member_id", String("utf-8")),
                ("group_instance_id", String("utf-8")),
                ("error_code", Int16),
            ),
        ),
    )


class _LeaveGroupRequestV3(RequestStruct):  # type: ignore[misc]
    API_KEY = 13
    API_VERSION = 3
    RESPONSE_TYPE = _LeaveGroupResponseV3
    SCHEMA = Schema(
        ("group", String("utf-8")),
        ("members", Array(("member_id", String("utf-8")), ("group_instance_id", String("utf-8")))),
    )


class LeaveGroupByInstanceId(Request[_LeaveGroupRequestV3]):  # type: ignore[misc]
    """LeaveGroup v3 naming a static member by its instance id alone (member id empty): Kafka
    removes whichever member holds that instance now (`GroupCoordinator.handleLeaveGroup`,
    KIP-345's administrative removal). aiokafka speaks LeaveGroup v0/v1 only."""

    API_KEY = 13

    def __init__(self, group_id: str, instance_id: str) -> None:
        self.group_id = group_id
        self.instance_id = instance_id

    def build(self, request_struct_class: type[_LeaveGroupRequestV3]) -> _LeaveGroupRequestV3:
        return request_struct_class(self.group_id, [("", self.instance_id)])


def produce_request_timeout_ms(settings: Settings) -> int:
    """How long one produce request waits for its acknowledgement: aiokafka's default (40 s),
    or a third of `publish_timeout_s` when that is less. A lost acknowledgement costs one
    request timeout before the answer is sent again, and the worker exits once an answer has
    waited `publish_timeout_s`: three attempts fit in it, so one lost acknowledgement followed
    by a broker restart does not stop the worker."""
    return int(min(40.0, settings.publish_timeout_s / 3) * 1000)


def make_producer(
    settings: Settings,
    limits: RecordLimits | None = None,
    *,
    kafka_clients: KafkaClients = AIOKAFKA,
    **overrides: Any,
) -> AIOKafkaProducer:
    """The results producer: acks from all replicas, idempotent, sized for large results.

    Raise `ConfigError` when the compression codec cannot be loaded.
    """
    limits = limits or RecordLimits.from_topic_limits(settings, {})
    compression = None if settings.compression_type == "none" else settings.compression_type
    if compression is not None:
        codec_available, _ = AIOKafkaProducer._COMPRESSORS[compression]
        if not codec_available():
            # aiokafka raises from deep in the constructor; this names the setting instead.
            raise ConfigError(
                f"--compression-type {compression} needs its codec library (cramjam), which "
                "cannot be imported; install it or choose --compression-type none"
            )
    kwargs: dict[str, Any] = {
        **client_kwargs(settings),
        "acks": "all",
        "enable_idempotence": settings.enable_idempotence,
        "compression_type": compression,
        # aiokafka checks this on the uncompressed record, whatever the compression.
        "max_request_size": limits.request_bytes,
        "linger_ms": 5,
        # Hundreds of jobs finish together; 16 KiB batches (the default) hold ~5 results and make
        # every other sender wait for a drain. A larger record still gets a batch of its own.
        "max_batch_size": limits.batch_bytes,
        "request_timeout_ms": produce_request_timeout_ms(settings),
    }
    kwargs.update(overrides)
    return kafka_clients.producer(**kwargs)


async def read_record_limits(
    settings: Settings, *, kafka_clients: KafkaClients = AIOKAFKA
) -> RecordLimits:
    """Read the answer topics' `max.message.bytes` (one admin request) and build the limits."""
    topic_bytes = await topics_max_message_bytes(
        settings, [settings.results_topic, settings.dead_letter_topic], kafka_clients=kafka_clients
    )
    limits = RecordLimits.from_topic_limits(settings, topic_bytes)
    for topic, value in topic_bytes.items():
        if value is not None and value < limits.request_bytes:
            logger.info("records for %s are limited to %d bytes (max.message.bytes)", topic, value)
    return limits


async def ensure_topics(
    connection: Mapping[str, Any],
    partitions: Mapping[str, int],
    *,
    replication_factor: int = 1,
    configs: Mapping[str, Mapping[str, str]] | None = None,
    kafka_clients: KafkaClients = AIOKAFKA,
) -> list[str]:
    """Create the topics of `partitions` (name: partition count) that do not exist yet, each
    with its `configs`; return the ones created. The one place topics are created (the CLI's
    --create-topics, the test fixtures, the demos and benchmarks). Raises `BrokerError` naming
    a topic the broker refuses or a broker that cannot be reached."""
    admin = kafka_clients.admin(**connection)
    try:
        await admin.start()
    except KafkaError as exc:
        raise BrokerError(
            f"cannot reach {connection.get('bootstrap_servers')} to create topics: {exc}"
        ) from exc
    created: list[str] = []
    try:
        existing = set(await admin.list_topics())
        for name, count in partitions.items():
            if name in existing:
                continue
            topic = NewTopic(
                name=name,
                num_partitions=count,
                replication_factor=replication_factor,
                topic_configs=dict((configs or {}).get(name, {})),
            )
            response = await admin.create_topics([topic])
            for _, code, *rest in response.topic_errors:
                if code == TopicAlreadyExistsError.errno:
                    break  # another worker (or test) created it first
                if code:
                    detail = rest[0] if rest and rest[0] else for_code(code).__name__
                    raise BrokerError(f"cannot create topic {name}: {detail}")
            else:
                created.append(name)
                logger.info("created topic %s (%d partitions)", name, count)
    finally:
        await admin.close()
    return created


async def create_topics(settings: Settings, *, kafka_clients: KafkaClients = AIOKAFKA) -> list[str]:
    """Create the jobs, results, dead-letter, control and status topics when missing; return
    the ones created.

    Each gets `max.message.bytes` matching `max_result_bytes`, since the broker's default
    (~1 MiB) rejects an 8k-token result with routed experts.
    """
    partitions = dict.fromkeys(
        [settings.jobs_topic, settings.results_topic, settings.dead_letter_topic],
        settings.topic_partitions,
    )
    # Every worker reads the whole control topic in order: one partition. Statuses are keyed
    # by worker; a few partitions are plenty.
    partitions.setdefault(settings.control_topic, 1)
    partitions.setdefault(settings.status_topic, 1)
    record_limit = {"max.message.bytes": str(record_size_limit(settings))}
    configs = dict.fromkeys(partitions, record_limit)
    configs[settings.control_topic] = {**record_limit, **CONTROL_TOPIC_CONFIGS}
    return await ensure_topics(
        client_kwargs(settings),
        partitions,
        replication_factor=settings.topic_replication_factor,
        configs=configs,
        kafka_clients=kafka_clients,
    )


async def topics_max_message_bytes(
    settings: Settings, topics: Sequence[str], *, kafka_clients: KafkaClients = AIOKAFKA
) -> dict[str, int | None]:
    """`max.message.bytes` of each topic (None where it cannot be read), in one request."""
    reader = TopicConfigReader(settings, kafka_clients)
    try:
        return await reader.max_message_bytes(topics)
    finally:
        await reader.close()


class TopicConfigReader:
    """Reads topics' `max.message.bytes` through one admin client, started at the first read
    and kept for the next: each reply topic a worker finds costs one DescribeConfigs request,
    not a client of its own (a bootstrap connection and a metadata request before it). A
    client whose start or request failed is closed, and the next read makes another. Its
    clients come from `kafka_clients`."""

    def __init__(self, settings: Settings, kafka_clients: KafkaClients = AIOKAFKA) -> None:
        self._settings = settings
        self._kafka_clients = kafka_clients
        self._admin: AIOKafkaAdminClient | None = None
        self._starting = asyncio.Lock()

    async def max_message_bytes_of(self, topic: str) -> int | None:
        """`max.message.bytes` of one topic (a job's reply topic), None when it cannot be
        read."""
        return (await self.max_message_bytes([topic]))[topic]

    async def max_message_bytes(self, topics: Sequence[str]) -> dict[str, int | None]:
        """`max.message.bytes` of each topic (None where it cannot be read), in one request."""
        limits: dict[str, int | None] = dict.fromkeys(topics)
        try:
            admin = await self._started()
            responses = await admin.describe_configs(
                [
                    ConfigResource(ConfigResourceType.TOPIC, topic, {"max.message.bytes": None})
                    for topic in limits
                ]
            )
        except KafkaError as exc:
            logger.warning("cannot read max.message.bytes of %s: %r", ", ".join(limits), exc)
            await self.close()
            return limits
        for response in responses:
            for error_code, _, _, name, entries in response.resources:
                if error_code or name not in limits:
                    continue
                for config, value, *_ in entries:
                    if config == "max.message.bytes" and value is not None:
                        limits[name] = int(value)
        return limits

    async def close(self) -> None:
        """Close the admin client, if one is open; a later read opens another."""
        admin, self._admin = self._admin, None
        if admin is not None:
            await admin.close()

    async def _started(self) -> AIOKafkaAdminClient:
        async with self._starting:
            if self._admin is None:
                admin = self._kafka_clients.admin(**client_kwargs(self._settings))
                try:
                    await admin.start()
                except BaseException:
                    await admin.close()
                    raise
                self._admin = admin
            return self._admin
