"""`submit` and `results` against a real broker, and their bad input."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schemas import (
    Completed,
    Completion,
    ErrorCode,
    ErrorInfo,
    Failed,
    RoutedExperts,
    decode_job,
    encode,
)
from tests.kafka_helpers import collect, produce
from tests.test_schemas import completed_with

pytestmark = pytest.mark.broker


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=120,
        check=False,
    )


async def test_submit_validates_fills_job_ids_and_produces_keyed_jobs(
    kafka_bootstrap_servers, new_topic, tmp_path: Path
):
    topic = await new_topic(2)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"job_id": "a", "prompt": "x"}\n\n{"prompt_token_ids": [1, 2]}\n')
    proc = cli(
        "submit",
        str(jobs),
        "--no-progress",
        "--bootstrap-servers",
        kafka_bootstrap_servers,
        "--jobs-topic",
        topic,
    )
    assert proc.returncode == 0, proc.stderr
    ids = proc.stdout.split()
    assert ids[0] == "a" and len(ids) == 2 and ids[1]
    records = await collect(kafka_bootstrap_servers, topic, 2)
    decoded = {r.key.decode(): decode_job(r.value) for r in records}
    assert set(decoded) == set(ids)
    assert decoded[ids[1]].prompt_token_ids == [1, 2]


async def test_submit_refuses_a_file_with_a_bad_line_and_produces_nothing(
    kafka_bootstrap_servers, new_topic, tmp_path: Path
):
    topic = await new_topic(1)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": "ok"}\n{"prompt": "x", "sampling": {"n": 0}}\n')
    proc = cli(
        "submit", str(jobs), "--bootstrap-servers", kafka_bootstrap_servers, "--jobs-topic", topic
    )
    assert proc.returncode == 2
    assert f"{jobs}:2:" in proc.stderr and "$.sampling.n" in proc.stderr
    missing = cli(
        "submit", str(tmp_path / "nope.jsonl"), "--bootstrap-servers", kafka_bootstrap_servers
    )
    assert missing.returncode == 1 and "No such file" in missing.stderr


async def test_results_summarises_routed_experts_and_writes_json_lines(
    kafka_bootstrap_servers, new_topic, tmp_path: Path
):
    import numpy as np  # noqa: PLC0415

    topic = await new_topic(1)
    routed = RoutedExperts.from_array(np.zeros((4, 3, 2), dtype=np.int32), start=1)
    result = Completed(
        job_id="r1",
        completions=[
            Completion(
                index=0, token_ids=[1, 2], text="ab", finish_reason="length", routed_experts=routed
            )
        ],
        prompt_token_count=3,
    )
    await produce(
        kafka_bootstrap_servers, topic, [(b"r1", encode(result), []), (b"junk", b"not json", [])]
    )
    out = tmp_path / "results.jsonl"
    proc = cli(
        "results",
        "--bootstrap-servers",
        kafka_bootstrap_servers,
        "--results-topic",
        topic,
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "r1 completed prompt=3 [0] tokens=2 finish=length routed_experts=4x3x2 uint8 start=1"
        in proc.stdout
    )
    assert "1 completed, 0 failed, 1 undecodable" in proc.stderr
    assert out.read_bytes() == encode(result) + b"\n"


def test_the_demo_prints_one_row_per_result_with_routing_shapes():
    from worker.demo import results_table  # noqa: PLC0415

    routed = RoutedExperts.from_array(np.zeros((4, 2, 2), dtype=np.uint8), start=1)
    completed = completed_with(routed)
    failed = Failed(job_id="b", error=ErrorInfo(code=ErrorCode.INVALID_JOB, detail="start 10"))
    lines = results_table([encode(completed), encode(failed)]).splitlines()
    assert len(lines) == 3
    assert lines[1].split()[:2] == ["job-1", "completed"] and "3 tokens, 4x2x2" in lines[1]
    assert lines[2].split()[:3] == ["b", "failed:", "invalid_job"] and "start 10" in lines[2]
