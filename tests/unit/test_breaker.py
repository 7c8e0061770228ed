"""The crash-loop breaker and the offset map across process lives, with the in-memory consumer,
producer and engine driving real `Worker`s.

A life is one worker process. Its death is simulated where the real one would happen: when a
job holding the crash token starts, the broker stops taking that process's commits and
results (a SIGKILLed process says nothing more), and the next life reads what was committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition

from schemas import Completed, Failed, Job, decode_job, decode_result
from tests.fakes import ScriptedEngine
from tests.lives import DLQ, JOBS, RESULTS, Process, job, process_settings, run, worker_on
from worker.core.clock import SYSTEM_CLOCK
from worker.core.errors import BrokerError, EngineDeadError
from worker.core.metrics import Metrics
from worker.delivery.offset_map import decode_offset_map, encode_offset_map
from worker.delivery.offsets import Commit, OffsetTracker
from worker.dev.harness.waiting import wait_for
from worker.loop.breaker import CrashLoopBreaker
from worker.loop.worker import Worker

P0, P1 = TopicPartition(JOBS, 0), TopicPartition(JOBS, 1)


@dataclass
class Lives:
    """Worker processes, one after the other, over the same records and committed offsets."""

    records: dict[TopicPartition, list[bytes]]
    committed: dict[TopicPartition, Commit] = field(default_factory=dict)
    deaths: int = 0
    results: list[Completed | Failed] = field(default_factory=list)
    dead_lettered: list[str] = field(default_factory=list)
    engines: list[ScriptedEngine] = field(default_factory=list)

    async def read_committed(self, tps: list[TopicPartition]) -> dict[TopicPartition, Commit]:
        return {tp: self.committed[tp] for tp in tps if tp in self.committed}

    @property
    def latest(self) -> dict[str, Completed | Failed]:
        return {r.job_id: r for r in self.results if r.job_id is not None}

    def job_ids(self) -> set[str]:
        return {decode_job(value).job_id for records in self.records.values() for value in records}

    async def live(self, **overrides: Any) -> tuple[Process, ScriptedEngine, Worker, bool]:
        """One life: until every job has an answer and all is committed, or the process dies.
        Returns whether it died."""
        process = Process(self.committed)
        for tp, records in self.records.items():
            for value in records:
                process.consumer.add(tp, value)
            position = self.committed.get(tp, (0, ""))[0]
            process.consumer.start_at(tp, position)
        process.consumer.assign(set(self.records))
        engine = ScriptedEngine(max_concurrency=64)
        self.engines.append(engine)

        def on_start(started: Job) -> None:
            if "crash" in started.metadata:
                process.dead = True

        engine.on_start = on_start
        worker = worker_on(process, engine, process_settings(**overrides), self.read_committed)
        task = run(worker)
        ends = {tp: len(records) for tp, records in self.records.items()}

        def settled() -> bool:
            committed = {tp: c[0] for tp, c in self.committed.items()}
            now = {
                decode_result(value).job_id
                for topic, _, value, _ in process.producer.sent
                if topic == RESULTS and value is not None
            }
            answered = set(self.latest) | now
            return process.dead or (committed == ends and answered >= self.job_ids()) or task.done()

        try:
            await wait_for(settled, 30, lambda: f"life {len(self.engines)} to settle")
        finally:
            worker.request_stop()
            await asyncio.wait_for(task, 10)
        self.results += [
            decode_result(value)
            for topic, _, value, _ in process.producer.sent
            if topic == RESULTS and value is not None
        ]
        # A dead-letter copy is the job record itself.
        self.dead_lettered += [
            decode_job(value or b"").job_id
            for topic, _, value, _ in process.producer.sent
            if topic == DLQ
        ]
        if process.dead:
            self.deaths += 1
        return process, engine, worker, process.dead


async def test_a_killer_in_one_partition_gets_no_healthy_job_of_another_dead_lettered():
    # The killer in P0 and a long healthy job in P1 are in flight together at the first
    # death. Blamed per partition, the healthy job was in flight at each of the killer's deaths
    # and was dead-lettered beside it at the fourth life.
    lives = Lives(
        {
            P0: [job("p0-0"), job("killer", crash="1", gate="never"), job("p0-2")],
            P1: [job("healthy", delay_s="0.2"), job("p1-1")],
        }
    )
    for _ in range(8):
        _, _, _, died = await lives.live()
        if not died:
            break
    # Its first death, its retry beside the others, its try together with the other suspects
    # of two deaths, two of its own (the default limit, 5).
    assert lives.deaths == 5
    latest = lives.latest
    assert isinstance(latest["killer"], Failed) and not latest["killer"].error.retryable
    assert all(isinstance(latest[j], Completed) for j in ("p0-0", "p0-2", "healthy", "p1-1"))
    assert lives.dead_lettered == ["killer"]
    assert lives.committed[P0][0] == 3 and lives.committed[P1][0] == 2


async def test_after_one_death_its_suspects_run_again_beside_each_other():
    # Seeds 40030, 41021, 41130 (`bench/sim.py --hostile long`): a kill from outside left every
    # job in flight a suspect, and they ran one at a time: four 20 s rollouts held every
    # partition for 80 s. Most deaths are no job's doing: one retry runs as usual.
    lives = Lives(
        {
            P0: [job(f"p0-{i}", delay_s="0.3") for i in range(4)],
            P1: [job(f"p1-{i}", delay_s="0.3") for i in range(4)],
        }
    )
    # The last process died with all eight in flight.
    for tp in (P0, P1):
        lives.committed[tp] = (0, encode_offset_map(0, [], running=range(4)))
    process, engine, _, died = await lives.live()
    assert not died
    assert engine.peak_running == 8
    assert all(isinstance(r, Completed) for r in lives.latest.values())
    assert len(lives.latest) == 8
    # Each started once a commit naming it as running had landed: a death would count.
    consumer = process.consumer
    named = set()
    for positions, metadata in zip(consumer.commits, consumer.metadata, strict=True):
        for tp, position in positions.items():
            named |= {(tp, o) for o in decode_offset_map(position, metadata[tp]).running}
    assert named == {(tp, o) for tp in (P0, P1) for o in range(4)}


def _died_twice_with(lives: Lives, offsets: range) -> None:
    """The last process died with `offsets` of each partition in flight, each retried after
    an earlier death: suspects of two deaths now."""
    for tp in lives.records:
        lives.committed[tp] = (
            0,
            encode_offset_map(0, [], running=offsets, deaths=dict.fromkeys(offsets, 1)),
        )


@contextlib.asynccontextmanager
async def _serving(lives: Lives, **overrides: Any) -> AsyncIterator[tuple[Process, ScriptedEngine]]:
    """A worker serving `lives`' records from their committed positions, stopped on exit."""
    process = Process(lives.committed)
    for tp, values in lives.records.items():
        for value in values:
            process.consumer.add(tp, value)
    process.consumer.assign(set(lives.records))
    engine = ScriptedEngine()
    worker = worker_on(process, engine, process_settings(**overrides), lives.read_committed)
    task = run(worker)
    try:
        yield process, engine
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 10)


