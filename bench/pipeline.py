"""Benchmark: jobs/s through the worker vs a bare aiokafka loop, and RSS while draining a backlog.

Run `python bench/pipeline.py [--jobs N] [--rounds R] [--backlog N]`. Uses $KAFKA_BOOTSTRAP_SERVERS
when set, else starts a local noida-db broker (worker.dev.broker.LocalBroker).

1. Throughput. The same jobs (one pre-produced topic) are served, in alternating rounds, by
   - the worker in this process (`Worker` as `serve` builds it, the mock engine at zero latency),
   - a bare loop: `getmany` -> produce the pre-encoded mock result of each job -> await the
     deliveries -> commit. Same client settings, same result bytes, no engine call, and
   - the same bare loop that also decodes each job, runs the mock engine and encodes the result,
     one job at a time, and produces a fetch's results as record batches, as the worker's outbox
     does: the worker's work without its machinery (tasks, offsets, metrics, rebalance and
     shutdown handling).
   Each run uses its own group and results topic (made as `serve --create-topics` makes them);
   its rate is timed by the results' own timestamps, from the first to the last (so group join is
   excluded). The worker/bare ratio (goal >= 0.8) is of the medians; worker/(bare + engine)
   is printed next to it.
2. Memory. A `python -m worker serve --engine mock` subprocess drains a backlog of `--backlog` jobs;
   its RSS is sampled with psutil while it drains, and the peak so far is printed at 25/50/75/100%
   of the drain, so flat-vs-growing is visible.

It prints figures and the ratio next to the goal; it never fails on them (exit code 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Final

import psutil
from aiokafka import AIOKafkaProducer, TopicPartition

from schemas import Completed, Job, SamplingSpec, Timings, decode_job, encode
from worker.answering.encoder import encode_result
from worker.build import build_worker, tune_gc_for_serving
from worker.core.config import Settings, settings_from
from worker.core.kafka import (
    ensure_topics,
    make_consumer,
    make_producer,
    read_record_limits,
    record_size_limit,
)
from worker.core.paced_consumer import PacedConsumer
from worker.dev.broker import env_or_local_broker
from worker.engines.mock import MockEngine, MockEngineSettings

RATIO_GOAL: Final = 0.8
REPO: Final = Path(__file__).resolve().parent.parent
MAX_TOKENS: Final = 8
NUM_LAYERS: Final = 8  # small routed-experts arrays keep the in-memory dev broker small


def _jobs(count: int) -> list[Job]:
    prefix = uuid.uuid4().hex[:8]
    return [
        Job(
            job_id=f"{prefix}-{i}",
            prompt=f"benchmark prompt {i}",
            sampling=SamplingSpec(max_tokens=MAX_TOKENS),
            return_routed_experts=True,
        )
        for i in range(count)
    ]


async def _create_topics(bootstrap: str, *names: str, max_message_bytes: int | None = None) -> None:
    configs = {} if max_message_bytes is None else {"max.message.bytes": str(max_message_bytes)}
    await ensure_topics(
        {"bootstrap_servers": bootstrap},
        dict.fromkeys(names, 1),
        configs=dict.fromkeys(names, configs),
    )


def _topic() -> str:
    return f"bench-{uuid.uuid4().hex}"


async def _produce(bootstrap: str, topic: str, jobs: list[Job]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20)
    await producer.start()
    try:
        futures = [await producer.send(topic, value=encode(j), key=j.job_id.encode()) for j in jobs]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


class EndOffsetProbe:
    """Watches a topic's end offset (one partition): how many results exist, and when."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._consumer = PacedConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        self._tp = TopicPartition(topic, 0)

    async def __aenter__(self) -> EndOffsetProbe:
        await self._consumer.start()
        self._consumer.assign([self._tp])
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def count(self) -> int:
        offsets = await self._consumer.end_offsets([self._tp])
        return int(offsets[self._tp])

    async def wait(
        self,
        target: int,
        on_progress: Callable[[int], None] | None = None,
        interval_s: float = 0.05,
        timeout_s: float = 600.0,
    ) -> float:
        """Wait for `target` results; return the seconds from the first one to the last.

        Timed by the records' own timestamps (set when the producer took each one), not by
        when this probe looks: a loop that answers a whole fetch without yielding would keep
        the probe from looking at all.
        """
        deadline = time.monotonic() + timeout_s
        while (n := await self.count()) < target:
            if on_progress is not None:
                on_progress(n)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} of {target} results after {timeout_s}s")
            await asyncio.sleep(interval_s)
        if on_progress is not None:
            on_progress(n)
        first, last = await self._timestamp_ms(0), await self._timestamp_ms(target - 1)
        # From the first result to the last is target - 1 intervals.
        return (last - first) / 1000 * target / max(target - 1, 1)

    async def _timestamp_ms(self, offset: int) -> int:
        self._consumer.seek(self._tp, offset)
        record = await self._consumer.getone(self._tp)
        return int(record.timestamp)


