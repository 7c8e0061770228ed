"""Hostile commands on the control topic, on a real broker with the mock engine: what a worker
refuses (acknowledged `failed`, nothing changed), signatures, versions, and the catch-up of a
restarted worker."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from schemas import (
    Abort,
    Command,
    CommandAck,
    ErrorCode,
    Failed,
    ResetPrefixCache,
    Resume,
    UpdateWeights,
    decode_status,
    encode,
    sign_command,
)
from tests.integration.broker.test_control import SLOW, checkpoint, fence, job
from worker.client.fleet import Fleet as FleetClient
from worker.client.rollout import RolloutClient
from worker.core.config import settings_from
from worker.core.errors import ConfigError
from worker.core.kafka import create_topics
from worker.dev.harness.clients import job_record, produce
from worker.dev.harness.fleet import Results, Status, answered, completed, send
from worker.dev.harness.topics import Fleet, make_fleet
from worker.dev.harness.waiting import wait_for, wait_generating
from worker.engines.mock import MockEngineSettings

pytestmark = pytest.mark.broker

KEY = "fleet-key-" + "x" * 30


def transfer(command_id: str, version: int) -> UpdateWeights:
    return UpdateWeights(
        command_id=command_id,
        version=version,
        backend="nccl",
        init_info={"master_address": "attacker.example", "master_port": 29500},
        update_info={"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[1]]},
    )


async def test_a_refused_update_is_acknowledged_failed_before_anything_changes(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    root = tmp_path / "root"
    w = await start_steered(fleet, "w1", mock=SLOW, weights_root=[str(root)])
    outside = checkpoint(tmp_path, "outside")
    root.mkdir()
    code = checkpoint(root, "with-code")
    Path(code, "modeling_x.py").write_text("import os; os.system('id')")
    (root / "escape").symlink_to(outside)
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        await status.wait_live("w1")
        await produce(bs, fleet.topics.jobs, [job_record(job("running", 300))])
        await wait_generating(w.inner)
        # Each would abort the running job if it got as far as the engine.
        refused = {
            "outside": (UpdateWeights, outside, "outside --weights-root"),
            "symlink": (UpdateWeights, str(root / "escape"), "outside --weights-root"),
            "code": (UpdateWeights, code, "brings code"),
            "nul": (UpdateWeights, f"{root}/a\x00b", "NUL character"),
        }
        await send(
            bs,
            fleet,
            *(
                UpdateWeights(command_id=cid, version=1, path=path, on_inflight="abort")
                for cid, (_, path, _) in refused.items()
            ),
            transfer("nccl", 1),
        )
        for cid, (_, _, message) in refused.items():
            (ack,) = await status.wait_acks(cid, 1)
            assert ack.outcome == "failed" and message in ack.detail, ack
        (ack,) = await status.wait_acks("nccl", 1)
        assert ack.outcome == "failed" and "--allow-weight-transfer" in ack.detail
        got = completed((await results.wait("running", timeout_s=30))["running"])
        assert len(got.completions[0].token_ids) == 300  # never interrupted
        assert got.weight_version == 0
    assert w.inner.loads == []
    assert await w.stop() == 0


async def test_without_a_root_or_the_flag_no_path_update_is_taken(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    closed = await start_steered(fleet, "closed", weights_root=[])
    anywhere = await start_steered(fleet, "anywhere", allow_any_weights_path=True)
    async with Status(bs, fleet.status) as status:
        await status.wait_live("closed", "anywhere")
        await send(
            bs, fleet, UpdateWeights(command_id="u", version=4, path=checkpoint(tmp_path, "b"))
        )
        acks = {a.worker: a for a in await status.wait_acks("u", 2)}
    assert acks["closed"].outcome == "failed"
    assert "without --weights-root" in acks["closed"].detail
    assert acks["anywhere"].outcome == "ok"
    assert (closed.engine.weight_version, anywhere.engine.weight_version) == (0, 4)
    for w in (closed, anywhere):
        assert await w.stop() == 0


async def test_versions_only_move_forward_unless_forced(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1")
    b, c = checkpoint(tmp_path, "b"), checkpoint(tmp_path, "c")
    now = time.time()
    async with Status(bs, fleet.status) as status:
        await status.wait_live("w1")
        await send(
            bs,
            fleet,
            UpdateWeights(command_id="v5", version=5, path=b),
            UpdateWeights(command_id="v3", version=3, path=c),
            UpdateWeights(command_id="v5-again", version=5, path=c),  # the same version: taken
            # A rollback must say when it was issued (a fresh one is taken).
            UpdateWeights(command_id="v1-forced-undated", version=1, path=b, force=True),
            UpdateWeights(command_id="v2-forced", version=2, path=b, force=True, issued_at=now),
        )
        outcomes = {
            cid: (a.outcome, a.weight_version)
            for cid in ("v5", "v3", "v5-again", "v1-forced-undated", "v2-forced")
            for a in await status.wait_acks(cid, 1)
        }
        assert "older than the served version 5" in status.acks("v3")[0].detail
    assert outcomes == {
        "v5": ("ok", 5),
        "v3": ("failed", 5),
        "v5-again": ("ok", 5),
        "v1-forced-undated": ("failed", 5),
        "v2-forced": ("ok", 2),
    }
    assert await w.stop() == 0


async def test_a_signing_fleet_applies_only_well_signed_commands(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1", control_hmac_key=KEY)
    b = checkpoint(tmp_path, "b")
    now = time.time()
    forged = sign_command(
        UpdateWeights(command_id="forged", version=9, path=b, issued_at=now), b"y" * 40
    )
    tampered = encode(
        sign_command(
            UpdateWeights(command_id="tampered", version=1, path=b, issued_at=now), KEY.encode()
        )
    )
    tampered = tampered.replace(b'"version":1', b'"version":8')
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        await status.wait_live("w1")
        # A forged record first takes a real command's id: the real one still applies.
        await send(
            bs,
            fleet,
            UpdateWeights(command_id="unsigned", version=7, path=b),
            forged,
            tampered,
            Abort(command_id="signed-abort", job_ids=["x"]),  # unsigned, reusing a real id
        )
        # Not signed by the fleet's key: nobody's command, dropped before anything is sent.
        signed_abort = Abort(command_id="signed-abort", job_ids=["x"], issued_at=time.time())
        await send(bs, fleet, sign_command(signed_abort, KEY.encode()))
        (ack,) = await status.wait_acks("signed-abort", 1)
        assert ack.outcome == "ok"
        assert {a.command_id for a in acks_of(status, "w1")} == {"signed-abort"}
        assert status.errors() == []
        # The CLI signs with the key from the environment; RolloutClient and Fleet when given it.
        rc, out, err = await control_cli(
            bs,
            fleet,
            "update-weights",
            b,
            "--version",
            "3",
            "--wait",
            env={"VKW_CONTROL_HMAC_KEY": KEY},
        )
        assert rc == 0, (out, err)
        assert KEY not in out + err
        async with RolloutClient(
            bootstrap_servers=bs,
            jobs_topic=fleet.topics.jobs,
            results_topic=fleet.topics.results,
            control_topic=fleet.control,
            status_topic=fleet.status,
            group_id=fleet.topics.group,
            control_hmac_key=KEY,
        ) as client:
            acks = await client.update_weights(b, 4, timeout_s=30)
        assert acks["w1"].outcome == "ok" and acks["w1"].weight_version == 4
        async with FleetClient(
            {"bootstrap_servers": bs},
            control_topic=fleet.control,
            status_topic=fleet.status,
            control_hmac_key=KEY,
        ) as client_fleet:
            await client_fleet.send(ResetPrefixCache(command_id="reset"))
        (ack,) = await status.wait_acks("reset", 1)
        assert ack.outcome == "ok"
        await produce(bs, fleet.topics.jobs, [job_record(job("served"))])
        assert completed((await results.wait("served"))["served"]).weight_version == 4
    assert w.inner.loads == [(b, 3), (b, 4)]
    assert w.inner.prefix_cache_resets == 1
    assert await w.stop() == 0


async def control_cli(
    bs: str, fleet: Fleet, *args: str, env: dict[str, str]
) -> tuple[int, str, str]:
    """`python -m worker control ARGS` for `fleet`, with `env` over a clean environment."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker",
        "control",
        *args,
        *("--bootstrap-servers", bs, "--control-topic", fleet.control),
        *("--status-topic", fleet.status, "--group-id", fleet.topics.group),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("VKW_")}, **env},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# ---- catch-up --------------------------------------------------------------------------------


