"""Trace context on a real broker: a job's traceparent, produced with it, comes back on every
record of its answer (parts, failures, invalid_job, dead-letter copies), and RolloutClient sends
one that does the same."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from schemas import Completed, ErrorCode, Failed, Job, SamplingSpec, encode
from tests.fakes import ScriptedEngine
from worker.client.rollout import RolloutClient
from worker.dev.harness.clients import assembled, collect, committed_is, produce
from worker.dev.harness.topics import make_topics
from worker.dev.harness.waiting import wait_for
from worker.engines.mock import MockEngineSettings

pytestmark = pytest.mark.broker

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
TRACESTATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
TRACED = [
    ("traceparent", TRACEPARENT.encode()),
    ("tracestate", TRACESTATE.encode()),
    ("x-request-id", b"req-42"),
]
CLIENT_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
# Records of up to 256 KiB: a group of six 300-token completions with Qwen3-30B-A3B's routing
# is split into parts.
SMALL_RESULTS = {"max.message.bytes": str(256 * 1024)}


def job(job_id: str, **kwargs: Any) -> bytes:
    kwargs.setdefault("sampling", SamplingSpec(max_tokens=4))
    return encode(Job(job_id=job_id, prompt_token_ids=[11, 12, 13, 14], **kwargs))


async def test_a_produced_jobs_trace_arrives_on_every_record_of_its_answer(
    kafka_bootstrap_servers, new_topic, start_worker
):
    bs = kafka_bootstrap_servers
    topics = await make_topics(new_topic, results_configs=SMALL_RESULTS)
    group = job(
        "group",
        sampling=SamplingSpec(n=6, max_tokens=300, seed=3),
        return_routed_experts=True,
    )
    records = [
        (b"group", group, TRACED),
        (b"failing", job("failing", metadata={"fail": "engine_error_final"}), TRACED),
        (b"bad", b'{"job_id": "bad", "prompt": 5}', TRACED),
        (b"untraced", job("untraced"), []),
        (b"malformed", job("malformed"), [("traceparent", TRACEPARENT.upper().encode())]),
    ]
    await produce(bs, topics.jobs, records)
    engine = ScriptedEngine(MockEngineSettings(num_layers=48, top_k=8, num_experts=128))
    run = await start_worker(topics, engine)
    async with RolloutClient(
        bootstrap_servers=bs, jobs_topic=topics.jobs, results_topic=topics.results, timeout_s=60
    ) as client:
        answered = await client.submit(
            Job(job_id="client", prompt="hi", sampling=SamplingSpec(max_tokens=4)),
            traceparent=CLIENT_TRACEPARENT,
            request_id="req-c",
        )
    assert isinstance(answered, Completed)
    whole, seen = await assembled(bs, topics.results, 6)
    codes = {k: v.error.code if isinstance(v, Failed) else "completed" for k, v in whole.items()}
    assert codes == {
        "group": "completed",
        "failing": ErrorCode.ENGINE_ERROR,
        "bad": ErrorCode.INVALID_JOB,
        "untraced": "completed",
        "malformed": "completed",
        "client": "completed",
    }
    headers_by_key: dict[bytes, list[list[tuple[str, bytes]]]] = defaultdict(list)
    for record in seen:
        headers_by_key[record.key].append(list(record.headers))
    assert len(headers_by_key[b"group"]) > 1  # split into parts, each in the trace
    for key in (b"group", b"failing", b"bad"):
        assert all(h == TRACED for h in headers_by_key[key]), key
    assert headers_by_key[b"untraced"] == [[]] and headers_by_key[b"malformed"] == [[]]
    assert headers_by_key[b"client"] == [
        [("traceparent", CLIENT_TRACEPARENT.encode()), ("x-request-id", b"req-c")]
    ]
    # The engine's requests were made in the jobs' traces.
    assert engine.trace_headers["group"] == {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    assert engine.trace_headers["client"] == {"traceparent": CLIENT_TRACEPARENT}
    assert engine.trace_headers["malformed"] is None
    (copy,) = await collect(bs, topics.dlq, 1)
    assert copy.key == b"bad" and list(copy.headers)[: len(TRACED)] == TRACED
    await wait_for(
        lambda: committed_is(bs, topics, {0: len(records) + 1}), what="commit of every job"
    )
    assert await run.stop() == 0