def _settings(bootstrap: str, jobs_topic: str, results_topic: str, dlq: str) -> Settings:
    return settings_from(
        {
            "bootstrap_servers": bootstrap,
            "jobs_topic": jobs_topic,
            "results_topic": results_topic,
            "dead_letter_topic": dlq,
            "group_id": f"bench-{uuid.uuid4().hex[:8]}",
            "engine": "mock",
            "mock_num_layers": NUM_LAYERS,
            "shutdown_grace_s": 5,
        },
        {},
    )


async def _answer_topics(bootstrap: str, jobs_topic: str) -> Settings:
    """Fresh results and dead-letter topics, made as `serve --create-topics` makes them."""
    settings = _settings(bootstrap, jobs_topic, _topic(), _topic())
    await _create_topics(
        bootstrap,
        settings.results_topic,
        settings.dead_letter_topic,
        max_message_bytes=record_size_limit(settings),
    )
    return settings


def _engine() -> MockEngine:
    return MockEngine(MockEngineSettings(per_token_latency_ms=0.0, num_layers=NUM_LAYERS))


async def _result_bytes(jobs: list[Job]) -> dict[bytes, bytes]:
    """The mock engine's result for each job, encoded as the worker would publish it."""
    engine = _engine()
    out: dict[bytes, bytes] = {}
    for job in jobs:
        out[job.job_id.encode()] = encode(await _mock_result(engine, job))
    return out


async def run_worker(bootstrap: str, jobs_topic: str, count: int) -> float:
    settings = await _answer_topics(bootstrap, jobs_topic)
    results = settings.results_topic
    worker = await build_worker(  # as `serve` builds it, without the control plane
        settings, _engine(), steered=False, on_serving=tune_gc_for_serving
    )
    return await _rate(bootstrap, results, count, worker.run(), worker.request_stop)


async def _answer_inline(engine: MockEngine, value: bytes) -> bytes:
    """What the worker computes for a job, without its service machinery around it."""
    return encode_result(await _mock_result(engine, decode_job(value)))


async def _mock_result(engine: MockEngine, job: Job) -> Completed:
    output = await engine.generate(job, job.job_id)
    return Completed(
        job_id=job.job_id,
        completions=output.completions,
        prompt_token_count=len(output.prompt_token_ids),
        prompt_token_ids=output.prompt_token_ids,
        metadata=job.metadata,
        model=engine.model_name,
        worker="bench-bare-loop",
        timings=Timings(queue_wait_s=0.0, engine_s=0.0),
    )


async def run_bare(
    bootstrap: str,
    jobs_topic: str,
    count: int,
    result_bytes: dict[bytes, bytes],
    *,
    with_engine: bool = False,
) -> float:
    settings = await _answer_topics(bootstrap, jobs_topic)
    results = settings.results_topic
    limits = await read_record_limits(settings)
    consumer = make_consumer(settings, limits)
    producer = make_producer(settings, limits)
    engine = _engine()
    stop = asyncio.Event()

    async def loop() -> None:
        consumer.subscribe([jobs_topic])
        await consumer.start()
        await producer.start()
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=settings.poll_timeout_ms)
                deliveries: list[asyncio.Future[Any]] = []
                offsets: dict[TopicPartition, int] = {}
                for tp, records in batch.items():
                    if with_engine:
                        # Each result is appended as soon as it is computed: the results' own
                        # timestamps, which time the run, must not bunch up.
                        builder = producer.create_batch()
                        for record in records:
                            value = await _answer_inline(engine, record.value)
                            if builder.append(key=record.key, value=value, timestamp=None) is None:
                                deliveries.append(await _send_batch(producer, results, builder))
                                builder = producer.create_batch()
                                builder.append(key=record.key, value=value, timestamp=None)
                        deliveries.append(await _send_batch(producer, results, builder))
                    else:
                        for record in records:
                            value = result_bytes[record.key]
                            deliveries.append(
                                await producer.send(results, value=value, key=record.key)
                            )
                    offsets[tp] = records[-1].offset + 1
                if deliveries:
                    await asyncio.gather(*deliveries)
                    await consumer.commit(offsets)
        finally:
            await consumer.stop()
            await producer.stop()

    return await _rate(bootstrap, results, count, loop(), stop.set)


async def _send_batch(producer: AIOKafkaProducer, topic: str, builder: Any) -> Any:
    """Submit a batch to the one-partition results topic, closed as the worker's outbox does."""
    builder.close()
    return await producer.send_batch(builder, topic, partition=0)


