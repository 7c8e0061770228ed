"""A starting worker's catch-up with the project's own `ControlPlane`, on in-memory topics.

What the control topic holds is judged by what the fleet said it did (the status topic's
tail): these cases are the ones where the two disagree in ways a following worker would not.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiokafka import ConsumerRecord
from hypothesis import given
from hypothesis import strategies as st

from schemas import (
    Command,
    CommandAck,
    Pause,
    Resume,
    StatusMessage,
    Target,
    UpdateWeights,
    WorkerStatus,
    encode,
    sign_command,
)
from tests.fakes import ManualClock
from tests.unit.test_control_fuzz import (
    CONTROL,
    HOSTILE_STATUS,
    ISSUED_AT,
    KEY,
    STATUS,
    STREAMS,
    IdleWorker,
    OnePartition,
    StatusTopic,
)
from worker.control.catch_up import ControlLog, FleetState, plan_catch_up, read_fleet_state
from worker.control.plane import ControlPlane
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import settings_from
from worker.core.metrics import Metrics
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.steerable import SteerableEngine

GROUP = "g"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for name in ("v3", "v5", "v6", "v7"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"name": name}))
    return tmp_path


def update(root: Path, version: int, **kwargs: Any) -> UpdateWeights:
    return UpdateWeights(
        command_id=kwargs.pop("command_id", f"u{version}"),
        version=version,
        path=str(root / f"v{version}"),
        issued_at=kwargs.pop("issued_at", ISSUED_AT),
        **kwargs,
    )


def transfer(version: int) -> UpdateWeights:
    return UpdateWeights(
        command_id=f"t{version}",
        version=version,
        backend="nccl",
        update_info={"names": []},
        issued_at=ISSUED_AT,
    )


def ack(command: Command, offset: int, worker: str = "w1") -> CommandAck:
    return CommandAck(
        worker=worker,
        group=GROUP,
        command_id=command.command_id,
        kind="update_weights",
        outcome="ok",
        duration_s=0.1,
        weight_version=0,
        at=ISSUED_AT,
        offset=offset,
    )


def heartbeat(worker: str = "w1", **state: Any) -> WorkerStatus:
    return WorkerStatus(
        worker=worker,
        group=GROUP,
        model="m",
        weight_version=0,
        paused=False,
        in_flight=0,
        lag=0,
        engine_healthy=True,
        uptime_s=1.0,
        at=ISSUED_AT,
        interval_s=5.0,
        **state,
    )


class Started:
    """A control plane caught up on `control` (records as given) and the status tail."""

    def __init__(self, plane: ControlPlane, engine: SteerableEngine, sent: StatusTopic) -> None:
        self.plane, self.engine, self.sent = plane, engine, sent

    @property
    def loads(self) -> list[tuple[str, int]]:
        inner = self.engine._inner
        assert isinstance(inner, MockEngine)
        return inner.loads


async def start(
    root: Path,
    control: list[bytes],
    status: list[StatusMessage],
    *,
    worker: str = "w2",
    version: int = 0,
    key: bytes | None = None,
    built_on: str | None = None,
) -> Started:
    control_topic = OnePartition(CONTROL, listed=frozenset({STATUS}))
    for value in control:
        control_topic.add(value)
    status_topic = OnePartition(STATUS)
    for message in status:
        status_topic.add(encode(message))
    values: dict[str, Any] = {
        "control_topic": CONTROL,
        "status_topic": STATUS,
        "worker_id": worker,
        "group_id": GROUP,
        "weights_root": [str(root)],
        "allow_weight_transfer": True,
    }
    if key is not None:
        values["control_hmac_key"] = key.decode()
    engine = SteerableEngine(
        MockEngine(
            MockEngineSettings(num_layers=2, top_k=1, num_experts=4, weight_version=version)
        ),
        clock=SYSTEM_CLOCK,
    )
    sent = StatusTopic()
    plane = ControlPlane(
        settings_from(values, {}),
        engine,
        Metrics(),
        IdleWorker(),
        consumer=control_topic,
        producer=sent,
        status_consumer=status_topic,
        clock=ManualClock(wall=ISSUED_AT),
        built_on=built_on,
    )
    await plane.start()
    await plane.catch_up()
    return Started(plane, engine, sent)


def signed(*commands: Command) -> list[bytes]:
    return [encode(sign_command(c, KEY)) for c in commands]


# ---- a replayed record ---------------------------------------------------------------------


def test_a_replayed_rollback_is_a_duplicate_at_catch_up_as_it_is_live(root):
    # The trainer rolled back to 5, then moved on to 7. A byte-for-byte copy of the signed
    # rollback (anyone who can write the topic can make one) is produced after it; the fleet
    # skips it as a duplicate, but its next heartbeat has not gone out yet. The starting
    # worker took the copy for an unanswered rollback and applied it: 5, with the fleet on 7.
    u5, u6, u7 = update(root, 5), update(root, 6), update(root, 7)
    rollback = update(root, 5, command_id="r5", force=True)
    control = signed(u5, u6, rollback, u7)
    control.append(control[2])
    status: list[StatusMessage] = [
        *(ack(c, o) for o, c in enumerate((u5, u6, rollback, u7))),
        heartbeat(weights_command_id="u7", control_offset=4),
    ]

    async def run() -> Started:
        return await start(root, control, status, key=KEY)

    got = asyncio.run(run())
    assert got.engine.weight_version == 7
    assert got.loads == [(str(root / "v7"), 7)]
    assert [a.command_id for a in got.sent.acks().values()] == ["u7"]
    assert got.plane.status().control_offset == 5


@pytest.mark.parametrize("fleet_beat_after_copy", [False, True])
def test_a_replayed_pause_leaves_a_starting_worker_running_with_the_fleet(
    root, fleet_beat_after_copy
):
    # Pause, resume, then a copy of the pause. Before the fleet's next heartbeat the copy was
    # taken as unanswered and applied; after it, as the latest pause the fleet applied.
    pause = Pause(command_id="p", issued_at=ISSUED_AT)
    resume = Resume(command_id="r", issued_at=ISSUED_AT)
    control = signed(pause, resume)
    control.append(control[0])
    status: list[StatusMessage] = [
        ack(pause, 0),
        ack(resume, 1),
        heartbeat(control_offset=3 if fleet_beat_after_copy else 2),
    ]

    async def run() -> Started:
        return await start(root, control, status, key=KEY)

    got = asyncio.run(run())
    assert not got.engine.paused
    assert got.sent.acks() == {}
    assert got.plane.status().pause_command_id is None


def test_the_first_record_of_an_id_is_the_command_whoever_the_copy_addresses():
    # A following worker takes an id once, at its first record, addressed to it or not.
    log = ControlLog()
    first = Pause(command_id="p", target=Target(group="other"))
    assert log.take(0, first, addressed=False)
    assert not log.take(3, Pause(command_id="p"), addressed=True)
    assert (log.ids, log.addressed) == ({"p": 0}, [])


# ---- targeted commands -----------------------------------------------------------------------


def test_a_command_for_a_worker_that_was_down_is_applied_when_it_starts(root):
    # A pause for w2 alone, sent while w2 was down. w1 passed over it (not its own) and its
    # heartbeats said so; w2 took that for an answer and forgot the pause.
    pause = Pause(command_id="p", target=Target(workers=["w2"]), issued_at=ISSUED_AT)
    u6 = update(root, 6, target=Target(workers=["w2"]))
    status: list[StatusMessage] = [heartbeat("w1", control_offset=2)]

    async def run() -> Started:
        return await start(root, [encode(pause), encode(u6)], status, worker="w2")

    got = asyncio.run(run())
    assert got.engine.paused
    assert (got.engine.weight_version, got.plane.status().pause_command_id) == (6, "p")
    assert {cid: a.offset for cid, a in got.sent.acks().items()} == {"p": 0, "u6": 1}


def test_a_command_for_a_worker_that_died_in_its_catch_up_is_applied_at_the_next_start(root):
    # A pause for w2 alone (0), sent while w2 was down, then the fleet's update (1). w2's
    # next start acknowledged the fleet's update first (1) and died before it took up the
    # pause; that acknowledgement was read as "w2 answered everything below 2", and the pause
    # was forgotten for good. Seed 1100005 of the simulation's control flag set (5 workers),
    # where the forgotten command was a superseded update left unacknowledged.
    pause = Pause(command_id="p", target=Target(workers=["w2"]), issued_at=ISSUED_AT)
    u6 = update(root, 6)
    status: list[StatusMessage] = [
        ack(u6, 1, worker="w1"),
        heartbeat("w1", control_offset=2),
        ack(u6, 1, worker="w2"),
    ]

    async def run() -> Started:
        return await start(root, [encode(pause), encode(u6)], status, worker="w2", version=5)

    got = asyncio.run(run())
    assert got.engine.paused
    assert (got.engine.weight_version, got.plane.status().pause_command_id) == (6, "p")
    assert got.sent.acks()["p"].outcome == "ok"


def test_a_command_for_a_worker_that_answered_it_is_not_applied_again(root):
    pause = Pause(command_id="p", target=Target(workers=["w2"]), issued_at=ISSUED_AT)
    status: list[StatusMessage] = [
        ack(pause, 0, worker="w2"),
        heartbeat("w1", control_offset=1),
        heartbeat("w2", control_offset=1, pause_command_id="p"),
    ]

    async def run() -> Started:
        return await start(root, [encode(pause)], status, worker="w2")

    got = asyncio.run(run())
    # Answered by w2 before it stopped: the pause in force is the fleet's state, taken as such
    # (acknowledged once more, at the offset it was sent at), not a command applied again.
    assert got.engine.paused
    assert [a.command_id for a in got.sent.acks().values()] == ["p"]
    assert got.sent.acks()["p"].offset == 0


def test_a_command_for_a_worker_that_was_down_yields_to_the_fleets_newer_transfer(root):
    # An update for w2 alone (6) was sent while w2 was down; the fleet then applied a transfer
    # (7). A following worker would have taken 6, then 7. The restarted w2 took the fleet's
    # state first (lacking 7), then applied 6 as unanswered, which ended the needs_weights
    # hold: it served 6, weights the fleet had left, and said nothing of 7. Seed 1 of the
    # simulation's control flag set (3 workers).
    u6, t7 = update(root, 6, target=Target(workers=["w2"])), transfer(7)
    status: list[StatusMessage] = [ack(t7, 1, worker="w1"), heartbeat("w1", control_offset=2)]

    async def run() -> Started:
        return await start(root, [encode(u6), encode(t7)], status, worker="w2", version=5)

    got = asyncio.run(run())
    beat = got.plane.status()
    assert got.loads == []
    assert (beat.needs_weights, beat.needs_weights_command_id) == (True, "t7")
    assert (got.engine.weight_version, got.engine.paused) == (5, True)
    overtaken = got.sent.acks()["u6"]
    assert (overtaken.outcome, overtaken.offset) == ("failed", 0)
    assert "t7" in overtaken.detail


def test_a_rollback_for_a_worker_that_was_down_yields_to_the_fleets_newer_update(root):
    # A forced rollback to 3 for w2 alone, sent while it was down, then the fleet's update to
    # 7: applied after the fleet's state, the rollback left w2 on 3 while the fleet served 7.
    rollback = update(root, 3, command_id="r3", force=True, target=Target(workers=["w2"]))
    u7 = update(root, 7)
    status: list[StatusMessage] = [ack(u7, 1, worker="w1"), heartbeat("w1", control_offset=2)]

    async def run() -> Started:
        return await start(root, [encode(rollback), encode(u7)], status, worker="w2", version=5)

    got = asyncio.run(run())
    assert got.loads == [(str(root / "v7"), 7)]
    assert got.plane.status().weights_command_id == "u7"
    assert got.sent.acks()["r3"].outcome == "failed"


def test_a_pause_for_a_worker_that_was_down_yields_to_the_fleets_newer_resume(root):
    # A pause for w2 alone, sent while it was down; the fleet then paused and resumed. The
    # restarted w2 resumed with the fleet, then applied its own older pause and stayed paused.
    mine = Pause(command_id="p1", target=Target(workers=["w2"]), issued_at=ISSUED_AT)
    pause = Pause(command_id="p2", issued_at=ISSUED_AT)
    resume = Resume(command_id="r", issued_at=ISSUED_AT)
    status: list[StatusMessage] = [
        ack(pause, 1, worker="w1"),
        ack(resume, 2, worker="w1"),
        heartbeat("w1", control_offset=3),
    ]

    async def run() -> Started:
        control = [encode(mine), encode(pause), encode(resume)]
        return await start(root, control, status, worker="w2")

    got = asyncio.run(run())
    assert not got.engine.paused
    assert got.plane.status().pause_command_id is None
    assert got.sent.acks()["p1"].outcome == "failed"


def test_a_command_for_a_worker_that_was_down_sent_after_the_fleets_state_is_applied(root):
    u6 = update(root, 6)
    u7 = update(root, 7, target=Target(workers=["w2"]))
    status: list[StatusMessage] = [ack(u6, 0, worker="w1"), heartbeat("w1", control_offset=2)]

    async def run() -> Started:
        return await start(root, [encode(u6), encode(u7)], status, worker="w2", version=5)

    got = asyncio.run(run())
    assert got.loads == [(str(root / "v6"), 6), (str(root / "v7"), 7)]
    assert got.sent.acks()["u7"].outcome == "ok"


# ---- rollbacks below the start version -------------------------------------------------------


def test_a_rollback_below_the_start_version_undoes_the_update_it_rolled_back_from(root):
    # Started on version 5; the fleet went to 7 and was rolled back (force) to 3. Only
    # versions from 5 up counted, so the starting worker loaded 7, the weights the trainer
    # had just rolled back from.
    u7, rollback = update(root, 7), update(root, 3, command_id="r3", force=True)
    status: list[StatusMessage] = [ack(u7, 0), ack(rollback, 1), heartbeat(control_offset=2)]

    async def run() -> Started:
        return await start(root, [encode(u7), encode(rollback)], status, version=5)

    got = asyncio.run(run())
    assert got.loads == [(str(root / "v3"), 3)]
    assert got.plane.status().weights_command_id == "r3"


def test_a_rollback_between_the_engine_build_and_the_catch_up_is_taken(root):
    # The engine was built on the fleet's 7 (read before the build); a forced rollback to 3
    # came while it was built and the fleet applied it. The catch-up counts from the built
    # version, 7, so it dropped the rollback and kept serving 7.
    u7, rollback = update(root, 7), update(root, 3, command_id="r3", force=True)
    status: list[StatusMessage] = [ack(u7, 0), ack(rollback, 1), heartbeat(control_offset=2)]

    async def run() -> Started:
        control = [encode(u7), encode(rollback)]
        return await start(root, control, status, version=7, built_on="u7")

    got = asyncio.run(run())
    assert (got.engine.weight_version, got.loads) == (3, [(str(root / "v3"), 3)])


@pytest.mark.parametrize(("beat_age_s", "served"), [(0.0, 3), (7200.0, 5)])
def test_a_rollback_of_the_start_up_weights_counts_while_the_fleet_serves_it(
    root, beat_age_s, served
):
    # Started on 5 like the fleet, which was then rolled back (force) to 3 with no update
    # before: nothing of this run precedes the rollback, so the worker started on 5 while the
    # fleet served 3. A fleet serving it now (a heartbeat within three intervals) says it is
    # this run's; a rollback and a heartbeat two hours old (past --command-max-age-s and its
    # clock skew) are an earlier run's, and 5 stands.
    rollback = update(root, 3, command_id="r3", force=True, issued_at=ISSUED_AT - beat_age_s)
    beat = heartbeat(weights_command_id="r3", control_offset=1)
    status: list[StatusMessage] = [
        ack(rollback, 0),
        msgspec.structs.replace(beat, at=ISSUED_AT - beat_age_s),
    ]

    async def run() -> Started:
        return await start(root, [encode(rollback)], status, version=5)

    got = asyncio.run(run())
    assert got.engine.weight_version == served


def test_a_fresh_rollback_below_the_start_version_counts_after_the_whole_fleet_stopped(root):
    # Started on 10 like the fleet, which was rolled back (force) to 7, moved on to a
    # transfer of 9, then stopped, all of it for longer than three heartbeat intervals. The
    # rollback, issued minutes ago, counted neither by an update before it nor by a fleet
    # serving it now: the restarted worker served its start-up 10, with no word of the
    # transfer it lacked. Seed 6 of the simulation's control flag set (3 workers).
    rollback = update(root, 7, command_id="r7", force=True, issued_at=ISSUED_AT - 300.0)
    t9 = transfer(9)
    beat = heartbeat(weights_command_id="t9", control_offset=2)
    status: list[StatusMessage] = [
        ack(rollback, 0),
        ack(t9, 1),
        msgspec.structs.replace(beat, at=ISSUED_AT - 60.0),
    ]

    async def run() -> Started:
        return await start(root, [encode(rollback), encode(t9)], status, version=10)

    got = asyncio.run(run())
    beat = got.plane.status()
    assert got.loads == [(str(root / "v7"), 7)]
    assert (beat.needs_weights, beat.needs_weights_command_id) == (True, "t9")
    assert got.engine.paused


def test_an_update_below_the_start_version_the_fleet_serves_now_counts(root):
    # Started on 10 like the fleet, rolled back (force) to 6, then updated to 7. Retention
    # deleted the rollback's acknowledgements; the live fleet's heartbeats name 7. The
    # rollback no longer counted as applied, so 7 lay below the start version and the
    # restarted worker served 10 (seed 3069 of the control flag set, 3 workers).
    rollback = update(root, 6, command_id="r6", force=True)
    u7 = update(root, 7)
    status: list[StatusMessage] = [heartbeat("w1", weights_command_id="u7", control_offset=2)]

    async def run() -> Started:
        return await start(root, [encode(rollback), encode(u7)], status, version=10)

    got = asyncio.run(run())
    assert got.loads == [(str(root / "v7"), 7)]
    assert got.plane.status().weights_command_id == "u7"


def test_updates_after_a_rollback_below_the_start_version_count_from_its_version():
    def versions(start: int, *commands: UpdateWeights) -> list[int]:
        log = ControlLog(end=len(commands))
        for offset, command in enumerate(commands):
            log.take(offset, command, addressed=True)
        state = FleetState(applied={c.command_id for c in commands})
        state.answer("w1", len(commands))
        return [u.version for u in plan_catch_up(log, state, start).checkpoints]

    def up(version: int, **kwargs: Any) -> UpdateWeights:
        cid = f"{'r' if kwargs.get('force') else 'u'}{version}"
        return UpdateWeights(command_id=cid, version=version, path=f"/c/{version}", **kwargs)

    assert versions(5, up(7), up(3, force=True), up(4)) == [4, 3, 7]
    # A rollback with nothing of this run before it is an earlier run's: not counted, nor
    # what follows it below the start version.
    assert versions(10, up(5), up(9, force=True), up(4)) == []


# ---- needs_weights ---------------------------------------------------------------------------


def test_needs_weights_survives_the_transfers_acknowledgements_leaving_the_status_tail(root):
    # The fleet's newest update was a transfer. A worker restarted after it reports
    # needs_weights. Once the transfer's acknowledgements have left the status tail a later
    # worker reads, only heartbeats tell it: they said which checkpoint was served, not that
    # the fleet was on a transfer, so the later worker served that checkpoint with no hold.
    u3, t5 = update(root, 3), transfer(5)
    control = [encode(u3), encode(t5)]
    acks: list[StatusMessage] = [ack(u3, 0), ack(t5, 1)]

    async def run() -> tuple[Started, Started]:
        first = await start(root, control, acks, worker="w1")
        tail_without_acks: list[StatusMessage] = [first.plane.status()]
        later = await start(root, control, tail_without_acks, worker="w2")
        return first, later

    first, later = asyncio.run(run())
    for got in (first, later):
        beat = got.plane.status()
        assert got.engine.weight_version == 3
        assert got.engine.paused  # jobs held until the next update (--stale-weights-at-start)
        assert (beat.needs_weights, beat.weights_command_id) == (True, "u3")
    assert later.plane.status().needs_weights_command_id == "t5"


def test_an_update_that_loads_ends_the_needs_weights_heartbeats(root):
    u3, t5, u6 = update(root, 3), transfer(5), update(root, 6)

    async def run() -> Started:
        got = await start(root, [encode(u3), encode(t5)], [ack(u3, 0), ack(t5, 1)])
        value = encode(u6)
        await got.plane._take(ConsumerRecord(CONTROL, 0, 2, 0, 0, None, value, None, 0, 0, ()))
        return got

    got = asyncio.run(run())
    beat = got.plane.status()
    assert (beat.needs_weights, beat.needs_weights_command_id) == (False, None)
    assert (got.engine.weight_version, got.engine.paused) == (6, False)


# ---- hostile status records ------------------------------------------------------------------


@STREAMS
@given(st.data())
def test_hostile_status_records_never_hide_the_fleets_answers_from_the_catch_up(data):
    # The status topic is not signed: junk, forged and oversized records are skipped or
    # counted, and never raise or take a real answer away.
    live = [f"w{i}" for i in range(data.draw(st.integers(1, 3)))]
    records: list[bytes | None] = []
    for n, worker in enumerate(live):
        records += data.draw(st.lists(HOSTILE_STATUS, max_size=4))
        records.append(encode(ack(Pause(command_id=f"p{n}"), n, worker=worker)))
        records.append(
            encode(heartbeat(worker, control_offset=n + 1, needs_weights_command_id=f"t{n}"))
        )
    records += data.draw(st.lists(HOSTILE_STATUS, max_size=4))

    async def run() -> FleetState:
        partition = OnePartition(STATUS, fetch_max=5)
        for value in records:
            partition.add(value)
        settings = settings_from({"status_topic": STATUS, "group_id": GROUP}, {})
        return await read_fleet_state(partition, settings)

    state = asyncio.run(run())
    for n, worker in enumerate(live):
        assert {f"p{n}", f"t{n}"} <= state.applied
        assert state.answered_by[worker] >= n + 1
