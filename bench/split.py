"""Benchmark: results too large for a record, split by completion, vs the same results whole.

Run `python bench/split.py [--jobs N] [--rounds R]`. Uses $KAFKA_BOOTSTRAP_SERVERS when set, else
starts a local noida-db broker.

1. Publish path. The same GRPO-shaped jobs (n=8, 1024 tokens, a 48-layer top-8 mock model: about
   4 MiB of base64 routing a job) are served, in alternating rounds, by the worker (as `serve`
   builds it, mock engine at zero latency) into
   - a results topic whose 1 MiB `max.message.bytes` makes every result split into parts, and
   - a results topic that takes each result as one record.
   A run is timed from its first result record's timestamp to the moment the group's commit
   covers every job (a split job commits only once all its parts are acknowledged). Throughput
   is the whole results' bytes per second; the split/whole ratio of the medians has goal >= 0.8.
2. Reader side. The split run's records are decoded and fed to `schemas.ResultAssembler`, versus
   decoding the whole records: results/s, MB/s and the ratio.

It prints figures and ratios; it never fails on them (exit code 0).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas import Job, ResultAssembler, SamplingSpec, decode_result, encode
from worker.build import build_worker, tune_gc_for_serving
from worker.core.config import MiB, settings_from
from worker.core.paced_consumer import PacedConsumer
from worker.dev.broker import env_or_local_broker, new_topics
from worker.engines.mock import MockEngine, MockEngineSettings

RATIO_GOAL: Final = 0.8
N: Final = 8
TOKENS: Final = 1024
LAYERS: Final = 48
SPLIT_LIMIT: Final = 1 * MiB
WHOLE_LIMIT: Final = 32 * MiB


async def _delete(bootstrap: str, *names: str) -> None:
    """The in-memory dev broker keeps every byte: free each run's topics after it."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics(list(names))
    finally:
        await admin.close()


async def _produce_jobs(bootstrap: str, topic: str, count: int) -> None:
    prefix = uuid.uuid4().hex[:6]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=10)
    await producer.start()
    try:
        for i in range(count):
            job = Job(
                job_id=f"{prefix}-{i}",
                prompt_token_ids=list(range(1, 33)),
                sampling=SamplingSpec(n=N, max_tokens=TOKENS, seed=i),
                return_routed_experts=True,
                routed_experts_prompt_start=32,
            )
            await producer.send(topic, value=encode(job), key=job.job_id.encode())
        await producer.flush()
    finally:
        await producer.stop()


async def _committed(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int:
    return (await consumer.committed(tp)) or 0


class Run:
    """One worker run into a fresh results topic with `limit` as its max.message.bytes."""

    def __init__(self, bootstrap: str, jobs_topic: str, count: int, limit: int) -> None:
        self.bootstrap = bootstrap
        self.jobs_topic = jobs_topic
        self.count = count
        self.limit = limit
        self.results_topic = ""
        self.group = f"bench-{uuid.uuid4().hex[:8]}"

    async def seconds(self) -> float:
        (self.results_topic,) = await new_topics(
            self.bootstrap, 1, configs={"max.message.bytes": str(self.limit)}
        )
        settings = settings_from(
            {
                "bootstrap_servers": self.bootstrap,
                "jobs_topic": self.jobs_topic,
                "results_topic": self.results_topic,
                "dead_letter_topic": self.results_topic,
                "group_id": self.group,
                "engine": "mock",
                "commit_interval_ms": 0,
                "max_result_bytes": WHOLE_LIMIT - MiB,
                "shutdown_grace_s": 5,
            },
            {},
        )
        worker = await build_worker(
            settings,
            MockEngine(MockEngineSettings(num_layers=LAYERS, top_k=8, num_experts=128)),
            steered=False,
            on_serving=tune_gc_for_serving,
        )
        watcher = PacedConsumer(
            bootstrap_servers=self.bootstrap, group_id=self.group, enable_auto_commit=False
        )
        await watcher.start()
        jobs_tp = TopicPartition(self.jobs_topic, 0)
        task = asyncio.create_task(worker.run())
        try:
            while await _committed(watcher, jobs_tp) < self.count:
                if task.done():
                    raise RuntimeError(f"the worker stopped early: {task.result()}")
                await asyncio.sleep(0.02)
            done_ms = time.time() * 1000
        finally:
            worker.request_stop()
            await asyncio.wait_for(task, 60)
            await watcher.stop()
        first = await self._first_timestamp_ms()
        return (done_ms - first) / 1000

    async def _first_timestamp_ms(self) -> int:
        consumer = PacedConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            tp = TopicPartition(self.results_topic, 0)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            return int((await consumer.getone(tp)).timestamp)
        finally:
            await consumer.stop()

    async def values(self) -> list[bytes]:
        consumer = PacedConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            max_partition_fetch_bytes=WHOLE_LIMIT,
            fetch_max_bytes=2 * WHOLE_LIMIT,
        )
        await consumer.start()
        try:
            tp = TopicPartition(self.results_topic, 0)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            end = (await consumer.end_offsets([tp]))[tp]
            out: list[bytes] = []
            while len(out) < end:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    out += [r.value for r in records if r.value is not None]
            return out
        finally:
            await consumer.stop()


