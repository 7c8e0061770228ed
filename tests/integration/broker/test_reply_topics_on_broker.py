"""Reply topics against a broker's metadata: the lookup `AnswerTopics` makes, on a real broker
and on the answers a broker without auto-creation gives."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaProducer

from schemas import Completed, ErrorCode, Failed, Job, SamplingSpec
from tests.fakes import ScriptedEngine
from worker.core.kafka import broker_has_topic
from worker.dev.harness.clients import job_record, produce, results
from worker.dev.harness.topics import make_topics
from worker.engines.mock import MockEngineSettings


def job(job_id: str, reply_to: str | None = None) -> Job:
    return Job(job_id=job_id, prompt="hi", sampling=SamplingSpec(max_tokens=2), reply_to=reply_to)


@pytest.mark.broker
async def test_on_a_real_broker_the_lookup_finds_a_topic_and_creates_none(
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
    # auto.create.topics.enable; the worker's lookup asks them not to: a reply topic nobody
    # created is answered invalid_job on the results topic, and no topic comes of it.
    created = f"trainer-{uuid.uuid4().hex[:8]}"
    run = await start_worker(topics, reply_topics=f"trainer-.*|{existing}")
    await run.serving()
    await produce(
        bs,
        topics.jobs,
        [job_record(job("mine", reply_to=existing)), job_record(job("new", reply_to=created))],
    )
    assert isinstance((await results(bs, existing, 1))["mine"], Completed)
    refused = (await results(bs, topics.results, 1))["new"]
    assert isinstance(refused, Failed) and refused.error.code is ErrorCode.INVALID_JOB
    assert "no such topic" in refused.error.detail
    producer = AIOKafkaProducer(bootstrap_servers=bs)
    await producer.start()
    try:
        assert not await broker_has_topic(producer, created)
    finally:
        await producer.stop()
    assert await run.stop() == 0


@pytest.mark.broker
async def test_a_reply_topic_smaller_than_a_result_is_read_and_its_answer_fits_it(
    kafka_bootstrap_servers, new_topic, start_worker, caplog
):
    # A trainer's reply topic created with a small max.message.bytes and a long rollout: the
    # result was sized for the results topic, refused, and the worker stopped on every restart.
    bs = kafka_bootstrap_servers
    reply = await new_topic(1, configs={"max.message.bytes": "65536"})
    topics = await make_topics(new_topic)
    engine = ScriptedEngine(MockEngineSettings(num_layers=48, top_k=8, num_experts=128))
    run = await start_worker(topics, engine, reply_topics=reply, compression_type="none")
    await run.serving()
    long = Job(
        job_id="long",
        prompt="hi",
        sampling=SamplingSpec(max_tokens=400),
        return_routed_experts=True,
        reply_to=reply,
    )
    await produce(bs, topics.jobs, [job_record(long), job_record(job("short", reply_to=reply))])
    answered = await results(bs, reply, 2)
    assert isinstance(answered["short"], Completed)
    failed = answered["long"]
    assert isinstance(failed, Failed) and failed.error.code == ErrorCode.RESULT_TOO_LARGE
    assert "65536" in failed.error.detail  # the reply topic's own limit, read up front
    assert "refused" not in caplog.text  # shaped to fit before it was sent
    assert await run.stop() == 0


@pytest.mark.broker
async def test_small_answers_to_a_reply_topic_with_a_smaller_limit_are_all_completed(
    kafka_bootstrap_servers, new_topic, start_worker
):
    # 40 results of about 3 KB finishing together, for a reply topic of 100 KB: batched for the
    # results topic (1 MiB), the broker refused the batch; sent again one by one, aiokafka
    # batched them again, and the second refusal was taken for records too large: every job
    # was answered failed/result_too_large. Uncompressed, as the broker then checks the size
    # aiokafka batched.
    bs = kafka_bootstrap_servers
    reply = await new_topic(1, configs={"max.message.bytes": "100000"})
    topics = await make_topics(new_topic)
    engine = ScriptedEngine()
    engine.on_start = lambda _: engine.release("all") if len(engine.started) == 40 else None
    run = await start_worker(
        topics, engine, reply_topics=reply, compression_type="none", max_in_flight=64
    )
    await run.serving()
    await produce(
        bs,
        topics.jobs,
        [
            job_record(
                Job(
                    job_id=f"j{i}",
                    prompt="hi",
                    sampling=SamplingSpec(max_tokens=380),
                    reply_to=reply,
                    metadata={"gate": "all"},
                )
            )
            for i in range(40)
        ],
    )
    answered = await results(bs, reply, 40)
    assert sorted(answered) == sorted(f"j{i}" for i in range(40))
    failed = {job_id: r for job_id, r in answered.items() if isinstance(r, Failed)}
    assert failed == {}
    assert await run.stop() == 0
