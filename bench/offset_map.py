"""Benchmark: work run again after a SIGKILL with and without the offset map, and what the map
costs a commit at its cap.

Run `python bench/offset_map.py [--short-jobs N] [--kill-at N]`. Uses $KAFKA_BOOTSTRAP_SERVERS
when set, else starts a local noida-db broker (worker.dev.broker.LocalBroker).

1. Re-run work. One slow job at the front of a partition, N short jobs behind it (mock engine,
   50 ms a token, mixed lengths), one `python -m worker serve` process with 256 jobs in flight;
   SIGKILL once `--kill-at` short jobs are answered (all past the contiguous commit, which the
   slow job holds), restart with the same instance id, wait for every answer. Printed per
   variant (map on; `--offset-map-max-bytes 0 --max-crash-attempts 0`): jobs generated twice,
   and that over the jobs in flight at the kill. Both variants run in this process, one after the other.
2. Commit cost. The same partition state (a slow job, then every other offset answered: the
   map's worst shape) committed to the broker with its map at ~3 KB and without a map; the
   median wall time of one commit each way and their ratio, plus the time to build the map.

3. Commit cost behind a long head-of-line job (no broker): one slow job at the head and N
   short ones behind it finished, then a job more started and finished before each commit, as
   when short jobs keep finishing. The median time to plan one commit at N = 1k, 10k, 100k,
   300k, against the same at N = 100 measured in the same run (the baseline), and against
   building the map from a sorted copy of every finished offset each time (the previous
   implementation's shape). With the finished offsets kept as runs the ratio to the baseline
   stays near 1.

Figures and ratios only; it never fails on them (exit code 0). `--plan-only` runs part 3
alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import Job, SamplingSpec, decode_result, encode
from worker.core.paced_consumer import PacedConsumer
from worker.delivery.offset_map import encode_bounded, encode_offset_map
from worker.delivery.offsets import PartitionOffsets
from worker.dev.broker import env_or_local_broker, new_topics

REPO: Final = Path(__file__).resolve().parent.parent
IN_FLIGHT: Final = 256


def _serve(
    bootstrap: str, topics: list[str], group: str, log: Path, map_bytes: int
) -> subprocess.Popen[bytes]:
    jobs, results, dlq = topics
    argv = [
        sys.executable, "-m", "worker", "serve", "--engine", "mock",
        "--bootstrap-servers", bootstrap, "--jobs-topic", jobs, "--results-topic", results,
        "--dead-letter-topic", dlq, "--group-id", group, "--group-instance-id", f"{group}-0",
        "--max-in-flight", str(IN_FLIGHT), "--commit-interval-ms", "0", "--poll-timeout-ms", "50",
        "--mock-per-token-latency-ms", "50", "--mock-num-layers", "4",
        "--offset-map-max-bytes", str(map_bytes),
        # No map leaves the crash-loop breaker nothing to count in: it is off in that variant.
        "--max-crash-attempts", "3" if map_bytes else "0",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("VKW_")}
    with log.open("ab") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


async def _answers(consumer: AIOKafkaConsumer) -> list[str]:
    out: list[str] = []
    for records in (await consumer.getmany(timeout_ms=100)).values():
        out += [decode_result(r.value or b"").job_id or "" for r in records]
    return out


async def rerun_after_kill(bootstrap: str, short_jobs: int, kill_at: int, map_bytes: int) -> None:
    topics = await new_topics(bootstrap, 3)
    prefix = uuid.uuid4().hex[:6]
    jobs = [Job(job_id=f"{prefix}-slow", prompt="hi", sampling=SamplingSpec(max_tokens=160))]
    jobs += [
        Job(job_id=f"{prefix}-{i}", prompt="hi", sampling=SamplingSpec(max_tokens=2 + i % 5))
        for i in range(short_jobs)
    ]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20)
    await producer.start()
    try:
        for job in jobs:
            await producer.send(topics[0], value=encode(job), key=job.job_id.encode())
        await producer.flush()
    finally:
        await producer.stop()
    reader = PacedConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await reader.start()
    reader.assign([TopicPartition(topics[1], 0)])
    group, log = f"bench-{prefix}", Path(f"/tmp/bench-offset-map-{prefix}.log")  # noqa: S108
    seen: list[str] = []
    try:
        worker = _serve(bootstrap, topics, group, log, map_bytes)
        while len(set(seen)) < kill_at:
            seen += await _answers(reader)
        answered_at_kill = len(set(seen))
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        worker = _serve(bootstrap, topics, group, log, map_bytes)
        t0 = time.monotonic()
        while len(set(seen)) < len(jobs) and time.monotonic() - t0 < 120:
            seen += await _answers(reader)
        await asyncio.sleep(1)  # late duplicates
        seen += await _answers(reader)
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    finally:
        await reader.stop()
    twice = sum(n - 1 for n in Counter(seen).values())
    in_flight = min(IN_FLIGHT, len(jobs) - answered_at_kill)
    label = f"map {map_bytes} B" if map_bytes else "no map"
    print(
        f"  {label:<12} answered at kill {answered_at_kill:4d}, generated twice {twice:4d}, "
        f"/ in flight at kill ({in_flight}) = {twice / in_flight:.2f}"
    )


async def commit_cost(bootstrap: str, rounds: int = 50) -> None:
    (topic,) = await new_topics(bootstrap, 1)
    tp = TopicPartition(topic, 0)
    offsets = PartitionOffsets()
    for offset in range(3000):
        offsets.start(offset)
    answered = range(2, 3000, 2)  # every other job answered behind the slow one at 0
    for offset in answered:
        offsets.finish(offset)
    t0 = time.perf_counter()
    position, metadata = offsets.to_commit() or (0, "")
    build_ms = (time.perf_counter() - t0) * 1000
    metadata = metadata[:3072]  # at the cap (the worker would hold the partition here)
    consumer = PacedConsumer(bootstrap_servers=bootstrap, group_id=f"bench-{uuid.uuid4().hex}")
    await consumer.start()
    consumer.assign([tp])
    try:
        times: dict[str, list[float]] = {"map": [], "none": []}
        for _ in range(rounds):
            for label, meta in (("map", metadata), ("none", "")):
                t = time.perf_counter()
                await consumer.commit({tp: (position, meta)})
                times[label].append(time.perf_counter() - t)
    finally:
        await consumer.stop()
    with_map, without = (statistics.median(times[k]) * 1000 for k in ("map", "none"))
    print(
        f"  one commit: {with_map:.2f} ms with a {len(metadata)}-byte map, {without:.2f} ms "
        f"without; ratio {with_map / without:.2f}; building the map of {len(answered)} runs "
        f"{build_ms:.2f} ms"
    )


def _behind_a_slow_head(finished: int) -> PartitionOffsets:
    partition = PartitionOffsets()
    for offset in range(finished + 1):
        partition.start(offset)
    for offset in range(1, finished + 1):
        partition.finish(offset)
    return partition


def _median_plan_s(finished: int, rounds: int) -> float:
    """Median time to plan a commit after one more short job finished behind the head."""
    partition = _behind_a_slow_head(finished)
    times = []
    for i in range(rounds):
        offset = finished + 1 + i
        partition.start(offset)
        partition.finish(offset)
        t = time.perf_counter()
        partition.plan(limit=3072)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _median_from_scratch_s(finished: int, rounds: int) -> float:
    """The same commit built from every finished offset each time: sorted, encoded twice."""
    answered = set(range(1, finished + 1))
    times = []
    for i in range(rounds):
        answered.add(finished + 1 + i)
        t = time.perf_counter()
        encode_bounded(3072, 0, [*answered], running=[0])
        encode_offset_map(0, answered)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def plan_cost(rounds: int = 30) -> None:
    baseline = _median_plan_s(100, rounds)
    print(f"  baseline: 100 finished behind the head, {baseline * 1e6:.1f} us a commit")
    for finished in (1_000, 10_000, 100_000, 300_000):
        kept = _median_plan_s(finished, rounds)
        scratch = _median_from_scratch_s(finished, max(rounds // 6, 3))
        print(
            f"  {finished:>7} finished: {kept * 1e6:8.1f} us a commit, "
            f"{kept / baseline:5.2f} x baseline; from scratch {scratch * 1e3:8.2f} ms, "
            f"{scratch / kept:8.0f} x runs"
        )


async def main(args: argparse.Namespace, bootstrap: str) -> None:
    print(f"re-run work after SIGKILL ({args.short_jobs} short jobs behind a slow one):")
    for map_bytes in (3072, 0):
        await rerun_after_kill(bootstrap, args.short_jobs, args.kill_at, map_bytes)
    print("commit path:")
    await commit_cost(bootstrap)
    print("planning a commit behind a long head-of-line job:")
    plan_cost()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--short-jobs", type=int, default=500)
    parser.add_argument("--kill-at", type=int, default=300)
    parser.add_argument("--plan-only", action="store_true", help="part 3 alone (no broker)")
    options = parser.parse_args()
    if options.plan_only:
        print("planning a commit behind a long head-of-line job:")
        plan_cost()
        sys.exit(0)
    with env_or_local_broker() as bootstrap:
        asyncio.run(main(options, bootstrap))
