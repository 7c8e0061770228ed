"""The consume loop against an in-memory consumer and producer: flow control, commits, rebalance."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError

from schemas import Failed, Job, SamplingSpec, decode_result, encode
from tests.fakes import FakeConsumer, MemoryProducer, ScriptedEngine
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import Settings, settings_from
from worker.core.errors import EngineLostToUpdateError
from worker.core.limits import RecordLimits
from worker.core.metrics import Metrics
from worker.delivery.commits import CommittedReader, Committer
from worker.delivery.offset_map import decode_offset_map, encode_offset_map
from worker.dev.harness.waiting import wait_for
from worker.loop.worker import Worker

JOBS, RESULTS, DLQ = "jobs", "results", "dlq"
P0, P1 = TopicPartition(JOBS, 0), TopicPartition(JOBS, 1)


@dataclass
class Loop:
    worker: Worker
    consumer: FakeConsumer
    producer: MemoryProducer
    engine: ScriptedEngine
    task: asyncio.Task[int]

    def answered(self) -> list[str]:
        return [
            decode_result(value).job_id or ""
            for topic, _, value, _ in self.producer.sent
            if topic == RESULTS and value is not None
        ]


def settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "jobs_topic": JOBS,
        "results_topic": RESULTS,
        "dead_letter_topic": DLQ,
        "engine": "mock",
        "commit_interval_ms": 0,
        "poll_timeout_ms": 20,
        "shutdown_grace_s": 2,
    }
    values.update(overrides)
    return settings_from(values, {})


@pytest.fixture
async def start_loop() -> AsyncIterator[Callable[..., Any]]:
    loops: list[Loop] = []

    async def start(
        consumer: FakeConsumer,
        engine: ScriptedEngine,
        read_committed: CommittedReader | None = None,
        **overrides: Any,
    ) -> Loop:
        s = settings(**overrides)
        producer = MemoryProducer({RESULTS: 1, DLQ: 1})
        worker = Worker(
            s,
            consumer=consumer,
            producer=producer,
            engine=engine,
            limits=RecordLimits.from_topic_limits(s, {}),
            read_committed=read_committed,
            clock=SYSTEM_CLOCK,
        )
        loop = Loop(worker, consumer, producer, engine, asyncio.create_task(worker.run()))
        loops.append(loop)
        return loop

    yield start
    for loop in loops:
        loop.worker.request_stop()
        if loop.consumer.commit_gate is not None:
            loop.consumer.commit_gate.set()
        await asyncio.wait_for(loop.task, 10)


def consumer_with_jobs(count: int, **metadata: str) -> FakeConsumer:
    """A consumer assigned P0, which holds jobs j0, j1, ... with this metadata."""
    consumer = FakeConsumer()
    for i in range(count):
        consumer.add(P0, job(f"j{i}", **metadata))
    consumer.assign({P0})
    return consumer


async def turns_pass(consumer: FakeConsumer, turns: int = 5) -> None:
    """Until the loop has turned `turns` more times: polled, or paused everything at the cap."""
    target = consumer.getmany_calls + consumer.pause_calls + turns
    await wait_for(
        lambda: consumer.getmany_calls + consumer.pause_calls >= target,
        what=f"{turns} turns of the loop",
    )


async def polls_pass(consumer: FakeConsumer, polls: int = 5) -> None:
    """Until the loop has fetched `polls` more times."""
    target = consumer.getmany_calls + polls
    await wait_for(lambda: consumer.getmany_calls >= target, what=f"{polls} more polls")


def job(job_id: str, **metadata: str) -> bytes:
    return encode(
        Job(job_id=job_id, prompt="hi", sampling=SamplingSpec(max_tokens=2), metadata=metadata)
    )


async def test_partitions_assigned_at_the_cap_stay_paused_and_lose_no_record(start_loop):
    consumer = FakeConsumer()
    consumer.add(P0, job("a", gate="g"))
    consumer.add(P0, job("b", gate="g"))
    for i in range(3):
        consumer.add(P1, job(f"p1-{i}"))
    consumer.assign({P0})
    engine = ScriptedEngine()
    loop = await start_loop(consumer, engine, max_in_flight=2)
    await wait_for(lambda: len(engine.started) == 2, what="the cap to fill")
    consumer.assign({P0, P1})  # a rebalance while full: aiokafka starts P1 unpaused
    await wait_for(lambda: P1 in consumer.assignment(), what="the new assignment")
    await turns_pass(consumer)  # several turns at the cap
    assert engine.started == ["a", "b"], "a partition assigned at the cap must stay paused"
    assert {P0, P1} <= consumer.paused()
    engine.release("g")
    await wait_for(lambda: len(loop.answered()) == 5, what="every job answered")
    assert sorted(loop.answered()) == ["a", "b", "p1-0", "p1-1", "p1-2"]
    await wait_for(
        lambda: consumer.commits and consumer.commits[-1].get(P1) == 3, what="P1 committed"
    )


async def test_at_the_cap_a_freed_slot_starts_the_next_job_at_once(start_loop):
    # At the cap the loop's wait ends only for the commit interval and the keepalive (here
    # seconds); a job that finishes must wake it, or the engine's batch runs short meanwhile.
    consumer = consumer_with_jobs(3)
    engine = ScriptedEngine()
    started = time.monotonic()
    loop = await start_loop(
        consumer, engine, max_in_flight=1, poll_timeout_ms=5_000, commit_interval_ms=5_000
    )
    await wait_for(lambda: len(loop.answered()) == 3, what="every job answered")
    assert engine.peak_running == 1
    assert time.monotonic() - started < 2.0  # not a wait's end (3 s) per job


async def test_with_a_backlog_in_the_engine_freed_slots_are_refilled_in_lots(start_loop):
    # 12 in flight on an engine that runs 4: 8 wait in its queue, and the loop refills in lots
    # of 4, each named running by one write-ahead commit, instead of a commit per freed slot.
    consumer = FakeConsumer()
    for i in range(20):
        consumer.add(P0, job(f"j{i}", gate=f"g{i}"))
    consumer.assign({P0})
    engine = ScriptedEngine(max_concurrency=4)
    named_at_start: dict[str, frozenset[int]] = {}

    def on_start(started: Job) -> None:
        committed = consumer.commits[-1][P0]
        named = decode_offset_map(committed, consumer.metadata[-1][P0]).running
        named_at_start[started.job_id] = named

    engine.on_start = on_start
    loop = await start_loop(consumer, engine, max_in_flight=12, commit_interval_ms=60_000)
    await wait_for(lambda: len(engine.started) == 12, what="the cap to fill")
    for i in range(3):
        engine.release(f"g{i}")
    await wait_for(lambda: len(loop.answered()) == 3, what="three jobs answered")
    await asyncio.sleep(0.2)  # many loop turns: three free slots are not a lot yet
    assert len(engine.started) == 12
    engine.release("g3")
    await wait_for(lambda: len(engine.started) == 16, what="a lot of four to start")
    lot = [f"j{i}" for i in range(12, 16)]
    assert engine.started[12:] == lot
    assert all(named_at_start[j] >= {12, 13, 14, 15} for j in lot)  # one commit named them all
    for i in range(4, 20):
        engine.release(f"g{i}")
    await wait_for(lambda: len(loop.answered()) == 20, what="every job answered")


async def test_a_slow_commit_does_not_hold_up_fetching(start_loop):
    consumer = FakeConsumer()
    consumer.commit_gate = asyncio.Event()  # the coordinator does not answer
    consumer.add(P0, job("first"))
    consumer.assign({P0})
    loop = await start_loop(consumer, ScriptedEngine(), commit_timeout_s=30)
    await wait_for(lambda: consumer.commits_started >= 1, what="a commit to start")
    consumer.add(P0, job("second"))
    await wait_for(lambda: "second" in loop.answered(), what="a job fetched while committing")
    assert consumer.commits == []  # still blocked
    consumer.commit_gate.set()
    await wait_for(
        lambda: consumer.commits and consumer.commits[-1] == {P0: 2}, what="the commit of both"
    )


async def test_a_job_task_that_dies_of_a_bug_stops_the_worker_uncommitted(start_loop, monkeypatch):
    consumer = FakeConsumer()
    consumer.add(P0, job("doomed"))
    consumer.assign({P0})
    loop = await start_loop(consumer, ScriptedEngine())

    def broken_queue(ticket: Any) -> bool:
        raise RuntimeError("a bug in delivery")

    monkeypatch.setattr(loop.worker._delivery, "queue", broken_queue)
    assert await asyncio.wait_for(loop.task, 10) == 1
    assert all(commit.get(P0, 0) == 0 for commit in consumer.commits)


def committed_as(commit: tuple[int, str]) -> CommittedReader:
    async def read(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        return {tp: commit for tp in tps}

    return read


async def test_records_the_committed_map_names_are_skipped_not_run_again(start_loop):
    consumer = consumer_with_jobs(5)
    engine = ScriptedEngine()
    answered_before = committed_as((0, encode_offset_map(0, {1, 2, 4})))
    loop = await start_loop(consumer, engine, read_committed=answered_before)
    await wait_for(lambda: consumer.commits and consumer.commits[-1] == {P0: 5}, what="commit")
    assert engine.started == ["j0", "j3"]
    assert sorted(loop.answered()) == ["j0", "j3"]
    assert loop.worker.metrics.skipped.values[()] == 3


async def test_metadata_that_is_not_a_map_is_ignored_and_every_record_runs(start_loop, caplog):
    consumer = consumer_with_jobs(3)
    engine = ScriptedEngine()
    loop = await start_loop(consumer, engine, read_committed=committed_as((0, "vkw1:!!corrupt")))
    await wait_for(lambda: len(loop.answered()) == 3, what="all three answered")
    assert engine.started == ["j0", "j1", "j2"]
    assert "ignoring the committed metadata" in caplog.text


async def test_a_map_near_its_cap_holds_the_partition_until_the_gap_closes(start_loop):
    consumer = FakeConsumer()
    consumer.add(P0, job("front", gate="front"))
    for i in range(1, 60):  # every other job waits too: the map fragments into short runs
        consumer.add(P0, job(f"j{i}", gate="odd") if i % 2 else job(f"j{i}"))
    consumer.assign({P0})
    engine = ScriptedEngine(max_concurrency=100)
    loop = await start_loop(consumer, engine, offset_map_max_bytes=40, max_in_flight=16)
    await wait_for(lambda: P0 in loop.worker._committer.held(), what="the partition held")
    await turns_pass(consumer)  # turns go on; no record of the held partition is taken
    started = len(engine.started)
    await turns_pass(consumer)
    assert len(engine.started) == started < 60
    assert all(len(m) <= 40 for commit in consumer.metadata for m in commit.values())
    engine.release("front")
    engine.release("odd")
    await wait_for(lambda: len(loop.answered()) == 60, what="every job answered")
    await wait_for(lambda: consumer.commits[-1] == {P0: 60}, what="the commit of all")
    assert P0 not in loop.worker._committer.held()


async def test_a_broker_refusing_the_map_gets_positions_alone(start_loop, caplog):
    consumer = FakeConsumer()
    consumer.metadata_limit = 4  # any map is too large for this broker
    consumer.add(P0, job("slow", gate="g"))
    consumer.add(P0, job("fast"))
    consumer.assign({P0})
    engine = ScriptedEngine()
    loop = await start_loop(consumer, engine)
    await wait_for(lambda: "fast" in loop.answered(), what="the fast job")
    await wait_for(lambda: bool(consumer.commits), what="a commit")
    assert consumer.metadata[-1] == {P0: ""}
    assert "refuses offset maps" in caplog.text
    engine.release("g")
    await wait_for(lambda: consumer.commits[-1] == {P0: 2}, what="the commit of both")


async def test_once_the_broker_refuses_maps_jobs_start_without_a_write_ahead_commit(start_loop):
    # A commit without a map names nothing running, so waiting for one before jobs start
    # protects nothing: each batch would only wait for the coordinator.
    consumer = FakeConsumer()
    consumer.metadata_limit = 4  # any map is too large for this broker
    consumer.add(P0, job("first"))
    consumer.assign({P0})
    engine = ScriptedEngine()
    commits_at_start: dict[str, int] = {}

    def on_start(started: Job) -> None:
        commits_at_start.setdefault(started.job_id, consumer.commits_started)

    engine.on_start = on_start
    loop = await start_loop(consumer, engine, commit_interval_ms=60_000)
    await wait_for(lambda: "first" in loop.answered(), what="the first job")
    await wait_for(lambda: not loop.worker._committer.maps_on, what="the maps refused")
    assert commits_at_start["first"] >= 1  # written ahead: the broker had not refused maps yet
    consumer.commit_gate = asyncio.Event()  # from now on no commit finishes
    before = consumer.commits_started
    consumer.add(P0, job("second"))
    await wait_for(lambda: "second" in loop.answered(), what="the second job")
    assert commits_at_start["second"] == before
    consumer.commit_gate.set()


async def test_each_commit_carries_the_map_of_what_finished_out_of_order(start_loop):
    consumer = FakeConsumer()
    consumer.add(P0, job("slow", gate="g"))
    for i in range(3):
        consumer.add(P0, job(f"fast{i}"))
    consumer.assign({P0})
    engine = ScriptedEngine()
    loop = await start_loop(consumer, engine)
    await wait_for(lambda: len(loop.answered()) == 3, what="the fast jobs")
    await wait_for(
        lambda: (
            consumer.metadata
            and decode_offset_map(0, consumer.metadata[-1][P0]).answered == {1, 2, 3}
        ),
        what="a map of the three",
    )
    assert consumer.commits[-1] == {P0: 0}
    engine.release("g")
    await wait_for(lambda: consumer.commits[-1] == {P0: 4}, what="the commit past all")


async def test_a_map_over_its_cap_is_left_out_of_the_commit_with_a_warning(start_loop, caplog):
    consumer = FakeConsumer()
    consumer.add(P0, job("front", gate="front"))
    for i in range(1, 60):  # fetched at once: the map overshoots before the hold can act
        consumer.add(P0, job(f"j{i}", gate="odd") if i % 2 else job(f"j{i}"))
    consumer.assign({P0})
    engine = ScriptedEngine(max_concurrency=100)
    loop = await start_loop(consumer, engine, offset_map_max_bytes=40)
    await wait_for(lambda: len(loop.answered()) == 29, what="the even jobs")
    # The write-ahead commit, made while all sixty ran (one run), fits; the first commit after
    # the even answers cannot, and leaves the map out.
    await wait_for(
        lambda: consumer.metadata and consumer.metadata[-1] == {P0: ""},
        what="a commit with the map left out",
    )
    assert "is over --offset-map-max-bytes" in caplog.text
    engine.release("front")
    engine.release("odd")
    await wait_for(lambda: consumer.commits[-1] == {P0: 60}, what="the commit of all")


def _died_with(running: set[int], deaths: dict[int, int], clean: bool = False) -> CommittedReader:
    return committed_as((0, encode_offset_map(0, [], running=running, deaths=deaths, clean=clean)))


async def test_suspects_of_a_second_death_run_alone_and_a_repeat_killer_is_not_run(start_loop):
    consumer = consumer_with_jobs(6, delay_s="0.05")
    engine = ScriptedEngine()
    alone: dict[str, int] = {}
    engine.on_start = lambda j: alone.__setitem__(j.job_id, engine.running)
    # The last owner died with j1 and j3 in flight; j1 had been in flight at 1 death before,
    # j3 at 2.
    loop = await start_loop(
        consumer, engine, read_committed=_died_with({1, 3}, {1: 1, 3: 2}), max_crash_attempts=3
    )
    await wait_for(lambda: len(loop.answered()) == 6, what="every record answered")
    assert "j3" not in engine.started  # in flight at its third death: not run again
    assert alone["j1"] == 1  # the suspect ran alone
    failed = [
        decode_result(v) for t, _, v, _ in loop.producer.sent if t == RESULTS and v is not None
    ]
    (crashed,) = [r for r in failed if r.job_id == "j3"]
    assert isinstance(crashed, Failed) and not crashed.error.retryable
    assert "in flight at 3 worker process deaths" in crashed.error.detail
    copies = [h for t, _, _, h in loop.producer.sent if t == DLQ]
    assert [dict(h)["vkw.source.offset"] for h in copies] == [b"3"]
    await wait_for(lambda: consumer.commits[-1] == {P0: 6}, what="the commit past all")


async def test_after_a_clean_hand_over_nothing_is_suspected(start_loop):
    consumer = consumer_with_jobs(4, delay_s="0.05")
    engine = ScriptedEngine()
    loop = await start_loop(consumer, engine, read_committed=_died_with({1, 2}, {}, clean=True))
    await wait_for(lambda: len(loop.answered()) == 4, what="every record answered")
    assert engine.peak_running == 4  # all at once: nobody was blamed


async def test_jobs_are_named_running_in_a_commit_before_they_start(start_loop):
    consumer = FakeConsumer()
    consumer.add(P0, job("j0", gate="g"))
    consumer.assign({P0})
    engine = ScriptedEngine()
    seen: list[frozenset[int]] = []

    def on_start(_: Job) -> None:
        seen.append(decode_offset_map(0, consumer.metadata[-1][P0]).running)

    engine.on_start = on_start
    await start_loop(consumer, engine)
    await wait_for(lambda: bool(seen), what="the job to start")
    assert seen == [frozenset({0})]
    engine.release("g")


async def test_a_write_ahead_commit_counts_as_the_intervals_commit() -> None:
    # It commits every partition's answers as well as what runs: an interval commit right
    # after it would send the broker the same thing again, once per cluster of starting jobs.
    consumer = FakeConsumer()
    consumer.add(P0, job("j0"))
    consumer.add(P0, job("j1"))
    committer = Committer(consumer, settings(commit_interval_ms=60_000), Metrics())
    await committer.assigned({P0})
    partition = committer.partition(P0)
    partition.start(0)
    await committer.write_ahead()
    assert consumer.commits == [{P0: 0}]
    partition.start(1)
    partition.finish(0)
    committer.tick()
    await asyncio.sleep(0)
    assert consumer.commits == [{P0: 0}]  # the interval runs from the write-ahead commit
    await committer.write_ahead()
    assert consumer.commits == [{P0: 0}, {P0: 1}]


async def test_an_inherited_map_near_its_cap_does_not_stall_the_new_owner(start_loop):
    # The previous owner answered every fourth record from 20 on out of order: its map is 37
    # bytes, past 3/4 of the 40-byte cap. Once this owner has nothing in flight no gap of its
    # own can close, and those offsets leave the map only as they are fetched.
    consumer = consumer_with_jobs(60)
    engine = ScriptedEngine(max_concurrency=100)
    answered_before = set(range(20, 60, 4))
    previous = committed_as((0, encode_offset_map(0, answered_before)))
    await start_loop(
        consumer, engine, read_committed=previous, offset_map_max_bytes=40, max_in_flight=16
    )
    await wait_for(
        lambda: consumer.commits and consumer.commits[-1] == {P0: 60},
        what=lambda: f"the commit of all 60 (commits so far end {consumer.commits[-3:]})",
    )
    assert sorted(engine.started) == sorted(f"j{i}" for i in range(60) if i not in answered_before)


async def test_an_inherited_map_near_its_cap_does_not_hold_the_new_owner_behind_its_own_slow_job(
    start_loop,
):
    # The previous owner was held at 3/4 of the cap behind a slow job, then the partition
    # moved. The new owner's own slow job at the front kept it held too (a map near its cap,
    # something in flight), though nothing it finished out of order was in the map: it answered
    # what was in flight and then waited on the slow job. Only this owner's own out-of-order
    # answers count toward the hold.
    consumer = FakeConsumer()
    consumer.add(P0, job("slow", gate="slow"))
    for i in range(1, 60):
        consumer.add(P0, job(f"j{i}"))
    consumer.assign({P0})
    engine = ScriptedEngine(max_concurrency=100)
    answered_before = set(range(20, 60, 4))
    previous = committed_as((0, encode_offset_map(0, answered_before)))
    loop = await start_loop(
        consumer, engine, read_committed=previous, offset_map_max_bytes=40, max_in_flight=16
    )
    others = {f"j{i}" for i in range(1, 60) if i not in answered_before}
    await wait_for(
        lambda: set(loop.answered()) >= others,
        what=lambda: f"the jobs behind the slow one ({len(loop.answered())} of {len(others)})",
    )
    engine.release("slow")
    await wait_for(lambda: consumer.commits[-1] == {P0: 60}, what="the commit of all 60")


async def test_records_of_a_partition_revoked_while_their_commit_was_awaited_do_not_start(
    start_loop,
):
    # The rebalance callbacks run beside the loop: a revoke (and a new assignment of the same
    # partition, from the committed position) can land while fetched records wait for the
    # commit naming them running. Started then, each would run twice in this one process.
    consumer = consumer_with_jobs(3)
    engine = ScriptedEngine()
    loop = await start_loop(consumer, engine)
    committer = loop.worker._committer
    revoked = asyncio.Event()

    async def write_ahead_during_a_rebalance() -> None:
        await loop.worker.on_partitions_revoked({P0})
        revoked.set()

    committer.write_ahead = write_ahead_during_a_rebalance
    await wait_for(revoked.is_set, 10, "the revoke during the write-ahead")
    await polls_pass(consumer)
    assert engine.peak_running == 0
    assert not loop.producer.sent


async def test_records_fetched_while_their_partition_is_being_revoked_do_not_start(start_loop):
    # The revoke callback runs beside the loop, and the partition stays assigned until it
    # returns: a record fetched meanwhile would run after the hand-over, and again at the next
    # owner.
    consumer = consumer_with_jobs(1)
    engine = ScriptedEngine()
    loop = await start_loop(consumer, engine)
    await wait_for(lambda: "j0" in loop.answered(), what="the first job")
    committer = loop.worker._committer
    hand_over = committer.revoked

    async def hand_over_while_a_record_is_fetched(*args: Any, **kwargs: Any) -> set[Any]:
        consumer.add(P0, job("late"))
        await wait_for(lambda: consumer._positions[P0] == 2, 10, "the late record fetched")
        kept: set[Any] = await hand_over(*args, **kwargs)
        return kept

    committer.revoked = hand_over_while_a_record_is_fetched
    await loop.worker.on_partitions_revoked({P0})
    await polls_pass(consumer)
    assert "late" not in loop.answered()
    assert engine.peak_running <= 1


async def _first_job_committed_second_gated(
    start_loop: Any,
) -> tuple[FakeConsumer, ScriptedEngine, Loop]:
    """A worker with short commit and close timeouts and a 5 s grace, whose first job is
    answered and committed, and whose second waits for the gate "g"."""
    consumer = consumer_with_jobs(1)
    consumer.add(P0, job("second", gate="g"))
    engine = ScriptedEngine()
    loop = await start_loop(
        consumer, engine, commit_timeout_s=0.2, close_timeout_s=0.2, shutdown_grace_s=5
    )
    await wait_for(lambda: "j0" in loop.answered(), what="the first job")
    await wait_for(lambda: consumer.commits and consumer.commits[-1] == {P0: 1}, what="a commit")
    return consumer, engine, loop


async def test_a_worker_a_weight_update_left_without_engine_hands_over_within_the_grace(
    start_loop,
):
    # Found by the fleet simulation (`bench/sim.py --seed 73583 --workers 3
    # --weight-update-every-s 4 --engine-killing-updates 0.3`, and 73476): the update that left
    # no engine came during a coordinator outage; the stop blames no job, but its hand-over
    # had only --close-timeout-s to land (no grace after a fatal error), so the next owner
    # counted a death against every job the worker had in flight.
    consumer, engine, loop = await _first_job_committed_second_gated(start_loop)
    await wait_for(lambda: engine.running == 1, what="the second job to start")
    consumer.commit_gate = asyncio.Event()  # the coordinator is away
    tried = consumer.commits_started
    loop.worker.fail(EngineLostToUpdateError("the engine died loading v3"), "control plane")
    await wait_for(lambda: consumer.commits_started >= tried + 4, what="the hand-over tried again")
    assert not loop.task.done()
    consumer.commit_gate.set()  # back within the grace
    assert await asyncio.wait_for(loop.task, 10) == 1
    handed_over = decode_offset_map(1, consumer.metadata[-1][P0])
    assert handed_over.clean and handed_over.running == {1}


async def test_a_stopping_worker_hands_over_once_the_coordinator_is_back_within_the_grace(
    start_loop,
):
    # Found by the fleet simulation (`bench/sim.py --seed 5 --workers 3`): SIGTERM during a
    # coordinator outage; the hand-over and the final commit each timed out once and the
    # worker exited, so the next owner found its jobs named as running by a writer gone, and
    # counted a death against each.
    consumer, engine, loop = await _first_job_committed_second_gated(start_loop)
    consumer.commit_gate = asyncio.Event()  # the coordinator is away
    tried = consumer.commits_started
    loop.worker.request_stop()
    engine.release("g")
    await wait_for(lambda: len(loop.answered()) == 2, what="the second job")
    await wait_for(lambda: consumer.commits_started >= tried + 3, what="the hand-over tried again")
    assert not loop.task.done()
    consumer.commit_gate.set()  # back
    assert await asyncio.wait_for(loop.task, 10) == 0
    assert consumer.commits[-1] == {P0: 2}


def reads_commits_of(consumer: FakeConsumer) -> CommittedReader:
    """The group's committed offsets and maps: the last commit of each partition."""

    async def read(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        latest: dict[TopicPartition, tuple[int, str]] = {}
        for positions, metadata in zip(consumer.commits, consumer.metadata, strict=True):
            for tp, position in positions.items():
                latest[tp] = (position, metadata[tp])
        return {tp: latest[tp] for tp in tps if tp in latest}

    return read


async def _slow_job_in_flight(start_loop: Callable[..., Any]) -> Loop:
    """A worker on P0 whose job "slow" runs (gated) after "j1" was answered and committed
    past, with a short revoke grace."""
    consumer = FakeConsumer()
    consumer.add(P0, job("j0"))
    consumer.add(P0, job("slow", gate="slow"))
    consumer.add(P0, job("j2"))
    consumer.assign({P0})
    engine = ScriptedEngine()
    loop: Loop = await start_loop(
        consumer, engine, read_committed=reads_commits_of(consumer), revoke_grace_s=0.05
    )
    await wait_for(lambda: {"j0", "j2"} <= set(loop.answered()), what="the quick jobs")
    await wait_for(lambda: "slow" in engine.started, what="the slow job to start")
    return loop


async def test_a_job_runs_on_through_a_rebalance_that_gives_its_partition_back(start_loop):
    # Found by the fleet simulation (`bench/sim.py --seed 500003 --workers 5
    # --weight-update-every-s 8 --engine-killing-updates 0.3 --hostile
    # invalid,crash,long,reply_small,reply_locked`): the group's protocol revokes every
    # partition at every rebalance, and each one cancelled the jobs still running past the
    # grace. A member crash-looping elsewhere rebalanced the group every 7 s, so a 20 s job
    # never finished anywhere, and its worker, running it alone as a suspect of a crash, held
    # all its partitions for 150 s.
    loop = await _slow_job_in_flight(start_loop)
    worker, consumer, engine = loop.worker, loop.consumer, loop.engine
    await worker.on_partitions_revoked({P0})
    await worker.on_partitions_assigned({P0})
    assert engine.cancelled == []
    engine.release("slow")
    await wait_for(lambda: "slow" in loop.answered(), what="the slow job's answer")
    await wait_for(lambda: consumer.commits[-1] == {P0: 3}, what="the commit past all three")
    assert engine.started.count("slow") == 1
    assert sorted(loop.answered()) == ["j0", "j2", "slow"]


async def test_a_job_whose_partition_moved_during_the_rebalance_is_cancelled_unanswered(
    start_loop,
):
    loop = await _slow_job_in_flight(start_loop)
    worker, engine = loop.worker, loop.engine
    await worker.on_partitions_revoked({P0})
    engine.release("slow")  # answered while the partition is revoked: held, not sent
    await turns_pass(loop.consumer)
    assert "slow" not in loop.answered()
    await worker.on_partitions_assigned(set())
    await turns_pass(loop.consumer)
    assert "slow" not in loop.answered()
    assert not worker._committer.tracker.holds(P0) and not worker._committer.parked(P0)


async def test_a_partition_committed_by_another_member_meanwhile_is_not_taken_back(start_loop):
    # Between the revoke and this assignment another member held P0 and answered "slow":
    # its commit, not this member's hand-over, is what the group holds, so the job running
    # here is cancelled and the partition read from that commit.
    loop = await _slow_job_in_flight(start_loop)
    worker, consumer, engine = loop.worker, loop.consumer, loop.engine
    await worker.on_partitions_revoked({P0})
    consumer.commits.append({P0: 3})
    consumer.metadata.append({P0: ""})
    await worker.on_partitions_assigned({P0})
    assert engine.cancelled == ["slow"]
    engine.release("slow")
    await turns_pass(loop.consumer)
    assert "slow" not in loop.answered()


async def _parked_with_answer_on_its_way(start_loop: Callable[..., Any], *, expire: bool) -> Loop:
    """A worker on P0 whose job "slow" still runs when P0 is revoked, and whose job "q",
    answered just before, has its answer on its way: still queued (the producer takes no
    batch: a broker away) or, with `expire`, handed to the producer and unacknowledged. P0 is
    then handed over, parked, with "slow" and "q" named as running."""
    loop = await _slow_job_in_flight(start_loop)
    producer, consumer = loop.producer, loop.consumer
    if expire:
        producer.hold_next = 1
    else:
        producer.taking_batches.clear()
    consumer.add(P0, job("q"))
    await wait_for(lambda: "q" in loop.engine.started, what="q to start")
    if expire:
        await wait_for(lambda: producer.held, what="q's delivery to be held")
    else:
        await wait_for(lambda: loop.worker._delivery.pending, what="q's answer to be queued")
        await turns_pass(consumer)
    await loop.worker.on_partitions_revoked({P0})
    assert P0 in loop.worker._rebalances._parked.awaiting(), "P0 is parked with slow running"
    hand_over = decode_offset_map(1, consumer.metadata[-1][P0])
    assert consumer.commits[-1] == {P0: 1}
    assert hand_over.clean and {1, 3} <= set(hand_over.running)
    return loop


def _its_delivery_comes_back(loop: Loop, *, expire: bool) -> None:
    """The broker is back: the queued batch is taken, or the held delivery expires."""
    if expire:
        loop.producer.held.pop().set_exception(KafkaTimeoutError())
    else:
        loop.producer.taking_batches.set()


@pytest.mark.parametrize("expire", [False, True], ids=["queued", "expired"])
async def test_an_answer_on_its_way_when_its_partition_is_parked_is_not_sent_once_it_moved(
    start_loop, expire
):
    # The hand-over names "q" as running, so the partition's next owner answers it: this
    # worker sending its answer after the hand-over answered "q" twice, beyond the bound of a
    # rebalance (an answer handed to the producer and landing after the hand-over).
    loop = await _parked_with_answer_on_its_way(start_loop, expire=expire)
    _its_delivery_comes_back(loop, expire=expire)
    await turns_pass(loop.consumer)
    assert "q" not in loop.answered()
    await loop.worker.on_partitions_assigned(set())
    loop.engine.release("slow")
    await turns_pass(loop.consumer)
    assert "q" not in loop.answered()
    assert "slow" not in loop.answered()


@pytest.mark.parametrize("expire", [False, True], ids=["queued", "expired"])
async def test_an_answer_held_while_its_partition_was_parked_goes_out_once_it_comes_back(
    start_loop, expire
):
    loop = await _parked_with_answer_on_its_way(start_loop, expire=expire)
    _its_delivery_comes_back(loop, expire=expire)
    await turns_pass(loop.consumer)
    await loop.worker.on_partitions_assigned({P0})
    loop.engine.release("slow")
    await wait_for(lambda: loop.consumer.commits[-1] == {P0: 4}, what="the commit past all four")
    assert sorted(loop.answered()) == ["j0", "j2", "q", "slow"]
