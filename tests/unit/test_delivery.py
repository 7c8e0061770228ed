"""Delivery against an in-memory producer: acknowledgements finish offsets, refusals shrink."""

from __future__ import annotations

import asyncio

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaTimeoutError

from schemas import ErrorCode, Failed, Job, SamplingSpec, decode_result, encode
from tests.fakes import MemoryProducer, ScriptedEngine
from worker.answering.answers import AnswerBuilder
from worker.answering.records import Answer
from worker.core.clock import SYSTEM_CLOCK
from worker.core.config import settings_from
from worker.core.errors import FatalError
from worker.core.limits import RecordLimits
from worker.core.metrics import Metrics
from worker.delivery.offsets import PartitionOffsets
from worker.delivery.publish import Delivery, Ticket
from worker.dev.harness.waiting import wait_for
from worker.loop.starts import PartitionAnswerOwner

TP = TopicPartition("jobs", 0)
RESULTS, DLQ = "results", "dlq"


async def stays(tp: TopicPartition, partition: PartitionOffsets) -> bool:
    return True  # no rebalance here


def ticket(tp: TopicPartition, offsets: PartitionOffsets, offset: int, answer: Answer) -> Ticket:
    return Ticket(tp, PartitionAnswerOwner(tp, offsets, stays), offset, answer)


class Harness:
    def __init__(self, broker_limit: int | None) -> None:
        self.settings = settings_from(
            {"results_topic": RESULTS, "dead_letter_topic": DLQ, "engine": "mock"}, {}
        )
        # The worker could not read the topics' limits: only the broker knows them.
        limits = RecordLimits.from_topic_limits(self.settings, {})
        self.metrics = Metrics()
        self.answers = AnswerBuilder(
            self.settings, ScriptedEngine(), limits, self.metrics, clock=SYSTEM_CLOCK
        )
        self.producer = MemoryProducer({RESULTS: 1, DLQ: 1}, broker_limit=broker_limit)
        self.fatal: list[FatalError] = []
        self.events: list[tuple[str, int]] = []
        self.delivery = Delivery(
            self.producer,
            self.settings,
            limits,
            self.metrics,
            smaller=self.answers.smaller,
            on_free=lambda: None,
            on_fatal=self.fatal.append,
            on_acknowledged=lambda: self.events.append(("woken", -1)),
            clock=SYSTEM_CLOCK,
        )
        self.offsets = PartitionOffsets()

    async def post(
        self,
        offset: int,
        job: Job,
        tp: TopicPartition = TP,
        offsets: PartitionOffsets | None = None,
    ) -> None:
        offsets = self.offsets if offsets is None else offsets
        value = encode(job)
        record = ConsumerRecord(
            tp.topic, tp.partition, offset, 0, 0, b"k", value, None, 1, len(value), ()
        )
        offsets.start(offset)
        answer = await self.answers.answer(tp, record)
        posted = ticket(tp, offsets, offset, answer)
        if not self.delivery.queue(posted):
            await self.delivery.send_alone(posted)


class RecordingOwner:
    """An answer's owner that records what the producer side tells it and asks it."""

    def __init__(self, events: list[tuple[str, int]], *, stays: bool = True) -> None:
        self.events = events
        self.stays = stays

    def acknowledged(self, offset: int) -> None:
        self.events.append(("acknowledged", offset))

    async def may_send(self) -> bool:
        self.events.append(("asked", -1))
        return self.stays


async def answer_of(h: Harness, offset: int, job_id: str) -> Answer:
    value = encode(job(job_id))
    record = ConsumerRecord("jobs", 0, offset, 0, 0, b"k", value, None, 1, len(value), ())
    return await h.answers.answer(TP, record)


def job(job_id: str, metadata_chars: int = 0) -> Job:
    return Job(
        job_id=job_id,
        prompt="hello",
        sampling=SamplingSpec(max_tokens=2),
        metadata={"pad": "x" * metadata_chars} if metadata_chars else {},
    )