async def _fetches(process: Process, count: int) -> None:
    """Until the worker has fetched (or polled with every partition paused) `count` times
    more: what it would start meanwhile, it has started."""
    seen = process.consumer.getmany_calls
    await wait_for(lambda: process.consumer.getmany_calls >= seen + count, 10, "more fetches")


async def test_suspects_of_a_second_death_run_one_at_a_time_under_a_limit_of_four():
    lives = Lives(
        {
            P0: [job(f"p0-{i}", delay_s="0.02") for i in range(4)],
            P1: [job(f"p1-{i}", delay_s="0.02") for i in range(4)],
        }
    )
    _died_twice_with(lives, range(4))
    _, engine, _, died = await lives.live(max_crash_attempts=4)
    assert not died
    assert engine.peak_running == 1
    assert all(isinstance(r, Completed) for r in lives.latest.values())
    assert len(lives.latest) == 8


async def test_suspects_of_a_second_death_run_together_with_nothing_else_in_flight():
    # Seeds 103113 and 103135 (`bench/sim.py --hostile invalid,crash,long,reply_small,
    # reply_locked`): two kills from outside in a row left long rollouts suspects of two
    # deaths; run one at a time, each after a drain, they held the worker past the settle
    # period. Together, they cost one drain and the longest of them.
    lives = Lives(
        {
            P0: [*(job(f"p0-{i}", gate="together") for i in range(3)), job("p0-3")],
            P1: [*(job(f"p1-{i}", gate="together") for i in range(3)), job("p1-3")],
        }
    )
    _died_twice_with(lives, range(3))
    async with _serving(lives) as (process, engine):
        await wait_for(lambda: engine.running == 6, 10, "the six suspects to run together")
        await _fetches(process, 1)
        assert sorted(engine.started) == sorted(f"p{p}-{i}" for p in (0, 1) for i in range(3))
        # A commit naming all six as running landed before any started: a death blames them.
        position, metadata = lives.committed[P0]
        assert decode_offset_map(position, metadata).running == {0, 1, 2}
        engine.release("together")
        await wait_for(lambda: len(engine.started) == 8, 10, "the jobs behind them")
    assert lives.committed[P0][0] == 4 and lives.committed[P1][0] == 4