def _reader_seconds(values: list[bytes], *, assemble: bool, repeats: int = 5) -> float:
    """Best of `repeats`: decode every value (and assemble, for parts)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        if assemble:
            ResultAssembler().add_all(decode_result(v) for v in values)
        else:
            for value in values:
                decode_result(value)
        best = min(best, time.perf_counter() - t0)
    return best


async def main(bootstrap: str, count: int, rounds: int) -> None:
    (jobs_topic,) = await new_topics(bootstrap, 1, configs={"max.message.bytes": str(MiB)})
    await _produce_jobs(bootstrap, jobs_topic, count)
    rates: dict[str, list[float]] = {"split": [], "whole": []}
    kept: dict[str, list[bytes]] = {}
    job_bytes = 0
    for r in range(rounds):
        order = [("split", SPLIT_LIMIT), ("whole", WHOLE_LIMIT)]
        for name, limit in order if r % 2 == 0 else order[::-1]:
            run = Run(bootstrap, jobs_topic, count, limit)
            seconds = await run.seconds()
            values = await run.values()
            if name == "whole":
                job_bytes = sum(len(v) for v in values)
            if r == 0:
                kept[name] = values
            await _delete(bootstrap, run.results_topic)
            rates[name].append(seconds)
            print(f"  round {r + 1} {name:5s} {len(values):4d} records in {seconds:6.2f} s")
    median = {name: statistics.median(seconds) for name, seconds in rates.items()}
    mb = job_bytes / 1e6
    split_rate, whole_rate = mb / median["split"], mb / median["whole"]
    ratio = split_rate / whole_rate
    verdict = "meets" if ratio >= RATIO_GOAL else "BELOW"
    parts = len(kept["split"]) / count
    print(
        f"publish: {count} jobs, {mb / count:.1f} MB a result; split into {parts:.1f} parts of "
        f"<= 1 MiB: {split_rate:.1f} MB/s, whole records: {whole_rate:.1f} MB/s, "
        f"ratio {ratio:.2f} ({verdict} goal >= {RATIO_GOAL})"
    )
    assemble_s = _reader_seconds(kept["split"], assemble=True)
    decode_s = _reader_seconds(kept["whole"], assemble=False)
    print(
        f"reader: decode + assemble {count / assemble_s:.0f} results/s "
        f"({mb / assemble_s:.0f} MB/s); decode whole records {count / decode_s:.0f} results/s "
        f"({mb / decode_s:.0f} MB/s); ratio {decode_s / assemble_s:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=48, help="jobs per run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (alternating order)")
    args = parser.parse_args()
    with env_or_local_broker() as bootstrap:
        print(f"broker {bootstrap}")
        asyncio.run(main(bootstrap, args.jobs, args.rounds))