async def test_acknowledged_answers_finish_their_offsets():
    h = Harness(broker_limit=None)
    h.delivery.start()
    for offset in range(3):
        await h.post(offset, job(f"j{offset}"))
    await wait_for(lambda: h.offsets.commit_position() == 3, 5, "all three acknowledged")
    assert [key for _, key, _, _ in h.producer.sent] == [b"j0", b"j1", b"j2"]
    assert h.metrics.jobs.values[("completed", "")] == 3
    await h.delivery.close()


async def test_a_record_the_broker_refuses_is_sent_again_smaller_and_its_offset_finishes():
    h = Harness(broker_limit=4000)
    h.delivery.start()
    await h.post(0, job("big", metadata_chars=8000))
    await h.post(1, job("small"))
    await wait_for(lambda: h.offsets.commit_position() == 2, 5, "both answered")
    assert h.producer.refusals >= 2  # the batch, then the record alone
    answers = {key: decode_result(value or b"") for _, key, value, _ in h.producer.sent}
    big = answers[b"big"]
    assert isinstance(big, Failed) and big.error.code == ErrorCode.RESULT_TOO_LARGE
    assert "the broker" in big.error.detail and big.metadata == {}
    assert h.metrics.jobs.values[("failed", "result_too_large")] == 1
    assert h.fatal == []
    await h.delivery.close()


async def test_a_broker_that_refuses_even_the_smallest_answer_is_fatal_not_a_lost_task():
    h = Harness(broker_limit=10)
    h.delivery.start()
    await h.post(0, job("any"))
    await wait_for(lambda: bool(h.fatal), 5, "the fatal error")
    assert "refused even the smallest answer" in str(h.fatal[0])
    assert h.offsets.commit_position() == 0  # unanswered: left for redelivery
    await asyncio.sleep(0)
    await h.delivery.close()


async def test_a_batch_that_expires_unacknowledged_is_sent_again_not_fatal():
    # aiokafka fails a batch whose acknowledgement did not come within request_timeout_ms
    # with KafkaTimeoutError, which it marks not retriable; the broker may well be back for
    # the next attempt. Found by the fleet simulation (`bench/sim.py --seeds 20 --first-seed 300
    # --workers 16 --hostile invalid,crash,long,reply_small,reply_locked`, seed 302): a lost
    # acknowledgement made the worker exit 1.
    h = Harness(broker_limit=None)
    h.producer.expire_next = 2  # the batch, then its first attempt alone
    h.delivery.start()
    await h.post(0, job("j0"))
    await wait_for(lambda: h.offsets.commit_position() == 1, 10, "the answer acknowledged")
    assert h.fatal == []
    assert [key for _, key, _, _ in h.producer.sent] == [b"j0"]
    await h.delivery.close()


async def test_an_answer_handed_over_unacknowledged_is_not_sent_again_when_its_delivery_fails():
    # A revoke's grace ended with the answer's acknowledgement still out (a results partition
    # without a leader): the hand-over lists the job as running and the next owner runs it.
    # Found by the fleet simulation (`bench/sim.py --seed 14416 --workers 3`; 13583 too, before
    # its producer waited for undrained batches): the batch expired seconds later, was sent
    # again alone and answered the job twice.
    h = Harness(broker_limit=None)
    kept = TopicPartition("jobs", 1)
    h.producer.hold_next = 1
    await h.post(0, job("handed-over"))
    kept_offsets = PartitionOffsets()
    kept_offsets.start(0)
    value = encode(job("kept"))
    record = ConsumerRecord("jobs", 1, 0, 0, 0, b"k", value, None, 1, len(value), ())
    h.delivery.queue(ticket(kept, kept_offsets, 0, await h.answers.answer(kept, record)))
    h.delivery.start()  # both answers in one batch
    await wait_for(lambda: len(h.producer.held) == 1, 5, "the batch sent")
    await h.delivery.settle({TP}, asyncio.get_running_loop().time() + 0.05)
    for delivery in h.producer.held:
        delivery.set_exception(KafkaTimeoutError())
    # The partition still held is sent again; the one handed over is left to its next owner.
    await wait_for(lambda: kept_offsets.commit_position() == 1, 5, "the kept answer re-sent")
    assert [key for _, key, _, _ in h.producer.sent] == [b"kept"]
    assert h.offsets.commit_position() == 0
    assert h.delivery.pending == 0 and h.fatal == []
    await h.delivery.close()


