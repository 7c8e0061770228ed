"""A worker killed between the parts of a split result: the job comes out once, whole."""

from __future__ import annotations

import signal

import pytest

from schemas import (
    Completed,
    decode_result,
)
from tests.integration.broker.test_large_results_on_broker import (
    ONE_MIB,
    group_job,
    part_of,
)
from worker.dev.harness.clients import assembled, collect, job_record, produce
from worker.dev.harness.topics import Topics

pytestmark = [pytest.mark.broker, pytest.mark.chaos]


@pytest.mark.chaos
async def test_sigkill_between_the_parts_of_a_split_result_yields_the_job_once(
    kafka_bootstrap_servers, new_topic, spawn
):
    bs = kafka_bootstrap_servers
    topics = Topics(
        jobs=await new_topic(1),
        results=await new_topic(1, configs=ONE_MIB),
        dlq=await new_topic(1),
    )
    await produce(bs, topics.jobs, [job_record(group_job("grpo", 16, 1536))])
    shape = {"mock_per_token_latency_ms": 0, "mock_num_layers": 48, "mock_top_k": 8}
    # The worker kills itself once the first part is acknowledged and the others are not.
    first = spawn(topics, env={"VKW_FAILPOINTS": "kill-between-parts"}, **shape)
    assert await first.wait(60) == -signal.SIGKILL, first.text()
    cut_short = [decode_result(r.value) for r in await collect(bs, topics.results, 1)]
    first_attempt = part_of(cut_short[0])
    assert first_attempt.index == 0 and first_attempt.count > 1

    second = spawn(topics, **shape)
    got, records = await assembled(bs, topics.results, 1, timeout_s=90)
    by_attempt: dict[str, set[int]] = {}
    for record in records:
        label = part_of(decode_result(record.value))
        by_attempt.setdefault(label.attempt, set()).add(label.index)
    # Two attempts: the first cut short, the second whole; the job came out once, from it.
    assert len(by_attempt) == 2
    assert len(by_attempt[first_attempt.attempt]) < first_attempt.count
    (whole_attempt,) = set(by_attempt) - {first_attempt.attempt}
    assert len(by_attempt[whole_attempt]) == first_attempt.count
    result = got["grpo"]
    assert isinstance(result, Completed)
    assert [c.index for c in result.completions] == list(range(16))
    second.signal(signal.SIGTERM)
    assert await second.wait(30) == 0, second.text()