@pytest.mark.parametrize("stale", ["hold", "serve"])
async def test_a_restarted_worker_does_not_repeat_a_transfer_and_says_it_needs_weights(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path, stale
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    b, c = checkpoint(tmp_path, "b"), checkpoint(tmp_path, "c")
    # What a fleet that takes transfers left in the topic: a checkpoint, then a transfer.
    await send(bs, fleet, UpdateWeights(command_id="v3", version=3, path=b), transfer("t5", 5))
    await answered(bs, fleet, ("v3", 0, "ok"), ("t5", 1, "ok"))
    await produce(bs, fleet.topics.jobs, [job_record(job("first"))])
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        w = await start_steered(
            fleet, "w1", allow_weight_transfer=True, stale_weights_at_start=stale
        )
        await wait_for(
            lambda: any(s.needs_weights for s in status.statuses("w1")), 30, "needs_weights"
        )
        assert w.inner.loads == [(b, 3)]  # the checkpoint replayed, the transfer not tried
        assert [a.command_id for a in acks_of(status, "w1")] == ["v3"]
        assert not status.acks("t5")[1:]  # the earlier worker's only
        if stale == "serve":
            assert completed((await results.wait("first"))["first"]).weight_version == 3
        else:
            await wait_for(lambda: w.worker.jobs_in_flight == 1, 20, "the job held")
            assert w.engine.paused
            await send(bs, fleet, Resume(command_id="resume"))  # does not lift the hold
            (ack,) = await status.wait_acks("resume", 1)
            assert "held until the next update_weights" in ack.detail
        await send(bs, fleet, UpdateWeights(command_id="v6", version=6, path=c))
        (ack,) = await status.wait_acks("v6", 1)
        assert ack.outcome == "ok"
        assert completed((await results.wait("first"))["first"]).weight_version == (
            3 if stale == "serve" else 6
        )
        await wait_for(lambda: not status.statuses("w1")[-1].needs_weights, 10, "weights")
        assert not w.engine.paused
    assert await w.stop() == 0


def acks_of(status: Status, worker: str) -> list[CommandAck]:
    return [
        m
        for _, v in status.records
        if isinstance(m := decode_status(v), CommandAck) and m.worker == worker
    ]


async def test_a_stale_update_from_an_earlier_run_is_not_applied(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    await send(
        bs, fleet, UpdateWeights(command_id="old-run", version=5, path=checkpoint(tmp_path, "b"))
    )
    await produce(bs, fleet.topics.jobs, [job_record(job("first"))])
    async with Results(bs, fleet.topics.results) as results:
        # A worker started on the new run's checkpoint, version 10.
        started_on_10 = MockEngineSettings(num_layers=4, top_k=2, num_experts=8, weight_version=10)
        w = await start_steered(fleet, "w1", mock=started_on_10, weight_version=10)
        assert completed((await results.wait("first"))["first"]).weight_version == 10
    assert w.inner.loads == []
    assert await w.stop() == 0


async def test_a_worker_refuses_a_control_topic_of_several_partitions(
    kafka_bootstrap_servers, new_topic, start_steered
):
    fleet = await make_fleet(new_topic)
    fleet.control = await new_topic(3)
    w = await start_steered(fleet, "w1")
    with pytest.raises(ConfigError, match=f"control topic {fleet.control} has 3 partitions"):
        await asyncio.wait_for(w.task, 60)
    # `serve` says it in one line and exits 2.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker",
        "serve",
        "--engine",
        "mock",
        *("--bootstrap-servers", kafka_bootstrap_servers),
        *("--jobs-topic", fleet.topics.jobs, "--results-topic", fleet.topics.results),
        *("--dead-letter-topic", fleet.topics.dlq, "--group-id", fleet.topics.group),
        *("--control-topic", fleet.control, "--status-topic", fleet.status),
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("VKW_")},
    )
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 2
    errors = [line for line in err.decode().splitlines() if "error:" in line]
    assert len(errors) == 1 and f"control topic {fleet.control} has 3 partitions" in errors[0]


