"""The trainer's half of the simulation (`worker.dev.sim.trainer`, `trainer_checks`): the real
`RolloutClient` on simulated clients, the invariants its calls are judged by, and the client
defects the simulation found, each at the unit level."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiokafka.errors import KafkaTimeoutError
from aiokafka.structs import TopicPartition

from schemas import (
    CommandAck,
    Completed,
    Completion,
    Failed,
    SamplingSpec,
    WorkerStatus,
    decode_job,
    encode,
)
from tests.unit.test_answers import builder as answer_builder
from tests.unit.test_answers import record as job_record
from tests.unit.test_rollout_answers import Topics, completed, prompt
from worker.client.conversation import Conversation, ConversationError
from worker.client.rollout import RolloutClient, RolloutError
from worker.dev.sim.clients import Process, SimConsumer
from worker.dev.sim.clock import EPOCH_S, VirtualClock, VirtualLoop, virtual_time
from worker.dev.sim.cluster import Cluster, StoredRecord
from worker.dev.sim.history import History
from worker.dev.sim.kafka_clients import SimKafkaClients
from worker.dev.sim.run import Scenario, flag_set_scenario, run
from worker.dev.sim.trainer_checks import SLACK_S, UPDATE_SLACK_S, check_trainers

T = TypeVar("T")


def _on_virtual_time(body: Callable[[Cluster], Coroutine[Any, Any, T]]) -> T:
    """Run `body` on a simulated cluster of two topics, `jobs` and `results`, on the virtual
    clock (`time.time` included, which the client's deadlines read)."""
    clock = VirtualClock()
    loop = VirtualLoop(clock)
    cluster = Cluster(History(lambda: clock.now))
    cluster.create_topic("jobs", 2)
    cluster.create_topic("results", 2)
    try:
        with virtual_time(clock):
            return loop.run_until_complete(body(cluster))
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.close()


def _answer(cluster: Cluster, topic: str, value: bytes, key: bytes) -> None:
    cluster.produce(
        "worker", TopicPartition(topic, 0), [(key, value, [])], producer_id=None, now_ms=0
    )


async def _job_record(cluster: Cluster, number: int) -> Any:
    """The `number`th job appended to `jobs` (from 0), once it is."""
    while True:
        records = sorted(
            (r for log in cluster.topics["jobs"].logs for r in log), key=lambda r: r.timestamp_ms
        )
        if len(records) > number:
            return decode_job(records[number].value or b"")
        await asyncio.sleep(0.01)


def test_the_real_client_runs_on_simulated_clients_and_reads_from_when_it_started() -> None:
    """`RolloutClient` built with `SimKafkaClients` produces its jobs to the simulated cluster
    and reads its results topic from its end: an answer appended before it started is not
    read, even one naming the job id it then sends."""

    async def body(cluster: Cluster) -> tuple[Completed, int]:
        stale = Completed(job_id="j", completions=[], prompt_token_count=3)
        _answer(cluster, "results", encode(stale), b"j")
        client = RolloutClient(
            bootstrap_servers="sim:9092",
            jobs_topic="jobs",
            results_topic="results",
            timeout_s=5.0,
            kafka_clients=SimKafkaClients.of_process(Process("trainer", cluster, random.Random(0))),
            client_id="t",
        )
        await client.start()
        future = client.submit({"job_id": "j", "prompt_token_ids": [1, 2, 3]})
        job = await _job_record(cluster, 0)
        completion = Completion(index=0, token_ids=[7, 8], text="", finish_reason="length")
        answer = Completed(
            job_id=job.job_id,
            completions=[completion],
            prompt_token_count=3,
            submission_id=job.submission_id or "",
        )
        _answer(cluster, "results", encode(answer), b"j")
        result = await future
        in_flight = client.in_flight
        await client.close()
        assert isinstance(result, Completed)
        return result, in_flight

    result, in_flight = _on_virtual_time(body)
    assert result.job_id == "j"
    assert result.completions[0].token_ids == [7, 8]
    assert in_flight == 0


def test_seek_to_end_waits_for_the_broker_and_positions_at_the_end() -> None:
    """aiokafka looks a reset's offsets up again while the leader is away; the position is the
    end as it is once the broker answers, not as it was when asked."""

    async def body(cluster: Cluster) -> tuple[int, float]:
        tp = TopicPartition("results", 0)
        _answer(cluster, "results", b"1", b"k")
        consumer = SimConsumer(
            Process("c", cluster, random.Random(0)), client_id="c", group_id=None
        )
        await consumer.start()
        consumer.assign([tp])
        cluster.broker_down = True
        loop = asyncio.get_running_loop()
        started = loop.time()
        seek = asyncio.create_task(consumer.seek_to_end(tp))
        await asyncio.sleep(2.0)
        assert not seek.done()
        _answer_when_up = cluster.end_offset(tp)
        cluster.broker_down = False
        _answer(cluster, "results", b"2", b"k")
        await seek
        assert _answer_when_up == 1
        return await consumer.position(tp), loop.time() - started

    position, waited = _on_virtual_time(body)
    assert position == 2
    assert waited >= 2.0


@pytest.fixture
async def topics() -> Any:
    topics = Topics()
    yield topics
    await topics.close()


async def test_an_expired_answer_names_the_submission_of_the_asking_it_answers(
    topics: Topics,
) -> None:
    """The client's own `expired` answer stands for a worker's, which echoes the job's
    submission: a caller that matches answers to askings by it finds this one's asking.
    (Seen as `trainer_wrong_answer` in every seed of the trainer flag set: the answer named no
    submission.)"""
    client = topics.client(timeout_s=0.3, max_retries=0)
    future = client.submit(
        {"job_id": "j", "prompt_token_ids": prompt(3), "submission_id": "asking-1"}
    )
    result = await asyncio.wait_for(future, 2)
    assert isinstance(result, Failed) and result.error.code == "expired"
    assert result.submission_id == "asking-1"
    assert client.in_flight == 0


async def test_a_turn_whose_answer_does_not_continue_the_conversation_can_be_run_again(
    topics: Topics,
) -> None:
    """An answer to the turn's very sending (its submission echoed) that is to another prompt
    (a worker's defect, or a forged record) fails the turn with `ConversationError`; the
    conversation is where it was, and the turn is run again. Before, the refused turn stayed
    in flight in the conversation, and every re-run raised 'still in flight' for ever."""
    client = topics.client(timeout_s=3, max_retries=0)
    conversation = Conversation(sampling=SamplingSpec(max_tokens=4))
    first = asyncio.create_task(client.turn(conversation, prompt(6)))
    wrong = completed(await topics.job(0), [1, 2])
    topics.publish({**wrong, "prompt_token_count": 9})
    with pytest.raises(ConversationError, match="prompt of 9 tokens"):
        await asyncio.wait_for(first, 2)
    assert conversation.in_flight is None

    again = asyncio.create_task(client.turn(conversation, prompt(6)))
    topics.publish(completed(await topics.job(1), [3, 4]))
    result = await asyncio.wait_for(again, 2)

    assert isinstance(result, Completed) and result.completions[0].token_ids == [3, 4]
    assert [t.completion.token_ids for t in conversation.turns] == [[3, 4]]
    assert client.in_flight == 0


# -- the checks, on hand-made histories -------------------------------------------------------


class _Trainer:
    """Writes a trainer's events into a history at chosen times."""

    def __init__(self, name: str = "trainer-a#1", timeout_s: float = 2.0) -> None:
        self.now = 0.0
        self.history = History(lambda: self.now)
        self.name = name
        self.timeout_s = timeout_s
        self.history.add("rl_plan", name=name.split("-")[1].split("#", maxsplit=1)[0])
        self.history.add("rl_begin", trainer=name)
        self._calls = 0

    def call(self, at: float, job: dict[str, Any]) -> int:
        self.now = at
        number = self._calls
        self._calls += 1
        self.history.add(
            "rl_call",
            trainer=self.name,
            call=number,
            op="turn",
            timeout_s=self.timeout_s,
            jobs=[job],
        )
        return number

    def returned(self, at: float, number: int, result: dict[str, Any]) -> None:
        self.now = at
        self.history.add("rl_return", trainer=self.name, call=number, results=[result])

    def raised(self, at: float, number: int, error: str) -> None:
        self.now = at
        self.history.add("rl_error", trainer=self.name, call=number, error=error)

    def loop_end(self, at: float, in_flight: int = 0) -> None:
        self.now = at
        self.history.add("rl_loop_end", trainer=self.name, in_flight=in_flight)

    def invariants(self, end: float = 100.0) -> list[str]:
        return sorted(v.invariant for v in check_trainers(self.history, end))


def _asked(ask: str = "a#1/0", submission: str = "s0") -> dict[str, Any]:
    return {
        "job": "rl-a-s0-g0",
        "submission": submission,
        "ask": ask,
        "prompt": 5,
        "n": 2,
        "max_tokens": 8,
    }


def _completed(ask: str = "a#1/0", submission: str = "s0", **fields: Any) -> dict[str, Any]:
    return {
        "job": "rl-a-s0-g0",
        "submission": submission,
        "ask": ask,
        "prompt": 5,
        "indices": [0, 1],
        "longest": 8,
        "part": False,
        **fields,
    }


def test_a_call_that_takes_its_own_answer_in_time_breaks_nothing() -> None:
    trainer = _Trainer()
    number = trainer.call(1.0, _asked())
    trainer.returned(2.5, number, _completed())
    trainer.loop_end(3.0)
    assert trainer.invariants() == []


@pytest.mark.parametrize(
    "answer",
    [
        _completed(ask="a#1/7"),
        _completed(submission="s-earlier"),
        _completed(job="rl-a-s0-g0~retry1"),
        _completed(prompt=6),
        _completed(indices=[0]),
        _completed(longest=9),
        _completed(part=True),
        {"job": "rl-a-s0-g0", "submission": "s0", "ask": "a#2/0", "failed": "engine_error"},
    ],
    ids=[
        "another-askings-tag",
        "another-submission",
        "the-resubmissions-id",
        "another-prompt",
        "too-few-completions",
        "longer-than-max-tokens",
        "a-part",
        "another-runs-failure",
    ],
)
def test_a_result_that_answers_anything_but_the_asking_is_a_wrong_answer(
    answer: dict[str, Any],
) -> None:
    trainer = _Trainer()
    number = trainer.call(1.0, _asked())
    trainer.returned(1.5, number, answer)
    trainer.loop_end(3.0)
    assert trainer.invariants() == ["trainer_wrong_answer"]


def test_a_failure_that_carries_no_tag_is_not_judged_by_it() -> None:
    """A worker that could not read the job answers without its metadata."""
    trainer = _Trainer()
    number = trainer.call(1.0, _asked())
    failed = {"job": "rl-a-s0-g0", "submission": "s0", "ask": None, "failed": "engine_error"}
    trainer.returned(1.5, number, failed)
    trainer.loop_end(3.0)
    assert trainer.invariants() == []


@pytest.mark.parametrize(
    ("ended_at", "late"), [(3.0 + SLACK_S, False), (3.0 + SLACK_S + 0.01, True)]
)
def test_a_call_ends_by_its_deadline_and_the_slack(ended_at: float, late: bool) -> None:
    trainer = _Trainer(timeout_s=2.0)
    number = trainer.call(1.0, _asked())
    trainer.returned(ended_at, number, _completed())
    trainer.loop_end(ended_at)
    assert trainer.invariants() == (["trainer_late"] if late else [])


def test_a_call_that_never_ends_hangs_unless_its_client_was_stopped() -> None:
    hung = _Trainer()
    hung.call(1.0, _asked())
    assert hung.invariants() == ["trainer_hung", "trainer_unfinished"]

    killed = _Trainer()
    killed.call(1.0, _asked())
    killed.now = 2.0
    killed.history.add("rl_killed", trainer=killed.name)
    killed.history.add("rl_begin", trainer="trainer-a#2")
    killed.name = "trainer-a#2"
    killed.loop_end(50.0)
    assert killed.invariants() == []


@pytest.mark.parametrize(
    ("error", "flagged"),
    [
        ("RolloutError: job rl-a-s0-g0 could not be produced: KafkaTimeoutError()", False),
        ("RolloutError: the client was closed", False),
        (
            "RolloutError: job rl-a-s0-g0: no answer to its sending within 2s; a failure "
            "(engine_error: not run again) echoing no submission_id came, which may answer "
            "an earlier sending of the id",
            False,
        ),
        ("RolloutError: job rl-a-s0-g0 is already in flight on this client", True),
        ("ConversationError: turn rl-a-s0-g0-c0-turn1 is still in flight: record it", True),
    ],
)
def test_a_call_fails_only_for_a_documented_reason(error: str, flagged: bool) -> None:
    trainer = _Trainer()
    number = trainer.call(1.0, _asked())
    trainer.raised(1.2, number, error)
    trainer.loop_end(3.0)
    assert trainer.invariants() == (["trainer_error"] if flagged else [])


def test_a_loop_that_ran_every_step_holds_nothing_in_flight() -> None:
    trainer = _Trainer()
    number = trainer.call(1.0, _asked())
    trainer.returned(1.5, number, _completed())
    trainer.loop_end(3.0, in_flight=2)
    assert trainer.invariants() == ["trainer_left_pending"]


def test_a_result_on_weights_older_than_its_job_asked_for_is_stale() -> None:
    """docs/operator/control-plane.md, "Versions on results": a job's `min_weight_version`
    is never run on older weights."""
    trainer = _Trainer()
    number = trainer.call(1.0, {**_asked(), "min_version": 3})
    trainer.returned(1.5, number, _completed(version=2))
    again = trainer.call(2.0, {**_asked(ask="a#1/1", submission="s1"), "min_version": 3})
    trainer.returned(2.5, again, _completed(ask="a#1/1", submission="s1", version=3))
    trainer.loop_end(3.0)
    assert trainer.invariants() == ["trainer_stale_weights"]


def _heartbeat(worker: str, at: float, interval_s: float = 5.0) -> StoredRecord:
    status = WorkerStatus(
        worker=worker,
        group="sim",
        model="m",
        weight_version=0,
        paused=False,
        in_flight=0,
        lag=0,
        engine_healthy=True,
        uptime_s=at,
        at=EPOCH_S + at,
        interval_s=interval_s,
    )
    return StoredRecord(0, int(at * 1000), None, encode(status), [], worker)


def _ack(worker: str, at: float, command_id: str = "cmd-1", outcome: str = "ok") -> StoredRecord:
    ack = CommandAck(
        worker=worker,
        group="sim",
        command_id=command_id,
        kind="update_weights",
        outcome=outcome,  # type: ignore[arg-type]
        duration_s=0.1,
        weight_version=1,
        at=EPOCH_S + at,
    )
    return StoredRecord(0, int(at * 1000), None, encode(ack), [], worker)


def _update(trainer: _Trainer, asked: float, returned: float, timeout_s: float = 10.0) -> None:
    trainer.now = asked
    trainer.history.add(
        "rl_update", trainer=trainer.name, call=0, version=1, force=False, timeout_s=timeout_s
    )
    trainer.now = returned
    trainer.history.add(
        "rl_updated", trainer=trainer.name, call=0, command_id="cmd-1", workers=["w0"]
    )


@pytest.mark.parametrize(
    ("status", "flagged"),
    [
        ([_heartbeat("w0", 8.0), _heartbeat("w1", 9.0), _ack("w0", 10.5)], True),
        ([_heartbeat("w0", 8.0), _heartbeat("w1", 9.0), _ack("w0", 10.5), _ack("w1", 12.5)], True),
        ([_heartbeat("w0", 8.0), _heartbeat("w1", 9.0), _ack("w0", 10.5), _ack("w1", 11.5)], False),
        (
            [_heartbeat("w0", 8.0), _heartbeat("w1", 9.0), *map(_ack, ["w0", "w1"], [10.5, 11])],
            False,
        ),
        (
            [_heartbeat("w0", 8.0), _heartbeat("w1", 9.0), _ack("w0", 10.5), _ack("w1", 11, "x")],
            True,
        ),
        (
            [
                _heartbeat("w0", 8.0),
                _heartbeat("w1", 9.0),
                _ack("w0", 10.5),
                _ack("w1", 11, outcome="failed"),
            ],
            True,
        ),
        ([_heartbeat("w0", 8.0), _heartbeat("w1", -20.0), _ack("w0", 10.5)], False),
        ([_heartbeat("w0", 8.0), _heartbeat("w1", 10.2), _ack("w0", 10.5)], False),
    ],
    ids=[
        "a-live-worker-never-acked",
        "acked-after-the-call-returned",
        "every-live-worker-acked-in-time",
        "both-acked",
        "acked-another-command",
        "acked-failed",
        "silent-for-longer-than-its-window",
        "first-heard-after-the-call-began",
    ],
)
def test_an_update_returns_only_once_every_live_worker_acknowledged_it(
    status: list[StoredRecord], flagged: bool
) -> None:
    trainer = _Trainer()
    _update(trainer, asked=10.0, returned=12.0)
    trainer.loop_end(13.0)
    found = sorted(v.invariant for v in check_trainers(trainer.history, 100.0, [status]))
    assert found == (["trainer_update_unacknowledged"] if flagged else [])


def test_an_update_call_ends_by_its_timeout_or_is_late_or_hung() -> None:
    late = _Trainer()
    _update(late, asked=1.0, returned=1.0 + 10.0 + UPDATE_SLACK_S + 0.1)
    late.loop_end(30.0)
    assert late.invariants() == ["trainer_update_late"]

    hung = _Trainer()
    hung.now = 1.0
    hung.history.add("rl_update", trainer=hung.name, call=0, version=1, timeout_s=10.0)
    assert hung.invariants() == ["trainer_hung", "trainer_unfinished"]


# -- runs -------------------------------------------------------------------------------------


def _short_trainer(seed: int) -> Scenario:
    return Scenario(seed=seed, duration_s=30.0, settle_s=30.0, trainer=True)


def test_a_run_with_the_trainer_replays_exactly() -> None:
    """Submission ids are drawn from the run's seed (`seeded_uuids`), so what a trainer appends
    is the same in every run of a seed."""
    first, second = run(_short_trainer(3)), run(_short_trainer(3))
    assert first.digest == second.digest
    assert sum(1 for _ in first.history.of("rl_call")) > 5


def test_the_first_run_of_a_process_replays_as_the_runs_after_it() -> None:
    """A library imported for the first time during a run draws ids at import (OpenTelemetry's
    context keys): they shifted the trainers' submission and command ids in the first run of
    a process only, so a sweep's seed could differ from its replay."""
    script = (
        "from worker.dev.sim.run import Scenario, run; "
        "s = Scenario(seed=3, duration_s=30.0, settle_s=30.0, trainer=True); "
        "print(run(s).digest, run(s).digest)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    first, second = done.stdout.split()
    assert first == second


def test_the_trainer_flag_set_drives_the_client_through_expiries_reruns_and_echoes() -> None:
    """The net reaches what it is for: calls that expire and are run again, answers to
    earlier askings appended again, weight updates through the client and jobs that ask for
    their versions, and every call judged."""
    outcome = run(flag_set_scenario("trainer", 2, 3))
    results = [r for e in outcome.history.of("rl_return") for r in e.fields["results"]]
    expired = [r for r in results if r.get("failed") == "expired"]
    completed_ = [r for r in results if "failed" not in r]
    assert expired, "no call expired"
    assert len(completed_) > len(expired)
    assert any(outcome.history.of("rl_echoed"))
    assert any(outcome.history.of("rl_loop_end"))
    updated = [e.fields["call"] for e in outcome.history.of("rl_updated")]
    assert len(updated) >= 2, "the loop put fewer than two versions on the fleet"
    floors = [j.get("min_version") for e in outcome.history.of("rl_call") for j in e.fields["jobs"]]
    assert max(f or 0 for f in floors) >= 2, "no job asked for the weights the loop put"
    assert outcome.violations == [], "\n".join(map(str, outcome.violations[:5]))


def test_a_forced_rollback_through_the_client_is_the_weights_the_fleet_converges_to() -> None:
    """Seed 9300006, three workers: the loop put version 4 on the fleet, then rolled it back
    to 3, which every worker serves at the end. The run's checker took the highest version
    ever applied (4) for the fleet's, and flagged every worker `weights_diverged`."""
    outcome = run(flag_set_scenario("trainer", 9300006, 3))
    updates = [e.fields for e in outcome.history.of("rl_update")]
    assert any(u["force"] for u in updates), "the seed no longer rolls back"
    assert outcome.violations == [], "\n".join(map(str, outcome.violations[:5]))


def test_a_rollback_that_failed_on_one_worker_leaves_the_loop_able_to_finish() -> None:
    """Seed 9400009, three workers: a forced rollback from 2 to 1 was applied by two workers
    and not answered by the third. The loop kept asking its jobs for version 2, which the
    rolled-back workers held until each expired, and never ran its last step."""
    outcome = run(flag_set_scenario("trainer", 9400009, 3))
    failed = [e.fields for e in outcome.history.of("rl_update_error")]
    assert failed, "the seed no longer fails an update"
    assert outcome.violations == [], "\n".join(map(str, outcome.violations[:5]))


def test_a_late_answer_to_an_earlier_sending_carries_its_own_generations_weights() -> None:
    """Seed 9400002, five workers: one process generated a turn on weights 0, then its re-run
    (the same job id) on weights 1, and sent the first answer after the second generation.
    The run's checker compared it with the process's last generation of that id and flagged
    `wrong_weights`; each answer carries its own generation's version."""
    outcome = run(flag_set_scenario("trainer", 9400002, 5))
    assert outcome.violations == [], "\n".join(map(str, outcome.violations[:5]))


def test_a_conversation_whose_floor_the_fleet_no_longer_serves_is_dropped() -> None:
    """Seed 7600039, one worker: trainer a rolled the fleet back from 3 to 2 while trainer b's
    conversations stood between turns on 3. Their next turns could only expire; the loop now
    drops each such conversation (as a trainer drops a sample) and finishes its steps."""
    outcome = run(flag_set_scenario("trainer", 7600039, 1))
    dropped = [e.fields for e in outcome.history.of("rl_conversation_dropped")]
    assert dropped, "the seed no longer rolls back below a conversation"
    assert all(max(d["served"]) < d["floor"] for d in dropped)
    assert outcome.violations == [], "\n".join(map(str, outcome.violations[:5]))


def test_without_the_trainer_no_trainer_event_is_recorded() -> None:
    outcome = run(Scenario(seed=4, duration_s=15.0, settle_s=15.0))
    assert not [e for e in outcome.history.events if e.kind.startswith("rl_")]


class _RefusingProducer:
    """A producer whose broker refuses the records of one job id (a partition whose leader is
    away past `request_timeout_ms`) and takes the rest."""

    def __init__(self, topics: Topics, refused: str) -> None:
        self._topics = topics
        self._refused = refused.encode()

    async def send(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if key == self._refused:
            done.set_exception(KafkaTimeoutError())
        else:
            self._topics.produced(value)
            done.set_result(None)
        return done

    async def stop(self) -> None:
        return


async def test_a_generate_that_fails_leaves_none_of_its_jobs_in_flight(topics: Topics) -> None:
    """One job of a `generate` the broker refuses fails the call; its other jobs are no longer
    waited for, so the caller can run the same jobs again at once. Before, they stayed in
    flight until their timeout, and running the group again raised 'already in flight'."""
    client = topics.client(timeout_s=30, max_retries=0)
    client._producer = _RefusingProducer(topics, "g0")
    jobs = [{"job_id": f"g{i}", "prompt_token_ids": prompt(3)} for i in range(3)]
    with pytest.raises(RolloutError, match="g0 could not be produced"):
        await asyncio.wait_for(client.generate(jobs), 2)
    await asyncio.sleep(0)  # the client forgets a cancelled job from the loop's next turn
    assert client.in_flight == 0

    client._producer = _RefusingProducer(topics, "none")
    again = asyncio.create_task(client.generate(jobs))
    for number in range(3):
        topics.publish(completed(await topics.job(2 + number), [number + 1]))
    results = await asyncio.wait_for(again, 2)

    assert [r.completions[0].token_ids for r in results] == [[1], [2], [3]]  # type: ignore[union-attr]
    assert client.in_flight == 0


async def test_a_restarted_trainer_does_not_take_its_previous_runs_crash_looped_failure(
    topics: Topics,
) -> None:
    """The previous run's job, in flight at two worker deaths, is answered 'not run again'
    (by the worker's own `AnswerBuilder.crash_looped`) after the restarted loop sent the same
    id: that failure is the earlier sending's, not the new one's. Before, it echoed no
    submission and the client took a failure without one for any sending of its id."""
    before = topics.client(timeout_s=3)
    before.submit({"job_id": "step0-g0", "prompt_token_ids": prompt(5)})
    previous = await topics.job(0)
    await before.close()

    after = topics.client(timeout_s=3)
    future = after.submit({"job_id": "step0-g0", "prompt_token_ids": prompt(5)})
    current = await topics.job(1)
    answer = await answer_builder().crash_looped(
        TopicPartition("jobs", 0), job_record(json.dumps(previous).encode()), deaths=2
    )
    crash_looped = json.loads(answer.records[-1].value or b"")
    assert crash_looped["type"] == "failed" and "not run again" in crash_looped["error"]["detail"]
    topics.publish(crash_looped)
    topics.publish(completed(current, [2]))
    result = await asyncio.wait_for(future, 2)

    assert isinstance(result, Completed)
    assert result.completions[0].token_ids == [2]
