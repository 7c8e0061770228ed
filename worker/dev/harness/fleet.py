"""Readers of a steered fleet's topics: commands in, acknowledgements, heartbeats, results out."""

from __future__ import annotations

import time
from typing import Self

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from schemas import (
    Command,
    CommandAck,
    Completed,
    ControlRecordError,
    Failed,
    WorkerStatus,
    decode_result,
    decode_status,
    encode,
)
from worker.core.clients import AIOKAFKA
from worker.dev.harness.background import InBackground
from worker.dev.harness.clients import produce
from worker.dev.harness.topics import Fleet
from worker.dev.harness.waiting import wait_for


async def send(bs: str, fleet: Fleet, *commands: Command | bytes) -> None:
    await produce(
        bs,
        fleet.control,
        [(None, c if isinstance(c, bytes) else encode(c), []) for c in commands],
    )


async def answered(bs: str, fleet: Fleet, *answers: tuple[str, int, str]) -> None:
    """What a worker of the fleet that ran earlier wrote on the status topic: its
    acknowledgement of each (command id, control-topic offset, outcome), as a worker
    starting now reads the fleet's state from."""
    acks = [
        CommandAck(
            worker="earlier-worker",
            group=fleet.topics.group,
            command_id=command_id,
            kind="update_weights",
            outcome=outcome,  # type: ignore[arg-type]
            duration_s=0.1,
            weight_version=0,
            at=time.time(),
            offset=offset,
        )
        for command_id, offset, outcome in answers
    ]
    await produce(bs, fleet.status, [(b"earlier-worker", encode(a), []) for a in acks])


class Topic(InBackground):
    """Reads a topic's first partition from the beginning in the background, keeping
    (timestamp, value) unless a subclass's `_take` keeps something else."""

    def __init__(self, bs: str, topic: str) -> None:
        self.records: list[tuple[int, bytes]] = []
        self._bs, self._topic = bs, topic
        self._partition = TopicPartition(topic, 0)
        self._consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> Self:
        consumer = AIOKAFKA.consumer(bootstrap_servers=self._bs, enable_auto_commit=False)
        await consumer.start()
        consumer.assign([self._partition])
        await consumer.seek_to_beginning(self._partition)
        self._consumer = consumer
        self._run_in_background(self._run(consumer))
        return self

    async def read_to_end(self, timeout_s: float = 10) -> None:
        """Until everything the partition held when called has been taken: a snapshot of what
        was read is then all that its writers (stopped before the call) wrote, not a prefix of
        it that the reader happened to have fetched."""
        consumer = self._consumer
        assert consumer is not None, "read_to_end outside the reader's context"
        end: int = (await consumer.end_offsets([self._partition]))[self._partition]

        async def reached() -> bool:
            position: int = await consumer.position(self._partition)
            return position >= end

        await wait_for(reached, timeout_s, f"{self._topic} read up to offset {end}")

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while True:
                for batch in (await consumer.getmany(timeout_ms=100)).values():
                    self._take(batch)
        finally:
            await consumer.stop()

    def _take(self, batch: list[ConsumerRecord[bytes, bytes]]) -> None:
        self.records += [(r.timestamp, r.value) for r in batch]


class Status(Topic):
    def acks(self, command_id: str) -> list[CommandAck]:
        return [
            m
            for _, v in self.records
            if isinstance(m := decode_status(v), CommandAck) and m.command_id == command_id
        ]

    def ack_time(self, command_id: str) -> int:
        return next(
            t
            for t, v in self.records
            if isinstance(m := decode_status(v), CommandAck) and m.command_id == command_id
        )

    def errors(self) -> list[ControlRecordError]:
        return [m for _, v in self.records if isinstance(m := decode_status(v), ControlRecordError)]

    def statuses(self, worker: str) -> list[WorkerStatus]:
        return [
            m
            for _, v in self.records
            if isinstance(m := decode_status(v), WorkerStatus) and m.worker == worker
        ]

    async def wait_live(self, *workers: str, timeout_s: float = 30) -> None:
        """Until each worker has sent a heartbeat: its control plane has caught up with the
        commands already in the topic and follows the new ones (commands sent before that are
        state to catch up with, not commands to acknowledge one by one)."""
        await wait_for(
            lambda: all(self.statuses(w) for w in workers), timeout_s, f"heartbeats of {workers}"
        )

    async def wait_acks(
        self, command_id: str, count: int, timeout_s: float = 20
    ) -> list[CommandAck]:
        await wait_for(lambda: len(self.acks(command_id)) >= count, timeout_s, f"{count} acks")
        return self.acks(command_id)


class Results(Topic):
    def by_id(self) -> dict[str, list[Completed | Failed]]:
        out: dict[str, list[Completed | Failed]] = {}
        for _, v in self.records:
            result = decode_result(v)
            out.setdefault(result.job_id or "", []).append(result)
        return out

    def timed(self) -> list[tuple[int, Completed | Failed]]:
        return [(t, decode_result(v)) for t, v in self.records]

    async def wait(self, *job_ids: str, timeout_s: float = 20) -> dict[str, Completed | Failed]:
        await wait_for(lambda: set(job_ids) <= set(self.by_id()), timeout_s, f"{job_ids}")
        return {j: self.by_id()[j][-1] for j in job_ids}


def completed(result: Completed | Failed) -> Completed:
    assert isinstance(result, Completed), result
    return result