async def _rate(
    bootstrap: str,
    results: str,
    count: int,
    serving: Coroutine[Any, Any, object],
    stop: Callable[[], object],
) -> float:
    """Jobs/s of `serving` answering `count` jobs into `results`; `stop` ends it."""
    async with EndOffsetProbe(bootstrap, results) as probe:
        task = asyncio.create_task(serving)
        try:
            seconds = await probe.wait(count)
        finally:
            stop()
            await asyncio.wait_for(task, 60)
    return count / seconds


async def throughput(bootstrap: str, count: int, rounds: int) -> None:
    jobs = _jobs(count)
    jobs_topic = _topic()
    await _create_topics(bootstrap, jobs_topic)
    await _produce(bootstrap, jobs_topic, jobs)
    t0 = time.perf_counter()
    result_bytes = await _result_bytes(jobs)
    engine_us = (time.perf_counter() - t0) / count * 1e6
    mean_size = statistics.fmean(len(v) for v in result_bytes.values())
    print(
        f"throughput: {count} jobs, result ~{mean_size:.0f} B, mock engine + encode "
        f"{engine_us:.0f} us/job (in the worker's path, not the bare loop's)"
    )
    rates: dict[str, list[float]] = {"bare": [], "bare+engine": [], "worker": []}
    runs: list[tuple[str, Callable[[], Awaitable[float]]]] = [
        ("bare", lambda: run_bare(bootstrap, jobs_topic, count, result_bytes)),
        (
            "bare+engine",
            lambda: run_bare(bootstrap, jobs_topic, count, result_bytes, with_engine=True),
        ),
        ("worker", lambda: run_worker(bootstrap, jobs_topic, count)),
    ]
    for r in range(rounds):
        for name, run in runs if r % 2 == 0 else runs[::-1]:
            rate = await run()
            rates[name].append(rate)
            print(f"  round {r + 1} {name:11s} {rate:8.0f} jobs/s")
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratio = median["worker"] / median["bare"]
    verdict = "meets" if ratio >= RATIO_GOAL else "BELOW"
    print(
        f"median: worker {median['worker']:.0f} jobs/s, bare loop {median['bare']:.0f} jobs/s,"
        f" ratio {ratio:.2f} ({verdict} goal >= {RATIO_GOAL})"
    )
    print(
        f"        bare loop that also decodes, runs the mock engine and encodes, one job at a"
        f" time, producing in batches: {median['bare+engine']:.0f} jobs/s; worker/that"
        f" {median['worker'] / median['bare+engine']:.2f}"
    )


async def backlog_rss(bootstrap: str, count: int) -> None:
    jobs_topic, results, dlq = _topic(), _topic(), _topic()
    await _create_topics(bootstrap, jobs_topic, results, dlq)
    t0 = time.perf_counter()
    await _produce(bootstrap, jobs_topic, _jobs(count))
    print(f"backlog: {count} jobs produced in {time.perf_counter() - t0:.1f}s")
    argv = [
        sys.executable,
        "-m",
        "worker",
        "serve",
        "--engine",
        "mock",
        "--mock-num-layers",
        str(NUM_LAYERS),
        "--bootstrap-servers",
        bootstrap,
        "--jobs-topic",
        jobs_topic,
        "--results-topic",
        results,
        "--dead-letter-topic",
        dlq,
        "--group-id",
        f"bench-{uuid.uuid4().hex[:8]}",
        "--log-level",
        "WARNING",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VKW_")}
    proc = await asyncio.create_subprocess_exec(*argv, cwd=REPO, env=env)
    ps = psutil.Process(proc.pid)
    peak = 0
    marks = [25, 50, 75, 100]
    start_rss = ps.memory_info().rss

    def sample(done: int) -> None:
        nonlocal peak
        with contextlib.suppress(psutil.Error):
            peak = max(peak, ps.memory_info().rss)
        while marks and done * 100 >= marks[0] * count:
            print(
                f"  {marks.pop(0):3d}% drained ({done:6d} results): peak RSS {peak / 2**20:6.1f} MiB"
            )

    try:
        async with EndOffsetProbe(bootstrap, results) as probe:
            seconds = await probe.wait(count, on_progress=sample, interval_s=0.1)
    finally:
        proc.terminate()
        rc = await asyncio.wait_for(proc.wait(), 60)
    print(
        f"backlog drained at {count / seconds:.0f} jobs/s; RSS at start {start_rss / 2**20:.1f} MiB,"
        f" peak {peak / 2**20:.1f} MiB; worker exit {rc}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per throughput run")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (alternating)")
    parser.add_argument("--backlog", type=int, default=20_000, help="backlog for the RSS run")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-backlog", action="store_true")
    args = parser.parse_args()
    with env_or_local_broker() as bootstrap:
        print(f"broker {bootstrap}")
        if not args.skip_throughput:
            asyncio.run(throughput(bootstrap, args.jobs, args.rounds))
        if not args.skip_backlog:
            asyncio.run(backlog_rss(bootstrap, args.backlog))


if __name__ == "__main__":
    main()
