"""The service against a real broker: commit rule, bad input, sizes, shutdown, rebalance, backlog."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import psutil
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    RequestTimedOutError,
    TopicAuthorizationFailedError,
)
from aiokafka.partitioner import DefaultPartitioner

from schemas import Completed, ErrorCode, Failed, Job, SamplingSpec, encode
from tests.fakes import ScriptedEngine
from worker.answering.records import DLQ_HEADERS
from worker.core.metrics import MetricsServer
from worker.dev.harness.clients import (
    collect,
    committed,
    committed_is,
    committed_total_is,
    job_record,
    produce,
    results,
)
from worker.dev.harness.topics import Topics, make_topics
from worker.dev.harness.waiting import wait_for
from worker.engines.mock import MockEngineSettings

pytestmark = pytest.mark.broker


@pytest.fixture
async def topics(new_topic: Any) -> Topics:
    return await make_topics(new_topic)


async def produce_jobs(bs: str, topics: Topics, prefix: str, count: int, **kwargs: Any) -> None:
    """`count` jobs named prefix-0, prefix-1, ... on the jobs topic."""
    await produce(
        bs, topics.jobs, [job_record(job(f"{prefix}-{i}", **kwargs)) for i in range(count)]
    )


def count_commit_rounds(worker: Any) -> Callable[[], int]:
    """Count the worker's commit rounds (each a plan of what to commit, and the commit when
    there is one): a test that waits for nothing to be committed waits for rounds, not time."""
    committer = worker._committer
    commit = committer._commit
    rounds = 0

    async def counting(*args: Any, **kwargs: Any) -> None:
        nonlocal rounds
        rounds += 1
        await commit(*args, **kwargs)

    committer._commit = counting
    return lambda: rounds


def job(job_id: str, **kwargs: Any) -> Job:
    sampling = kwargs.pop("sampling", SamplingSpec(max_tokens=4))
    return Job(job_id=job_id, prompt="hello world", sampling=sampling, **kwargs)


async def test_out_of_order_completion_commits_only_contiguous_prefix(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    jobs = [job("slow", metadata={"gate": "slow"})] + [job(f"fast-{i}") for i in range(4)]
    await produce(bs, topics.jobs, [job_record(j) for j in jobs])
    run = await start_worker(topics)
    rounds = count_commit_rounds(run.worker)
    answered = await results(bs, topics.results, 4)
    assert set(answered) == {f"fast-{i}" for i in range(4)}
    seen = rounds()
    await wait_for(lambda: rounds() >= seen + 3, what="three commit rounds after the answers")
    # Offset 0 is a hole: nothing past it may be committed.
    assert (await committed(bs, topics.group, topics.jobs))[0] in (None, 0)
    run.engine.release("slow")
    await wait_for(lambda: committed_is(bs, topics, {0: 5}), what="commit past the released job")
    assert await run.stop() == 0


async def test_results_go_to_the_partition_of_their_key_as_send_would_put_them(
    kafka_bootstrap_servers, new_topic, start_worker
):
    bs = kafka_bootstrap_servers
    topics = await make_topics(new_topic, results_partitions=3)
    await produce_jobs(bs, topics, "p", 30)
    run = await start_worker(topics)
    records = await collect(bs, topics.results, 30)
    await wait_for(lambda: committed_is(bs, topics, {0: 30}), what="commit of all 30")
    assert await run.stop() == 0
    placed = {record.key: record.partition for record in records}
    assert len(placed) == 30
    assert placed == {key: DefaultPartitioner()(key, [0, 1, 2], [0, 1, 2]) for key in placed}
    assert set(placed.values()) == {0, 1, 2}


async def test_a_free_slot_is_filled_while_the_other_jobs_still_run(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    await produce_jobs(bs, topics, "held", 7, metadata={"gate": "held"})
    run = await start_worker(topics, max_in_flight=8)
    await wait_for(lambda: len(run.engine.started) == 7, what="the first seven jobs to start")
    await produce(bs, topics.jobs, [job_record(job("late"))])
    # The eighth slot is free: the late job runs now, not when the held ones finish.
    late = await results(bs, topics.results, 1)
    assert set(late) == {"late"}
    assert run.engine.running == 7
    run.engine.release("held")
    await wait_for(lambda: committed_is(bs, topics, {0: 8}), what="commit of all eight")
    assert await run.stop() == 0


async def test_bad_records_are_answered_and_valid_jobs_around_them_complete(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    past = time.time() - 60
    records = [
        job_record(job("ok-1")),
        (b"k-garbage", b"\x00\x01 not json", [("trace", b"t1")]),
        (b"k-trunc", b'{"job_id": "trunc", "prompt": "hel', []),
        (b"k-types", b'{"job_id": "types", "prompt": 5}', []),
        (b"k-nofield", b'{"job_id": "nofield"}', []),
        (b"k-noid", b'{"prompt": "hello"}', []),
        (b"k-utf8", b'{"job_id": "\xff\xfe", "prompt": "x"}', []),
        (b"k-tomb", None, []),
        (b"k-limit", encode({"job_id": "limit", "prompt": "x", "sampling": {"n": 100000}}), []),
        job_record(job("expired", deadline=past)),
        job_record(job("eng", metadata={"fail": "engine_error"})),
        job_record(job("eng-final", metadata={"fail": "engine_error_final"})),
        job_record(job("invalid", metadata={"fail": "invalid"})),
        job_record(job("bug", metadata={"fail": "bug"})),
        job_record(job("ok-2", return_routed_experts=True)),
        (None, encode(job("ok-nokey")), [("h", b"x" * 10_000)]),
    ]
    await produce(bs, topics.jobs, records)
    run = await start_worker(topics)
    # Answered by a result: every record whose job_id can be read.
    answered = await results(bs, topics.results, 11)
    codes = {
        k: (v.error.code, v.error.retryable) if isinstance(v, Failed) else "completed"
        for k, v in answered.items()
    }
    assert codes == {
        "ok-1": "completed",
        "ok-2": "completed",
        "ok-nokey": "completed",
        "types": (ErrorCode.INVALID_JOB, False),
        "nofield": (ErrorCode.INVALID_JOB, False),
        "limit": (ErrorCode.INVALID_JOB, False),
        "expired": (ErrorCode.EXPIRED, False),
        "eng": (ErrorCode.ENGINE_ERROR, True),
        "eng-final": (ErrorCode.ENGINE_ERROR, False),
        "invalid": (ErrorCode.INVALID_JOB, False),
        "bug": (ErrorCode.INTERNAL_ERROR, False),
    }
    types_failure = answered["types"]
    assert isinstance(types_failure, Failed)
    assert "$.prompt" in types_failure.error.detail
    limit_failure = answered["limit"]
    assert isinstance(limit_failure, Failed)
    assert "$.sampling.n" in limit_failure.error.detail
    assert "expired" not in run.engine.started  # expired jobs never reach the engine
    # Every schema-invalid record is copied to the dead-letter topic with its origin.
    dead = await collect(bs, topics.dlq, 8)
    by_key = {r.key: r for r in dead}
    assert set(by_key) == {
        b"k-garbage",
        b"k-trunc",
        b"k-types",
        b"k-nofield",
        b"k-noid",
        b"k-utf8",
        b"k-tomb",
        b"k-limit",
    }
    garbage = by_key[b"k-garbage"]
    assert garbage.value == b"\x00\x01 not json"
    headers = dict(garbage.headers)
    assert headers["trace"] == b"t1"  # the original headers are kept
    assert set(DLQ_HEADERS) <= set(headers)
    assert headers["vkw.error.code"] == b"invalid_job"
    assert headers["vkw.source.topic"] == topics.jobs.encode()
    assert headers["vkw.source.offset"] == b"1"
    assert by_key[b"k-tomb"].value is None
    await wait_for(
        lambda: committed_is(bs, topics, {0: len(records)}), what="commit of all records"
    )
    assert await run.stop() == 0


async def test_a_dead_letter_copy_too_large_to_produce_goes_without_its_value(
    kafka_bootstrap_servers, new_topic, start_worker
):
    bs = kafka_bootstrap_servers
    topics = Topics(
        jobs=await new_topic(1, configs={"max.message.bytes": str(8 * 2**20)}),
        results=await new_topic(1),
        dlq=await new_topic(1),
    )
    # The producer takes max_result_bytes + 1 MiB of framing: 1.06 MiB here.
    huge = b"\x00not json" * 150_000
    await produce(bs, topics.jobs, [(b"k-huge", huge, [("trace", b"t")]), job_record(job("after"))])
    run = await start_worker(topics, max_result_bytes=64 * 1024)
    dead = (await collect(bs, topics.dlq, 1))[0]
    assert dead.key == b"k-huge"
    assert dead.value is None
    headers = dict(dead.headers)
    assert headers["vkw.value.dropped"] == str(len(huge)).encode()
    assert headers["vkw.error.code"] == b"invalid_job"
    assert headers["vkw.source.offset"] == b"0"
    assert headers["trace"] == b"t"
    assert isinstance((await results(bs, topics.results, 1))["after"], Completed)
    await wait_for(lambda: committed_is(bs, topics, {0: 2}), what="commit past both")
    assert await run.stop() == 0


async def test_a_completion_larger_than_max_result_bytes_is_answered_result_too_large(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    big = job("big", return_routed_experts=True, sampling=SamplingSpec(max_tokens=4000))
    small = job("small", return_routed_experts=True)
    await produce(bs, topics.jobs, [job_record(big), job_record(small)])
    engine = ScriptedEngine(MockEngineSettings(num_layers=48, top_k=8, num_experts=128))
    run = await start_worker(topics, engine, max_result_bytes=256 * 1024)
    answered = await results(bs, topics.results, 2)
    failure = answered["big"]
    assert isinstance(failure, Failed)
    assert failure.error.code == ErrorCode.RESULT_TOO_LARGE
    # One completion over the limit on its own cannot be split; without a payload store the
    # answer says which limit and which option would publish it.
    assert "a record holds" in failure.error.detail
    assert "max_result_bytes (262144)" in failure.error.detail
    assert "--payload-store" in failure.error.detail
    size = int(failure.error.detail.split("completion 0: ")[1].split(" bytes")[0])
    assert size > 4000 * 48 * 8  # the routed experts alone
    assert isinstance(answered["small"], Completed)
    await wait_for(lambda: committed_is(bs, topics, {0: 2}), what="commit")
    assert await run.stop() == 0


@pytest.mark.parametrize(
    "limit_from",
    [
        "topic",
        # The topic itself takes the broker's default (about 1 MiB); `serve` passes what it
        # read, and the worker must use that rather than read it again.
        "caller",
    ],
)
async def test_a_completion_over_the_results_topics_limit_is_answered_result_too_large(
    kafka_bootstrap_servers, new_topic, start_worker, limit_from
):
    bs = kafka_bootstrap_servers
    if limit_from == "topic":
        topics = await make_topics(new_topic, results_configs={"max.message.bytes": "200000"})
        options: dict[str, Any] = {"compression_type": "none"}
    else:
        topics = await make_topics(new_topic)
        options = {"topic_limits": {topics.results: 200_000}}
    big = job("big", return_routed_experts=True, sampling=SamplingSpec(max_tokens=3000))
    await produce(bs, topics.jobs, [job_record(big), job_record(job("after"))])
    engine = ScriptedEngine(MockEngineSettings(num_layers=48, top_k=8, num_experts=128))
    run = await start_worker(topics, engine, **options)
    answered = await results(bs, topics.results, 2)
    failure = answered["big"]
    assert isinstance(failure, Failed)
    assert failure.error.code == ErrorCode.RESULT_TOO_LARGE
    assert "max.message.bytes (200000)" in failure.error.detail
    assert isinstance(answered["after"], Completed)
    assert await run.stop() == 0


class FlakyProducer:
    """A real producer whose first deliveries of chosen keys fail with a given error."""

    def __init__(self, inner: AIOKafkaProducer, failures: dict[bytes, list[KafkaError]]) -> None:
        self._inner = inner
        self._failures = failures
        self.attempts: dict[bytes, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def send(
        self, topic: str, value: Any = None, key: Any = None, headers: Any = None
    ) -> Any:
        if key is not None:
            self.attempts[key] = self.attempts.get(key, 0) + 1
        errors = self._failures.get(key or b"")
        if errors:
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(errors.pop(0))
            return failed
        return await self._inner.send(topic, value=value, key=key, headers=headers)

    def create_batch(self) -> KeyRecordingBatch:
        return KeyRecordingBatch(self._inner.create_batch())

    async def send_batch(self, batch: KeyRecordingBatch, topic: str, *, partition: int) -> Any:
        """A batch fails, whole, when any of its keys is due to fail."""
        error: KafkaError | None = None
        for key in batch.keys:
            self.attempts[key] = self.attempts.get(key, 0) + 1
            errors = self._failures.get(key)
            if errors:
                error = error or errors.pop(0)
        if error is not None:
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(error)
            return failed
        return await self._inner.send_batch(batch.inner, topic, partition=partition)


class KeyRecordingBatch:
    """A producer's batch that remembers the keys appended to it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.keys: list[bytes] = []

    def append(self, *, timestamp: int | None, key: bytes | None, value: Any, headers: Any) -> Any:
        metadata = self.inner.append(timestamp=timestamp, key=key, value=value, headers=headers)
        if metadata is not None and key is not None:
            self.keys.append(key)
        return metadata

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize(
    ("errors", "outcome"),
    [
        pytest.param([RequestTimedOutError()], "completed", id="transient-then-delivered"),
        pytest.param(
            [MessageSizeTooLargeError(), MessageSizeTooLargeError()],
            ErrorCode.RESULT_TOO_LARGE,
            id="refused-as-too-large",
        ),
    ],
)
async def test_a_failed_delivery_is_sent_again_and_then_committed(
    kafka_bootstrap_servers, topics, start_worker, errors, outcome
):
    bs = kafka_bootstrap_servers
    await produce_jobs(bs, topics, "d", 3)
    flaky: list[FlakyProducer] = []

    def wrap(producer: AIOKafkaProducer) -> AIOKafkaProducer | FlakyProducer:
        if flaky:
            # A producer renewed after a refusal (its sequence broke): the faults were the
            # first producer's.
            return producer
        flaky.append(FlakyProducer(producer, {b"d-1": list(errors)}))
        return flaky[0]

    run = await start_worker(topics, wrap_producer=wrap)
    answered = await results(bs, topics.results, 3)
    await wait_for(lambda: committed_is(bs, topics, {0: 3}), what="commit of all three")
    assert await run.stop() == 0
    failed = answered["d-1"]
    if outcome == "completed":
        assert isinstance(failed, Completed)
        assert flaky[0].attempts[b"d-1"] == 2
    else:
        assert isinstance(failed, Failed)
        assert failed.error.code == outcome
        # First send and re-send; the small answer goes out on the renewed producer.
        assert flaky[0].attempts[b"d-1"] == 2
    assert isinstance(answered["d-0"], Completed)
    assert isinstance(answered["d-2"], Completed)


