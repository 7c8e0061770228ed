"""Fuzzing the readers of the control and status topics (hypothesis, a bounded budget each).

- The command and status decoders raise nothing but `SchemaError`, whatever the bytes; the
  signature check and the matching of a decoded command raise nothing at all.
- A stream of hostile control records mixed with good commands leaves the control plane
  applying and acknowledging every good one (with and without a signing key), and the plane
  itself running.
- Hostile status records never break the Fleet's reader: every real worker is found live,
  every real acknowledgement is collected, and no forged heartbeat far from now counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import pytest
from aiokafka import ConsumerRecord, TopicPartition
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from schemas import (
    Abort,
    Command,
    CommandAck,
    ControlRecordError,
    Pause,
    ResetPrefixCache,
    Resume,
    SchemaError,
    Target,
    UpdateWeights,
    WorkerStatus,
    decode_command,
    decode_status,
    encode,
    sign_command,
    signature_problem,
)
from tests.fakes import ManualClock
from tests.hypothesis_profiles import examples
from worker.client import fleet as fleet_module
from worker.control.plane import ControlPlane
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import settings_from
from worker.core.errors import FatalError
from worker.core.metrics import Metrics
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.steerable import SteerableEngine

# Each test stays well under 30 s on a busy 2-core machine.
FUZZ = settings(
    max_examples=examples(0.6),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Generated, not shrunk: an example of these runs a control plane for up to FEED_TIMEOUT_S, and
# shrinking one that fails that way ran for many minutes. The failure prints the records fed.
STREAMS = settings(
    max_examples=examples(0.25),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEED_TIMEOUT_S = 20.0
KEY = b"fuzz-key-" + b"k" * 32
# The control plane's clock and the good commands' `issued_at`: fixed, so the same examples
# draw the same bytes on every run (the signature covers issued_at).
ISSUED_AT = 1_800_000_000.0
CONTROL, STATUS = "fuzz.control", "fuzz.status"

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
COMMAND_FIELDS = [
    "command_id",
    "target",
    "issued_at",
    "signature",
    "version",
    "path",
    "on_inflight",
    "backend",
    "init_info",
    "update_info",
    "force",
    "mode",
    "job_ids",
    "metadata",
]
STATUS_FIELDS = [
    "worker",
    "group",
    "model",
    "weight_version",
    "paused",
    "in_flight",
    "lag",
    "engine_healthy",
    "uptime_s",
    "at",
    "interval_s",
    "needs_weights",
    "command_id",
    "kind",
    "outcome",
    "detail",
    "duration_s",
    "offset",
    "control_offset",
    "weights_command_id",
    "pause_command_id",
    "needs_weights_command_id",
]


def tagged(tag: str, tags: list[str], fields: list[str]) -> st.SearchStrategy[bytes]:
    """JSON objects shaped like the union's members: a real tag (mostly), fields with names
    the schema knows and values of any JSON type."""
    return st.fixed_dictionaries(
        {tag: st.sampled_from(tags) | st.text(max_size=8)},
        optional={name: JSON for name in fields},
    ).map(lambda d: json.dumps(d).encode())


COMMAND_LIKE = tagged(
    "kind", ["pause", "resume", "update_weights", "abort", "reset_prefix_cache"], COMMAND_FIELDS
)
STATUS_LIKE = tagged("type", ["ack", "status", "control_error"], STATUS_FIELDS)
ANY_BYTES = st.binary(max_size=300) | JSON.map(lambda v: json.dumps(v).encode())


def mutated(data: bytes) -> st.SearchStrategy[bytes]:
    """`data` with a few bytes changed, cut or inserted."""
    return st.lists(
        st.tuples(st.integers(0, max(len(data) - 1, 0)), st.binary(max_size=3)), max_size=4
    ).map(lambda edits: _apply_edits(data, edits))


def _apply_edits(data: bytes, edits: list[tuple[int, bytes]]) -> bytes:
    out = bytearray(data)
    for at, patch in edits:
        out[at : at + 1] = patch
    return bytes(out)


# ---- decoders --------------------------------------------------------------------------------


@FUZZ
@given(st.one_of(ANY_BYTES, COMMAND_LIKE, st.just(b"[" * 50_000)), st.text(max_size=10))
def test_the_command_decoder_raises_only_schema_errors(data, name):
    try:
        command = decode_command(data)
    except SchemaError:
        return
    # What the plane does with a decoded command raises nothing.
    assert signature_problem(data, KEY) in (
        None,
        "unsigned",
        "bad signature",
        "signature is not a string",
    )
    command.target.matches(name, name)
    if isinstance(command, Abort):
        command.matches(name, {name: name})


@FUZZ
@given(st.one_of(ANY_BYTES, STATUS_LIKE, st.just(b"{" * 50_000)))
def test_the_status_decoders_raise_only_schema_errors(data):
    try:
        message = decode_status(data)
    except SchemaError:
        message = None
    assert fleet_module._decode(data) == message  # the Fleet's reader: None, never a raise
    if isinstance(message, WorkerStatus):
        fleet_module._live(message, time.time())


@FUZZ
@given(ANY_BYTES | COMMAND_LIKE, st.binary(min_size=1, max_size=64))
def test_the_signature_check_never_raises(data, key):
    problem = signature_problem(data, key)
    assert problem is None or isinstance(problem, str)


# ---- a control plane fed hostile records -----------------------------------------------------


class OnePartition:
    """Partition 0 of `topic` in memory, as a control plane's or a Fleet's consumer reads it:
    `listed` are the topics the broker names; `fetch_max` records come a fetch, if set."""

    def __init__(
        self, topic: str, *, listed: frozenset[str] = frozenset(), fetch_max: int | None = None
    ) -> None:
        self.topic = topic
        self.listed = listed | {topic}
        self.fetch_max = fetch_max
        self.records: list[ConsumerRecord[bytes, bytes]] = []
        self._position = 0

    def add(self, value: bytes | None) -> None:
        size = 0 if value is None else len(value)
        self.records.append(
            ConsumerRecord(self.topic, 0, len(self.records), 0, 0, None, value, None, 0, size, ())
        )

    async def start(self) -> None:
        return

    async def stop(self) -> None:
        return

    async def topics(self) -> set[str]:
        return set(self.listed)

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0}

    def assign(self, tps: list[TopicPartition]) -> None:
        return

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._position = offset

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, len(self.records))

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, 0)

    async def position(self, tp: TopicPartition) -> int:
        return self._position

    async def getmany(
        self, *tps: TopicPartition, timeout_ms: int = 0
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        batch = self.records[self._position :][: self.fetch_max]
        self._position += len(batch)
        if not batch:
            await asyncio.sleep(0.001)  # a poll that found nothing
        return {TopicPartition(self.topic, 0): batch}


class StatusTopic:
    """The status producer in memory: what the plane sent, decoded."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def start(self) -> None:
        return

    async def stop(self) -> None:
        return

    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> None:
        self.sent.append(decode_status(value))

    def acks(self) -> dict[str, CommandAck]:
        return {m.command_id: m for m in self.sent if isinstance(m, CommandAck)}


