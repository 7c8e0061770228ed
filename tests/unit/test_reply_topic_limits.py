"""A reply topic that refuses a job's result (its `max.message.bytes` is below the result, or
the worker may not write to it) against the consume loop: that job gets a clear answer, nothing
else is lost, and the worker goes on.

The producer here behaves as aiokafka's idempotent one does: a record the broker refuses still
took its sequence numbers, so the next record to that partition is refused as out of order,
and from then on the producer fails everything."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from aiokafka.errors import (
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    TopicAuthorizationFailedError,
)

from schemas import Completed, Failed, Job, Result, SamplingSpec, decode_result, encode
from tests.fakes import FakeConsumer, MemoryProducer, ScriptedEngine
from tests.unit.test_loop import DLQ, P0, RESULTS, settings
from worker.answering import topics as topics_module
from worker.answering.topics import AnswerTopics
from worker.core import kafka
from worker.core.clock import SYSTEM_CLOCK
from worker.core.limits import RecordLimits, ValueBudgets, record_bytes
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


def _job(job_id: str, tokens: int, reply_to: str | None = REPLY, **metadata: str) -> bytes:
    return encode(
        Job(
            job_id=job_id,
            prompt="hi",
            sampling=SamplingSpec(max_tokens=tokens),
            reply_to=reply_to,
            metadata=metadata,
        )
    )


async def _serve(
    producer: IdempotentBroker,
    values: list[bytes],
    *,
    limit_lookup: Any = None,
    renewable: bool = True,
    engine: ScriptedEngine | None = None,
    **overrides: Any,
) -> tuple[int, dict[str, list[Result]], Worker]:
    consumer = FakeConsumer()
    for value in values:
        consumer.add(P0, value)
    consumer.assign({P0})
    s = settings(reply_topics="trainer-.*", **overrides)

    async def present(topic: str) -> bool:
        return True

    worker = Worker(
        s,
        consumer=consumer,
        producer=producer,
        engine=engine or ScriptedEngine(),
        limits=RecordLimits.from_topic_limits(s, {}),
        topic_lookup=present,
        topic_limit_lookup=limit_lookup,
        producer_factory=producer.renewed if renewable else None,
        clock=SYSTEM_CLOCK,
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


class BatchingBroker(IdempotentBroker):
    """As aiokafka's producer batches (`MessageAccumulator.add_message`): records `send()` is
    given for a partition while its last batch lingers go into that batch, up to the
    producer's `max_batch_size`; and the broker checks `max.message.bytes` on a whole batch,
    not on each record (Kafka's `LogValidator`, on the batch as written)."""

    def __init__(self, limits: dict[str, int], batch_bytes: int) -> None:
        super().__init__(limits)
        self.batch_bytes = batch_bytes
        self.biggest_batches: dict[str, int] = {}
        self._lingering: dict[str, tuple[list[Any], list[asyncio.Future[Any]], list[int]]] = {}

    def renewed(self) -> BatchingBroker:
        fresh = BatchingBroker(self.limits, self.batch_bytes)
        fresh.sent = self.sent
        fresh.biggest_batches = self.biggest_batches
        self.renewals.append(fresh)
        return fresh

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        if self.dead:
            raise OutOfOrderSequenceNumber()
        size = record_bytes(key, value, list(headers or []))
        lingering = self._lingering.get(topic)
        if lingering is None or lingering[2][0] + size > self.batch_bytes:
            lingering = self._lingering[topic] = ([], [], [0])
            # linger_ms: the batch goes once the senders of this turn of the loop are done.
            asyncio.get_running_loop().call_later(0.005, self._drain, topic, lingering)
        records, futures, total = lingering
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        records.append((topic, key, value, list(headers or [])))
        futures.append(future)
        total[0] += size
        return future

    def _drain(self, topic: str, lingering: Any) -> None:
        if self._lingering.get(topic) is lingering:
            del self._lingering[topic]
        records, futures, _ = lingering
        batch: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._deliver(batch, records)
        refused = batch.exception()
        for future in futures:
            if refused is not None:
                future.set_exception(refused)
            else:
                future.set_result(None)

    def _deliver(self, delivery: asyncio.Future[Any], records: Any) -> None:
        topic = records[0][0]
        size = sum(record_bytes(k, v, h) for _, k, v, h in records)
        self.biggest_batches[topic] = max(self.biggest_batches.get(topic, 0), size)
        limit = self.limits.get(topic)
        if not self.dead and limit is not None and size > limit:
            self.refusals += 1
            self.broken_topics.add(topic)
            delivery.set_exception(MessageSizeTooLargeError())
            return
        super()._deliver(delivery, records)


async def test_small_answers_to_a_reply_topic_with_a_smaller_limit_are_batched_to_fit_it():
    # 40 results of about 3 KB for a reply topic of 100 KB, finishing together: batched up to
    # the results topic's size (1 MiB), the broker refused the batch; sent again one by one,
    # aiokafka batched them again, the second refusal was taken for a record too large, and
    # every job was answered failed/result_too_large.
    limit = 100_000
    s = settings()
    producer = BatchingBroker({REPLY: limit}, RecordLimits.from_topic_limits(s, {}).batch_bytes)

    async def limit_of(topic: str) -> int | None:
        return limit if topic == REPLY else None

    engine = ScriptedEngine()
    engine.on_start = lambda _: engine.release("all") if len(engine.started) == 40 else None
    values = [_job(f"j{i}", 380, gate="all") for i in range(40)]
    status, answered, _ = await _serve(
        producer, values, limit_lookup=limit_of, engine=engine, max_in_flight=64
    )
    assert status == 0
    assert sorted(answered) == sorted(f"j{i}" for i in range(40))
    failed = [r for results in answered.values() for r in results if isinstance(r, Failed)]
    assert failed == []
    sizes = [len(v or b"") for t, _, v, _ in producer.sent if t == REPLY]
    assert len(sizes) == 40 and min(sizes) > 2_500
    assert producer.all_refusals == 0
    assert 0 < producer.biggest_batches[REPLY] <= limit


async def test_answers_a_reply_topic_refused_as_a_batch_are_sent_again_each_in_a_batch_of_its_own():
    # The reply topic's limit is unknown (no DescribeConfigs): the batch is refused, and each
    # answer is sent again alone, which must mean alone in its batch, not batched again by the
    # producer: otherwise the second refusal is taken for a record too large.
    s = settings()
    producer = BatchingBroker({REPLY: 100_000}, RecordLimits.from_topic_limits(s, {}).batch_bytes)
    engine = ScriptedEngine()
    engine.on_start = lambda _: engine.release("all") if len(engine.started) == 40 else None
    values = [_job(f"j{i}", 380, gate="all") for i in range(40)]
    status, answered, _ = await _serve(producer, values, engine=engine, max_in_flight=64)
    assert status == 0
    assert producer.all_refusals >= 1
    failed = [r for results in answered.values() for r in results if isinstance(r, Failed)]
    assert failed == []
    assert sorted(answered) == sorted(f"j{i}" for i in range(40))


def test_a_reply_topics_budget_follows_its_limit_when_the_topic_is_read_again():
    # AnswerTopics reads a reply topic's max.message.bytes again once it forgot the topic
    # (evicted, or refused and looked up again): unknown at first (no DescribeConfigs answer
    # in time), then read. The budget was kept from the first read for good, so every later
    # answer was sized for the producer's limit and refused by the broker.
    s = settings()
    read: dict[str, int | None] = {REPLY: None}
    budgets = ValueBudgets(RecordLimits.from_topic_limits(s, {}), RESULTS, read.get)
    unknown, why = budgets.of("j0", REPLY)
    assert "max_request_size" in why or "max_result_bytes" in why
    read[REPLY] = 2048
    budget, why = budgets.of("j1", REPLY)
    assert budget < 2048 < unknown
    assert "2048" in why
    read[REPLY] = 65536
    assert 2048 < budgets.of("j2", REPLY)[0] < 65536


class _VanishingReply(IdempotentBroker):
    """The reply topic is deleted once `vanish()` is called: the producer's metadata wait for
    it ends, after `request_timeout_s`, with UnknownTopicOrPartitionError (aiokafka's
    `AIOKafkaClient._wait_on_metadata`), and `send_batch` waits for it first. `landed` is when
    each job's answer was appended."""

    request_timeout_s = 3.0

    def __init__(self) -> None:
        super().__init__({})
        self.landed: dict[bytes | None, float] = {}

    def vanish(self) -> None:
        del self.partitions[REPLY]

    async def partitions_for(self, topic: str) -> set[int]:
        if topic not in self.partitions:
            await asyncio.sleep(self.request_timeout_s)
        return await super().partitions_for(topic)

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> Any:
        await self.partitions_for(topic)
        return await super().send_batch(batch, topic, partition=partition)

    def _deliver(self, delivery: asyncio.Future[Any], records: Any) -> None:
        super()._deliver(delivery, records)
        for _, key, _, _ in records:
            self.landed.setdefault(key, asyncio.get_running_loop().time())


async def test_a_reply_topic_deleted_after_it_was_found_costs_its_jobs_not_the_worker():
    # The topic was found when its first job named it, then deleted: each try to send its
    # answer again waited out the producer's metadata wait, until --publish-timeout-s stopped
    # the worker. It is answered as a job naming a topic the broker does not have: on the
    # results topic.
    producer = _VanishingReply()
    engine = ScriptedEngine()
    engine.on_start = lambda job: producer.vanish() if job.job_id == "gone" else None
    values = [_job("gone", 2, delay_s="0.1"), _job("plain", 2, None, delay_s="0.2")]
    started = asyncio.get_running_loop().time()
    status, answered, _ = await _serve(producer, values, engine=engine, publish_timeout_s=6)
    assert status == 0
    (gone,) = answered["gone"]
    assert isinstance(gone, Failed) and gone.error.code == "invalid_job", gone
    assert REPLY in gone.error.detail
    assert isinstance(answered["plain"][0], Completed)
    assert asyncio.get_running_loop().time() - started < 3 * producer.request_timeout_s


async def test_answers_behind_a_deleted_reply_topics_answer_do_not_wait_for_its_metadata():
    # The outbox waited for a topic's metadata in the middle of a lot: a reply topic the
    # producer's metadata no longer had held the answers behind it for request_timeout_ms.
    producer = _VanishingReply()
    engine = ScriptedEngine()
    engine.on_start = lambda job: producer.vanish() if job.job_id == "gone" else None
    values = [_job("gone", 2, delay_s="0.1"), _job("plain", 2, None, delay_s="0.2")]
    started = asyncio.get_running_loop().time()
    await _serve(producer, values, engine=engine, publish_timeout_s=6)
    assert producer.landed[b"plain"] - started < 2.0


class _CountedAdmin:
    """aiokafka's admin client as `topics_max_message_bytes` uses it."""

    async def start(self) -> None:
        return

    async def close(self) -> None:
        return

    async def describe_configs(self, resources: list[Any]) -> list[Any]:
        return [
            SimpleNamespace(resources=[(0, "", 2, r.name, [("max.message.bytes", "65536")])])
            for r in resources
        ]


class _CountedAdmins:
    """Kafka clients of which only admin clients are made, counted (each one a bootstrap
    connection and a metadata request before its request)."""

    def __init__(self) -> None:
        self.made = 0

    def producer(self, **options: Any) -> Any:
        raise AssertionError(f"no producer expected, got {options}")

    def consumer(self, *topics: str, **options: Any) -> Any:
        raise AssertionError(f"no consumer expected, got {topics} {options}")

    def admin(self, **options: Any) -> _CountedAdmin:
        self.made += 1
        return _CountedAdmin()


async def test_reply_topics_found_one_after_another_share_one_admin_client():
    # Each reply topic found had its max.message.bytes read by an admin client of its own,
    # started and closed for that one request.
    admins = _CountedAdmins()
    s = settings(reply_topics="trainer-.*")

    async def present(topic: str) -> bool:
        return True

    configs = kafka.TopicConfigReader(s, admins)
    topics = AnswerTopics(s, present, limit_lookup=configs.max_message_bytes_of, clock=SYSTEM_CLOCK)
    await topics.check("trainer-a")
    await topics.check("trainer-b")
    await configs.close()
    assert topics.limit_of("trainer-a") == topics.limit_of("trainer-b") == 65536
    assert admins.made == 1


async def test_a_reply_topics_check_waits_at_most_its_bound_in_all(monkeypatch):
    # The metadata lookup and the max.message.bytes read each got REPLY_TOPIC_CHECK_S, one
    # after the other: a job's first answer to a reply topic could wait twice the bound.
    monkeypatch.setattr(topics_module, "REPLY_TOPIC_CHECK_S", 0.5)
    s = settings(reply_topics="trainer-.*")

    async def slow_present(topic: str) -> bool:
        await asyncio.sleep(0.4)
        return True

    async def slow_limit(topic: str) -> int | None:
        await asyncio.sleep(0.4)
        return 65536

    topics = AnswerTopics(s, slow_present, limit_lookup=slow_limit, clock=SYSTEM_CLOCK)
    started = asyncio.get_running_loop().time()
    await topics.check(REPLY)
    assert asyncio.get_running_loop().time() - started <= 0.5 + 0.05


async def test_a_reply_topic_too_small_for_any_answer_is_answered_on_the_results_topic():
    # A job named a reply topic whose max.message.bytes is below the smallest answer: the
    # refused minimal answer stopped the worker ("refused even the smallest answer"), and
    # its restart met the same record. Anyone who can write a job could stop a worker so.
    for limit_known in (False, True):
        producer = IdempotentBroker({REPLY: 120})

        async def limit(topic: str, known: bool = limit_known) -> int | None:
            return 120 if topic == REPLY and known else None

        values = [_job("tiny", 2), _job("plain", 2, None), _job("after", 2)]
        status, answered, _ = await _serve(producer, values, limit_lookup=limit)
        assert status == 0, limit_known
        (tiny,) = answered["tiny"]
        assert isinstance(tiny, Failed) and REPLY in tiny.error.detail, limit_known
        assert any(isinstance(r, Completed) for r in answered["plain"]), limit_known
        on_results = {
            decode_result(v or b"").job_id for t, _, v, _ in producer.sent if t == RESULTS
        }
        assert {"tiny", "plain", "after"} <= on_results, limit_known
