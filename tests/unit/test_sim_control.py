"""The simulation's control plane: the trainer's commands and faults
(`worker.dev.sim.control`), status-topic retention, transfers in the mock engine, and the
invariants judged on a run (`worker.dev.sim.control_checks`)."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from schemas import (
    Command,
    CommandAck,
    Job,
    Pause,
    SamplingSpec,
    StatusMessage,
    Target,
    UpdateWeights,
    WorkerStatus,
    encode,
)
from worker.core.clock import SYSTEM_CLOCK
from worker.core.errors import WeightUpdateError
from worker.dev.sim.checker import Violation
from worker.dev.sim.clients import Process, SimConsumer
from worker.dev.sim.clock import EPOCH_S, VirtualClock, VirtualLoop, virtual_time
from worker.dev.sim.cluster import Cluster
from worker.dev.sim.control import START_VERSION
from worker.dev.sim.control_checks import ControlBounds, check_control
from worker.dev.sim.fleet import Fleet, SimEngine
from worker.dev.sim.history import Event, History
from worker.dev.sim.run import flag_set_scenario, run, settings_for
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.steerable import SteerableEngine

CONTROL = "c"
STATUS = "s"
GROUP = "sim"
BOUNDS = ControlBounds(CONTROL, STATUS, GROUP, end=200.0)


def _cluster() -> tuple[Cluster, History]:
    now = [0.0]
    history = History(lambda: now[0])
    cluster = Cluster(history)
    cluster.create_topic(CONTROL, 1)
    cluster.create_topic(STATUS, 1)
    return cluster, history


def _append(cluster: Cluster, topic: str, value: bytes, at: float) -> None:
    cluster.produce(
        "trainer",
        TopicPartition(topic, 0),
        [(None, value, [])],
        producer_id=None,
        now_ms=int(at * 1000),
    )


def _ack(command: Command, worker: str, at: float, offset: int, ok: bool = True) -> CommandAck:
    return CommandAck(
        worker=worker,
        group=GROUP,
        command_id=command.command_id,
        kind="update_weights",
        outcome="ok" if ok else "failed",
        duration_s=0.0,
        weight_version=0,
        at=EPOCH_S + at,
        offset=offset,
    )


def _beat(worker: str, at: float, **state: Any) -> WorkerStatus:
    return WorkerStatus(
        worker=worker,
        group=GROUP,
        model="m",
        weight_version=state.pop("weight_version", 0),
        paused=False,
        in_flight=0,
        lag=0,
        engine_healthy=True,
        uptime_s=1.0,
        at=EPOCH_S + at,
        interval_s=5.0,
        **state,
    )


def _status(cluster: Cluster, *messages: StatusMessage) -> None:
    for message in messages:
        _append(cluster, STATUS, encode(message), message.at - EPOCH_S)


def _update(version: int, command_id: str, **kwargs: Any) -> UpdateWeights:
    return UpdateWeights(command_id=command_id, version=version, path=f"/w/v{version}", **kwargs)


def _invariants(violations: list[Violation]) -> set[str]:
    return {v.invariant for v in violations}


# ---- the cluster and the engine ----------------------------------------------------------------


def test_retention_deletes_the_oldest_records_for_readers_but_keeps_them_for_the_checker() -> None:
    clock = VirtualClock()
    loop = VirtualLoop(clock)

    async def body() -> tuple[int, list[int]]:
        cluster, _ = _cluster()
        for at in (1.0, 2.0, 3.0, 4.0):
            _append(cluster, STATUS, f"{at}".encode(), at)
        cluster.retain(STATUS, older_than_ms=2_500)
        cluster.retain(STATUS, older_than_ms=1_000)  # a log start never moves back
        reader = SimConsumer(Process("r", cluster, random.Random(1)), client_id="r", group_id=None)
        tp = TopicPartition(STATUS, 0)
        reader.assign([tp])
        begin = (await reader.beginning_offsets([tp]))[tp]
        reader.seek(tp, 0)  # below the log start: read from it on, as auto.offset.reset does
        batch = await reader.getmany(tp, timeout_ms=100)
        assert len(cluster.topics[STATUS].logs[0]) == 4
        assert await reader.position(tp) == 4
        return begin, [r.offset for r in batch[tp]]

    try:
        with virtual_time(clock):
            begin, read = loop.run_until_complete(body())
    finally:
        loop.close()
    assert (begin, read) == (2, [2, 3])


def test_the_mock_engine_takes_a_transfer_only_while_its_rendezvous_is_open() -> None:
    clock = VirtualClock()
    loop = VirtualLoop(clock)
    cluster, _ = _cluster()
    settings = settings_for(flag_set_scenario("control", 1, 1))
    fleet = Fleet(cluster, random.Random(1), clock, settings, MockEngineSettings())
    engine = SimEngine(MockEngineSettings(weight_version=START_VERSION), fleet, "w0")
    fleet.transfers["r"] = 5.0

    async def body() -> None:
        await engine.transfer_weights("nccl", None, {"rendezvous": "r"}, 11)
        assert engine.weight_version == 11
        await asyncio.sleep(5.0)
        with pytest.raises(WeightUpdateError, match="not open"):
            await engine.transfer_weights("nccl", None, {"rendezvous": "r"}, 12)
        with pytest.raises(WeightUpdateError, match="not open"):
            await engine.transfer_weights("ipc", None, {"rendezvous": "unknown"}, 12)

    try:
        with virtual_time(clock):
            loop.run_until_complete(body())
    finally:
        loop.close()
    assert engine.weight_version == 11


def test_a_job_continued_across_a_forced_rollback_names_the_weights_it_finished_on(
    tmp_path: Path,
) -> None:
    """A `keep` rollback continues a running job on the older weights: the result named the
    higher version it began on, though its last tokens came from the rollback (wrong_weights
    in the control flag set's runs)."""
    (tmp_path / "config.json").write_text(json.dumps({"name": "v3"}))
    settings = MockEngineSettings(per_token_latency_ms=10.0, weight_version=5)
    engine = SteerableEngine(MockEngine(settings), clock=SYSTEM_CLOCK)
    job = Job(job_id="j", prompt_token_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=40))

    async def body() -> tuple[int, list[int]]:
        running = asyncio.create_task(engine.generate(job, "r"))
        await asyncio.sleep(0.1)
        await engine.load_checkpoint(str(tmp_path), 3, "keep")
        output = await running
        spans = output.completions[0].weight_versions
        assert isinstance(spans, list)
        return output.weight_version, [span.version for span in spans]

    version, spans = asyncio.run(body())
    assert spans == [5, 3]
    assert version == 3


