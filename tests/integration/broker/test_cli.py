"""`submit`, `results` and `payloads gc`, and their bad input."""

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from schemas import (
    Completed,
    Completion,
    ErrorCode,
    ErrorInfo,
    Failed,
    Part,
    RoutedExperts,
    decode_job,
    encode,
)
from tests.unit.test_schemas import completed_with
from worker.answering.payload_store import FilePayloadStore
from worker.dev.harness.clients import collect, produce

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


async def test_submit_keys_the_turns_of_a_session_by_it_so_they_share_a_partition(
    kafka_bootstrap_servers, new_topic, tmp_path: Path
):
    topic = await new_topic(4)
    jobs = tmp_path / "jobs.jsonl"
    lines = [
        encode({"job_id": f"talk-turn{t}", "prompt": "x" * (t + 1), "session_id": "talk"})
        for t in range(4)
    ]
    jobs.write_bytes(b"\n".join([*lines, encode({"job_id": "alone", "prompt": "y"})]) + b"\n")
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
    records = await collect(kafka_bootstrap_servers, topic, 5)
    by_id = {decode_job(r.value).job_id: r for r in records}
    turns = [by_id[f"talk-turn{t}"] for t in range(4)]
    assert {r.key for r in turns} == {b"talk"}
    assert len({r.partition for r in turns}) == 1
    assert by_id["alone"].key == b"alone"


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


async def test_results_replay_writes_each_completed_jobs_arrays_to_an_npz(
    kafka_bootstrap_servers, new_topic, tmp_path: Path
):
    topic = await new_topic(1)

    def routed(index: int, tokens: int, start: int) -> Completion:
        rows = np.arange((3 + tokens - 1 - start) * 2 * 2).reshape(-1, 2, 2) % 7 + index
        return Completion(
            index=index,
            token_ids=list(range(tokens)),
            text="",
            finish_reason="length",
            routed_experts=RoutedExperts.from_array(rows, start=start, num_experts=8),
        )

    group = Completed(
        job_id="g", prompt_token_count=3, completions=[routed(0, 2, 0), routed(1, 4, 0)]
    )
    late = Completed(job_id="late", prompt_token_count=3, completions=[routed(0, 2, 1)])
    failed = Failed(job_id="f", error=ErrorInfo(code=ErrorCode.EXPIRED, detail="late"))
    await produce(
        kafka_bootstrap_servers,
        topic,
        [(b"g", encode(group), []), (b"late", encode(late), []), (b"f", encode(failed), [])],
    )
    out = tmp_path / "run.npz"
    common = ["--bootstrap-servers", kafka_bootstrap_servers, "--results-topic", topic]
    proc = cli("results", *common, "--quiet", "--replay", "verl", "--out", str(out))
    assert proc.returncode == 1, proc.stderr  # one completion verl cannot take
    assert "late/0: not replayable as verl: routing starts at position 1" in proc.stderr
    assert f"2 replay arrays (verl, int16) written to {out}, 1 not replayable" in proc.stderr
    with np.load(out) as arrays:
        assert sorted(arrays.files) == ["g/0", "g/1"]
        for c in group.completions:
            array = arrays[f"g/{c.index}"]
            assert c.routed_experts is not None
            # verl: one row per position, rows from 0, the last row zero.
            assert array.shape == (3 + len(c.token_ids), 2, 2) and array.dtype == np.int16
            np.testing.assert_array_equal(array[:-1], c.routed_experts.to_array())
            assert (array[-1] == 0).all()
    unknown = cli("results", *common, "--replay", "no-such-trainer", "--out", str(out))
    assert unknown.returncode == 2 and "invalid choice: 'no-such-trainer'" in unknown.stderr