async def test_a_suspect_fetched_after_the_others_started_joins_them():
    # Seed 102164: the fetch that started suspects together held one partition's records; the
    # suspects of the others ran after them, each group holding the worker for a long rollout.
    # Here a fetch of two records holds P0's suspect and the job behind it, not P1's suspect.
    lives = Lives({P0: [job("p0-0", gate="g"), job("p0-1")], P1: [job("p1-0", gate="g")]})
    _died_twice_with(lives, range(1))
    async with _serving(lives, max_in_flight=2) as (_, engine):
        # P0's suspect still runs: P1's joined it rather than waiting for it to end.
        await wait_for(lambda: engine.running == 2, 10, "the second suspect to join the first")
        assert sorted(engine.started) == ["p0-0", "p1-0"]
        engine.release("g")
        await wait_for(lambda: len(engine.started) == 3, 10, "the job behind them")
    assert lives.committed[P0][0] == 2 and lives.committed[P1][0] == 1


async def test_a_death_while_suspects_run_together_leaves_them_to_run_alone():
    # A killer among them dies again beside them: each counts that death, and from then on
    # they run alone, so the killer alone reaches the limit and the others are answered.
    lives = Lives(
        {
            P0: [job("p0-0", delay_s="0.02"), job("killer", crash="1", gate="never")],
            P1: [job(f"p1-{i}", delay_s="0.02") for i in range(2)],
        }
    )
    _died_twice_with(lives, range(2))
    _, engine, _, died = await lives.live()
    assert died and engine.peak_running == 4
    for _ in range(4):
        _, engine, _, died = await lives.live()
        if not died:
            break
        assert engine.peak_running == 1
    # Together, then two of its own: the default limit of 5 with the two before.
    assert lives.deaths == 3
    assert lives.dead_lettered == ["killer"]
    assert all(isinstance(lives.latest[j], Completed) for j in ("p0-0", "p1-0", "p1-1"))
    assert lives.committed[P0][0] == 2 and lives.committed[P1][0] == 2


async def test_a_death_with_many_in_flight_never_stalls_the_partition(caplog):
    # One (gap, count) pair per death: 40 suspects made a map past a 64-byte cap, committed
    # empty (every death count lost) and the partition stalled with nothing in flight.
    caplog.set_level(logging.WARNING)
    lives = Lives({P0: [job(f"j{i}") for i in range(50)]})
    lives.committed[P0] = (0, encode_offset_map(0, [], running=range(40)))
    process, _, _, died = await lives.live(offset_map_max_bytes=64, max_in_flight=64)
    assert not died
    # The counts of the suspects still to run stayed in the map while they ran.
    consumer = process.consumer
    kept = [
        len(decode_offset_map(positions[P0], metadata[P0]).deaths)
        for positions, metadata in zip(consumer.commits, consumer.metadata, strict=True)
        if P0 in positions
    ]
    assert max(kept) >= 39
    assert lives.committed[P0][0] == 50
    assert len(lives.latest) == 50
    assert "left out" not in caplog.text