# ---- the trainer's program -------------------------------------------------------------------


def test_the_control_flag_set_sends_every_command_and_fault_it_names() -> None:
    """Over a few seeds, every kind of step happens: a schedule that stopped drawing one would
    leave its invariant unjudged."""
    seen: Counter[str] = Counter()
    for seed in (1, 2, 3, 4):
        outcome = run(flag_set_scenario("control", seed, 3))
        assert outcome.violations == [], "\n".join(map(str, outcome.violations[:5]))
        history = outcome.history
        for event in history.of("control_sent"):
            f = event.fields
            seen[f["command"]] += 1
            seen["targeted" if f["workers"] else "group" if f["group"] else "fleet"] += 1
            if f["version"] is not None and f["version"] < START_VERSION:
                seen["below_start"] += 1
        seen["replayed"] += sum(1 for _ in history.of("control_replayed"))
        seen["retained"] += sum(1 for _ in history.of("retained"))
        seen["transferred"] += sum(1 for _ in history.of("transferred"))
        seen["fleet_down"] += sum(
            1 for e in history.of("kill") if e.fields["why"] == "the whole fleet is down"
        )
        seen["target_down"] += sum(
            1 for e in history.of("kill") if e.fields["why"].startswith("down while")
        )
        seen["judged"] += sum(1 for _ in history.of("control_state"))
    kinds = ("Pause", "Resume", "UpdateWeights", "targeted", "group", "fleet", "below_start")
    faults = ("replayed", "retained", "transferred", "fleet_down", "target_down", "judged")
    assert all(seen[k] > 0 for k in kinds + faults), seen