async def test_a_delivery_failing_for_good_stops_the_worker_uncommitted(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    await produce_jobs(bs, topics, "d", 1)
    refused: list[KafkaError] = [TopicAuthorizationFailedError(), TopicAuthorizationFailedError()]
    run = await start_worker(
        topics, wrap_producer=lambda producer: FlakyProducer(producer, {b"d-0": refused})
    )
    assert await asyncio.wait_for(run.task, 60) == 1
    # Nothing past the undelivered job: it is redelivered to the next worker.
    assert (await committed(bs, topics.group, topics.jobs)).get(0) in (None, 0)


async def test_engine_death_exits_nonzero_without_committing_unfinished_jobs(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    records = [
        job_record(job("done-0")),
        job_record(job("done-1")),
        job_record(job("running", metadata={"gate": "never"})),
        job_record(job("dies", metadata={"delay_s": "0.5", "fail": "dead"})),
        job_record(job("later")),
    ]
    await produce(bs, topics.jobs, records)
    run = await start_worker(topics)
    status = await asyncio.wait_for(run.task, 30)
    assert status == 1
    assert "running" in run.engine.cancelled
    assert await committed(bs, topics.group, topics.jobs) == {0: 2}
    assert run.engine.closed


async def test_engine_failing_its_health_check_stops_an_idle_worker(
    kafka_bootstrap_servers, topics, start_worker
):
    run = await start_worker(topics, health_check_interval_s=0.2)
    await wait_for(lambda: run.worker.ready, what="readiness")
    run.engine.healthy = False
    assert await asyncio.wait_for(run.task, 30) == 1
    assert run.engine.closed


async def test_shutdown_waits_for_in_flight_jobs_within_grace(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    await produce_jobs(bs, topics, "j", 3, metadata={"delay_s": "1.0"})
    run = await start_worker(topics, shutdown_grace_s=10)
    await wait_for(lambda: len(run.engine.started) == 3, what="jobs to start")
    assert await run.stop() == 0
    assert run.engine.cancelled == []
    assert set(await results(bs, topics.results, 3)) == {"j-0", "j-1", "j-2"}
    assert await committed(bs, topics.group, topics.jobs) == {0: 3}


async def test_shutdown_past_grace_aborts_and_leaves_jobs_for_redelivery(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    await produce(
        bs,
        topics.jobs,
        [job_record(job("quick"))]
        + [job_record(job(f"stuck{i}", metadata={"gate": "g"})) for i in range(2)],
    )
    run = await start_worker(topics, shutdown_grace_s=0.3)
    await wait_for(lambda: len(run.engine.started) == 3, what="jobs to start")
    await results(bs, topics.results, 1)
    assert await run.stop() == 0
    assert sorted(run.engine.cancelled) == ["stuck0", "stuck1"]
    assert await committed(bs, topics.group, topics.jobs) == {0: 1}
    # The next worker of the group gets exactly the unfinished jobs again.
    engine = ScriptedEngine()
    engine.release("g")
    rerun = await start_worker(topics, engine)
    answered = await results(bs, topics.results, 3)
    assert set(answered) == {"quick", "stuck0", "stuck1"}
    assert sorted(engine.started) == ["stuck0", "stuck1"]
    assert await rerun.stop() == 0


async def test_restart_resumes_from_committed_offset_without_loss(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    await produce(bs, topics.jobs, [job_record(job(f"a{i}")) for i in range(10)])
    first = await start_worker(topics)
    await results(bs, topics.results, 10)
    await wait_for(lambda: committed_is(bs, topics, {0: 10}), what="commit")
    assert await first.stop() == 0
    await produce(bs, topics.jobs, [job_record(job(f"b{i}")) for i in range(10)])
    second = await start_worker(topics)
    answered = await results(bs, topics.results, 20)
    assert set(answered) == {f"a{i}" for i in range(10)} | {f"b{i}" for i in range(10)}
    assert sorted(second.engine.started) == sorted(f"b{i}" for i in range(10))
    assert await second.stop() == 0


class SlowBatchProducer:
    """A real producer that takes `delay_s` to accept each batch, as when the broker lags."""

    def __init__(self, inner: AIOKafkaProducer, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> Any:
        await asyncio.sleep(self._delay_s)
        return await self._inner.send_batch(batch, topic, partition=partition)


async def test_a_revoke_delivers_and_commits_answers_the_outbox_still_holds(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    await produce_jobs(bs, topics, "r", 3)
    run = await start_worker(
        topics, wrap_producer=lambda producer: SlowBatchProducer(producer, delay_s=1.0)
    )
    await wait_for(lambda: len(run.engine.started) == 3, what="jobs to start")
    await wait_for(lambda: run.worker._delivery.pending == 3, what="answers in the outbox")
    tp = TopicPartition(topics.jobs, 0)
    await run.worker.on_partitions_revoked({tp})
    # Before the partition is released, its answers are acknowledged and committed.
    assert await committed(bs, topics.group, topics.jobs) == {0: 3}
    assert set(await results(bs, topics.results, 3)) == {"r-0", "r-1", "r-2"}
    assert await run.stop() == 0


async def test_two_workers_split_partitions_and_one_leaving_loses_nothing(
    tansu_broker, new_topic, start_worker
):
    # On tansu: the local noida-db broker does not hand a departed group leader's partitions on.
    bs = tansu_broker.bootstrap_servers
    topics = await make_topics(new_topic, jobs_partitions=4, bootstrap_servers=bs)
    common = {"bootstrap_servers": bs, "enable_idempotence": False}
    one = await start_worker(topics, **common)
    two = await start_worker(topics, **common)
    await wait_for(
        lambda: (
            one.worker.ready
            and two.worker.ready
            and len(one.worker.assignment()) + len(two.worker.assignment()) == 4
        ),
        timeout_s=60,
        what="both workers to hold partitions",
    )
    records = [job_record(job(f"j{i}", metadata={"delay_s": "0.05"})) for i in range(80)]
    await produce(bs, topics.jobs, records[:40])
    await wait_for(
        lambda: len(one.engine.started) > 3 and len(two.engine.started) > 3, what="both to work"
    )
    assert await one.stop() == 0
    await produce(bs, topics.jobs, records[40:])
    answered = await results(bs, topics.results, 80, timeout_s=90)
    assert set(answered) == {f"j{i}" for i in range(80)}
    assert all(isinstance(r, Completed) for r in answered.values())
    await wait_for(
        lambda: committed_total_is(bs, topics.group, topics.jobs, 80),
        timeout_s=30,
        what="all offsets committed by the survivor",
    )
    assert await two.stop() == 0


async def test_backlog_keeps_in_flight_under_the_cap_and_memory_bounded(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    count = 10_000
    payload = encode(job("x"))
    await produce(
        bs,
        topics.jobs,
        [(f"j{i}".encode(), payload.replace(b'"x"', f'"j{i}"'.encode()), []) for i in range(count)],
    )
    engine = ScriptedEngine(max_concurrency=8)  # cap = 2 x 8
    rss_before = psutil.Process(os.getpid()).memory_info().rss
    run = await start_worker(topics, engine)
    assert run.worker.max_in_flight == 16
    await results(bs, topics.results, count, timeout_s=240)
    rss_after = psutil.Process(os.getpid()).memory_info().rss
    assert engine.peak_running <= 16
    assert len(engine.started) == count
    assert rss_after - rss_before < 150 * 1024 * 1024
    await wait_for(lambda: committed_is(bs, topics, {0: count}), what="commit")
    assert await run.stop() == 0


async def test_broker_gone_longer_than_publish_timeout_stops_the_worker_uncommitted(
    restartable_broker, new_topic, start_worker
):
    bs = restartable_broker.bootstrap_servers
    topics = await make_topics(new_topic, bootstrap_servers=bs)
    await produce(
        bs,
        topics.jobs,
        [job_record(job("first")), job_record(job("orphan", metadata={"gate": "g"}))],
    )
    run = await start_worker(
        topics,
        bootstrap_servers=bs,
        publish_timeout_s=2,
        close_timeout_s=3,
        commit_timeout_s=1,
        # The hand-over is tried for the grace after a fatal error too; with no broker to
        # land it, a short grace keeps the stop short.
        shutdown_grace_s=2,
    )
    await results(bs, topics.results, 1)
    await wait_for(lambda: "orphan" in run.engine.started, what="the second job to start")
    await asyncio.to_thread(restartable_broker.stop)  # a clean stop keeps the committed offsets
    run.engine.release("g")
    started = time.monotonic()
    assert await asyncio.wait_for(run.task, 120) == 1
    assert time.monotonic() - started < 90
    # The orphan's answer never reached the broker: no commit the worker made covers it.
    tp = TopicPartition(topics.jobs, 0)
    assert run.worker._committer.committed_position(tp) in (None, 0, 1)


async def test_metrics_health_and_readiness_endpoints(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    await produce(
        bs, topics.jobs, [job_record(job(f"m{i}", return_routed_experts=True)) for i in range(3)]
    )
    await produce(bs, topics.jobs, [(b"bad", b"nope", [])])
    run = await start_worker(topics)
    server = MetricsServer(run.worker.metrics, "127.0.0.1", 0, lambda: run.worker.ready)
    server.start()
    await results(bs, topics.results, 3)
    await wait_for(lambda: run.worker.ready, what="readiness")
    port = server.bound_port
    assert port is not None
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/healthz") as r:
            assert r.status == 200
        async with http.get(f"http://127.0.0.1:{port}/readyz") as r:
            assert r.status == 200
        dead_lettered = 'vkw_jobs_total{code="invalid_job",outcome="dead_lettered"}'

        async def dead_letter_counted() -> bool:
            return await _metric(http, port, dead_lettered) == 1.0

        await wait_for(dead_letter_counted, what="dead-letter metric")
        assert await _metric(http, port, 'vkw_jobs_total{code="",outcome="completed"}') == 3.0
        assert await _metric(http, port, "vkw_generated_tokens_total") == 12.0
        assert (await _metric(http, port, "vkw_routed_experts_bytes_total") or 0) > 0
        lag = f'vkw_consumer_lag{{partition="0",topic="{topics.jobs}"}}'

        async def caught_up() -> bool:
            return await _metric(http, port, lag) == 0.0

        await wait_for(caught_up, what="lag 0 once every record is committed")
    assert await run.stop() == 0
    server.stop()


async def _metric(http: aiohttp.ClientSession, port: int, name: str) -> float | None:
    async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return None


async def test_an_answer_too_large_even_as_a_failure_is_shrunk_and_the_partition_moves_on(
    kafka_bootstrap_servers, new_topic, start_worker
):
    """A failed answer that copies ~120 KB of incompressible metadata is itself over a 64 KiB
    results topic: it must be answered minimally, not refused (which broke the idempotent
    producer's sequence and crash-looped the worker)."""
    bs = kafka_bootstrap_servers
    topics = await make_topics(new_topic, results_configs={"max.message.bytes": str(64 * 1024)})
    # 120 KB of base64 of random bytes: within the schema's limits, and zstd cannot shrink it
    # below the topic's limit.
    metadata = {f"m{i}": base64.b64encode(os.urandom(6000)).decode() for i in range(15)}
    big = job(
        "big",
        metadata=metadata,
        return_routed_experts=True,
        sampling=SamplingSpec(max_tokens=300),
    )
    await produce(bs, topics.jobs, [job_record(big), job_record(job("after"))])
    engine = ScriptedEngine(MockEngineSettings(num_layers=48, top_k=8, num_experts=128))
    run = await start_worker(topics, engine)
    answered = await results(bs, topics.results, 2)
    failure = answered["big"]
    assert isinstance(failure, Failed)
    assert failure.error.code == ErrorCode.RESULT_TOO_LARGE
    assert failure.metadata == {}  # dropped: with it the answer does not fit
    assert f"max.message.bytes ({64 * 1024})" in failure.error.detail
    assert isinstance(answered["after"], Completed)
    await wait_for(lambda: committed_is(bs, topics, {0: 2}), what="commit past both")
    assert not run.task.done()
    assert await run.stop() == 0


async def test_a_result_the_broker_refuses_names_the_broker_and_is_answered_smaller(
    kafka_bootstrap_servers, new_topic, start_worker
):
    """The results topic's limit is unknown to the worker (as when describe_configs is not
    allowed): the broker's refusal is what the answer names, and a smaller answer goes out."""
    bs = kafka_bootstrap_servers
    topics = await make_topics(new_topic, results_configs={"max.message.bytes": "200000"})
    big = job("big", return_routed_experts=True, sampling=SamplingSpec(max_tokens=3000))
    await produce(bs, topics.jobs, [job_record(big), job_record(job("after"))])
    engine = ScriptedEngine(MockEngineSettings(num_layers=48, top_k=8, num_experts=128))
    run = await start_worker(
        topics,
        engine,
        topic_limits={topics.results: None, topics.dlq: None},
        compression_type="none",
        # aiokafka's idempotent producer does not recover its sequence after a refused batch
        # (OutOfOrderSequenceNumber, then the worker stops): with idempotence the worker relies
        # on knowing the limit, as the test above does.
        enable_idempotence=False,
    )
    answered = await results(bs, topics.results, 2)
    failure = answered["big"]
    assert isinstance(failure, Failed)
    assert failure.error.code == ErrorCode.RESULT_TOO_LARGE
    assert "the broker ([Error 10] MessageSizeTooLargeError) refused it" in failure.error.detail
    # Not a limit that had nothing to do with it (max_result_bytes and the producer's).
    assert str(16 * 2**20) not in failure.error.detail
    assert isinstance(answered["after"], Completed)
    await wait_for(lambda: committed_is(bs, topics, {0: 2}), what="commit past both")
    assert await run.stop() == 0


async def test_a_revoke_longer_than_the_session_timeout_keeps_its_membership(
    tansu_broker, new_topic, start_worker
):
    """On a broker that evicts, a member still draining its revoked jobs past the session
    timeout must not be dropped from the group: its slow job is answered once, by it, and
    committed. (tansu keeps such a member even with aiokafka's default rebalance timeout, the
    session timeout, so this holds the behaviour; test_config checks the setting reaches the
    consumer, which is what Apache Kafka needs.)"""
    bs = tansu_broker.bootstrap_servers
    topics = await make_topics(new_topic, jobs_partitions=2, bootstrap_servers=bs)
    tansu = {"bootstrap_servers": bs, "enable_idempotence": False, "session_timeout_ms": 6000}
    one = await start_worker(topics, revoke_grace_s=9, **tansu)
    await wait_for(lambda: len(one.worker.assignment()) == 2, 60, "the first member")
    await produce(bs, topics.jobs, [job_record(job("slow", metadata={"delay_s": "8"}))], 0)
    await wait_for(lambda: "slow" in one.engine.started, 30, "the slow job to start")
    revokes = 0
    revoke = one.worker.on_partitions_revoked

    async def counting(revoked: set[TopicPartition]) -> None:
        nonlocal revokes
        revokes += 1
        await revoke(revoked)

    one.worker.on_partitions_revoked = counting
    two = await start_worker(topics, **tansu)  # joining revokes the slow job's partition
    await wait_for(
        lambda: len(one.worker.assignment()) == len(two.worker.assignment()) == 1,
        90,
        "one partition each",
    )
    answered = await collect(bs, topics.results, 1, timeout_s=30)

    async def slow_committed() -> bool:
        return (await committed(bs, topics.group, topics.jobs)).get(0) == 1

    # The commit past the slow job is made by the member that drained it, after its revoke:
    # had the group dropped it meanwhile, the new owner would have started the job again.
    await wait_for(slow_committed, 30, "the slow job committed")
    assert revokes == 1
    assert [r.key for r in await collect(bs, topics.results, 1)] == [b"slow"]
    assert answered[0].key == b"slow"
    assert "slow" not in two.engine.started


async def test_the_next_owner_skips_what_the_last_one_answered_out_of_order(
    kafka_bootstrap_servers, topics, start_worker
):
    bs = kafka_bootstrap_servers
    slow = job("slow", metadata={"gate": "never"})
    await produce(bs, topics.jobs, [job_record(slow)])
    await produce_jobs(bs, topics, "f", 20)
    first = await start_worker(topics, shutdown_grace_s=0)
    await results(bs, topics.results, 20)
    # Leaving the group revokes the partition: the slow job is aborted, the rest is answered.
    assert await first.stop() == 0
    second = await start_worker(topics)
    await wait_for(lambda: "slow" in second.engine.started, what="the slow job to run again")
    second.engine.release("never")
    await wait_for(lambda: committed_is(bs, topics, {0: 21}), what="commit past all")
    assert second.engine.started == ["slow"]  # the 20 answered jobs were not generated again
    assert second.worker.metrics.skipped.values[()] == 20