class IdleWorker:
    jobs_in_flight = 0

    def lag(self) -> int | None:
        return None

    async def answers_acknowledged(self, timeout_s: float) -> bool:
        return True

    def fail(self, exc: FatalError, where: str) -> None:
        raise AssertionError(f"the worker was stopped by {where}: {exc}")


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-weights")
    (root / "good").mkdir()
    (root / "good" / "config.json").write_text(json.dumps({"name": "good"}))
    return root


def good_commands(count: int, root: Path) -> list[Command]:
    """Commands that must each be acknowledged `ok`: every kind, versions moving forward."""
    kinds: list[Command] = []
    now = ISSUED_AT  # a signed command must say when it was issued
    for i in range(count):
        match i % 5:
            case 0:
                kinds.append(Abort(command_id=f"good-{i}", job_ids=["none"], issued_at=now))
            case 1:
                kinds.append(ResetPrefixCache(command_id=f"good-{i}", issued_at=now))
            case 2:
                kinds.append(Pause(command_id=f"good-{i}", mode="wait", issued_at=now))
            case 3:
                kinds.append(Resume(command_id=f"good-{i}", issued_at=now))
            case _:
                kinds.append(
                    UpdateWeights(
                        command_id=f"good-{i}", version=i, path=str(root / "good"), issued_at=now
                    )
                )
    return kinds