async def test_results_reassembles_split_results_and_raw_shows_the_parts(
    kafka_bootstrap_servers, new_topic, tmp_path: Path
):
    topic = await new_topic(1)

    def completion(i: int) -> Completion:
        return Completion(index=i, token_ids=[i], text=str(i), finish_reason="length")

    whole = Completed(
        job_id="g", completions=[completion(i) for i in range(3)], prompt_token_count=2
    )
    parts = [
        msgspec.structs.replace(
            whole, completions=[completion(i)], part=Part(index=i, count=3, attempt="a2")
        )
        for i in range(3)
    ]
    cut_short = msgspec.structs.replace(
        whole, completions=[completion(0)], part=Part(index=0, count=2, attempt="a1")
    )
    left_over = msgspec.structs.replace(
        whole, job_id="h", completions=[completion(0)], part=Part(index=0, count=2, attempt="b")
    )
    records = [cut_short, parts[2], parts[0], parts[0], parts[1], left_over]
    await produce(
        kafka_bootstrap_servers, topic, [(r.job_id.encode(), encode(r), []) for r in records]
    )
    out = tmp_path / "whole.jsonl"
    common = ["--bootstrap-servers", kafka_bootstrap_servers, "--results-topic", topic]
    proc = cli("results", *common, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "g completed prompt=2 [0] tokens=1 finish=length [1] tokens=1 finish=length "
        "[2] tokens=1 finish=length"
    ]
    assert "h incomplete: parts [0] of 2 (attempt b)" in proc.stderr
    assert "1 completed, 0 failed, 0 undecodable, 1 incomplete" in proc.stderr
    assert out.read_bytes() == encode(whole) + b"\n"
    raw = cli("results", *common, "--raw")
    assert raw.returncode == 0, raw.stderr
    lines = raw.stdout.splitlines()
    assert len(lines) == len(records)
    assert lines[0].startswith("g completed prompt=2 part=1/2 attempt=a1")
    assert "6 completed, 0 failed, 0 undecodable" in raw.stderr


def test_payloads_gc_removes_old_payloads_and_refuses_bad_arguments(tmp_path: Path):
    store = FilePayloadStore(tmp_path)
    uri, _ = store.put("ab", 0, b"payload")
    path = Path(uri.removeprefix("file://"))
    long_ago = path.stat().st_mtime - 7200
    os.utime(path, (long_ago, long_ago))
    kept_uri, _ = store.put("ab", 1, b"recent")
    proc = cli("payloads", "gc", "--older-than", "1h", "--payload-store", tmp_path.as_uri())
    assert proc.returncode == 0, proc.stderr
    assert "removed 1 payloads (7 bytes)" in proc.stdout
    assert not path.exists() and Path(kept_uri.removeprefix("file://")).exists()
    for args, message in (
        (["--older-than", "1 hour", "--payload-store", tmp_path.as_uri()], "duration '1 hour'"),
        (["--older-than", "1h"], "needs --payload-store"),
        (["--older-than", "1h", "--payload-store", "s3://b/k"], "file:///absolute/dir"),
        (["--older-than", "1h", "--payload-store", (tmp_path / "nope").as_uri()], "no directory"),
    ):
        bad = cli("payloads", "gc", *args)
        assert bad.returncode == 2, (args, bad.stderr)
        assert message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_the_demo_prints_one_row_per_result_with_routing_shapes():
    from worker.dev.demo import results_table  # noqa: PLC0415

    routed = RoutedExperts.from_array(np.zeros((4, 2, 2), dtype=np.uint8), start=1)
    completed = completed_with(routed)
    failed = Failed(job_id="b", error=ErrorInfo(code=ErrorCode.INVALID_JOB, detail="start 10"))
    lines = results_table([encode(completed), encode(failed)]).splitlines()
    assert len(lines) == 3
    assert lines[1].split()[:2] == ["job-1", "completed"] and "3 tokens, 4x2x2" in lines[1]
    assert lines[2].split()[:3] == ["b", "failed:", "invalid_job"] and "start 10" in lines[2]


def test_submit_wait_connects_with_the_security_flags(tmp_path: Path, monkeypatch, capsys):
    from worker.cli.main import main  # noqa: PLC0415

    seen: dict[str, object] = {}

    class Refused(Exception):
        pass

    def rollout_client(**kwargs: object) -> object:
        seen.update(kwargs)
        raise Refused

    monkeypatch.setattr("worker.client.rollout.RolloutClient", rollout_client)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": "hi", "sampling": {"max_tokens": 2}}\n')
    args = ["submit", str(jobs), "--wait", "--bootstrap-servers", "127.0.0.1:1"]
    sasl = ["--security-protocol", "SASL_PLAINTEXT", "--sasl-mechanism", "PLAIN"]
    sasl += ["--sasl-username", "trainer", "--sasl-password", "secret"]
    with pytest.raises(Refused):
        main([*args, *sasl])
    assert seen["bootstrap_servers"] == "127.0.0.1:1"
    assert seen["security_protocol"] == "SASL_PLAINTEXT"
    assert (seen["sasl_mechanism"], seen["sasl_plain_username"]) == ("PLAIN", "trainer")
