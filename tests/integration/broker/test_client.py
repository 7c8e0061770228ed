"""RolloutClient against a real broker: order, duplicates, parts, retries, timeouts, reply_to."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import (
    Completed,
    Completion,
    ErrorCode,
    ErrorInfo,
    Failed,
    Job,
    Part,
    Result,
    RoutedExperts,
    SamplingSpec,
    SchemaError,
    decode_job,
    encode,
)
from worker.client.conversation import Conversation
from worker.client.rollout import RETRY_SEPARATOR, RolloutClient, RolloutError
from worker.dev.harness.fleet import Results
from worker.dev.harness.topics import make_fleet
from worker.dev.harness.waiting import wait_for

pytestmark = pytest.mark.broker

Answer = Callable[[Job, int], list[Result]]


class Responder:
    """Stands in for the fleet: answers each job it reads with what `answer(job, n)` returns
    (n: how many jobs it has answered before), so a test decides every record the client sees."""

    def __init__(self, bs: str, jobs: str, results: str, answer: Answer) -> None:
        self.bs, self.jobs, self.results, self.answer = bs, jobs, results, answer
        self.seen: list[Job] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Responder:
        self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bs, enable_auto_commit=False)
        self._producer = AIOKafkaProducer(bootstrap_servers=self.bs)
        await self._consumer.start()
        await self._producer.start()
        tp = TopicPartition(self.jobs, 0)
        self._consumer.assign([tp])
        await self._consumer.seek_to_beginning(tp)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._consumer.stop()
        await self._producer.stop()

    async def _run(self) -> None:
        while True:
            for records in (await self._consumer.getmany(timeout_ms=100)).values():
                for record in records:
                    job = decode_job(record.value)
                    answers = self.answer(job, len(self.seen))
                    self.seen.append(job)
                    for result in answers:
                        await self._producer.send_and_wait(
                            self.results, encode(result), key=job.job_id.encode()
                        )


def done(job: Job, text: str = "ok", **kwargs: Any) -> Completed:
    """A worker's answer to `job`, echoing its submission as every worker's answer does."""
    kwargs.setdefault("submission_id", echo(job))
    return Completed(
        job_id=job.job_id,
        completions=[Completion(index=0, token_ids=[1, 2], text=text, finish_reason="stop")],
        prompt_token_count=1,
        **kwargs,
    )


def echo(job: Job) -> str | msgspec.UnsetType:
    """The submission a worker's answer to `job` echoes: the job's, absent when it has none."""
    return msgspec.UNSET if job.submission_id is None else job.submission_id


def job(job_id: str, **kwargs: Any) -> Job:
    return Job(job_id=job_id, prompt="hi", sampling=SamplingSpec(max_tokens=2), **kwargs)


async def topics(new_topic: Any) -> tuple[str, str]:
    return await new_topic(1), await new_topic(1)


def client(bs: str, jobs: str, results: str, **kwargs: Any) -> RolloutClient:
    return RolloutClient(bootstrap_servers=bs, jobs_topic=jobs, results_topic=results, **kwargs)


async def test_results_come_back_in_job_order_once_each_despite_duplicates(
    kafka_bootstrap_servers, new_topic
):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)
    # Every answer twice, and another trainer's answer on the same topic.
    stranger = done(job("not-mine"))

    def answer(j: Job, n: int) -> list[Result]:
        return [done(j, text=j.job_id), stranger, done(j, text=j.job_id)]

    progress: list[tuple[int, int]] = []
    async with (
        Responder(bs, jobs_topic, results_topic, answer),
        client(
            bs, jobs_topic, results_topic, on_progress=lambda d, t: progress.append((d, t))
        ) as c,
    ):
        batches = [[job(f"b{b}-{i}") for i in range(10)] for b in range(5)]
        got = await asyncio.gather(*(c.generate(batch) for batch in batches))
        assert c.in_flight == 0
    for batch, results in zip(batches, got, strict=True):
        assert [r.job_id for r in results] == [j.job_id for j in batch]
        assert all(isinstance(r, Completed) and r.completions[0].text == r.job_id for r in results)
    assert progress[-1] == (50, 50) and len(progress) == 50


async def test_split_results_are_reassembled_from_one_attempt(kafka_bootstrap_servers, new_topic):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)

    def completion(i: int, attempt: str) -> Completion:
        return Completion(index=i, token_ids=[i], text=f"{attempt}{i}", finish_reason="length")

    def answer(j: Job, n: int) -> list[Result]:
        base = done(j)
        cut = msgspec.structs.replace(
            base, completions=[completion(0, "a")], part=Part(index=0, count=3, attempt="a")
        )
        parts = [
            msgspec.structs.replace(
                base, completions=[completion(i, "b")], part=Part(index=i, count=3, attempt="b")
            )
            for i in range(3)
        ]
        return [cut, parts[2], parts[0], parts[0], parts[1]]

    async with (
        Responder(bs, jobs_topic, results_topic, answer),
        client(bs, jobs_topic, results_topic) as c,
    ):
        (result,) = await c.generate([job("split")])
    assert isinstance(result, Completed) and not result.is_part
    assert [x.text for x in result.completions] == ["b0", "b1", "b2"]


async def test_retryable_failures_are_resubmitted_up_to_the_limit(
    kafka_bootstrap_servers, new_topic
):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)

    def answer(j: Job, n: int) -> list[Result]:
        original = j.job_id.split(RETRY_SEPARATOR)[0]
        tries = j.job_id.count(RETRY_SEPARATOR) and int(j.job_id.split(RETRY_SEPARATOR)[1])
        if original == "flaky" and tries < 1:
            return [
                Failed(
                    job_id=j.job_id,
                    error=ErrorInfo(code=ErrorCode.ENGINE_ERROR, detail="oom", retryable=True),
                    submission_id=echo(j),
                )
            ]
        if original == "hopeless":
            return [
                Failed(
                    job_id=j.job_id,
                    error=ErrorInfo(code=ErrorCode.ABORTED, detail="again", retryable=True),
                    submission_id=echo(j),
                )
            ]
        if original == "invalid":
            return [
                Failed(
                    job_id=j.job_id,
                    error=ErrorInfo(code=ErrorCode.INVALID_JOB, detail="no"),
                    submission_id=echo(j),
                )
            ]
        return [done(j)]

    async with (
        Responder(bs, jobs_topic, results_topic, answer) as responder,
        client(bs, jobs_topic, results_topic, max_retries=2) as c,
    ):
        flaky, hopeless, invalid = await c.generate([job("flaky"), job("hopeless"), job("invalid")])
    assert isinstance(flaky, Completed) and flaky.job_id == "flaky"
    assert isinstance(hopeless, Failed) and hopeless.job_id == "hopeless"
    assert hopeless.error.code is ErrorCode.ABORTED  # the last failure, after 2 resubmissions
    assert isinstance(invalid, Failed) and invalid.error.code is ErrorCode.INVALID_JOB
    sent = [j.job_id for j in responder.seen]
    assert sent.count("hopeless") == 1 and f"hopeless{RETRY_SEPARATOR}2" in sent
    assert f"hopeless{RETRY_SEPARATOR}3" not in sent and "invalid~retry1" not in sent


async def test_a_job_nobody_answers_times_out_with_a_clear_answer(
    kafka_bootstrap_servers, new_topic
):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)
    async with (
        Responder(bs, jobs_topic, results_topic, lambda j, n: []) as responder,
        client(bs, jobs_topic, results_topic, timeout_s=1.0) as c,
    ):
        t0 = time.monotonic()
        (result,) = await c.generate([job("lost", metadata={"step": "2"})])
        waited = time.monotonic() - t0
    assert isinstance(result, Failed) and result.error.code is ErrorCode.EXPIRED
    assert "no result within 1s" in result.error.detail and result.metadata == {"step": "2"}
    # Not before the timeout; the upper bound only says it did not hang (a busy machine may be
    # slow to schedule the answer, so it is generous).
    assert 1.0 <= waited < 30.0, waited
    # The job itself carried the deadline, so no worker starts it after the client gave up.
    (sent,) = responder.seen
    assert sent.deadline is not None and sent.deadline <= time.time()


async def test_payload_references_are_read_checked_and_inlined(
    kafka_bootstrap_servers, new_topic, tmp_path
):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)
    rows = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    inline = RoutedExperts.from_array(rows, start=1)
    good = tmp_path / "good.bin"
    good.write_bytes(inline.data)
    sha = hashlib.sha256(inline.data).hexdigest()

    def answer(j: Job, n: int) -> list[Result]:
        path = good if j.job_id == "ref" else tmp_path / "gone.bin"
        ref = inline.as_reference(path.as_uri(), sha)
        c = Completion(index=0, token_ids=[1, 2], text="", finish_reason="stop", routed_experts=ref)
        return [
            Completed(job_id=j.job_id, completions=[c], prompt_token_count=1, submission_id=echo(j))
        ]

    async with (
        Responder(bs, jobs_topic, results_topic, answer),
        client(bs, jobs_topic, results_topic, payload_root=tmp_path) as c,
    ):
        result = await c.submit(job("ref"))
        with pytest.raises(RolloutError, match="is missing"):
            await c.submit(job("missing"))
    assert isinstance(result, Completed)
    routed = result.completions[0].routed_experts
    assert routed is not None and not routed.is_reference
    np.testing.assert_array_equal(routed.to_array(), rows)


async def test_bad_use_of_the_client_is_refused(kafka_bootstrap_servers, new_topic):
    bs = kafka_bootstrap_servers
    with pytest.raises(ValueError, match="timeout_s"):
        RolloutClient(bootstrap_servers=bs, timeout_s=0)
    unstarted = RolloutClient(bootstrap_servers=bs)
    with pytest.raises(RolloutError, match="not started"):
        unstarted.submit(job("x"))
    with pytest.raises(RolloutError, match="does not exist"):
        async with RolloutClient(bootstrap_servers=bs, results_topic="vkw-no-such-topic"):
            pass
    jobs_topic, results_topic = await topics(new_topic)
    async with client(bs, jobs_topic, results_topic, timeout_s=5) as c:
        first = c.submit(job("twice"))
        with pytest.raises(RolloutError, match="already in flight"):
            c.submit(job("twice"))
        first.cancel()


async def test_reply_to_inside_the_allow_list_and_outside_it(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    mine = await new_topic(1)  # a name the pattern below allows
    w = await start_steered(fleet, "w1", reply_topics=f"{mine}|other-trainer-.*")
    async with client(bs, fleet.topics.jobs, mine, reply_to=True, timeout_s=20) as c:
        results = await c.generate([job(f"r{i}") for i in range(5)])
    assert all(isinstance(r, Completed) for r in results)
    outside = await new_topic(1)
    async with Results(bs, fleet.topics.results) as default:
        async with client(bs, fleet.topics.jobs, outside, reply_to=True, timeout_s=2) as c:
            (lost,) = await c.generate([job("elsewhere")])
        assert (
            isinstance(lost, Failed) and lost.error.code is ErrorCode.EXPIRED
        )  # never answered there
        answered = (await default.wait("elsewhere"))["elsewhere"]
    assert isinstance(answered, Failed) and answered.error.code is ErrorCode.INVALID_JOB
    assert "is not a topic this worker answers to" in answered.error.detail
    assert await w.stop() == 0


async def test_the_client_updates_weights_and_reads_status(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w1 = await start_steered(fleet, "w1")
    w2 = await start_steered(fleet, "w2")
    ckpt = tmp_path / "b"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"name": "b"}))
    options = {
        "control_topic": fleet.control,
        "status_topic": fleet.status,
        "group_id": fleet.topics.group,
    }
    async with client(bs, fleet.topics.jobs, fleet.topics.results, **options) as c:
        await wait_for(lambda: _two(c), 20, "two live workers")
        acks = await c.update_weights(str(ckpt), 6, mode="keep")
        assert set(acks) == {"w1", "w2"} and all(a.weight_version == 6 for a in acks.values())
        (result,) = await c.generate([job("after")])
        assert isinstance(result, Completed) and result.weight_version == 6
        with pytest.raises(RolloutError, match=r"config\.json is missing"):
            await c.update_weights(str(tmp_path / "nope"), 7)
    for w in (w1, w2):
        assert await w.stop() == 0


async def _two(c: RolloutClient) -> bool:
    return len(await c.status()) == 2


async def test_submit_wait_prints_every_result_through_the_client(
    kafka_bootstrap_servers, new_topic, start_steered, tmp_path
):
    from tests.integration.broker.test_control import cli  # noqa: PLC0415 - the non-blocking CLI runner

    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    w = await start_steered(fleet, "w1")
    lines = tmp_path / "jobs.jsonl"
    lines.write_text(
        "\n".join(encode(job(f"s{i}")).decode() for i in range(3))
        + '\n{"prompt": "x", "sampling": {"max_tokens": 2}, "min_weight_version": 99}\n'
    )
    out = tmp_path / "results.jsonl"
    common = ["--bootstrap-servers", bs, "--jobs-topic", fleet.topics.jobs]
    common += ["--results-topic", fleet.topics.results, "--no-progress"]
    rc, stdout, stderr = await cli(
        "submit", str(lines), "--wait", "--timeout-s", "3", "--out", str(out), *common
    )
    # Three answered; the fourth waits for a weight version that never comes: answered
    # expired by the client's timeout, and the exit status says not everything completed.
    assert rc == 1, stderr
    printed = stdout.splitlines()
    assert [line.split()[0] for line in printed[:3]] == ["s0", "s1", "s2"]
    assert "failed expired" in printed[3]
    assert "3 completed, 1 failed" in stderr
    assert len(out.read_bytes().splitlines()) == 4
    rc, _, stderr = await cli("submit", str(lines), "--wait", "--timeout-s", "0", *common)
    assert rc == 2 and "--timeout-s must be > 0" in stderr
    assert await w.stop() == 0


async def test_a_job_the_producer_refuses_fails_alone(kafka_bootstrap_servers, new_topic):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)
    # Over the producer's 1 MiB request limit, yet a valid job (prompts may be 4 Mi chars).
    huge = Job(job_id="huge", prompt="x" * (2 * 1024 * 1024), sampling=SamplingSpec(max_tokens=2))
    async with (
        Responder(bs, jobs_topic, results_topic, lambda j, n: [done(j)]) as responder,
        client(bs, jobs_topic, results_topic, timeout_s=20) as c,
    ):
        refused, fine = c.submit(huge), c.submit(job("fine"))
        with pytest.raises(RolloutError, match="job huge could not be produced"):
            await refused
        assert isinstance(await fine, Completed)
        assert c.in_flight == 0
    assert [j.job_id for j in responder.seen] == ["fine"]


async def test_jobs_may_be_mappings_and_a_bad_one_names_its_field_before_anything_is_sent(
    kafka_bootstrap_servers, new_topic
):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)
    async with (
        Responder(bs, jobs_topic, results_topic, lambda j, n: [done(j)]) as responder,
        client(bs, jobs_topic, results_topic) as c,
    ):
        wire = {"job_id": "as-dict", "prompt": "hi", "sampling": {"max_tokens": 2}}
        (result,) = await c.generate([wire])
        assert isinstance(result, Completed) and result.job_id == "as-dict"
        bad = {"job_id": "bad", "prompt": "hi", "sampling": {"max_tokens": -1}}
        with pytest.raises(SchemaError) as caught:
            await c.generate([job("fine"), bad])
        assert caught.value.path == "$.sampling.max_tokens"
        assert str(caught.value).startswith("job 1: ")
        # A Job built in Python is checked as the wire checks it too.
        with pytest.raises(SchemaError, match=r"\$\.sampling\.n"):
            c.submit(Job(job_id="n0", prompt="hi", sampling=SamplingSpec(n=0)))
        assert c.in_flight == 0
        await c.generate([job("after")])
    assert [j.job_id for j in responder.seen] == ["as-dict", "after"]  # nothing bad was sent


async def test_a_reader_that_dies_fails_every_pending_job_at_once(
    kafka_bootstrap_servers, new_topic
):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)
    async with client(bs, jobs_topic, results_topic, timeout_s=600) as c:
        assert c._consumer is not None

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the reader broke")

        c._consumer.getmany = broken
        future = c.submit(job("waiting"))
        t0 = time.monotonic()
        with pytest.raises(RolloutError, match="the reader broke"):
            await asyncio.wait_for(future, 30)
        assert time.monotonic() - t0 < 30  # not at its 600 s timeout
        with pytest.raises(RolloutError, match="stopped"):
            c.submit(job("later"))


async def test_the_clients_connection_options_reach_the_fleet_it_steers(monkeypatch):
    seen: list[dict[str, Any]] = []

    class Refused(Exception):
        pass

    def fleet(connection: dict[str, Any], **topics: str) -> Any:
        seen.append({**connection, **topics})
        raise Refused

    monkeypatch.setattr("worker.client.steering.Fleet", fleet)
    c = RolloutClient(
        bootstrap_servers="127.0.0.1:1",
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_plain_username="trainer",
        sasl_plain_password="secret",
        control_topic="ctl",
        status_topic="st",
    )
    with pytest.raises(Refused):
        await c.status()
    with pytest.raises(Refused):
        await c.update_weights("/ckpt", 1)
    for connection in seen:
        assert connection["security_protocol"] == "SASL_PLAINTEXT"
        assert connection["sasl_plain_username"] == "trainer"
        assert (connection["control_topic"], connection["status_topic"]) == ("ctl", "st")
    assert len(seen) == 2


async def test_a_caller_that_stops_waiting_leaves_nothing_pending_and_may_submit_again(
    kafka_bootstrap_servers, new_topic
):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)
    answered = asyncio.Event()

    def answer(j: Job, n: int) -> list[Result]:
        # The first sending of each job goes unanswered; the second is answered.
        if n < 2:
            return []
        answered.set()
        return [done(j, text=j.job_id)]

    async with (
        Responder(bs, jobs_topic, results_topic, answer) as responder,
        client(bs, jobs_topic, results_topic) as c,
    ):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(c.submit(job("a")), 0.5)
        generating = asyncio.create_task(c.generate([job("b")]))
        await wait_for(lambda: len(responder.seen) == 2, 30, "both jobs to reach the fleet")
        generating.cancel()
        await asyncio.gather(generating, return_exceptions=True)
        assert c.in_flight == 0
        # The same ids go again, and this time they are answered.
        again = await asyncio.wait_for(c.generate([job("a"), job("b")]), 30)
        assert [r.job_id for r in again] == ["a", "b"] and answered.is_set()
        assert c.in_flight == 0


async def test_a_job_id_sent_again_takes_its_own_answer_never_the_late_one_of_its_first_sending(
    kafka_bootstrap_servers, new_topic
):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)
    held: list[Job] = []

    def answer(j: Job, n: int) -> list[Result]:
        # The first sending is answered only once the second arrives, and first.
        if n == 0:
            held.append(j)
            return []
        (late,) = held
        return [
            done(late, text="first sending", submission_id=echo(late)),
            done(j, text="second sending", submission_id=echo(j)),
        ]

    async with (
        Responder(bs, jobs_topic, results_topic, answer) as responder,
        client(bs, jobs_topic, results_topic, max_retries=0) as c,
    ):
        with pytest.raises(TimeoutError):  # its caller stops waiting for the first sending
            await asyncio.wait_for(c.submit(job("a")), 1.0)
        second = await asyncio.wait_for(c.submit(job("a", metadata={"try": "2"})), 30)
        assert c.in_flight == 0
    assert isinstance(second, Completed) and second.completions[0].text == "second sending"
    assert second.job_id == "a"
    sent = [j.submission_id for j in responder.seen]
    assert len(sent) == 2 and None not in sent and sent[0] != sent[1]


async def test_a_failed_turn_runs_again_on_the_same_client(kafka_bootstrap_servers, new_topic):
    bs = kafka_bootstrap_servers
    jobs_topic, results_topic = await topics(new_topic)

    def answer(j: Job, n: int) -> list[Result]:
        if n == 0:
            error = ErrorInfo(code=ErrorCode.ENGINE_ERROR, detail="the engine failed")
            return [Failed(job_id=j.job_id, error=error, submission_id=echo(j))]
        prompt = j.prompt_token_ids or []
        completion = Completion(index=0, token_ids=[7, 8], text="", finish_reason="stop")
        return [
            Completed(
                job_id=j.job_id,
                completions=[completion],
                prompt_token_count=len(prompt),
                submission_id=echo(j),
            )
        ]

    conversation = Conversation(return_routed_experts=False)
    async with (
        Responder(bs, jobs_topic, results_topic, answer),
        client(bs, jobs_topic, results_topic, timeout_s=20.0) as c,
    ):
        failed = await asyncio.wait_for(c.turn(conversation, [1, 2, 3]), 30)
        assert isinstance(failed, Failed) and conversation.turns == []
        started = time.monotonic()
        again = await asyncio.wait_for(c.turn(conversation, [1, 2, 3]), 30)
        assert time.monotonic() - started < 10  # answered, not expired at the client's timeout
    assert isinstance(again, Completed) and again.completions[0].token_ids == [7, 8]
    assert conversation.token_ids == [1, 2, 3, 7, 8]