def hostile_commands(root: Path) -> st.SearchStrategy[Command]:
    """Well-formed commands that must be refused or do no harm: paths anywhere, transfers,
    targets, modes, ids that are never a good command's."""
    ids = st.text(min_size=1, max_size=20).filter(lambda s: not s.startswith("good"))
    paths = st.one_of(
        st.text(max_size=30),
        st.sampled_from(["/", "/dev/zero", "/proc/self/root", "/etc", f"{root}/..", f"{root}/x"]),
        st.text(max_size=10).map(lambda s: f"{root}/good/../../{s}"),
        # A NUL stopped the whole control plane (ValueError from the filesystem).
        st.text(max_size=10).map(lambda s: f"{root}/good\x00{s}"),
    ).filter(bool)
    return st.one_of(
        st.builds(
            UpdateWeights,
            command_id=ids,
            version=st.integers(0, 2**40),
            path=paths,
            on_inflight=st.sampled_from(["keep", "wait", "restart", "abort"]),
            force=st.booleans(),
        ),
        st.builds(
            UpdateWeights,
            command_id=ids,
            version=st.integers(0, 2**40),
            backend=st.sampled_from(["nccl", "ipc"]),
            init_info=st.dictionaries(st.text(max_size=5), JSON, max_size=3),
            update_info=st.dictionaries(st.text(max_size=5), JSON, max_size=3),
        ),
        st.builds(Pause, command_id=ids, mode=st.sampled_from(["abort", "wait", "keep"])),
        st.builds(
            Abort,
            command_id=ids,
            metadata=st.dictionaries(st.text(max_size=5), st.text(max_size=5)),
        ),
        st.builds(
            ResetPrefixCache,
            command_id=ids,
            target=st.builds(Target, group=st.none() | st.text(max_size=5)),
        ),
    )


async def caught_up_plane(
    values: dict[str, Any],
    records: list[bytes],
    *,
    before: tuple[bytes, ...] | list[bytes] = (),
    metrics: Metrics | None = None,
) -> tuple[ControlPlane, StatusTopic, SteerableEngine]:
    """A control plane with settings `values`, on in-memory control and status topics, caught
    up on `before`, with `records` waiting on its control topic."""
    control, status = OnePartition(CONTROL, listed=frozenset({STATUS})), StatusTopic()
    for value in before:
        control.add(value)
    engine = SteerableEngine(
        MockEngine(MockEngineSettings(num_layers=2, top_k=1, num_experts=4)), clock=SYSTEM_CLOCK
    )
    plane = ControlPlane(
        settings_from(
            {"control_topic": CONTROL, "status_topic": STATUS, "worker_id": "fuzz", **values}, {}
        ),
        engine,
        metrics or Metrics(),
        IdleWorker(),
        consumer=control,
        producer=status,
        status_consumer=OnePartition(STATUS),
        clock=ManualClock(wall=ISSUED_AT),
    )
    await plane.start()
    await plane.catch_up()
    for value in records:
        control.add(value)
    return plane, status, engine


async def feed(records: list[bytes], good: list[Command], key: bytes | None, root: Path) -> None:
    values: dict[str, Any] = {"weights_root": [str(root)], "status_interval_s": 3600}
    if key is not None:
        values["control_hmac_key"] = key.decode()
    plane, status, engine = await caught_up_plane(values, records)
    running = asyncio.create_task(plane.run())
    wanted = {c.command_id for c in good}

    def not_applied() -> set[str]:
        acks = status.acks()
        return {i for i in wanted if i not in acks or acks[i].outcome != "ok"}

    try:
        deadline = time.monotonic() + FEED_TIMEOUT_S
        while not_applied() and not running.done():
            assert time.monotonic() < deadline, f"not applied: {not_applied()}, {status.acks()}"
            await asyncio.sleep(0.005)
        assert not running.done(), running.exception()
    finally:
        running.cancel()
        stopped, _ = await asyncio.wait([running], timeout=FEED_TIMEOUT_S)
        assert stopped, f"the control plane did not stop when told to; records {records}"
    acks = status.acks()
    for command in good:
        ack = acks[command.command_id]
        assert ack.outcome == "ok", (ack, records)
    if key is not None:
        # Under a key, what is not signed is nobody's command: dropped before anything is
        # sent about it (the hostile copies before the real command included), so the only
        # records sent are the good commands' acknowledgements.
        sent = [m for m in status.sent if not isinstance(m, WorkerStatus)]
        assert all(isinstance(m, CommandAck) and m.outcome == "ok" for m in sent), sent
        assert sorted(m.command_id for m in sent) == sorted(c.command_id for c in good), sent
    versions = [c.version for c in good if isinstance(c, UpdateWeights)]
    assert engine.weight_version == max(versions, default=0)


