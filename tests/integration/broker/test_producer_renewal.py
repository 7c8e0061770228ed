"""The idempotent producer after the broker refused a record: aiokafka does not reset the
partition's sequence, so the next batch there is refused as out of order and the producer fails
everything; the worker renews its producer and goes on (`worker.delivery.renewal`)."""

from __future__ import annotations

from typing import Any

import pytest

from schemas import Completed, ErrorCode, Failed, Job, SamplingSpec
from tests.fakes import ScriptedEngine
from worker.dev.harness.clients import committed_is, job_record, produce, results
from worker.dev.harness.topics import make_topics
from worker.dev.harness.waiting import wait_for
from worker.engines.mock import MockEngineSettings

pytestmark = pytest.mark.broker


def job(job_id: str, **kwargs: Any) -> Job:
    sampling = kwargs.pop("sampling", SamplingSpec(max_tokens=4))
    return Job(job_id=job_id, prompt="hello world", sampling=sampling, **kwargs)


async def test_with_idempotence_a_refused_result_is_answered_and_the_next_ones_go_through(
    kafka_bootstrap_servers, new_topic, start_worker
):
    bs = kafka_bootstrap_servers
    topics = await make_topics(new_topic, results_configs={"max.message.bytes": "200000"})
    big = job("big", return_routed_experts=True, sampling=SamplingSpec(max_tokens=3000))
    after = [job(f"after-{i}") for i in range(5)]
    await produce(bs, topics.jobs, [job_record(big)] + [job_record(j) for j in after])
    engine = ScriptedEngine(MockEngineSettings(num_layers=48, top_k=8, num_experts=128))
    run = await start_worker(
        topics,
        engine,
        # The results topic's limit is unknown to the worker (no DescribeConfigs).
        topic_limits={topics.results: None, topics.dlq: None},
        compression_type="none",
        enable_idempotence=True,
    )
    answered = await results(bs, topics.results, 1 + len(after))
    failure = answered["big"]
    assert isinstance(failure, Failed)
    assert failure.error.code == ErrorCode.RESULT_TOO_LARGE
    assert all(isinstance(answered[j.job_id], Completed) for j in after)
    await wait_for(lambda: committed_is(bs, topics, {0: 1 + len(after)}), what="the commit")
    assert not run.task.done()
    assert await run.stop() == 0
