"""A model-based test of the offsets, commits, offset map and crash-loop breaker.

A hypothesis state machine drives real `Worker`s on the in-memory consumer and producer
(`tests.lives`) through random produces, out-of-order finishes, deaths with any number in
flight (a crash-token job starting, or a kill from outside), clean stops, rebalances to a second
owner, small map caps, and corrupt or foreign committed metadata. The reference model is the
simplest one: the records produced and which of them hold the crash token. After every step:

- no record below a committed position is without an answer (none is skipped unanswered);
- no record without the crash token is dead-lettered;
- the committer holds no partition with nothing in flight, and when the breaker holds every
  partition of an idle worker, a commit that releases them is due;
- no commit raised (the commit path logs no error; no worker stopped on one).

At the end every gate opens and the workers must answer everything and commit every partition
to its end within a bounded time: nothing stalls.

The workers run on a simulated clock (`VirtualClockLoop`): each step is the same span of
their polls, waits and commits on any machine, and costs only the CPU time of what runs in it.
The budget (examples x steps) keeps it to a few seconds of CI time.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiokafka import TopicPartition
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from schemas import Failed, Job, decode_job, decode_result
from tests.fakes import ScriptedEngine, VirtualClockLoop
from tests.hypothesis_profiles import examples
from tests.lives import DLQ, JOBS, RESULTS, Process, job, process_settings, worker_on
from worker.delivery.offset_map import encode_offset_map
from worker.delivery.offsets import Commit
from worker.loop.worker import Worker

P0, P1 = TopicPartition(JOBS, 0), TopicPartition(JOBS, 1)
PARTITIONS = (P0, P1)
# Deaths from outside (SIGKILL, OOM of a neighbour) that may land while a suspect runs alone:
# with the default limit of 5, a healthy job is present at three deaths it did not cause at
# most before it runs alone (a killer's first, its retry, where it ran beside it, and its try
# together with the other suspects of two deaths), and one such death stays below the limit.
# More would blame a healthy job for deaths it did not cause, which no breaker that counts
# deaths can tell apart.
MAX_OUTSIDE_KILLS = 1
MAX_POISON = 2
STEP_S = 0.03


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Owner:
    """One live worker process and the partitions it owns."""

    process: Process
    engine: ScriptedEngine
    worker: Worker
    task: asyncio.Task[int]
    partitions: set[TopicPartition]


@dataclass
class Model:
    records: dict[TopicPartition, list[tuple[str, bool]]] = field(
        default_factory=lambda: {tp: [] for tp in PARTITIONS}
    )

    def poison(self) -> set[str]:
        return {j for records in self.records.values() for j, bad in records if bad}


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # Simulated time: a step is STEP_S of the workers' polls, waits and commits whatever
        # the machine's speed or load, and takes only the CPU time of what runs in it.
        self.loop = VirtualClockLoop()
        self.model = Model()
        self.committed: dict[TopicPartition, Commit] = {}
        self.owners: list[Owner] = []
        self.released: set[str] = set()
        self.answers: list[tuple[str, bool]] = []  # (job_id, failed) of every landed result
        self.dead_lettered: list[str] = []
        self.outside_kills = 0
        self.cap = 3072
        self.errors = _Errors()
        logging.getLogger("worker").addHandler(self.errors)
        self._serial = 0

    # ---- the world -------------------------------------------------------------------------

    def _step(self, seconds: float = STEP_S) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))
        self._bury_the_dead()

    async def _read_committed(self, tps: list[TopicPartition]) -> dict[TopicPartition, Commit]:
        return {tp: self.committed[tp] for tp in tps if tp in self.committed}

    def _start(self, partitions: set[TopicPartition]) -> Owner:
        process = Process(self.committed)
        for tp in PARTITIONS:
            for job_id, bad in self.model.records[tp]:
                process.consumer.add(tp, self._value(job_id, bad))
            process.consumer.start_at(tp, self.committed.get(tp, (0, ""))[0])
        process.consumer.assign(partitions)
        engine = ScriptedEngine(max_concurrency=64)

        def on_start(started: Job) -> None:
            if "crash" in started.metadata:
                process.dead = True  # the crash token kills the process as the job starts
            elif started.job_id in self.released:
                engine.release(started.job_id)

        engine.on_start = on_start
        # A commit interval above zero: at zero, while the breaker is engaged, each commit's
        # end wakes the loop, whose tick starts the next one at once, and the loop never waits
        # for time (on a simulated clock, time would then stand still).
        settings_ = process_settings(
            offset_map_max_bytes=self.cap, max_in_flight=8, commit_interval_ms=5
        )
        worker = worker_on(process, engine, settings_, self._read_committed)
        owner = Owner(process, engine, worker, self.loop.create_task(worker.run()), partitions)
        self.owners.append(owner)
        return owner

    def _value(self, job_id: str, bad: bool) -> bytes:
        return job(job_id, crash="1", gate="never") if bad else job(job_id, gate=job_id)

    def _stop(self, owner: Owner) -> None:
        owner.worker.request_stop()
        self.loop.run_until_complete(asyncio.wait_for(owner.task, 10))
        self._collect(owner)
        self.owners.remove(owner)

    def _collect(self, owner: Owner) -> None:
        for topic, _, value, _ in owner.process.producer.sent:
            if topic == RESULTS and value is not None:
                result = decode_result(value)
                self.answers.append((result.job_id or "", isinstance(result, Failed)))
            elif topic == DLQ:
                self.dead_lettered.append(decode_job(value or b"").job_id)  # the record itself
        owner.process.producer.sent.clear()

    def _kill(self, owner: Owner) -> None:
        owner.process.dead = True
        self._stop(owner)
        self._start(owner.partitions)

    def _bury_the_dead(self) -> None:
        for owner in [o for o in self.owners if o.process.dead]:
            self._stop(owner)
            self._start(owner.partitions)

    # ---- rules -----------------------------------------------------------------------------

    @initialize(cap=st.sampled_from([48, 96, 3072]))
    def begin(self, cap: int) -> None:
        self.cap = cap
        self._start(set(PARTITIONS))

    @rule(tp=st.sampled_from(PARTITIONS), count=st.integers(1, 6), poison=st.booleans())
    def produce(self, tp: TopicPartition, count: int, poison: bool) -> None:
        for i in range(count):
            self._serial += 1
            bad = poison and i == 0 and len(self.model.poison()) < MAX_POISON
            job_id = f"{'poison' if bad else 'job'}-{self._serial}"
            self.model.records[tp].append((job_id, bad))
            for owner in self.owners:
                owner.process.consumer.add(tp, self._value(job_id, bad))
        self._step()

    @rule(data=st.data())
    def finish_some(self, data: st.DataObject) -> None:
        running = sorted(
            {j for o in self.owners for j in o.engine.started} - self.released - self.model.poison()
        )
        if running:
            chosen = data.draw(st.lists(st.sampled_from(running), max_size=4, unique=True))
            for job_id in chosen:
                self.released.add(job_id)
                for owner in self.owners:
                    owner.engine.release(job_id)
        self._step()

    @rule()
    def wait(self) -> None:
        self._step()

    @precondition(lambda self: self.outside_kills < MAX_OUTSIDE_KILLS)
    @rule(data=st.data())
    def kill_from_outside(self, data: st.DataObject) -> None:
        self.outside_kills += 1
        self._kill(data.draw(st.sampled_from(self.owners)))
        self._step()

    @rule(data=st.data())
    def sigterm(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(self.owners))
        self._stop(owner)
        self._start(owner.partitions)
        self._step()

    @rule()
    def rebalance(self) -> None:
        if len(self.owners) == 1:
            (first,) = self.owners
            first.process.consumer.assign({P0})  # P1 revoked on its next poll
            self.loop.run_until_complete(self._assigned(first, {P0}))
            first.partitions = {P0}
            self._start({P1})
        else:
            second = next(o for o in self.owners if o.partitions == {P1})
            self._stop(second)
            (first,) = self.owners
            # A partition newly assigned is read from its committed offset, as Kafka's
            # consumer does (the in-memory one would go on from where it last read).
            first.process.consumer.start_at(P1, self.committed.get(P1, (0, ""))[0])
            first.process.consumer.assign(set(PARTITIONS))
            first.partitions = set(PARTITIONS)
        self._step()

    async def _assigned(self, owner: Owner, partitions: set[TopicPartition]) -> None:
        for _ in range(500):
            if owner.process.dead or owner.process.consumer.assignment() == partitions:
                return
            await asyncio.sleep(0.005)

    @rule(
        tp=st.sampled_from(PARTITIONS),
        metadata=st.sampled_from(
            [
                "another tool's metadata",
                "vkw1:AAEAAQAA",  # the previous version of the map
                "vkw2:!!",
                "vkw2:AAABAwEBAwEA",  # answered and running at once
                "anchor",  # a well-formed map written for another position
            ]
        ),
    )
    def corrupt_the_committed_map(self, tp: TopicPartition, metadata: str) -> None:
        owner = next(o for o in self.owners if tp in o.partitions)
        self._stop(owner)  # a clean stop: the corrupt map is what the next owner reads
        position = self.committed.get(tp, (0, ""))[0]
        if metadata == "anchor":
            metadata = encode_offset_map(position + 1, [position + 2])
        self.committed[tp] = (position, metadata)
        self._start(owner.partitions)
        self._step()

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def nothing_committed_past_is_unanswered(self) -> None:
        for owner in self.owners:
            self._collect(owner)
        answered = {j for j, _ in self.answers}
        for tp, (position, _) in self.committed.items():
            unanswered = [j for j, _ in self.model.records[tp][:position] if j not in answered]
            assert not unanswered, f"{tp} committed at {position} past unanswered {unanswered}"

    @invariant()
    def only_the_crash_token_is_dead_lettered(self) -> None:
        innocent = set(self.dead_lettered) - self.model.poison()
        assert not innocent, f"dead-lettered without the crash token: {sorted(innocent)}"
        failed = {j for j, is_failed in self.answers if is_failed} - self.model.poison()
        assert not failed, f"answered failed without the crash token: {sorted(failed)}"

    @invariant()
    def no_partition_is_held_for_a_reason_that_cannot_change(self) -> None:
        for owner in self.owners:
            if owner.process.dead:
                continue
            committer = owner.worker._committer
            tracker = committer.tracker
            idle = all(p.idle for _, p in tracker.items())
            near_cap = committer.held() - committer._inheritance.reading
            assert all(not tracker.partition(tp).idle for tp in near_cap), near_cap
            breaker = owner.worker._breaker
            assignment = owner.process.consumer.assignment()
            if idle and assignment and breaker.held() >= assignment:
                # Every partition held with nothing in flight: only while the commit that
                # ends a suspect's lone run is still to land.
                assert tracker.plan(None, limit=self.cap), "held with nothing due to change it"

    @invariant()
    def commits_never_raise(self) -> None:
        assert not self.errors.records, [r.getMessage() for r in self.errors.records]
        for owner in self.owners:
            if owner.task.done():
                raise AssertionError(f"a worker stopped by itself: {owner.task.result()}")

    # ---- the end ---------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if self.owners:
                self._everything_is_answered_in_the_end()
        finally:
            for owner in list(self.owners):
                self._stop(owner)
            logging.getLogger("worker").removeHandler(self.errors)
            self.loop.close()

    def _everything_is_answered_in_the_end(self) -> None:
        everyone = {j for records in self.model.records.values() for j, _ in records}
        self.released |= everyone
        for owner in self.owners:
            for job_id in everyone:
                owner.engine.release(job_id)
        ends = {tp: len(records) for tp, records in self.model.records.items()}
        for _ in range(300):  # 300 steps: 9 simulated seconds
            self.nothing_committed_past_is_unanswered()
            positions = {tp: self.committed.get(tp, (0, ""))[0] for tp in PARTITIONS}
            if (
                positions == ends
                and {j for j, _ in self.answers} | set(self.dead_lettered) >= everyone
            ):
                break
            self._step()
        else:
            positions = {tp: self.committed.get(tp, (0, ""))[0] for tp in PARTITIONS}
            raise AssertionError(f"stalled: committed {positions}, ends {ends}")
        self.only_the_crash_token_is_dead_lettered()
        self.commits_never_raise()


BreakerMachine.TestCase.settings = settings(
    max_examples=examples(0.12),
    stateful_step_count=20,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_breaker_model = BreakerMachine.TestCase
