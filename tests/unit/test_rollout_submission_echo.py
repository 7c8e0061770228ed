"""Which sending of a job id a failure answers: every failed result a worker writes for a record
it can read a `submission_id` from echoes it, the last fallbacks included, and `RolloutClient`
takes for a sending only answers that echo that sending's submission."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from aiokafka import TopicPartition

from schemas import ErrorCode, Failed, decode_result
from tests.unit.test_answers import RESULTS, builder, job, record, value_of
from tests.unit.test_rollout_answers import Topics, completed, failed, prompt
from worker.answering.records import Answer, RecordKind
from worker.client.rollout import RolloutError

TP = TopicPartition("jobs", 0)


def the_failure(answer: Answer) -> Failed:
    (result,) = [r for r in answer.records if r.kind is RecordKind.RESULT]
    failure = decode_result(value_of(result))
    assert isinstance(failure, Failed)
    return failure


async def test_a_crash_looped_record_is_answered_with_its_submission() -> None:
    answer = await builder().crash_looped(TP, record(job(submission_id="s-1")), deaths=2)
    failure = the_failure(answer)
    assert "not run again" in failure.error.detail
    assert failure.submission_id == "s-1"


async def test_an_internal_error_is_answered_with_the_jobs_submission() -> None:
    """`ScriptedEngine` raises a bug for `fail: bug`: the worker's one broad catch answers."""
    value = job(submission_id="s-2", metadata={"fail": "bug"})
    failure = the_failure(await builder().answer(TP, record(value)))
    assert failure.error.code == ErrorCode.INTERNAL_ERROR
    assert failure.submission_id == "s-2"


async def test_an_invalid_job_is_answered_with_the_submission_it_names() -> None:
    """A record that decodes only partly: a map with a valid `submission_id` string."""
    value = json.dumps({"job_id": "x", "prompt": 5, "submission_id": "s-3"}).encode()
    failure = the_failure(await builder().answer(TP, record(value)))
    assert failure.error.code == ErrorCode.INVALID_JOB
    assert (failure.job_id, failure.submission_id) == ("x", "s-3")


@pytest.mark.parametrize(
    "named",
    [None, "", "s" * 65, 7, ["s"], {"s": "t"}],
    ids=["null", "empty", "too-long", "a-number", "a-list", "a-map"],
)
async def test_a_submission_a_reader_would_refuse_is_not_echoed(named: Any) -> None:
    """A reader decodes a result whose `submission_id` is not 1-64 chars as no result at all
    (`schemas.results.SubmissionId`): echoing it would lose the whole answer."""
    value = json.dumps({"job_id": "x", "prompt": 5, "submission_id": named}).encode()
    answer = await builder().answer(TP, record(value))
    failure = the_failure(answer)
    assert failure.error.code == ErrorCode.INVALID_JOB
    assert failure.submission_id is msgspec.UNSET


async def test_a_result_too_large_for_the_broker_is_answered_with_the_submission() -> None:
    b = builder()
    answer = await b.answer(TP, record(job(submission_id="s-4", metadata={"k": "v" * 1000})))
    smaller = b.smaller(answer, 0, "the broker (RecordTooLarge)")
    assert smaller is not None and smaller.records[0].minimal
    failure = the_failure(smaller)
    assert failure.error.code == ErrorCode.RESULT_TOO_LARGE
    assert failure.submission_id == "s-4"


async def test_a_failure_too_large_for_its_topic_falls_back_keeping_the_submission() -> None:
    """The last fallback of a failure (its metadata too large for the topic's limit)."""
    b = builder({RESULTS: 64 * 1024})
    huge = {f"m{i}": "x" * 8_000 for i in range(12)}
    value = job(submission_id="s-5", metadata={**huge, "fail": "invalid"})
    answer = await b.answer(TP, record(value))
    assert answer.records[0].minimal
    assert the_failure(answer).submission_id == "s-5"


async def test_an_answer_moved_off_a_refused_reply_topic_keeps_the_submission() -> None:
    b = builder()
    answer = await b.answer(TP, record(job(submission_id="s-6")))
    moved_from = msgspec.structs.replace(
        answer, records=(msgspec.structs.replace(answer.records[0], topic="reply-here"),)
    )
    moved = b.unwritable(moved_from, 0, "TopicAuthorizationFailedError")
    assert moved is not None and moved.records[0].topic == RESULTS
    failure = the_failure(moved)
    assert failure.error.code == ErrorCode.INVALID_JOB
    assert failure.submission_id == "s-6"


async def test_a_failure_echoing_a_submission_decodes_on_the_schema_before_it() -> None:
    """A trainer whose `Failed` has no `submission_id` field decodes it (msgspec ignores unknown
    fields), so the echo changes nothing for it."""

    answer = await builder().crash_looped(TP, record(job(submission_id="s-7")), deaths=2)
    (result,) = [r for r in answer.records if r.kind is RecordKind.RESULT]
    old = msgspec.json.decode(value_of(result), type=FailedBefore)
    assert (old.job_id, old.error.code) == ("j", "engine_error")


class ErrorBefore(msgspec.Struct):
    code: str
    detail: str
    retryable: bool = False


class FailedBefore(msgspec.Struct, tag="failed", tag_field="type"):
    """`schemas.results.Failed` before it had `submission_id`."""

    job_id: str | None
    error: ErrorBefore
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    worker: str = ""


@pytest.fixture
async def topics() -> Any:
    topics = Topics()
    yield topics
    await topics.close()


async def test_a_failure_echoing_no_submission_is_not_taken_and_the_job_ends_with_rollout_error(
    topics: Topics,
) -> None:
    """It may answer an earlier sending of the id (a worker that could not read this one's
    submission): the sending waits for its own answer, and without one fails at its timeout
    with `RolloutError` saying what came. Before, the failure was taken at once."""
    client = topics.client(timeout_s=0.5, max_retries=0)
    future = client.submit({"job_id": "g0", "prompt_token_ids": prompt(3)})
    anonymous = failed(await topics.job(0))
    del anonymous["submission_id"]
    topics.publish(anonymous)
    await asyncio.sleep(0.2)
    assert not future.done()

    with pytest.raises(RolloutError, match=r"job g0: .*engine_error.* echoing no submission_id"):
        await asyncio.wait_for(future, 2)
    assert client.in_flight == 0


async def test_a_completed_result_echoing_no_submission_is_not_taken(topics: Topics) -> None:
    """Same prompt, same id: a restarted trainer's deterministic job, answered for its
    previous run by a worker that echoes no submission."""
    client = topics.client(timeout_s=3, max_retries=0)
    future = client.submit({"job_id": "g0", "prompt_token_ids": prompt(3)})
    sent = await topics.job(0)
    topics.publish(completed(sent, [1], echo=False))
    topics.publish(completed(sent, [2]))
    result = await asyncio.wait_for(future, 2)
    assert result.completions[0].token_ids == [2]  # type: ignore[union-attr]


async def test_a_submission_echoed_by_a_forged_answer_to_another_job_is_not_taken(
    topics: Topics,
) -> None:
    client = topics.client(timeout_s=3, max_retries=0)
    future = client.submit({"job_id": "g0", "prompt_token_ids": prompt(3)})
    sent = await topics.job(0)
    topics.publish({**failed(sent), "submission_id": "someone-else"})
    topics.publish(completed(sent, [4]))
    result = await asyncio.wait_for(future, 2)
    assert result.completions[0].token_ids == [4]  # type: ignore[union-attr]
    assert result.submission_id is msgspec.UNSET  # the caller's job named none
