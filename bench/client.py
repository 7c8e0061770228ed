"""Benchmark: results/s through `RolloutClient.generate` vs a bare consumer of the same records.

Run `python bench/client.py [--results N] [--rounds R]`. Uses $KAFKA_BOOTSTRAP_SERVERS when
set, else starts a local noida-db broker.

In alternating rounds, N pre-encoded results (one completion with routed experts of 16 tokens
x 48 layers x top-8, ~6 KB) are produced onto a fresh results topic, and read by
- the client: N jobs submitted first (to a topic nobody serves; timing starts once they are
  all produced), then `generate`'s futures resolve as their results arrive: decode,
  reassembly, deduplication, bookkeeping;
- a bare aiokafka consumer that decodes each record with `schemas.decode_result`.
Both are timed from the first result produced to the last one read. The ratio of the medians
(client / bare) has goal >= 0.8. It prints figures and never fails on them (exit code 0).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Final

import numpy as np
from aiokafka import AIOKafkaProducer, TopicPartition

from schemas import Completed, Completion, Job, RoutedExperts, SamplingSpec, decode_result, encode
from worker.client.rollout import RolloutClient
from worker.core.paced_consumer import PacedConsumer
from worker.dev.broker import env_or_local_broker, new_topics

RATIO_GOAL: Final = 0.8


def results(prefix: str, count: int) -> list[tuple[bytes, bytes]]:
    rng = np.random.default_rng(0)
    routed = RoutedExperts.from_array(rng.integers(0, 128, (23, 48, 8), dtype=np.uint8), start=0)
    out = []
    for i in range(count):
        job_id = f"{prefix}-{i}"
        result = Completed(
            job_id=job_id,
            completions=[
                Completion(
                    index=0,
                    token_ids=list(range(16)),
                    text="x" * 16,
                    finish_reason="length",
                    routed_experts=routed,
                )
            ],
            prompt_token_count=8,
            weight_version=1,
        )
        out.append((job_id.encode(), encode(result)))
    return out


async def produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> float:
    """Produce the records; the wall time (time.time) when the first was handed over."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, acks=1)
    await producer.start()
    try:
        started = time.time()
        futures = [await producer.send(topic, value=v, key=k) for k, v in records]
        await asyncio.gather(*futures)
        return started
    finally:
        await producer.stop()


async def through_client(bootstrap: str, count: int) -> float:
    jobs_topic, results_topic = await new_topics(bootstrap, 2)
    prefix = uuid.uuid4().hex[:6]
    async with RolloutClient(
        bootstrap_servers=bootstrap,
        jobs_topic=jobs_topic,
        results_topic=results_topic,
        timeout_s=600,
    ) as client:
        jobs = [
            Job(job_id=f"{prefix}-{i}", prompt="x", sampling=SamplingSpec(max_tokens=16))
            for i in range(count)
        ]
        waiting = asyncio.ensure_future(client.generate(jobs))
        await jobs_produced(bootstrap, jobs_topic, count)  # nobody serves them
        started = await produce(bootstrap, results_topic, results(prefix, count))
        got = await waiting
        finished = time.time()
    if any(not isinstance(r, Completed) for r in got):
        raise RuntimeError("the client returned failures")
    return count / (finished - started)


async def jobs_produced(bootstrap: str, topic: str, count: int) -> None:
    """Until the client has produced every job: the timing is of the results' path."""
    consumer = PacedConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    tp = TopicPartition(topic, 0)
    try:
        while (await consumer.end_offsets([tp]))[tp] < count:  # noqa: ASYNC110 - the broker's count
            await asyncio.sleep(0.05)
    finally:
        await consumer.stop()


async def through_bare_consumer(bootstrap: str, count: int) -> float:
    (results_topic,) = await new_topics(bootstrap, 1)
    # Fetch sizes as the client's, so the comparison is of what each does with a record.
    consumer = PacedConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        max_partition_fetch_bytes=32 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    await consumer.start()
    tp = TopicPartition(results_topic, 0)
    consumer.assign([tp])
    await consumer.seek_to_end(tp)
    await consumer.position(tp)
    try:
        producing = asyncio.ensure_future(produce(bootstrap, results_topic, results("bare", count)))
        seen = 0
        while seen < count:
            for records in (await consumer.getmany(timeout_ms=100)).values():
                for record in records:
                    decode_result(record.value)
                    seen += 1
        finished = time.time()
        started = await producing
    finally:
        await consumer.stop()
    return count / (finished - started)


async def main(bootstrap: str, count: int, rounds: int) -> None:
    rates: dict[str, list[float]] = {"client": [], "bare": []}
    for r in range(rounds):
        order = [("client", through_client), ("bare", through_bare_consumer)]
        for name, run in order if r % 2 == 0 else order[::-1]:
            rate = await run(bootstrap, count)
            rates[name].append(rate)
            print(f"  round {r + 1} {name:6s} {rate:8.0f} results/s")
    client, bare = statistics.median(rates["client"]), statistics.median(rates["bare"])
    ratio = client / bare
    verdict = "meets" if ratio >= RATIO_GOAL else "BELOW"
    print(
        f"median: client {client:.0f} results/s, bare consumer {bare:.0f} results/s, "
        f"ratio {ratio:.2f} ({verdict} goal >= {RATIO_GOAL})"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--results", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with env_or_local_broker() as bootstrap:
        print(f"broker {bootstrap}")
        asyncio.run(main(bootstrap, args.results, args.rounds))
