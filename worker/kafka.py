"""Kafka clients built from the settings: security, sizes for large results, topic creation."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, for_code
from aiokafka.helpers import create_ssl_context

from worker.config import MiB, Settings
from worker.errors import BrokerError, ConfigError

__all__ = [
    "answer_topic_limits",
    "client_kwargs",
    "create_topics",
    "make_consumer",
    "make_producer",
    "make_results_producer",
    "producer_batch_bytes",
    "record_size_limit",
]

logger = logging.getLogger(__name__)

# Room for the key, headers and batch framing around a result of `max_result_bytes`.
RECORD_OVERHEAD_BYTES: Final = 1 * MiB

# Producer batch sizes (before compression): the default, the most when the topics' limits
# are known, and what is kept free of a limit for the batch's own framing.
DEFAULT_BATCH_BYTES: Final = 1 * MiB
MAX_BATCH_BYTES: Final = 16 * MiB
BATCH_FRAMING_BYTES: Final = 64 * 1024


def record_size_limit(settings: Settings) -> int:
    """The largest record the worker writes or reads: a result plus its framing."""
    return settings.max_result_bytes + RECORD_OVERHEAD_BYTES


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


def make_consumer(settings: Settings, **overrides: Any) -> AIOKafkaConsumer:
    """The jobs consumer: manual commits, fetches sized for the largest record."""
    limit = record_size_limit(settings)
    kwargs: dict[str, Any] = {
        **client_kwargs(settings),
        "group_id": settings.group_id,
        "group_instance_id": settings.group_instance_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": limit,
        "fetch_max_bytes": max(50 * MiB, 2 * limit),
        "session_timeout_ms": settings.session_timeout_ms,
        "heartbeat_interval_ms": settings.heartbeat_interval_ms,
        "max_poll_interval_ms": settings.max_poll_interval_ms,
        "isolation_level": "read_committed",
    }
    kwargs.update(overrides)
    return AIOKafkaConsumer(**kwargs)


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    """The results producer: acks from all replicas, idempotent, sized for large results."""
    kwargs: dict[str, Any] = {
        **client_kwargs(settings),
        "acks": "all",
        "enable_idempotence": settings.enable_idempotence,
        "compression_type": None
        if settings.compression_type == "none"
        else settings.compression_type,
        # aiokafka checks this on the uncompressed record, whatever the compression.
        "max_request_size": record_size_limit(settings),
        "linger_ms": 5,
        # Hundreds of jobs finish together; 16 KiB batches (the default) hold ~5 results and make
        # every other sender wait for a drain. A larger record still gets a batch of its own.
        # make_results_producer goes further when the topics allow it.
        "max_batch_size": DEFAULT_BATCH_BYTES,
        # One delivery attempt never outlasts the worker's own patience.
        "request_timeout_ms": int(min(40.0, settings.publish_timeout_s) * 1000),
    }
    kwargs.update(overrides)
    return AIOKafkaProducer(**kwargs)


async def answer_topic_limits(settings: Settings) -> dict[str, int | None]:
    """`max.message.bytes` of the results and dead-letter topics (None where unreadable)."""
    return await topics_max_message_bytes(
        settings, [settings.results_topic, settings.dead_letter_topic]
    )


def make_results_producer(
    settings: Settings, topic_limits: Mapping[str, int | None]
) -> AIOKafkaProducer:
    """`make_producer` with batches as large as the results and dead-letter topics accept
    (`topic_limits`: from `answer_topic_limits`)."""
    limits = [topic_limits.get(t) for t in (settings.results_topic, settings.dead_letter_topic)]
    return make_producer(settings, max_batch_size=producer_batch_bytes(limits))


def producer_batch_bytes(topic_limits: Sequence[int | None]) -> int:
    """The producer's batch size for topics with these `max.message.bytes` (None: unknown).

    Larger batches mean fewer produce round trips: with 1 MiB batches and jobs finishing by the
    hundred, a job waited ~70 ms on average for a full batch to drain (mock engine, 3 KB
    results). But aiokafka sizes a batch before compression and, unlike the Java client, does
    not split one the broker refuses as too large: every record in it would fail. So a batch
    never exceeds the smallest limit; when a limit is unknown, it stays at 1 MiB.
    """
    known = [limit for limit in topic_limits if limit is not None]
    if not known or len(known) < len(topic_limits):
        return DEFAULT_BATCH_BYTES
    smallest = min(known)
    # Room for the batch's own framing: 64 KiB, or half of a small limit.
    return min(max(smallest - BATCH_FRAMING_BYTES, smallest // 2), MAX_BATCH_BYTES)


async def create_topics(settings: Settings) -> list[str]:
    """Create the jobs, results and dead-letter topics when missing; return the ones created.

    Each gets `max.message.bytes` matching `max_result_bytes`, since the broker's default (~1 MiB)
    rejects an 8k-token result with routed experts.
    """
    admin = AIOKafkaAdminClient(**client_kwargs(settings))
    try:
        await admin.start()
    except KafkaError as exc:
        raise BrokerError(
            f"cannot reach {settings.bootstrap_servers} to create topics: {exc}"
        ) from exc
    created: list[str] = []
    try:
        existing = set(await admin.list_topics())
        configs = {"max.message.bytes": str(record_size_limit(settings))}
        wanted = [settings.jobs_topic, settings.results_topic, settings.dead_letter_topic]
        for name in dict.fromkeys(wanted):
            if name in existing:
                continue
            topic = NewTopic(
                name=name,
                num_partitions=settings.topic_partitions,
                replication_factor=settings.topic_replication_factor,
                topic_configs=configs,
            )
            response = await admin.create_topics([topic])
            for _, code, *rest in response.topic_errors:
                if code == TopicAlreadyExistsError.errno:
                    break  # another worker of the group created it first
                if code:
                    detail = rest[0] if rest and rest[0] else for_code(code).__name__
                    raise BrokerError(f"cannot create topic {name}: {detail}")
            else:
                created.append(name)
            logger.info("created topic %s (%d partitions)", name, settings.topic_partitions)
    finally:
        await admin.close()
    return created


async def topic_max_message_bytes(settings: Settings, topic: str) -> int | None:
    """The broker's `max.message.bytes` for `topic`, or None when it cannot be read.

    A result over it would be refused by the broker, which also breaks an idempotent producer's
    sequence; knowing it up front lets the worker answer `result_too_large` instead.
    """
    return (await topics_max_message_bytes(settings, [topic]))[topic]


async def topics_max_message_bytes(
    settings: Settings, topics: Sequence[str]
) -> dict[str, int | None]:
    """`max.message.bytes` of each topic (None where it cannot be read), in one request."""
    limits: dict[str, int | None] = dict.fromkeys(topics)
    admin = AIOKafkaAdminClient(**client_kwargs(settings))
    try:
        await admin.start()
        responses = await admin.describe_configs(
            [
                ConfigResource(ConfigResourceType.TOPIC, topic, {"max.message.bytes": None})
                for topic in limits
            ]
        )
    except KafkaError as exc:
        logger.warning("cannot read max.message.bytes of %s: %r", ", ".join(limits), exc)
        return limits
    finally:
        await admin.close()
    for response in responses:
        for error_code, _, _, name, entries in response.resources:
            if error_code or name not in limits:
                continue
            for config, value, *_ in entries:
                if config == "max.message.bytes" and value is not None:
                    limits[name] = int(value)
    return limits