async def test_create_topics_keeps_the_control_topic_for_ever_on_one_partition(
    kafka_bootstrap_servers,
):
    names = {f: f"test-create-{f}-{uuid.uuid4().hex[:8]}" for f in ("jobs", "results", "dlq")}
    control, status = f"test-ctl-{uuid.uuid4().hex[:8]}", f"test-st-{uuid.uuid4().hex[:8]}"
    settings = settings_from(
        {
            "bootstrap_servers": kafka_bootstrap_servers,
            "jobs_topic": names["jobs"],
            "results_topic": names["results"],
            "dead_letter_topic": names["dlq"],
            "control_topic": control,
            "status_topic": status,
            "topic_partitions": 4,
        },
        {},
    )
    created = await create_topics(settings)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap_servers)
    await admin.start()
    try:
        assert control in created
        (described,) = await admin.describe_topics([control])
        assert len(described["partitions"]) == 1
        (response,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, control)]
        )
        configs = {entry[0]: entry[1] for entry in response.resources[0][4]}
        assert configs["retention.ms"] == "-1" and configs["retention.bytes"] == "-1"
        assert configs.get("cleanup.policy", "delete") == "delete"
    finally:
        await admin.delete_topics(created)
        await admin.close()


async def test_a_stream_of_hostile_commands_leaves_every_good_one_acknowledged(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1")
    b = checkpoint(tmp_path, "b")
    hostile: list[Any] = [
        b"",
        b"\xff\xfe\x00",
        b"[" * 100_000,
        b'{"kind": "update_weights", "command_id": "h1", "version": 99999999999999999999999}',
        b'{"kind": "update_weights", "command_id": "h2", "version": 1, "path": "/tmp/\\u0000"}',
        b'{"kind": "abort", "command_id": "h3", "job_ids": ["a"], "metadata": {"x": "y"}}',
        b'{"kind": "pause", "command_id": "' + b"x" * 300 + b'"}',
        json.dumps(
            {"kind": "update_weights", "command_id": "h4", "version": 1, "path": "/"}
        ).encode(),
        json.dumps(
            {"kind": "update_weights", "command_id": "h5", "version": 1, "path": "/dev/zero"}
        ).encode(),
        json.dumps(
            {"kind": "update_weights", "command_id": "h6", "version": 1, "path": "/proc/self/root"}
        ).encode(),
        json.dumps({"kind": "reset_prefix_cache", "command_id": "h7", "target": 5}).encode(),
    ]
    good: list[Command] = [
        Abort(command_id=f"good-{i}", job_ids=["none"]) for i in range(len(hostile))
    ]
    good.append(UpdateWeights(command_id="good-update", version=2, path=b))
    mixed: list[Any] = [x for pair in zip(hostile, good, strict=False) for x in pair] + good[-1:]
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        await status.wait_live("w1")
        await send(bs, fleet, *mixed)
        for command in good:
            (ack,) = await status.wait_acks(command.command_id, 1)
            assert ack.outcome == "ok", ack
        await fence(bs, fleet, status, "w1")
        await produce(bs, fleet.topics.jobs, [job_record(job("after"))])
        after = (await results.wait("after"))["after"]
        assert not isinstance(after, Failed) or after.error.code is not ErrorCode.INTERNAL_ERROR
        assert completed(after).weight_version == 2
    assert not w.task.done()
    assert await w.stop() == 0
