"""The simulated producer batches `send()` as aiokafka's accumulator does, and the simulated
broker checks a topic's `max.message.bytes` on the whole batch: records each small enough are
refused together when their batch is not (aiokafka's `MessageAccumulator.add_message`
appends to the partition's last batch the sender has not taken yet; Kafka's
`LogValidator` checks the batch as written)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from aiokafka.errors import MessageSizeTooLargeError

from tests.fakes import run_on_virtual_time
from worker.dev.sim.clients import Process, SimProducer
from worker.dev.sim.cluster import Cluster
from worker.dev.sim.history import History


def _sent_together(
    count: int, *, max_message_bytes: int, linger_ms: int = 0
) -> tuple[list[Any], list[list[int]]]:
    """`count` records of 300 bytes sent to one partition in one go: what each send came to
    (its offset or its error) and the appends the log saw (the offsets of each batch)."""

    async def body() -> tuple[list[Any], list[list[int]]]:
        loop = asyncio.get_running_loop()
        history = History(loop.time)
        cluster = Cluster(history)
        cluster.create_topic("replies", 1, max_message_bytes=max_message_bytes)
        producer = SimProducer(
            Process("p", cluster, random.Random(0)),
            client_id="c",
            max_batch_size=1 << 20,
            linger_ms=linger_ms,
        )
        await producer.start()
        futures = [await producer.send("replies", value=b"x" * 300, key=b"k") for _ in range(count)]
        outcomes = [
            r.offset if not isinstance(r, BaseException) else r
            for r in await asyncio.gather(*futures, return_exceptions=True)
        ]
        appends = [
            list(range(e.fields["base"], e.fields["base"] + e.fields["count"]))
            for e in history.events
            if e.kind == "append"
        ]
        return outcomes, appends

    return run_on_virtual_time(body())


def test_records_sent_at_once_to_a_partition_go_in_one_batch_with_their_own_offsets() -> None:
    outcomes, appends = _sent_together(5, max_message_bytes=1 << 20)
    assert outcomes == [0, 1, 2, 3, 4]
    assert appends == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("linger_ms", [0, 5])
def test_records_each_under_the_topics_limit_are_refused_together_when_their_batch_is_not(
    linger_ms: int,
) -> None:
    outcomes, appends = _sent_together(5, max_message_bytes=1000, linger_ms=linger_ms)
    assert appends == []
    assert all(isinstance(o, MessageSizeTooLargeError) for o in outcomes), outcomes


def test_a_record_sent_while_its_partitions_batch_is_in_flight_goes_in_the_next() -> None:
    async def body() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        history = History(loop.time)
        cluster = Cluster(history)
        cluster.create_topic("replies", 1)
        producer = SimProducer(Process("p", cluster, random.Random(0)), client_id="c")
        first = await producer.send("replies", value=b"a", key=b"k")
        await asyncio.sleep(0.0003)  # taken by the sender, not yet acknowledged
        later = [await producer.send("replies", value=b"b", key=b"k") for _ in range(3)]
        await asyncio.gather(first, *later)
        return [[e.fields["base"], e.fields["count"]] for e in history.events if e.kind == "append"]

    assert run_on_virtual_time(body()) == [[0, 1], [1, 3]]
