"""Reply topics against a broker's metadata: the lookup `AnswerTopics` makes, on a real broker
and on the answers a broker without auto-creation gives."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import TopicAuthorizationFailedError, UnknownTopicOrPartitionError
from aiokafka.protocol.metadata import MetadataRequest_v4

from schemas import Job, SamplingSpec
from worker.answering.topics import AnswerTopics
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import settings_from
from worker.core.kafka import broker_has_topic


def job(job_id: str, reply_to: str | None = None) -> Job:
    return Job(job_id=job_id, prompt="hi", sampling=SamplingSpec(max_tokens=2), reply_to=reply_to)


class _Client:
    """A producer's client whose broker answers every metadata request with `error_code`."""

    def __init__(self, error_code: int) -> None:
        self.error_code = error_code
        self.requests: list[Any] = []

    def get_random_node(self) -> int:
        return 1

    async def send(self, node: int, request: Any) -> Any:
        self.requests.append(request)
        topic = request._topics[0]
        return SimpleNamespace(topics=[(self.error_code, topic, False, [])])


@pytest.mark.parametrize(
    ("error_code", "present"),
    [
        (0, True),
        (5, True),  # LEADER_NOT_AVAILABLE: being created (auto-creation on)
        (UnknownTopicOrPartitionError.errno, False),  # auto-creation off
        (TopicAuthorizationFailedError.errno, False),
    ],
)
async def test_the_lookup_reads_the_brokers_answer_for_that_one_topic(
    error_code: int, present: bool
) -> None:
    client = _Client(error_code)
    producer = SimpleNamespace(client=client)
    assert await broker_has_topic(producer, "trainer-x") is present
    (request,) = client.requests
    assert request._topics == ["trainer-x"]
    # Looking a topic up never creates it, whatever the broker's auto.create.topics.enable.
    assert request.build(MetadataRequest_v4).allow_auto_topic_creation is False


async def test_jobs_naming_ever_new_reply_topics_leave_what_is_remembered_bounded() -> None:
    settings = settings_from(
        {"jobs_topic": "jobs", "results_topic": "results", "reply_topics": r"trainer-\d+"}, {}
    )
    looked_up: list[str] = []

    async def lookup(topic: str) -> bool:
        looked_up.append(topic)
        return True

    topics = AnswerTopics(settings, lookup, limit_lookup=lambda _: _limit(), clock=SYSTEM_CLOCK)
    for n in range(5000):
        await topics.check(f"trainer-{n}")
        assert topics.answer_topic(f"trainer-{n}") == f"trainer-{n}"
    assert len(topics._limits) <= 1024 and len(topics._missing) == 0
    # The most recent are still known; the first is looked up again when named again.
    await topics.check("trainer-4999")
    await topics.check("trainer-0")
    assert looked_up.count("trainer-4999") == 1 and looked_up.count("trainer-0") == 2


async def _limit() -> int:
    return 1_048_576
