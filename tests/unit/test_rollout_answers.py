"""Which answer `RolloutClient` takes for which call: every result a call returns answers the
exact request it sent, a job id sent again (a re-run turn, a restarted trainer, another trainer
on the same results topic) never takes an answer to an earlier sending, and every call ends by
its deadline with nothing left pending. No broker: jobs and results travel through memory, and
the test plays the worker, answering the job records the client produced."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

from schemas import Completed, Failed, RoutedExperts, SamplingSpec, SchemaError, as_job, encode
from worker.client.conversation import Conversation
from worker.client.rollout import RolloutClient, RolloutError


class Topics:
    """A jobs topic and a results topic in memory, shared by every client made here: each job
    a client produces is kept (decoded, as a worker reads it); each result put is read by every
    client, as every reader of one results topic reads it."""

    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []
        self._arrived = asyncio.Event()
        self._readers: list[asyncio.Queue[bytes]] = []
        self._clients: list[RolloutClient] = []

    def client(self, **options: Any) -> RolloutClient:
        """A client whose producer and consumer are these topics; its reader and sweeper run as
        `start()` runs them."""
        client = RolloutClient(bootstrap_servers="unused:9092", **options)
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._readers.append(queue)
        client._producer = _Producer(self)
        client._consumer = _Consumer(queue)
        client._tasks = [asyncio.create_task(client._read()), asyncio.create_task(client._sweep())]
        for task in client._tasks:
            task.add_done_callback(client._background_stopped)
        self._clients.append(client)
        return client

    def produced(self, value: bytes) -> None:
        self.jobs.append(json.loads(value))
        self._arrived.set()

    async def job(self, number: int) -> dict[str, Any]:
        """The `number`th job record produced (from 0), once it is."""
        async with asyncio.timeout(5):
            while len(self.jobs) <= number:
                self._arrived.clear()
                await self._arrived.wait()
        return self.jobs[number]

    def publish(self, result: dict[str, Any]) -> None:
        value = json.dumps(result).encode()
        for queue in self._readers:
            queue.put_nowait(value)

    async def close(self) -> None:
        for client in self._clients:
            await client.close()


class _Producer:
    def __init__(self, topics: Topics) -> None:
        self._topics = topics

    async def send(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> asyncio.Future[None]:
        self._topics.produced(value)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def stop(self) -> None:
        return


class _Consumer:
    def __init__(self, queue: asyncio.Queue[bytes]) -> None:
        self._queue = queue
        self._offset = 0

    async def getmany(self, timeout_ms: int = 0) -> dict[str, list[Any]]:
        try:
            value = await asyncio.wait_for(self._queue.get(), timeout_ms / 1000)
        except TimeoutError:
            return {}
        self._offset += 1
        record = SimpleNamespace(topic="results", partition=0, offset=self._offset, value=value)
        return {"results-0": [record]}

    async def stop(self) -> None:
        return


def completed(job: dict[str, Any], output: list[int], *, echo: bool = True) -> dict[str, Any]:
    """A worker's answer to `job` as read: `output` generated after its prompt, with vLLM's rows
    from the job's start to the last token; `echo`: the job's submission echoed, as workers of
    this version do (older ones echo none, and the client takes none of their answers)."""
    prompt = job["prompt_token_ids"]
    start = job.get("routed_experts_prompt_start", 0)
    rows = len(prompt) + len(output) - 1 - start
    routed = RoutedExperts.from_array(np.full((rows, 2, 2), output[0] % 8, np.uint8), start=start)
    completion = {
        "index": 0,
        "token_ids": output,
        "text": "",
        "finish_reason": "stop",
        "routed_experts": json.loads(encode(routed)),
    }
    result = {
        "type": "completed",
        "job_id": job["job_id"],
        "completions": [completion],
        "prompt_token_count": len(prompt),
    }
    if echo and "submission_id" in job:
        result["submission_id"] = job["submission_id"]
    return result


def failed(job: dict[str, Any], code: str = "engine_error", *, retryable: bool = False) -> Any:
    result = {
        "type": "failed",
        "job_id": job["job_id"],
        "error": {"code": code, "detail": "the test's worker", "retryable": retryable},
    }
    if "submission_id" in job:
        result["submission_id"] = job["submission_id"]
    return result


def prompt(length: int, first: int = 10) -> list[int]:
    return list(range(first, first + length))


@pytest.fixture
async def topics() -> Any:
    topics = Topics()
    yield topics
    await topics.close()


async def test_a_late_answer_to_a_turns_first_sending_is_not_taken_for_its_rerun(
    topics: Topics,
) -> None:
    client = topics.client(timeout_s=0.5, max_retries=0)
    conversation = Conversation(sampling=SamplingSpec(max_tokens=4))
    first = asyncio.create_task(client.turn(conversation, prompt(6)))
    topics.publish(completed(await topics.job(0), [1, 2, 3]))
    await first

    # Turn 1 times out; it is run again with another tool answer (another prompt).
    timed_out = await client.turn(conversation, prompt(4, first=50))
    assert isinstance(timed_out, Failed) and timed_out.error.code == "expired"
    rerun = asyncio.create_task(client.turn(conversation, prompt(7, first=80)))
    late, again = topics.jobs[1], await topics.job(2)
    assert late["job_id"] == again["job_id"] == f"{conversation.conversation_id}-turn1"
    topics.publish(completed(late, [4, 4, 4]))  # the first sending's answer
    topics.publish(completed(again, [5, 6]))

    result = await asyncio.wait_for(rerun, 5)

    assert isinstance(result, Completed)
    assert result.completions[0].token_ids == [5, 6]
    turn = conversation.turns[1]
    assert turn.prompt_token_ids == again["prompt_token_ids"]
    assert turn.completion.token_ids == [5, 6]
    tokens, _, routed = conversation.stitched()
    assert tokens == [*again["prompt_token_ids"], 5, 6]
    assert routed.shape[0] == len(tokens) - 1
    assert client.in_flight == 0


async def test_a_failed_turn_runs_again_on_the_same_client_and_completes(topics: Topics) -> None:
    client = topics.client(timeout_s=3, max_retries=0)
    conversation = Conversation(sampling=SamplingSpec(max_tokens=4))
    asked = asyncio.create_task(client.turn(conversation, prompt(6)))
    topics.publish(failed(await topics.job(0)))
    assert isinstance(await asked, Failed)

    rerun = asyncio.create_task(client.turn(conversation, prompt(6)))
    topics.publish(completed(await topics.job(1), [7, 8]))
    result = await asyncio.wait_for(rerun, 2)  # well before the 3 s timeout

    assert isinstance(result, Completed) and result.completions[0].token_ids == [7, 8]
    assert len(conversation.turns) == 1 and client.in_flight == 0


async def test_a_job_id_submitted_again_takes_its_new_answer_never_the_old_one(
    topics: Topics,
) -> None:
    client = topics.client(timeout_s=3)
    job = {"job_id": "j", "prompt_token_ids": prompt(5)}
    first = client.submit(job)
    old = await topics.job(0)
    topics.publish(completed(old, [1]))
    assert (await first).completions[0].token_ids == [1]  # type: ignore[union-attr]

    second = client.submit({**job, "prompt_token_ids": prompt(9)})
    new = await topics.job(1)
    # The first answer delivered again (a worker that died before committing it), first.
    topics.publish(completed(old, [1]))
    topics.publish(completed(new, [2]))
    result = await asyncio.wait_for(second, 2)

    assert isinstance(result, Completed)
    assert result.completions[0].token_ids == [2]
    assert result.prompt_token_count == 9
    assert client.in_flight == 0


async def test_the_same_job_sent_again_takes_the_new_sendings_answer(topics: Topics) -> None:
    """Byte for byte the same job, sent again after its caller stopped waiting: the answer to
    the earlier sending arrives first and is not taken (a worker of this version echoes which
    sending it answers)."""
    client = topics.client(timeout_s=3)
    job = {"job_id": "j", "prompt_token_ids": prompt(5), "deadline": 4_000_000_000.0}
    abandoned = client.submit(job)
    abandoned.cancel()
    await asyncio.sleep(0)  # the client forgets a cancelled job from the loop's next turn
    again = client.submit(job)
    old, new = await topics.job(0), await topics.job(1)
    assert old["submission_id"] != new["submission_id"]
    topics.publish(completed(old, [1]))
    topics.publish(completed(new, [2]))

    result = await asyncio.wait_for(again, 2)

    assert result.completions[0].token_ids == [2]  # type: ignore[union-attr]
    assert result.submission_id is msgspec.UNSET  # the caller's job named no submission


async def test_a_resubmission_never_takes_the_id_of_a_callers_own_job(topics: Topics) -> None:
    client = topics.client(timeout_s=3, max_retries=1)
    own = client.submit({"job_id": "x", "prompt_token_ids": prompt(3)})
    other = client.submit({"job_id": "x~retry1", "prompt_token_ids": prompt(8)})
    topics.publish(failed(await topics.job(0), "aborted", retryable=True))
    resubmitted = await topics.job(2)
    assert resubmitted["prompt_token_ids"] == prompt(3)
    assert resubmitted["job_id"] not in ("x", "x~retry1")

    topics.publish(completed(resubmitted, [1]))
    topics.publish(completed(await topics.job(1), [2]))
    own_result, other_result = await asyncio.wait_for(asyncio.gather(own, other), 2)

    assert isinstance(own_result, Completed) and isinstance(other_result, Completed)
    assert (own_result.job_id, own_result.prompt_token_count) == ("x", 3)
    assert own_result.completions[0].token_ids == [1]
    assert (other_result.job_id, other_result.prompt_token_count) == ("x~retry1", 8)
    assert other_result.completions[0].token_ids == [2]
    assert client.in_flight == 0


async def test_a_restarted_trainer_does_not_take_its_previous_runs_late_answer(
    topics: Topics,
) -> None:
    """An RL loop names its jobs by step and sample, so a restarted loop sends the ids its
    previous run sent; the answer to the previous run's job, late, is not the new one's."""
    before = topics.client(timeout_s=3)
    before.submit({"job_id": "step0-s0", "prompt_token_ids": prompt(5)})
    previous = await topics.job(0)
    await before.close()

    after = topics.client(timeout_s=3)
    future = after.submit({"job_id": "step0-s0", "prompt_token_ids": prompt(5, first=30)})
    current = await topics.job(1)
    topics.publish(completed(previous, [1]))
    topics.publish(completed(current, [2]))
    result = await asyncio.wait_for(future, 2)

    assert result.completions[0].token_ids == [2]  # type: ignore[union-attr]


async def test_two_trainers_on_one_results_topic_each_take_only_their_own_answer(
    topics: Topics,
) -> None:
    one, two = topics.client(timeout_s=3), topics.client(timeout_s=3)
    first = one.submit({"job_id": "step0-s0", "prompt_token_ids": prompt(5)})
    second = two.submit({"job_id": "step0-s0", "prompt_token_ids": prompt(5, first=40)})
    for number, output in ((1, [2]), (0, [1])):
        topics.publish(completed(await topics.job(number), output))

    results = await asyncio.wait_for(asyncio.gather(first, second), 2)

    assert [r.completions[0].token_ids for r in results] == [[1], [2]]  # type: ignore[union-attr]


async def test_an_id_a_resubmission_travels_under_is_refused_without_touching_either(
    topics: Topics,
) -> None:
    client = topics.client(timeout_s=3, max_retries=1)
    own = client.submit({"job_id": "x", "prompt_token_ids": prompt(3)})
    topics.publish(failed(await topics.job(0), "aborted", retryable=True))
    resubmitted = await topics.job(1)
    assert resubmitted["job_id"] == "x~retry1"

    with pytest.raises(RolloutError, match="a resubmission of job x travels under that id"):
        client.submit({"job_id": "x~retry1", "prompt_token_ids": prompt(8)})
    topics.publish(completed(resubmitted, [1]))
    result = await asyncio.wait_for(own, 2)

    assert isinstance(result, Completed) and result.job_id == "x"
    assert result.completions[0].token_ids == [1] and len(topics.jobs) == 2
    assert client.in_flight == 0


async def test_a_forged_answer_with_an_unreadable_submission_is_skipped(topics: Topics) -> None:
    client = topics.client(timeout_s=3)
    future = client.submit({"job_id": "j", "prompt_token_ids": prompt(4)})
    sent = await topics.job(0)
    for forged in ("", "s" * 65, 7):
        topics.publish({**completed(sent, [9]), "submission_id": forged})
    topics.publish(completed(sent, [1]))

    result = await asyncio.wait_for(future, 2)

    assert result.completions[0].token_ids == [1]  # type: ignore[union-attr]
    assert client.in_flight == 0


def test_a_job_with_a_submission_id_out_of_bounds_is_refused_naming_it() -> None:
    for bad in ("", "s" * 65):
        with pytest.raises(SchemaError) as caught:
            as_job({"job_id": "j", "prompt": "hi", "submission_id": bad})
        assert caught.value.path == "$.submission_id"
