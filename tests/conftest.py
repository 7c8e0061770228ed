"""Broker fixtures: a shared broker for integration tests, private brokers for restart tests."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import NoReturn

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from tests import hypothesis_profiles

# Fixtures any module may ask for: a worker in-process, and one as a real process.
from tests.workers import spawn, start_steered, start_worker  # noqa: F401
from worker.core.kafka import ensure_topics
from worker.dev.broker import (
    BrokerBinaryNotFoundError,
    LocalBroker,
    LocalBrokerError,
    TansuBroker,
    wait_until_ready_blocking,
)
from worker.dev.harness.topics import TopicFactory

# pytester runs the leak guard's own tests in a pytest of their own.
pytest_plugins = ["tests.leak_guard", "pytester"]

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 30.0
# testcontainers' default (30 s) is tight for a cold JVM broker on a busy CI runner.
_CONTAINER_START_TIMEOUT_S = 120
_TOPIC_ADMIN_TIMEOUT_S = 10.0


_HYPOTHESIS_PROFILE = hypothesis_profiles.load()


def pytest_report_header() -> str:
    return f"hypothesis profile: {_HYPOTHESIS_PROFILE} (HYPOTHESIS_PROFILE=ci|dev)"


_LANE_MARKERS = {"broker": "broker", "vllm": "vllm", "chaos": "chaos", "frameworks": "frameworks"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test's folder is its lane: tests under `integration/<lane>/` carry that lane's marker,
    so `-m` selections and the folders never disagree."""
    for item in items:
        parts = item.path.parts
        if "integration" in parts:
            lane = parts[parts.index("integration") + 1]
            if lane in _LANE_MARKERS:
                item.add_marker(_LANE_MARKERS[lane])


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _unavailable(reason: str) -> NoReturn:
    # Under CI a missing broker means a broken pipeline, never a quietly skipped test.
    if _in_ci():
        pytest.fail(f"{reason} (CI=true: broker tests must not skip)", pytrace=False)
    pytest.skip(reason)


def _docker_answers() -> bool:
    try:
        import docker.errors  # type: ignore[import-untyped]  # noqa: PLC0415 - optional dependency
        from testcontainers.core.docker_client import (  # noqa: PLC0415 - optional dependency
            DockerClient,
            get_docker_host,
        )
    except ImportError:
        return False
    # Without a configured host or the default socket there is nothing to ask, and asking costs a
    # failed HTTP round trip.
    if get_docker_host() is None and not Path("/var/run/docker.sock").exists():
        return False
    with warnings.catch_warnings():
        # A failed connection leaves docker-py's socket to the garbage collector, which reports
        # it as a ResourceWarning: an error under filterwarnings=error, though nothing is wrong.
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            client = DockerClient()
            try:
                return bool(client.client.ping())
            finally:
                client.client.close()
        except (docker.errors.DockerException, OSError) as exc:
            # The text, not the exception: pytest keeps log records, and the exception's
            # traceback would keep the leaked socket alive until the session ends.
            logger.info("no Docker engine answers: %s", str(exc))
            return False
        finally:
            gc.collect()


def _new_local_broker(context: str) -> LocalBroker:
    try:
        return LocalBroker(start_timeout_s=_READY_TIMEOUT_S)
    except BrokerBinaryNotFoundError as exc:
        _unavailable(f"{context}: {exc}")


@pytest.fixture(scope="session")
def kafka_bootstrap_servers() -> Iterator[str]:
    """A broker shared by the session: $KAFKA_BOOTSTRAP_SERVERS, else Docker Kafka, else noida-db.

    Tests never restart or kill it; they use `restartable_broker` for that.
    """
    from_env = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if from_env:
        try:
            wait_until_ready_blocking(from_env, _READY_TIMEOUT_S)
        except TimeoutError as exc:
            # An address the user chose that does not answer is a mistake to report, not skip.
            pytest.fail(f"KAFKA_BOOTSTRAP_SERVERS={from_env}: {exc}", pytrace=False)
        yield from_env
        return
    if _docker_answers():
        try:
            from testcontainers.community.kafka import KafkaContainer  # noqa: PLC0415
        except ImportError:  # testcontainers releases from before the `community` package
            from testcontainers.kafka import KafkaContainer  # noqa: PLC0415

        container = KafkaContainer().start(timeout=_CONTAINER_START_TIMEOUT_S)
        try:
            yield container.get_bootstrap_server()
        finally:
            container.stop()
        return
    broker = _new_local_broker(
        "no Kafka broker: KAFKA_BOOTSTRAP_SERVERS is unset, no Docker engine answers"
    )
    try:
        broker.start()
    except LocalBrokerError as exc:
        # Installed but not working is a bug to see, so this fails even outside CI.
        pytest.fail(f"noida-db is installed but did not start: {exc}", pytrace=False)
    try:
        yield broker.bootstrap_servers
    finally:
        broker.stop()


@pytest.fixture
async def new_topic(kafka_bootstrap_servers: str) -> AsyncIterator[TopicFactory]:
    """Create uuid-named topics (on the shared broker unless told otherwise); delete at teardown.

    Topics created on a private broker (`bootstrap_servers=`) die with that broker, so only the
    shared broker's topics are deleted.
    """
    shared_topics: list[str] = []

    async def create(
        partitions: int = 1,
        *,
        configs: Mapping[str, str] | None = None,
        bootstrap_servers: str | None = None,
    ) -> str:
        servers = bootstrap_servers or kafka_bootstrap_servers
        name = f"test-{uuid.uuid4().hex}"
        async with asyncio.timeout(_TOPIC_ADMIN_TIMEOUT_S):
            await ensure_topics(
                {"bootstrap_servers": servers},
                {name: partitions},
                configs={name: dict(configs or {})},
            )
        if servers == kafka_bootstrap_servers:
            shared_topics.append(name)
        return name

    yield create

    if not shared_topics:
        return
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap_servers)
    try:
        async with asyncio.timeout(_TOPIC_ADMIN_TIMEOUT_S):
            await admin.start()
            await admin.delete_topics(shared_topics)
    except (KafkaError, OSError, TimeoutError) as exc:
        # Some Kafka-protocol brokers lack DeleteTopics; leftover uuid topics harm no other test.
        logger.info("could not delete test topics %s: %r", shared_topics, exc)
    finally:
        await admin.close()


@pytest.fixture
def restartable_broker() -> Iterator[LocalBroker]:
    """A private noida-db broker (own port, own data dir) that the test may restart or kill.

    From async code that keeps clients running meanwhile, call its blocking methods through
    `asyncio.to_thread`.
    """
    broker = _new_local_broker("no broker to restart")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def tansu_broker() -> Iterator[TansuBroker]:
    """A private tansu broker: the one that evicts dead group members. No idempotence on it."""
    try:
        broker = TansuBroker(start_timeout_s=_READY_TIMEOUT_S)
    except BrokerBinaryNotFoundError as exc:
        _unavailable(f"no tansu broker: {exc}")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