def test_a_stop_lands_whenever_it_comes_while_records_are_reported(weights):
    # A stop that came just as a status record had been sent was swallowed by
    # `asyncio.wait_for` (Python 3.11 returns the finished send instead of the cancellation):
    # the control plane never stopped and took the worker's exit with it. Found by the fuzz
    # tests below, one hang in a few hundred examples; here a stop comes at every turn of the
    # loop in turn while the plane reports unreadable records.
    async def stop_after(turns: int) -> None:
        plane, _, _ = await caught_up_plane({}, [b"not a command"] * 50)
        running = asyncio.create_task(plane.run())
        for _ in range(turns):
            await asyncio.sleep(0)
        running.cancel()
        done, _ = await asyncio.wait([running], timeout=5)
        assert done, f"the control plane did not stop when told to after {turns} turns"
        assert running.cancelled()

    for turns in range(40):
        asyncio.run(stop_after(turns))


@STREAMS
@given(st.data())
def test_hostile_control_records_leave_every_good_command_applied(weights, data):
    good = good_commands(data.draw(st.integers(1, 10)), weights)
    # Unsigned, a command's id is all that tells it from another: hostile ids are never good
    # ones here (under a key, the next test, they may be).
    hostile = st.one_of(ANY_BYTES, COMMAND_LIKE, hostile_commands(weights).map(encode)).filter(
        lambda b: b'"good' not in b
    )
    records: list[bytes] = []
    for command in good:
        records += data.draw(st.lists(hostile, max_size=3))
        records.append(encode(command))
    asyncio.run(feed(records, good, None, weights))


@STREAMS
@given(st.data())
def test_under_a_key_forged_and_tampered_records_change_nothing(weights, data):
    good = good_commands(data.draw(st.integers(1, 10)), weights)
    records: list[bytes] = []
    for command in good:
        signed = encode(sign_command(command, KEY))
        forgeries = st.one_of(
            ANY_BYTES,
            COMMAND_LIKE,
            hostile_commands(weights).map(encode),
            # The good command itself, unsigned or under another key, before the real one:
            # neither is applied, nor takes its id.
            st.just(encode(command)),
            st.just(encode(sign_command(command, b"x" * 40))),
            mutated(signed).filter(signed.__ne__),
        )
        records += data.draw(st.lists(forgeries, max_size=3))
        records.append(signed)
    asyncio.run(feed(records, good, KEY, weights))


@pytest.mark.parametrize("signed", [False, True])
def test_junk_on_the_control_topic_costs_at_most_one_status_record(weights, signed):
    # 3,000 junk records cost 3,000 sequential sends at start (6.7 s before the first job on
    # the local broker) and one status record each per worker, which pushed heartbeats out of
    # the readers' window. Under a key nothing is sent about them; without one, one report.
    async def run() -> None:
        values: dict[str, Any] = {"weights_root": [str(weights)], "status_interval_s": 3600}
        if signed:
            values["control_hmac_key"] = KEY.decode()
        junk = [b"junk %d" % i for i in range(3000)]
        if signed:  # readable but unsigned: under a key, no command either
            junk += [encode(Abort(command_id=f"x{i}", job_ids=["j"])) for i in range(500)]
        metrics = Metrics()
        _, status, _ = await caught_up_plane(values, [], before=junk, metrics=metrics)
        sent = [m for m in status.sent if not isinstance(m, WorkerStatus)]
        if signed:
            assert sent == []
        else:
            (report,) = sent
            assert isinstance(report, ControlRecordError)
            assert (report.count, report.offset) == (3000, 2999)
        dropped = {
            reason: metrics.registry.get_sample_value(
                "vkw_control_records_dropped_total", {"reason": reason}
            )
            for reason in ("unreadable", "unsigned")
        }
        assert dropped == {"unreadable": 3000, "unsigned": 500 if signed else None}

    asyncio.run(run())