async def test_a_revokes_answers_the_producer_was_not_handed_in_time_are_left_to_the_next_owner():
    # The producer takes no batch (a broker away): the revoke's grace ends with one answer in
    # a batch waiting in `send_batch` and one still in the outbox. The hand-over names their
    # jobs running; handed to the producer later, they would answer the jobs a second time,
    # beside the next owner's answers (seed 51687: the batch waiting in `send_batch` was sent
    # after the hand-over).
    h = Harness(broker_limit=None)
    h.producer.taking_batches.clear()
    h.delivery.start()
    await h.post(0, job("taken"))  # the outbox's task takes it, and waits on the producer
    await asyncio.sleep(0)
    await h.post(1, job("queued"))
    assert h.delivery.pending == 2
    await h.delivery.settle({TP}, asyncio.get_running_loop().time() + 0.05)
    assert h.delivery.pending == 0  # both taken back
    h.producer.taking_batches.set()
    await asyncio.sleep(0.05)
    assert h.producer.sent == []
    assert h.offsets.commit_position() == 0  # both stay unanswered
    await h.delivery.close()


async def test_a_waiting_batch_is_sent_without_the_answers_a_revoke_took_back():
    # Answers for a kept partition share the waiting batch (one results partition): the batch
    # is withdrawn, built again without the revoked partition's answer, and sent.
    h = Harness(broker_limit=None)
    kept, kept_offsets = TopicPartition("jobs", 1), PartitionOffsets()
    h.producer.taking_batches.clear()
    h.delivery.start()
    await h.post(0, job("revoked"))
    await h.post(0, job("kept"), tp=kept, offsets=kept_offsets)
    await asyncio.sleep(0)  # one lot, one batch, waiting on the producer
    await h.delivery.settle({TP}, asyncio.get_running_loop().time() + 0.05)
    assert h.delivery.pending == 1
    h.producer.taking_batches.set()
    await wait_for(lambda: kept_offsets.commit_position() == 1, 5, "the kept answer acknowledged")
    assert [key for _, key, _, _ in h.producer.sent] == [b"kept"]
    assert h.offsets.commit_position() == 0
    await h.delivery.close()


async def test_an_acknowledged_batch_tells_each_answers_owner_before_the_worker_is_woken():
    # The worker wakes to plan commits; each offset must be finished by then, or the commit
    # made on waking leaves the acknowledged answer uncommitted.
    h = Harness(broker_limit=None)
    owner = RecordingOwner(h.events)
    for offset in range(2):
        h.delivery.queue(Ticket(TP, owner, offset, await answer_of(h, offset, f"j{offset}")))
    h.delivery.start()  # both answers in one batch
    await wait_for(lambda: ("woken", -1) in h.events, 5, "the batch acknowledged")
    assert h.events == [("acknowledged", 0), ("acknowledged", 1), ("woken", -1)]
    await h.delivery.close()


async def test_a_failed_delivery_is_not_sent_again_once_the_owner_says_its_partition_moved():
    h = Harness(broker_limit=None)
    owner = RecordingOwner(h.events, stays=False)
    h.producer.hold_next = 1
    h.delivery.queue(Ticket(TP, owner, 0, await answer_of(h, 0, "moved")))
    h.delivery.start()
    await wait_for(lambda: len(h.producer.held) == 1, 5, "the batch sent")
    h.producer.held[0].set_exception(KafkaTimeoutError())
    await wait_for(lambda: bool(h.events), 5, "the owner asked")
    await wait_for(lambda: h.delivery.pending == 0, 5, "the re-send over")
    assert h.events == [("asked", -1)]  # asked once, never acknowledged
    assert h.producer.sent == [] and h.fatal == []
    await h.delivery.close()