def test_the_suspect_that_ran_alone_counts_until_a_commit_past_it_lands():
    # A supervisor (the chaos harness) kills a worker only while it reports no suspects. The
    # suspect that ran alone stopped counting once answered, but its map still named it alone
    # as running until the commit past it landed: a kill in that window blamed it again, and
    # two such kills dead-lettered a healthy job (CI, test_chaos, "failed_innocent=1").
    tracker = OffsetTracker()
    twice = encode_offset_map(0, [], running=[0], deaths={0: 1})
    tracker.assigned(P0, decode_offset_map(0, twice), anchor=0)
    breaker = CrashLoopBreaker(3, Metrics(), tracker, lambda: {P0, P1}, clock=SYSTEM_CLOCK)
    partition = tracker.partition(P0)
    records = [ConsumerRecord(JOBS, 0, o, 0, 0, b"k", job(f"j{o}"), None, 1, 1, ()) for o in (0, 1)]
    taken = breaker.take(P0, partition, records)
    assert [r.offset for r in taken.run] == [0] and taken.rewind_to == 1
    assert breaker.suspects() == 1 and not breaker.commit_due()
    breaker.confirmed(landed=True)
    assert not breaker.commit_due()  # still running: a commit now would name it running
    partition.finish(0)
    assert breaker.suspects() == 1
    assert breaker.commit_due()
    assert breaker.held() == {P0, P1}
    commit = partition.to_commit(writer=tracker.writer)
    assert commit is not None and commit[0] == 1
    tracker.committed({P0: commit})
    assert breaker.suspects() == 0
    assert not breaker.commit_due()
    assert breaker.held() == set()


def test_suspects_running_together_take_on_no_partition_assigned_beside_them():
    """Seed 700098 of the simulation's hostile flag set, one worker: suspects of two deaths
    ran together as a rebalance assigned the worker more partitions. Deciding what to hold
    around them looked each new partition up in the tracker, which took it on as held; the
    assignment then skipped reading its committed map, as for a partition kept through the
    rebalance, so its records ran as if never seen and the hold put on it until that read
    was never lifted: four partitions went unfetched for the rest of the run."""
    tracker = OffsetTracker()
    twice = encode_offset_map(0, [], running=[], deaths={0: 2, 1: 2})
    tracker.assigned(P0, decode_offset_map(0, twice), anchor=0)
    assignment = {P0}
    breaker = CrashLoopBreaker(5, Metrics(), tracker, lambda: assignment, clock=SYSTEM_CLOCK)
    records = [ConsumerRecord(JOBS, 0, o, 0, 0, b"k", job(f"j{o}"), None, 1, 1, ()) for o in (0, 1)]
    taken = breaker.take(P0, tracker.partition(P0), records)
    assert [r.offset for r in taken.run] == [0, 1]
    breaker.confirmed(landed=True)

    assignment.add(P1)  # assigned beside them: its committed map is not read yet
    assert breaker.held() == {P1}
    assert breaker.blocks(P1)
    assert not tracker.holds(P1)


async def test_after_a_suspect_ran_alone_the_commit_past_it_does_not_wait_for_the_interval():
    # Every partition is held until that commit lands: at the interval's tick, a minute here.
    lives = Lives({P0: [job("suspect"), job("next")], P1: [job("other")]})
    lives.committed[P0] = (0, encode_offset_map(0, [], running=[0], deaths={0: 1}))
    async with _serving(lives, commit_interval_ms=60_000) as (_, engine):
        await wait_for(lambda: len(engine.started) == 3, 10, "every job to start")
    assert engine.started[0] == "suspect"
    assert sorted(engine.started[1:]) == ["next", "other"]


async def test_suspects_run_one_after_another_without_waiting_out_fetch_timeouts():
    # While a suspect runs alone every partition is held, and each fetch waited out its whole
    # timeout: two of them per suspect beside its own run (10 s here for five; 400 ms a
    # suspect at the default --poll-timeout-ms, after a death with hundreds in flight).
    lives = Lives({P0: [job(f"j{i}") for i in range(5)]})
    twice = dict.fromkeys(range(5), 2)  # three deaths now: each runs alone
    lives.committed[P0] = (0, encode_offset_map(0, [], running=range(5), deaths=twice))
    process = Process(lives.committed)
    process.consumer.empty_wait_cap_ms = None
    for value in lives.records[P0]:
        process.consumer.add(P0, value)
    process.consumer.assign({P0})
    engine = ScriptedEngine()
    settings = process_settings(poll_timeout_ms=1_000)
    worker = worker_on(process, engine, settings, lives.read_committed)
    task = run(worker)
    try:
        await wait_for(lambda: lives.committed[P0][0] == 5, 4, "the five suspects, one at a time")
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 10)
    assert engine.peak_running == 1
    assert engine.started == [f"j{i}" for i in range(5)]


