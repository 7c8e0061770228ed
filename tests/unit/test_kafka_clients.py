"""Every Kafka client comes from the `KafkaClients` factory a caller passes
(`worker.core.clients`): the catch-up reader, topic creation, the topic-config reader; and the
simulation's factory answers what they ask."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import UnknownTopicOrPartitionError

from tests.unit.test_loop import DLQ, RESULTS, settings
from worker.control.catch_up import CatchUpPlan, read_catch_up_plan
from worker.core.kafka import ensure_topics, read_record_limits
from worker.dev.sim.clients import Process
from worker.dev.sim.clock import VirtualClock, VirtualLoop, virtual_time
from worker.dev.sim.cluster import Cluster
from worker.dev.sim.history import History
from worker.dev.sim.kafka_clients import SimKafkaClients


class _NoControlTopic:
    """A consumer of a broker that has no control topic."""

    async def start(self) -> None:
        return

    async def stop(self) -> None:
        return

    async def topics(self) -> set[str]:
        return {"vkw.jobs"}


class _Admin:
    """An admin client of a broker that has topic `existing`, whose topics allow
    `max_message_bytes`."""

    def __init__(self, max_message_bytes: int) -> None:
        self._max_message_bytes = max_message_bytes
        self.created: list[str] = []

    async def start(self) -> None:
        return

    async def close(self) -> None:
        return

    async def list_topics(self) -> list[str]:
        return ["existing"]

    async def create_topics(self, topics: list[Any]) -> Any:
        self.created += [t.name for t in topics]
        return SimpleNamespace(topic_errors=[(t.name, 0, None) for t in topics])

    async def describe_configs(self, resources: list[Any]) -> list[Any]:
        entries = [("max.message.bytes", str(self._max_message_bytes))]
        return [SimpleNamespace(resources=[(0, "", 2, r.name, entries) for r in resources])]


class _Recorded:
    """Kafka clients that record what they were asked for."""

    def __init__(self, admin: _Admin | None = None) -> None:
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self._admin = admin

    def producer(self, **options: Any) -> Any:
        raise AssertionError(f"no producer expected, got {options}")

    def consumer(self, *topics: str, **options: Any) -> Any:  # the control plane's calls only
        self.asked.append(("consumer", options))
        return _NoControlTopic()

    def admin(self, **options: Any) -> _Admin:
        assert self._admin is not None
        self.asked.append(("admin", options))
        return self._admin


async def test_the_catch_up_plan_is_read_on_a_consumer_of_the_factory_it_is_given() -> None:
    clients = _Recorded()
    plan = await read_catch_up_plan(settings(worker_id="w7"), 0, kafka_clients=clients)
    assert plan == CatchUpPlan()
    [(kind, options)] = clients.asked
    assert kind == "consumer"
    assert options["client_id"] == "vllm-kafka-worker-w7"
    assert options["group_id"] is None
    assert options["auto_offset_reset"] == "earliest"


async def test_topics_are_created_on_an_admin_client_of_the_factory_it_is_given() -> None:
    admin = _Admin(1_048_588)
    created = await ensure_topics(
        {"bootstrap_servers": "b:9092"}, {"existing": 1, "new": 2}, kafka_clients=_Recorded(admin)
    )
    assert created == admin.created == ["new"]


async def test_record_limits_are_read_on_an_admin_client_of_the_factory_it_is_given() -> None:
    clients = _Recorded(_Admin(300_000))
    limits = await read_record_limits(settings(), kafka_clients=clients)
    assert limits.topic_bytes == {RESULTS: 300_000, DLQ: 300_000}
    assert [kind for kind, _ in clients.asked] == ["admin"]


def test_the_simulated_admin_describes_a_topics_max_message_bytes() -> None:
    clock = VirtualClock()
    loop = VirtualLoop(clock)
    cluster = Cluster(History(lambda: clock.now))
    cluster.create_topic("small", 1, max_message_bytes=400)
    process = Process("w0#1", cluster, random.Random(1))

    async def describe() -> list[tuple[Any, ...]]:
        admin = SimKafkaClients.of_process(process).admin(client_id="vllm-kafka-worker-w0")
        await admin.start()
        [response] = await admin.describe_configs(
            [
                ConfigResource(ConfigResourceType.TOPIC, name, {"max.message.bytes": None})
                for name in ("small", "missing")
            ]
        )
        return response.resources

    try:
        with virtual_time(clock):
            small, missing = loop.run_until_complete(describe())
    finally:
        loop.close()
    assert small == (0, None, 2, "small", [("max.message.bytes", "400", False, False, False)])
    assert missing[0] == UnknownTopicOrPartitionError.errno
    assert missing[3:] == ("missing", [])