def test_heartbeats_claim_a_command_answered_only_once_it_is_applied(weights):
    # A worker starting while an update is being applied must apply it itself: the
    # heartbeats it reads the fleet's state from may not count it as answered before then.
    async def run() -> None:
        update = UpdateWeights(command_id="slow", version=3, path=str(weights / "good"))
        plane, status, _ = await caught_up_plane({"weights_root": [str(weights)]}, [])
        assert plane.status().control_offset == 0
        loading, release = asyncio.Event(), asyncio.Event()
        real_run = plane._runner.run

        async def slow_run(command: Command, **kwargs: Any) -> str:
            loading.set()
            await release.wait()
            return await real_run(command, **kwargs)

        with mock.patch.object(plane._runner, "run", slow_run):
            following = asyncio.create_task(plane.run())
            plane._consumer.add(encode(update))
            await asyncio.wait_for(loading.wait(), 5)
            assert plane.status().control_offset == 0
            release.set()
            while "slow" not in status.acks():  # noqa: ASYNC110 - the fake has no event
                await asyncio.sleep(0.001)
            await asyncio.sleep(0)
            beat = plane.status()
            assert (beat.control_offset, beat.weights_command_id) == (1, "slow")
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)

    asyncio.run(run())


# ---- the Fleet reading hostile status records ------------------------------------------------


class NoProducer:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return

    async def start(self) -> None:
        return

    async def stop(self) -> None:
        return


def heartbeat(worker: str, at: float, interval_s: float = 5.0) -> bytes:
    return encode(
        WorkerStatus(
            worker=worker,
            group="g",
            model="m",
            weight_version=1,
            paused=False,
            in_flight=0,
            lag=None,
            engine_healthy=True,
            uptime_s=1.0,
            at=at,
            interval_s=interval_s,
        )
    )


def ack(worker: str, command_id: str) -> bytes:
    return encode(
        CommandAck(
            worker=worker,
            group="g",
            command_id=command_id,
            kind="abort",
            outcome="ok",
            duration_s=0.0,
            weight_version=1,
            at=time.time(),
        )
    )


HOSTILE_STATUS = st.one_of(
    ANY_BYTES,
    STATUS_LIKE,
    st.none(),
    st.just(b" " * (fleet_module.MAX_STATUS_RECORD_BYTES + 1)),
    # Phantoms: dated far ahead or long ago, or claiming a huge interval.
    st.floats(1e5, 1e12).map(lambda ahead: heartbeat("phantom", time.time() + ahead)),
    st.floats(1e5, 1e12).map(lambda ago: heartbeat("phantom", time.time() - ago)),
    st.just(heartbeat("phantom", time.time(), 1e6)),
)


async def read_fleet(records: list[bytes | None], live: list[str]) -> None:
    # A few records a fetch, as fetches come.
    partition = OnePartition(STATUS, fetch_max=7)
    for value in records:
        partition.add(value)
    clients = mock.Mock(consumer=lambda *a, **k: partition, producer=lambda **k: NoProducer())
    async with fleet_module.Fleet(
        {}, control_topic=CONTROL, status_topic=STATUS, kafka_clients=clients
    ) as fleet:
        found = await fleet.live_workers()
        assert set(found) == set(live)
        acks = await fleet.acks("cmd", live, {TopicPartition(STATUS, 0): 0}, timeout_s=10)
        assert set(acks) == set(live)


@STREAMS
@given(st.data())
def test_hostile_status_records_never_break_the_fleets_reader(data):
    live = [f"w{i}" for i in range(data.draw(st.integers(0, 4)))]
    records: list[bytes | None] = []
    for worker in live:
        records += data.draw(st.lists(HOSTILE_STATUS, max_size=4))
        records += [heartbeat(worker, time.time()), ack(worker, "cmd")]
    records += data.draw(st.lists(HOSTILE_STATUS, max_size=4))
    asyncio.run(read_fleet(records, live))


def test_a_forged_heartbeat_dated_far_ahead_keeps_no_phantom_live():
    # Without the check, one record dated a year ahead kept "phantom" live for that year, and
    # every update waited for its acknowledgement until it timed out.
    records: list[bytes | None] = [heartbeat("phantom", time.time() + 365 * 86400)]
    asyncio.run(read_fleet(records, []))


def test_an_oversized_status_record_is_skipped_unread():
    big = msgspec.json.decode(heartbeat("w-big", time.time()))
    big["model"] = "m" * fleet_module.MAX_STATUS_RECORD_BYTES
    asyncio.run(read_fleet([json.dumps(big).encode()], []))