async def test_a_map_naming_an_offset_answered_and_suspect_is_ignored_and_commits_go_on(caplog):
    # Hand-made or another tool's: offset 1 both answered and in flight at 2 deaths. The
    # breaker ran the answered record again, it finished twice, and from then on every commit
    # of every partition raised ValueError.
    lives = Lives({P0: [job(f"j{i}") for i in range(4)], P1: [job("other")]})
    lives.committed[P0] = (0, encode_offset_map(0, [1], deaths={1: 2}))
    _, engine, _, died = await lives.live()
    assert not died
    assert sorted(engine.started) == ["j0", "j1", "j2", "j3", "other"]
    assert lives.committed[P0][0] == 4 and lives.committed[P1][0] == 1
    assert "ignoring the committed metadata" in caplog.text


async def test_records_at_offsets_reused_after_a_reset_are_not_skipped():
    # The map was committed at 10 and names 12 and 13 answered; the log was truncated to 8
    # records (an unclean leader election), so the consumer's fetch at 10 was out of range and
    # it reset to 0; then the log refilled past the offsets the map names.
    lives = Lives({P0: [job(f"j{i}") for i in range(16)]})
    lives.committed[P0] = (10, encode_offset_map(10, [12, 13]))
    process = Process(lives.committed)
    for value in lives.records[P0][:8]:
        process.consumer.add(P0, value)
    process.consumer.assign({P0})  # position 0: the reset, not the committed 10
    engine = ScriptedEngine()
    worker = worker_on(process, engine, process_settings(), lives.read_committed)
    task = run(worker)
    try:
        await wait_for(lambda: lives.committed[P0][0] == 8, what="the commit of the first 8")
        for value in lives.records[P0][8:]:
            process.consumer.add(P0, value)
        await wait_for(lambda: lives.committed[P0][0] == 16, what="the commit of all 16")
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 10)
    assert sorted(engine.started) == sorted(f"j{i}" for i in range(16))


# ---- stops that blame nobody --------------------------------------------------------------


async def _one_job_in_flight(**overrides: Any) -> tuple[Process, ScriptedEngine, Worker, Any]:
    process = Process({})
    process.consumer.add(P0, job("long", gate="g"))
    process.consumer.assign({P0})
    engine = ScriptedEngine()
    worker = worker_on(process, engine, process_settings(**overrides))
    task = run(worker)
    await wait_for(lambda: engine.running == 1, what="the job to run")
    return process, engine, worker, task


def _last_map(process: Process) -> Any:
    position, metadata = process.committed[P0]
    return decode_offset_map(position, metadata)


async def test_on_sigterm_a_clean_hand_over_is_committed_before_the_grace_runs_out():
    # A supervisor's SIGKILL lands when its own grace (Docker 10 s, Kubernetes 30 s) ends,
    # which may be before --shutdown-grace-s does: the hand-over must be on record by then.
    process, engine, worker, task = await _one_job_in_flight(shutdown_grace_s=30)
    worker.request_stop()
    await wait_for(
        lambda: P0 in process.committed and _last_map(process).clean,
        5,
        "a clean hand-over while the job still runs",
    )
    assert engine.running == 1
    assert _last_map(process).running == {0}
    engine.release("g")
    assert await asyncio.wait_for(task, 10) == 0
    assert process.committed[P0][0] == 1


async def test_a_broker_error_stop_blames_nobody():
    process, _, worker, task = await _one_job_in_flight()
    worker.fail(BrokerError("results topic unreachable past --publish-timeout-s"), "test")
    assert await asyncio.wait_for(task, 10) == 1
    assert _last_map(process).clean
    assert _last_map(process).running == {0}


async def test_an_engine_death_blames_the_jobs_in_flight():
    process, _, worker, task = await _one_job_in_flight()
    worker.fail(EngineDeadError("engine died"), "test")
    assert await asyncio.wait_for(task, 10) == 1
    assert not _last_map(process).clean
    assert _last_map(process).running == {0}
