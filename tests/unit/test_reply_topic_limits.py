"""A reply topic that refuses a job's result (its `max.message.bytes` is below the result, or
the worker may not write to it) against the consume loop: that job gets a clear answer, nothing
else is lost, and the worker goes on.

The producer here behaves as aiokafka's idempotent one does: a record the broker refuses still
took its sequence numbers, so the next record to that partition is refused as out of order,
and from then on the producer fails everything."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka.errors import OutOfOrderSequenceNumber, TopicAuthorizationFailedError

from schemas import Completed, Failed, Job, Result, SamplingSpec, decode_result, encode
from tests.fakes import FakeConsumer, MemoryProducer, ScriptedEngine
from tests.unit.test_loop import DLQ, P0, RESULTS, settings
from worker.core.limits import RecordLimits
from worker.dev.harness.waiting import wait_for
from worker.loop.worker import Worker

REPLY = "trainer-a"


class IdempotentBroker(MemoryProducer):
    """Per-topic `max.message.bytes` and write permissions, and the sequence an idempotent
    producer loses on a refusal. `renewed()` is a new producer on the same broker (what it
    sends lands in the same `sent`), with fresh sequences."""

    def __init__(self, limits: dict[str, int], forbidden: frozenset[str] = frozenset()) -> None:
        super().__init__({RESULTS: 1, DLQ: 1, REPLY: 1})
        self.limits = limits
        self.forbidden = forbidden
        self.broken_topics: set[str] = set()
        self.dead = False
        self.renewals: list[IdempotentBroker] = []

    def renewed(self) -> IdempotentBroker:
        fresh = IdempotentBroker(self.limits, self.forbidden)
        fresh.sent = self.sent
        self.renewals.append(fresh)
        return fresh

    @property
    def all_refusals(self) -> int:
        return self.refusals + sum(r.all_refusals for r in self.renewals)

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        if self.dead:
            raise OutOfOrderSequenceNumber()
        return await super().send(topic, *args, **kwargs)

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> Any:
        if self.dead:
            raise OutOfOrderSequenceNumber()
        return await super().send_batch(batch, topic, partition=partition)

    def _deliver(self, delivery: asyncio.Future[Any], records: Any) -> None:
        topics = {r[0] for r in records}
        if self.dead or topics & self.broken_topics:
            self.dead = True
            delivery.set_exception(OutOfOrderSequenceNumber())
            return
        for topic in topics:
            if topic in self.forbidden:
                self.refusals += 1
                self.broken_topics.add(topic)
                delivery.set_exception(TopicAuthorizationFailedError(topic))
                return
            limit = self.limits.get(topic)
            if limit is not None and any(
                len(r[2] or b"") > limit for r in records if r[0] == topic
            ):
                from aiokafka.errors import MessageSizeTooLargeError  # noqa: PLC0415

                self.refusals += 1
                self.broken_topics.add(topic)
                delivery.set_exception(MessageSizeTooLargeError())
                return
        super()._deliver(delivery, records)


def _job(job_id: str, tokens: int, reply_to: str | None = REPLY) -> bytes:
    return encode(
        Job(
            job_id=job_id,
            prompt="hi",
            sampling=SamplingSpec(max_tokens=tokens),
            reply_to=reply_to,
        )
    )


async def _serve(
    producer: IdempotentBroker,
    values: list[bytes],
    *,
    limit_lookup: Any = None,
    renewable: bool = True,
) -> tuple[int, dict[str, list[Result]], Worker]:
    consumer = FakeConsumer()
    for value in values:
        consumer.add(P0, value)
    consumer.assign({P0})
    s = settings(reply_topics="trainer-.*")

    async def present(topic: str) -> bool:
        return True

    worker = Worker(
        s,
        consumer=consumer,
        producer=producer,
        engine=ScriptedEngine(),
        limits=RecordLimits.from_topic_limits(s, {}),
        topic_lookup=present,
        topic_limit_lookup=limit_lookup,
        producer_factory=producer.renewed if renewable else None,
    )
    task = asyncio.create_task(worker.run())

    def answered() -> dict[str, list[Result]]:
        out: dict[str, list[Result]] = {}
        for topic, _, value, _ in producer.sent:
            if topic != DLQ and value is not None:
                result = decode_result(value)
                out.setdefault(result.job_id or "", []).append(result)
        return out

    try:
        await wait_for(
            lambda: (
                (len(answered()) == len(values) and consumer.commits[-1:] == [{P0: len(values)}])
                or task.done()
            ),
            10,
            lambda: f"every job answered and committed (answered {sorted(answered())})",
        )
    finally:
        worker.request_stop()
        status = await asyncio.wait_for(task, 10)
    return status, answered(), worker


async def test_a_result_over_the_reply_topics_limit_is_shaped_to_it_before_it_is_sent():
    # The trainer created its reply topic with a small max.message.bytes and asked for a long
    # rollout. The worker sized the result for its own results topic, the broker refused it,
    # the producer's sequence broke and the worker exited 1 on every restart.
    producer = IdempotentBroker({REPLY: 2048})

    async def limit(topic: str) -> int | None:
        return 2048 if topic == REPLY else None

    values = [_job("short-0", 2), _job("long", 400), _job("short-1", 2)]
    status, answered, _ = await _serve(producer, values, limit_lookup=limit, renewable=False)
    assert status == 0
    assert producer.refusals == 0
    long = answered["long"]
    assert all(isinstance(r, Completed) for r in answered["short-0"] + answered["short-1"])
    # Too large for one record of the reply topic: answered in parts there, or result_too_large.
    assert long and all(
        (isinstance(r, Completed) and r.part is not None)
        or (isinstance(r, Failed) and r.error.code == "result_too_large")
        for r in long
    ), long
    reply_values = [v for t, _, v, _ in producer.sent if t == REPLY]
    assert all(len(v or b"") <= 2048 for v in reply_values)


async def test_a_result_the_reply_topic_refuses_after_all_is_answered_and_the_worker_goes_on():
    # The reply topic's limit cannot be read (no DescribeConfigs): the broker refuses the long
    # result. Its answer is the smaller one (result_too_large, naming the broker), on a new
    # producer, since the refused batch broke the old one's sequence; the others are answered.
    producer = IdempotentBroker({REPLY: 2048})
    values = [_job("short-0", 2), _job("long", 400), _job("short-1", 2), _job("plain", 2, None)]
    status, answered, _ = await _serve(producer, values)
    assert status == 0
    assert producer.all_refusals >= 1 and producer.renewals
    (long,) = answered["long"]
    assert isinstance(long, Failed) and long.error.code == "result_too_large"
    assert "the broker" in long.error.detail
    for job_id in ("short-0", "short-1", "plain"):
        assert any(isinstance(r, Completed) for r in answered[job_id]), job_id
    on_reply = {decode_result(v or b"").job_id for t, _, v, _ in producer.sent if t == REPLY}
    assert {"long", "short-0", "short-1"} <= on_reply


async def test_a_reply_topic_the_worker_may_not_write_to_is_answered_on_the_results_topic():
    # The broker refuses the worker's writes to the reply topic (no ACL): a non-retriable
    # error, which stopped the worker with a BrokerError on every restart.
    producer = IdempotentBroker({}, forbidden=frozenset({REPLY}))
    values = [_job("first", 2), _job("plain", 2, None), _job("second", 2)]
    status, answered, _ = await _serve(producer, values)
    assert status == 0
    for job_id in ("first", "second"):
        (failed,) = answered[job_id]
        assert isinstance(failed, Failed) and failed.error.code == "invalid_job", failed
        assert REPLY in failed.error.detail
    assert isinstance(answered["plain"][0], Completed)
    assert not [v for t, _, v, _ in producer.sent if t == REPLY]


class _NoMetadataForReply(IdempotentBroker):
    """A broker that refuses even the reply topic's metadata to this worker's producer: the
    send fails before anything reaches the broker."""

    async def partitions_for(self, topic: str) -> set[int]:
        if topic in self.forbidden:
            raise TopicAuthorizationFailedError(topic)
        return await super().partitions_for(topic)

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        if topic in self.forbidden:
            raise TopicAuthorizationFailedError(topic)
        return await super().send(topic, *args, **kwargs)


async def test_a_reply_topic_refused_before_anything_is_sent_is_answered_on_the_results_topic():
    producer = _NoMetadataForReply({}, forbidden=frozenset({REPLY}))
    values = [_job("first", 2), _job("plain", 2, None)]
    status, answered, _ = await _serve(producer, values, renewable=False)
    assert status == 0
    (failed,) = answered["first"]
    assert isinstance(failed, Failed) and failed.error.code == "invalid_job", failed
    assert isinstance(answered["plain"][0], Completed)
