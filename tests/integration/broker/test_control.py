"""The control plane on a real broker, with the mock engine: commands, targets, acks, holds."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas import (
    Abort,
    Command,
    CommandAck,
    ErrorCode,
    Failed,
    Job,
    Pause,
    ResetPrefixCache,
    Resume,
    SamplingSpec,
    Target,
    UpdateWeights,
    VersionSpan,
    decode_status,
)
from worker.dev.harness.clients import job_record, produce
from worker.dev.harness.fleet import Results, Status, completed, send
from worker.dev.harness.topics import Fleet, make_fleet, make_topics
from worker.dev.harness.waiting import wait_for, wait_generating
from worker.engines.mock import MockEngineSettings

pytestmark = pytest.mark.broker

SLOW = MockEngineSettings(per_token_latency_ms=5, num_layers=4, top_k=2, num_experts=8)


def checkpoint(root: Path, name: str, **config: int) -> str:
    path = root / name
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"name": name, **config}))
    return str(path)


def job(job_id: str, tokens: int = 8, **kwargs: Any) -> Job:
    return Job(
        job_id=job_id,
        prompt_token_ids=[3, 4, 5, 6],
        sampling=SamplingSpec(max_tokens=tokens, seed=1, logprobs=0),
        return_routed_experts=True,
        routed_experts_prompt_start=1,
        **kwargs,
    )


async def fence(bs: str, fleet: Fleet, status: Status, *workers: str) -> None:
    """Send a command every worker acknowledges and wait for those acknowledgements.

    A worker applies and acknowledges commands in topic order, so once it has acknowledged the
    fence it has answered everything sent before: a check that nothing more came needs no sleep.
    """
    command_id = f"fence-{len(status.records)}"
    await send(bs, fleet, Abort(command_id=command_id, job_ids=["fence"]))
    await status.wait_acks(command_id, len(workers))


async def test_an_update_is_acknowledged_and_later_results_carry_the_new_version(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1")
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        await produce(bs, fleet.topics.jobs, [job_record(job("before"))])
        before = completed((await results.wait("before"))["before"])
        assert before.weight_version == 0
        assert before.completions[0].weight_versions == [VersionSpan(version=0, start=0, end=8)]
        await send(
            bs, fleet, UpdateWeights(command_id="u2", version=2, path=checkpoint(tmp_path, "b"))
        )
        (ack,) = await status.wait_acks("u2", 1)
        assert (ack.worker, ack.outcome, ack.weight_version, ack.kind) == (
            "w1",
            "ok",
            2,
            "update_weights",
        )
        await produce(bs, fleet.topics.jobs, [job_record(job("after"))])
        after = completed((await results.wait("after"))["after"])
        assert after.weight_version == 2
        assert after.completions[0].weight_versions == [VersionSpan(version=2, start=0, end=8)]
        assert after.completions[0].token_ids != before.completions[0].token_ids
        # Heartbeats say the same.
        await wait_for(lambda: any(s.weight_version == 2 for s in status.statuses("w1")), 10)
    assert await w.stop() == 0


async def test_targets_pick_the_workers_and_every_command_kind_is_acknowledged(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic, jobs_partitions=2)
    other_jobs = await new_topic(1)
    w1 = await start_steered(fleet, "w1", group="g1")
    w2 = await start_steered(fleet, "w2", group="g1")
    w3 = await start_steered(fleet, "w3", group="g2", jobs_topic=other_jobs)
    commands: list[Command] = [
        Pause(command_id="p", target=Target(group="g1"), mode="wait"),
        Resume(command_id="r", target=Target(group="g1")),
        ResetPrefixCache(command_id="c", target=Target(workers=["w3"])),
        Abort(command_id="a", job_ids=["nothing-running"]),  # no target: every worker
        UpdateWeights(
            command_id="u",
            target=Target(group="g1", workers=["w2"]),
            version=5,
            path=checkpoint(tmp_path, "b"),
        ),
    ]
    async with Status(bs, fleet.status) as status:
        await status.wait_live("w1", "w2", "w3")
        await send(bs, fleet, *commands)
        expected = {
            "p": {"w1", "w2"},
            "r": {"w1", "w2"},
            "c": {"w3"},
            "a": {"w1", "w2", "w3"},
            "u": {"w2"},
        }
        for command_id, workers in expected.items():
            acks = await status.wait_acks(command_id, len(workers))
            assert {a.worker for a in acks} == workers
            assert all(a.outcome == "ok" for a in acks)
        await fence(bs, fleet, status, "w1", "w2", "w3")  # nobody else answers later
        for command_id, workers in expected.items():
            assert {a.worker for a in status.acks(command_id)} == workers
    assert w3.inner.prefix_cache_resets == 1 and w1.inner.prefix_cache_resets == 0
    assert (w1.engine.weight_version, w2.engine.weight_version) == (0, 5)
    assert "aborted 0 jobs" in status.acks("a")[0].detail
    for w in (w1, w2, w3):
        assert await w.stop() == 0


async def test_duplicate_and_malformed_commands_are_skipped_and_serving_goes_on(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1")
    b = checkpoint(tmp_path, "b")
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        await status.wait_live("w1")
        await send(
            bs,
            fleet,
            b"not json at all",
            b'{"kind": "update_weights", "command_id": "no-path", "version": 3}',
            b'{"kind": "launch_rockets", "command_id": "x"}',
            UpdateWeights(command_id="u", version=3, path=b),
            UpdateWeights(command_id="u", version=3, path=b),  # the same command again
        )
        await status.wait_acks("u", 1)
        # Reported, not answered one by one: at most one report a heartbeat interval.
        await wait_for(
            lambda: sum(e.count for e in status.errors()) == 3, 10, "three unreadable records"
        )
        assert max(e.offset for e in status.errors()) == 2
        assert len(status.errors()) <= 3
        await produce(bs, fleet.topics.jobs, [job_record(job("served"))])
        assert completed((await results.wait("served"))["served"]).weight_version == 3
        await fence(bs, fleet, status, "w1")
        assert len(status.acks("u")) == 1
    assert w.inner.loads == [(b, 3)]
    assert await w.stop() == 0


async def test_a_bad_update_is_acknowledged_failed_and_the_old_weights_serve(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1")
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        await status.wait_live("w1")
        await send(
            bs,
            fleet,
            UpdateWeights(command_id="good", version=1, path=checkpoint(tmp_path, "b")),
            UpdateWeights(command_id="missing", version=2, path=str(tmp_path / "nope")),
            UpdateWeights(
                command_id="other-arch",
                version=3,
                path=checkpoint(tmp_path, "c", num_hidden_layers=48),
            ),
        )
        for command_id, message in (
            ("missing", "config.json is missing"),
            ("other-arch", "another architecture"),
        ):
            (ack,) = await status.wait_acks(command_id, 1)
            assert ack.outcome == "failed" and message in ack.detail
            assert ack.weight_version == 1
        await produce(bs, fleet.topics.jobs, [job_record(job("still"))])
        assert completed((await results.wait("still"))["still"]).weight_version == 1
    assert await w.stop() == 0


async def test_min_weight_version_holds_the_partition_until_the_update_or_the_deadline(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1")
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        await produce(
            bs,
            fleet.topics.jobs,
            [job_record(job("needs-5", min_weight_version=5)), job_record(job("behind"))],
        )
        await wait_for(lambda: w.worker.held_partitions == 1, 30, "the partition held")
        assert results.records == []  # held, and the job behind it keeps its place
        await send(
            bs, fleet, UpdateWeights(command_id="u5", version=5, path=checkpoint(tmp_path, "b"))
        )
        got = await results.wait("needs-5", "behind")
        assert completed(got["needs-5"]).weight_version == 5
        assert completed(got["behind"]).weight_version == 5
        # A job needing a version that never comes is answered `expired` at its deadline.
        deadline = time.time() + 1.5
        await produce(
            bs,
            fleet.topics.jobs,
            [job_record(job("needs-9", min_weight_version=9, deadline=deadline))],
        )
        expired = (await results.wait("needs-9", timeout_s=15))["needs-9"]
        assert isinstance(expired, Failed) and expired.error.code is ErrorCode.EXPIRED
        assert time.time() >= deadline
        await status.wait_acks("u5", 1)
    assert await w.stop() == 0


async def test_a_restarted_worker_serves_the_latest_good_update_from_its_first_job(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    first = await start_steered(fleet, "w1")
    async with Status(bs, fleet.status) as status:
        await status.wait_live("w1")
        await send(
            bs,
            fleet,
            UpdateWeights(command_id="v7", version=7, path=checkpoint(tmp_path, "b")),
            UpdateWeights(command_id="bad", version=8, path=str(tmp_path / "gone")),
            Pause(command_id="pause", mode="wait"),
            Resume(command_id="resume"),
        )
        await status.wait_acks("resume", 1)
        assert await first.stop() == 0
        await produce(bs, fleet.topics.jobs, [job_record(job("first-after-restart"))])
        async with Results(bs, fleet.topics.results) as results:
            second = await start_steered(fleet, "w1-again")
            got = completed((await results.wait("first-after-restart"))["first-after-restart"])
        assert got.weight_version == 7
        # It caught up on what the fleet did: the update the fleet refused is not tried again.
        catch_up = [
            a
            for a in status.records
            if isinstance(m := decode_status(a[1]), CommandAck) and m.worker == "w1-again"
        ]
        assert [decode_status(v).command_id for _, v in catch_up] == ["v7"]  # type: ignore[union-attr]
        assert not second.engine.paused
    assert await second.stop() == 0


@pytest.mark.parametrize("mode", ["keep", "restart", "abort", "wait"])
async def test_each_on_inflight_mode_through_the_worker(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path, mode
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1", mock=SLOW)
    # 5 s at 5 ms a token: the update, sent once all three generate, arrives while they run.
    tokens = 1000
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        await status.wait_live("w1")
        await produce(
            bs, fleet.topics.jobs, [job_record(job(f"long-{i}", tokens)) for i in range(3)]
        )
        await wait_generating(w.inner, 3)
        command = UpdateWeights(
            command_id="u", version=1, path=checkpoint(tmp_path, "b"), on_inflight=mode
        )
        await send(bs, fleet, command)
        (ack,) = await status.wait_acks("u", 1)
        assert ack.outcome == "ok"
        got = await results.wait("long-0", "long-1", "long-2", timeout_s=60)
        ack_ms = status.ack_time("u")
    for result in got.values():
        if mode == "abort":
            assert isinstance(result, Failed) and result.error.code is ErrorCode.ABORTED
            assert result.error.retryable
            assert not isinstance(result.partial, msgspec.UnsetType)
            (partial,) = result.partial
            done = len(partial.token_ids)
            assert 0 < done < tokens and partial.finish_reason == "abort"
            assert partial.routed_experts is not None
            # vLLM's row rule, so a trainer can continue with start = len - 1.
            assert partial.routed_experts.shape[0] == 4 + done - 1 - 1
            assert result.prompt_token_count == 4
            continue
        c = completed(result).completions[0]
        assert len(c.token_ids) == tokens
        spans = c.weight_versions
        assert not isinstance(spans, msgspec.UnsetType)
        if mode == "keep":
            old, new = spans
            assert (old.version, new.version) == (0, 1)
            assert old.end == new.start and new.end == tokens and old.end > 0
            assert c.routed_experts is not None and c.routed_experts.shape[0] == 4 + tokens - 1 - 1
        elif mode == "restart":
            assert spans == [VersionSpan(version=1, start=0, end=tokens)]
        else:  # wait: finished on the old weights before the update
            assert spans == [VersionSpan(version=0, start=0, end=tokens)]
    if mode == "restart":
        # No answer carrying the old version after the acknowledgement.
        assert all(t <= ack_ms for t, r in results.timed() if r.weight_version == 0)
    assert await w.stop() == 0


async def test_pause_keep_freezes_and_resume_continues_through_the_worker(
    kafka_bootstrap_servers, new_topic, start_steered
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1", mock=SLOW)
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        await status.wait_live("w1")
        await produce(bs, fleet.topics.jobs, [job_record(job("frozen", 100))])
        await wait_generating(w.inner)
        await send(bs, fleet, Pause(command_id="p", mode="keep"))
        await status.wait_acks("p", 1)
        await wait_for(
            lambda: any(s.paused for s in status.statuses("w1")), 10, "a paused heartbeat"
        )
        frozen_at = w.inner.generated_tokens
        # Nothing may happen while paused: wait for three more of the worker's heartbeats
        # (500 ms apart, so three times what the whole job needs), counted, not timed.
        beats = len(status.statuses("w1"))
        await wait_for(
            lambda: len(status.statuses("w1")) >= beats + 3, 30, "three heartbeats while paused"
        )
        assert w.inner.generated_tokens == frozen_at
        assert results.records == []
        await send(bs, fleet, Resume(command_id="r"))
        got = completed((await results.wait("frozen"))["frozen"])
        assert len(got.completions[0].token_ids) == 100
        # Abort by metadata, while running.
        await produce(
            bs, fleet.topics.jobs, [job_record(job("doomed", 400, metadata={"step": "9"}))]
        )
        await wait_generating(w.inner)
        await send(bs, fleet, Abort(command_id="a", metadata={"step": "9"}))
        doomed = (await results.wait("doomed"))["doomed"]
        assert isinstance(doomed, Failed) and doomed.error.code is ErrorCode.ABORTED
        (ack,) = await status.wait_acks("a", 1)
        assert "aborted 1 jobs in flight: doomed" in ack.detail
    assert await w.stop() == 0


async def test_a_worker_without_control_topics_still_serves(
    kafka_bootstrap_servers, new_topic, start_steered
):
    bs = kafka_bootstrap_servers
    topics = await make_topics(new_topic)
    fleet = Fleet(topics=topics, control="vkw-missing-control", status="vkw-missing-status")
    w = await start_steered(fleet, "w1")
    async with Results(bs, topics.results) as results:
        await produce(bs, topics.jobs, [job_record(job("plain"))])
        assert completed((await results.wait("plain"))["plain"]).weight_version == 0
    assert await w.stop() == 0


async def cli(*args: str) -> tuple[int, str, str]:
    """`python -m worker ARGS` without blocking the loop the workers run in."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_control_cli_waits_for_every_live_worker_and_exits_by_outcome(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic, jobs_partitions=2)
    w1 = await start_steered(fleet, "w1")
    w2 = await start_steered(fleet, "w2")
    common = [
        "--bootstrap-servers",
        bs,
        "--control-topic",
        fleet.control,
        "--status-topic",
        fleet.status,
        "--group-id",
        fleet.topics.group,
    ]
    async with Status(bs, fleet.status) as status:
        await wait_for(lambda: status.statuses("w1") and status.statuses("w2"), 20, "heartbeats")
    rc, out, err = await cli("status", *common)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["worker", "group", "version"]
    assert [line.split()[0] for line in lines[1:]] == ["w1", "w2"]
    b = checkpoint(tmp_path, "b")
    rc, out, err = await cli(
        "control", "update-weights", b, "--version", "3", "--on-inflight", "keep", "--wait", *common
    )
    assert rc == 0, (out, err)
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert set(rows) == {"w1", "w2"} and all(r[1] == "ok" and r[3] == "3" for r in rows.values())
    assert (w1.engine.weight_version, w2.engine.weight_version) == (3, 3)
    rc, out, err = await cli(
        "control", "update-weights", str(tmp_path / "nope"), "--version", "4", "--wait", *common
    )
    assert rc == 1 and "failed" in out and "config.json is missing" in out
    rc, out, _ = await cli(
        "control", "pause", "--mode", "keep", "--target-worker", "w2", "--wait", *common
    )
    assert rc == 0 and [line.split()[0] for line in out.splitlines()[1:]] == ["w2"]
    assert w2.engine.paused and not w1.engine.paused
    rc, out, _ = await cli("control", "resume", *common)  # no --wait: prints the command id
    assert rc == 0 and out.strip().startswith("cmd-")
    for w in (w1, w2):
        assert await w.stop() == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["update-weights", "/ckpt"], "the following arguments are required: --version"),
        (["update-weights", "/ckpt", "--version", "-1"], "Expected `int` >= 0"),
        (["update-weights", "--version", "2"], "needs `path`"),
        (["update-weights", "--version", "2", "--backend", "nccl"], "needs `update_info`"),
        (
            ["update-weights", "--version", "2", "--backend", "nccl", "--update-info", "[1]"],
            "a JSON object",
        ),
        (["abort"], "exactly one of `job_ids` or `metadata`"),
        (["abort", "--metadata", "step"], "expected KEY=VALUE"),
        (["pause", "--mode", "later"], "invalid choice: 'later'"),
    ],
)
async def test_control_cli_refuses_bad_arguments_with_exit_2(args, message):
    rc, _, err = await cli("control", *args, "--bootstrap-servers", "127.0.0.1:1")
    assert rc == 2, err
    assert message in err


async def test_a_failed_heartbeat_task_stops_the_worker_at_once(
    kafka_bootstrap_servers, new_topic, start_steered, monkeypatch, caplog
):
    async def broken_heartbeats(self: Any) -> None:
        raise RuntimeError("heartbeats broke")

    monkeypatch.setattr("worker.control.plane.ControlPlane._heartbeats", broken_heartbeats)
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1")
    # A worker whose control plane is half dead must not go on serving unsteered.
    assert await asyncio.wait_for(w.task, 60) == 1
    assert "the control plane stopped: RuntimeError('heartbeats broke')" in caplog.text