def test_a_control_run_replays_exactly() -> None:
    first = run(flag_set_scenario("control", 5, 3))
    second = run(flag_set_scenario("control", 5, 3))
    assert first.digest == second.digest


# ---- the invariants, on hand-made topics -----------------------------------------------------


def _started(history: History, *starts: tuple[str, float]) -> None:
    for name, at in starts:
        history.events.append(Event(at, "start", {"worker": name}))


def test_an_acknowledgement_of_a_replayed_record_is_flagged() -> None:
    cluster, history = _cluster()
    u11 = _update(11, "u11")
    _append(cluster, CONTROL, encode(u11), 1.0)
    _append(cluster, CONTROL, encode(u11), 2.0)  # a copy, byte for byte
    _status(cluster, _ack(u11, "w0", 1.1, 0))
    history.add("start", worker="w0#1")
    assert check_control(history, cluster, BOUNDS) == []
    _status(cluster, _ack(u11, "w0", 2.1, 1, ok=False))
    assert _invariants(check_control(history, cluster, BOUNDS)) == {"replay_obeyed"}


def test_a_command_for_another_group_acknowledged_here_is_flagged() -> None:
    cluster, history = _cluster()
    pause = Pause(command_id="p", target=Target(group="elsewhere"))
    _append(cluster, CONTROL, encode(pause), 1.0)
    history.add("start", worker="w0#1")
    _status(cluster, _ack(pause, "w0", 1.1, 0))
    assert _invariants(check_control(history, cluster, BOUNDS)) == {"not_addressed_obeyed"}


@pytest.mark.parametrize(
    ("serving", "flagged"),
    [("u12", False), ("u11", True)],
)
def test_a_worker_that_does_not_serve_the_trainers_last_update_at_the_end_is_flagged(
    serving: str, flagged: bool
) -> None:
    cluster, history = _cluster()
    u11, u12 = _update(11, "u11"), _update(12, "u12", force=True)
    _append(cluster, CONTROL, encode(u11), 1.0)
    _append(cluster, CONTROL, encode(u12), 2.0)
    _status(cluster, _ack(u11, "w0", 1.1, 0), _ack(u12, "w0", 2.1, 1))
    history.add("start", worker="w0#1")
    history.add(
        "control_state",
        worker="w0#1",
        weight_version=12 if serving == "u12" else 11,
        weights_command_id=serving,
        paused=False,
        needs_weights=False,
    )
    assert ("not_converged" in _invariants(check_control(history, cluster, BOUNDS))) == flagged


def test_a_worker_started_after_a_transfer_that_serves_older_weights_silently_is_flagged() -> None:
    cluster, history = _cluster()
    u11 = _update(11, "u11")
    t12 = UpdateWeights(command_id="t12", version=12, backend="nccl", update_info={})
    _append(cluster, CONTROL, encode(u11), 1.0)
    _append(cluster, CONTROL, encode(t12), 2.0)
    _status(cluster, _ack(u11, "w0", 1.1, 0), _ack(t12, "w0", 2.1, 1))
    history.add("start", worker="w0#1")
    history.add("start", worker="w1#1")
    # w1 restarted after the transfer: its catch-up serves u11 and must say it lacks t12.
    _started(history, ("w1#2", 5.0))
    _status(cluster, _beat("w1", 5.5, weights_command_id="u11", weight_version=11))
    found = _invariants(check_control(history, cluster, BOUNDS))
    assert found == {"stale_start", "needs_weights_unsaid"}


def test_a_worker_started_after_a_transfer_that_says_it_lacks_it_passes() -> None:
    cluster, history = _cluster()
    t12 = UpdateWeights(command_id="t12", version=12, backend="nccl", update_info={})
    _append(cluster, CONTROL, encode(t12), 2.0)
    _status(cluster, _ack(t12, "w0", 2.1, 0))
    history.add("start", worker="w0#1")
    _started(history, ("w1#2", 5.0))
    beat = _beat("w1", 5.5, needs_weights=True, needs_weights_command_id="t12")
    _status(cluster, beat, _beat("w1", 10.5, needs_weights=True, needs_weights_command_id="t12"))
    assert check_control(history, cluster, BOUNDS) == []
