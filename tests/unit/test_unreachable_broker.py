"""A broker nothing answers at: every command says in one line what it tried and exits 1 (the
command line, `docs/getting-started.md`: broker unreachable is a fatal error), with no
traceback and no aiokafka client left unclosed; the trainer's client raises `RolloutError`
only. The broker is a local port nothing listens on, so each attempt fails at once."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from worker.cli.main import main
from worker.client.rollout import RolloutClient, RolloutError


@pytest.fixture
def closed_port() -> str:
    """`host:port` of a local port nothing listens on (bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"


@pytest.fixture
def noise(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[str]]]:
    """What was said besides a command's own output, once everything unreferenced is
    collected: warnings (aiokafka's ResourceWarning for a client collected unclosed) and log
    records at WARNING or above (asyncio's report of that client, aiokafka's connection
    errors)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def said() -> list[str]:
            gc.collect()
            logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            return [str(w.message) for w in caught] + logged

        yield said


COMMANDS = {
    "submit": ["submit", "{jobs}"],
    "submit --wait": ["submit", "{jobs}", "--wait", "--no-progress"],
    "results": ["results", "--quiet"],
    "results --replay": ["results", "--replay", "prime-rl", "--out", "{out}"],
    "status": ["status"],
    "control pause": ["control", "pause"],
    "control update-weights --wait": [
        "control",
        "update-weights",
        "/w",
        "--version",
        "2",
        "--wait",
    ],
    "control abort": ["control", "abort", "--job-id", "j"],
}


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_each_command_says_in_one_line_that_the_broker_cannot_be_reached(
    command: list[str],
    closed_port: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    noise: Callable[[], list[str]],
) -> None:
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"job_id": "a", "prompt_token_ids": [1, 2]}\n')
    argv = [a.format(jobs=jobs, out=tmp_path / "out.npz") for a in command]

    status = main([*argv, "--bootstrap-servers", closed_port])

    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert len(err) == 1, err
    assert err[0].startswith("vllm-kafka-worker: error: ")
    assert f"cannot reach Kafka at {closed_port}" in err[0]
    assert noise() == []


async def test_the_client_raises_rollout_errors_only_and_leaves_nothing_open(
    closed_port: str, noise: Callable[[], list[str]]
) -> None:
    client = RolloutClient(bootstrap_servers=closed_port)

    with pytest.raises(RolloutError, match=f"cannot reach Kafka at {closed_port}"):
        await asyncio.wait_for(client.start(), 30)
    with pytest.raises(RolloutError, match=f"update to version 3: .*{closed_port}.*not sent"):
        await asyncio.wait_for(client.update_weights("/w/step-3", 3, timeout_s=30), 30)
    with pytest.raises(RolloutError, match=f"fleet status: .*{closed_port}"):
        await asyncio.wait_for(client.status(timeout_s=30), 30)
    with pytest.raises(RolloutError, match="not started"):
        client.submit({"job_id": "a", "prompt_token_ids": [1]})

    await client.close()
    del client
    assert [line for line in noise() if "Unclosed" in line] == []
