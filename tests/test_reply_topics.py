"""Reply topics against a broker's metadata: the lookup `AnswerTopics` makes, on a real broker
and on the answers a broker without auto-creation gives."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import TopicAuthorizationFailedError, UnknownTopicOrPartitionError

from schemas import Completed, Job, SamplingSpec
from tests.kafka_helpers import job_record, produce, results
from tests.workers import make_topics
from worker.core.kafka import broker_has_topic


def job(job_id: str, reply_to: str | None = None) -> Job:
    return Job(job_id=job_id, prompt="hi", sampling=SamplingSpec(max_tokens=2), reply_to=reply_to)


class _Client:
    """A producer's client whose broker answers every metadata request with `error_code`."""

    def __init__(self, error_code: int) -> None:
        self.error_code = error_code
        self.requests: list[Any] = []

    def get_random_node(self) -> int:
        return 1

    async def send(self, node: int, request: Any) -> Any:
        self.requests.append(request)
        topic = request._topics[0]
        return SimpleNamespace(topics=[(self.error_code, topic, False, [])])


@pytest.mark.parametrize(
    ("error_code", "present"),
    [
        (0, True),
        (5, True),  # LEADER_NOT_AVAILABLE: being created (auto-creation on)
        (UnknownTopicOrPartitionError.errno, False),  # auto-creation off
        (TopicAuthorizationFailedError.errno, False),
    ],
)
async def test_the_lookup_reads_the_brokers_answer_for_that_one_topic(
    error_code: int, present: bool
) -> None:
    client = _Client(error_code)
    producer = SimpleNamespace(client=client)
    assert await broker_has_topic(producer, "trainer-x") is present
    (request,) = client.requests
    assert request._topics == ["trainer-x"]


@pytest.mark.broker
async def test_on_a_real_broker_the_lookup_finds_a_topic_and_the_answer_goes_there(
    kafka_bootstrap_servers, new_topic, start_worker
):
    bs = kafka_bootstrap_servers
    existing = await new_topic(1)
    producer = AIOKafkaProducer(bootstrap_servers=bs)
    await producer.start()
    try:
        assert await broker_has_topic(producer, existing)
    finally:
        await producer.stop()
    topics = await make_topics(new_topic)
    # The brokers the tests run on create a topic on first use, as Kafka does with
    # auto.create.topics.enable: a reply topic they create is answered on.
    created = f"trainer-{uuid.uuid4().hex[:8]}"
    run = await start_worker(topics, reply_topics=f"trainer-.*|{existing}")
    await run.serving()
    await produce(
        bs,
        topics.jobs,
        [job_record(job("mine", reply_to=existing)), job_record(job("new", reply_to=created))],
    )
    assert isinstance((await results(bs, existing, 1))["mine"], Completed)
    assert isinstance((await results(bs, created, 1))["new"], Completed)
    assert await run.stop() == 0
