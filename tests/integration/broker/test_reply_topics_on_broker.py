"""Reply topics against a broker's metadata: the lookup `AnswerTopics` makes, on a real broker
and on the answers a broker without auto-creation gives."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaProducer

from schemas import Completed, Job, SamplingSpec
from worker.core.kafka import broker_has_topic
from worker.dev.harness.clients import job_record, produce, results
from worker.dev.harness.topics import make_topics


def job(job_id: str, reply_to: str | None = None) -> Job:
    return Job(job_id=job_id, prompt="hi", sampling=SamplingSpec(max_tokens=2), reply_to=reply_to)


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
