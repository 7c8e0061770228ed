"""What the fleet did, not what it was told: a restarted worker's weights come from the
fleet's acknowledgements; a signed command produced again after a trim is not obeyed; junk on
the control topic costs (almost) nothing. A real broker, the mock engine."""

from __future__ import annotations

import time

import pytest

from schemas import (
    Abort,
    CommandAck,
    Pause,
    Target,
    UpdateWeights,
    WorkerStatus,
    decode_status,
    encode,
    sign_command,
)
from tests.integration.broker.test_control import checkpoint, job
from tests.integration.broker.test_control_security import KEY, acks_of, transfer
from tests.workers import worker_settings
from worker.control import catch_up
from worker.control.catch_up import read_catch_up_plan
from worker.dev.harness.clients import job_record, produce
from worker.dev.harness.fleet import Results, Status, answered, completed, send
from worker.dev.harness.topics import make_fleet
from worker.dev.harness.waiting import wait_for

pytestmark = pytest.mark.broker

HOURS_AGO = 2 * 3600.0


async def test_a_restarted_worker_serves_the_version_the_fleet_applied_after_a_refused_one(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    # Measured before: the running worker served 7, every restarted one 5 (the refused v9
    # counted as applied, so v7 after it counted as refused).
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    a, c = checkpoint(tmp_path, "a"), checkpoint(tmp_path, "c")
    first = await start_steered(fleet, "w1")
    async with Status(bs, fleet.status) as status:
        await status.wait_live("w1")
        await send(
            bs,
            fleet,
            UpdateWeights(command_id="v5", version=5, path=a),
            UpdateWeights(command_id="v9-typo", version=9, path=str(tmp_path / "step-9-typo")),
            UpdateWeights(command_id="v7", version=7, path=c),
        )
        outcomes = [(await status.wait_acks(cid, 1))[0].outcome for cid in ("v5", "v9-typo", "v7")]
        assert outcomes == ["ok", "failed", "ok"]
        assert await first.stop() == 0
        await produce(bs, fleet.topics.jobs, [job_record(job("after-restart"))])
        async with Results(bs, fleet.topics.results) as results:
            second = await start_steered(fleet, "w2")
            got = completed((await results.wait("after-restart"))["after-restart"])
        assert got.weight_version == 7
        assert second.inner.loads == [(c, 7)]  # the refused update is not tried
        assert [a.command_id for a in acks_of(status, "w2")] == ["v7"]
        # Its heartbeats carry the state on for the next worker to start.
        await wait_for(lambda: status.statuses("w2"), 10, "a heartbeat")
        beat = status.statuses("w2")[-1]
        assert (beat.weights_command_id, beat.control_offset) == ("v7", 3)
    assert await second.stop() == 0


async def test_a_command_sent_while_no_worker_ran_is_applied_by_the_next_to_start(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    a = checkpoint(tmp_path, "a")
    await send(bs, fleet, UpdateWeights(command_id="v4", version=4, path=a, issued_at=time.time()))
    await produce(bs, fleet.topics.jobs, [job_record(job("first"))])
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        w = await start_steered(fleet, "w1")
        assert completed((await results.wait("first"))["first"]).weight_version == 4
        (ack,) = await status.wait_acks("v4", 1)
        assert (ack.outcome, ack.offset) == ("ok", 0)
    assert await w.stop() == 0


async def test_a_signed_command_produced_again_after_a_trim_is_not_obeyed(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    # Records the trainer signed hours ago, produced again byte for byte once the topic no
    # longer held them (so no worker remembers their ids): a rollback and a pause that aborts.
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    a, old = checkpoint(tmp_path, "a"), checkpoint(tmp_path, "old")
    key = KEY.encode()
    then = time.time() - HOURS_AGO
    replayed_rollback = sign_command(
        UpdateWeights(command_id="old-rollback", version=2, path=old, force=True, issued_at=then),
        key,
    )
    replayed_pause = sign_command(Pause(command_id="old-pause", mode="abort", issued_at=then), key)
    now = time.time()
    first = await start_steered(fleet, "w1", control_hmac_key=KEY)
    async with Status(bs, fleet.status) as status:
        await status.wait_live("w1")
        await send(
            bs,
            fleet,
            sign_command(UpdateWeights(command_id="v5", version=5, path=a, issued_at=now), key),
            replayed_rollback,
            replayed_pause,
        )
        acks = {
            cid: (await status.wait_acks(cid, 1))[0] for cid in ("v5", "old-rollback", "old-pause")
        }
        assert {cid: (a.outcome, a.weight_version) for cid, a in acks.items()} == {
            "v5": ("ok", 5),
            "old-rollback": ("failed", 5),
            "old-pause": ("failed", 5),
        }
        assert acks["old-rollback"].detail.startswith("stale: issued 72")
        assert not first.engine.paused
        assert await first.stop() == 0
        # A worker started afterwards takes the fleet's state, not the replays.
        await produce(bs, fleet.topics.jobs, [job_record(job("after-restart"))])
        async with Results(bs, fleet.topics.results) as results:
            second = await start_steered(fleet, "w2", control_hmac_key=KEY)
            got = completed((await results.wait("after-restart"))["after-restart"])
        assert got.weight_version == 5
        assert not second.engine.paused
        assert second.inner.loads == [(a, 5)]
        # Produced again once more, while it runs: refused as stale, never applied.
        await send(
            bs,
            fleet,
            encode(
                sign_command(
                    UpdateWeights(command_id="old-v8", version=8, path=old, issued_at=then), key
                )
            ),
        )
        (ack,) = [x for x in await status.wait_acks("old-v8", 1) if x.worker == "w2"]
        assert (ack.outcome, ack.weight_version) == ("failed", 5)
    assert await second.stop() == 0


@pytest.mark.parametrize("signed", [False, True])
async def test_junk_on_the_control_topic_costs_one_status_record_at_most(
    kafka_bootstrap_servers, new_topic, start_steered, signed
):
    # Measured before: 3,000 junk records, 6.7 s of sequential sends before the first job,
    # and one status record each (per worker), which pushed heartbeats out of the readers'
    # 5,000-record window.
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    junk = [b"junk %d" % i for i in range(3000)]
    unsigned = [encode(Abort(command_id=f"u{i}", job_ids=["x"])) for i in range(200)]
    await send(bs, fleet, *junk, *(unsigned if signed else []))
    overrides = {"control_hmac_key": KEY} if signed else {}
    async with Status(bs, fleet.status) as status:
        w = await start_steered(fleet, "w1", **overrides)
        await status.wait_live("w1")
        fence = Abort(command_id="fence", job_ids=["x"], issued_at=time.time())
        await send(bs, fleet, sign_command(fence, KEY.encode()) if signed else fence)
        await status.wait_acks("fence", 1)
        said = [
            m
            for _, v in status.records
            if not isinstance(m := decode_status(v), CommandAck) or m.command_id != "fence"
        ]
        if signed:  # nothing but heartbeats and the fence's acknowledgement
            assert all(isinstance(m, WorkerStatus) for m in said), said
        else:
            (report,) = status.errors()
            assert (report.count, report.offset) == (3000, 2999)
    assert await w.stop() == 0


async def test_a_worker_learns_the_checkpoints_to_build_on_before_its_engine_exists(
    kafka_bootstrap_servers, new_topic, tmp_path
):
    # What `serve` reads before it builds a vLLM engine: the fleet's applied checkpoints,
    # newest first, without the one the fleet refused.
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    b, c, d = (checkpoint(tmp_path, n) for n in ("b", "c", "d"))
    await send(
        bs,
        fleet,
        UpdateWeights(command_id="fleet-b", version=3, path=b),
        UpdateWeights(command_id="fleet-c", version=9, path=c),
        UpdateWeights(command_id="fleet-d", version=12, path=d),
    )
    await answered(bs, fleet, ("fleet-b", 0, "ok"), ("fleet-c", 1, "ok"), ("fleet-d", 2, "failed"))
    settings = worker_settings(
        bs, fleet.topics, control_topic=fleet.control, status_topic=fleet.status
    )
    plan = await read_catch_up_plan(settings, 0)
    assert [u.command_id for u in plan.checkpoints] == ["fleet-c", "fleet-b"]
    assert plan.unanswered == [] and plan.seen == {"fleet-b", "fleet-c", "fleet-d"}


async def test_a_copy_of_an_answered_rollback_is_not_obeyed_by_a_starting_worker(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    # The fleet applied 5, 6, a rollback to 5 and 7, then went down; a byte-for-byte copy of
    # the signed rollback was produced after that (no key needed to copy a record). Measured
    # before: the starting worker took the copy for a command nobody answered and applied it,
    # serving 5 where the fleet had left 7.
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    key, now = KEY.encode(), time.time()
    paths = {v: checkpoint(tmp_path, f"v{v}") for v in (5, 6, 7)}
    commands = [
        UpdateWeights(command_id="u5", version=5, path=paths[5], issued_at=now),
        UpdateWeights(command_id="u6", version=6, path=paths[6], issued_at=now),
        UpdateWeights(command_id="r5", version=5, path=paths[5], force=True, issued_at=now),
        UpdateWeights(command_id="u7", version=7, path=paths[7], issued_at=now),
    ]
    records = [encode(sign_command(c, key)) for c in commands]
    await send(bs, fleet, *records, records[2])
    await answered(bs, fleet, *((c.command_id, o, "ok") for o, c in enumerate(commands)))
    await produce(bs, fleet.topics.jobs, [job_record(job("after-copy"))])
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        w = await start_steered(fleet, "w1", control_hmac_key=KEY)
        got = completed((await results.wait("after-copy"))["after-copy"])
        assert got.weight_version == 7
        assert w.inner.loads == [(paths[7], 7)]
        assert [a.command_id for a in acks_of(status, "w1")] == ["u7"]
    assert await w.stop() == 0


async def test_needs_weights_outlives_the_transfers_acknowledgements_in_the_status_tail(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path, monkeypatch
):
    # A worker restarted after a transfer says needs_weights. Once the transfer's
    # acknowledgements are older than the tail a starting worker reads (here: the last 2
    # records, which are the first worker's heartbeats), the next worker must still hold.
    # Measured before: it served 3 with no hold, and `status` showed it current.
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    b = checkpoint(tmp_path, "b")
    await send(bs, fleet, UpdateWeights(command_id="v3", version=3, path=b), transfer("t5", 5))
    await answered(bs, fleet, ("v3", 0, "ok"), ("t5", 1, "ok"))
    async with Status(bs, fleet.status) as status:
        first = await start_steered(fleet, "w1", allow_weight_transfer=True)
        await wait_for(lambda: len(status.statuses("w1")) >= 2, 30, "two heartbeats")
        assert await first.stop() == 0
        monkeypatch.setattr(catch_up, "STATUS_TAIL_RECORDS", 2)
        second = await start_steered(fleet, "w2", allow_weight_transfer=True)
        await wait_for(lambda: status.statuses("w2"), 30, "a heartbeat")
        beat = status.statuses("w2")[-1]
        assert (beat.needs_weights, beat.weight_version, beat.weights_command_id) == (True, 3, "v3")
        assert second.engine.paused
    assert await second.stop() == 0


async def test_a_pause_for_a_worker_that_was_down_holds_it_when_it_starts(
    kafka_bootstrap_servers, new_topic, start_steered
):
    # w1 passes over a pause meant for w2 alone and reports an offset past it. Measured
    # before: w2, starting later, took that for the fleet's answer and never paused.
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    async with Status(bs, fleet.status) as status:
        first = await start_steered(fleet, "w1")
        await status.wait_live("w1")
        pause = Pause(command_id="p-w2", target=Target(workers=["w2"]), issued_at=time.time())
        await send(bs, fleet, pause)
        await wait_for(
            lambda: any(s.control_offset == 1 for s in status.statuses("w1")), 10, "w1 past it"
        )
        second = await start_steered(fleet, "w2")
        (ack,) = await status.wait_acks("p-w2", 1)
        assert (ack.worker, ack.outcome, ack.offset) == ("w2", "ok", 0)
        assert second.engine.paused and not first.engine.paused
    assert await second.stop() == 0
    assert await first.stop() == 0
