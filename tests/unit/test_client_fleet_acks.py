"""`Fleet.acks`, the wait for a command's acknowledgements, on the simulation's virtual clock
(the fleet's own, the `time` module left alone): time moves only while every task waits, so a
wait that asks for no time at all never ends."""

from __future__ import annotations

import random
from typing import Any

from aiokafka.structs import TopicPartition

from worker.client.fleet import Fleet
from worker.dev.sim.clients import Process
from worker.dev.sim.clock import VirtualClock, VirtualLoop
from worker.dev.sim.cluster import Cluster
from worker.dev.sim.history import History
from worker.dev.sim.kafka_clients import SimKafkaClients


def test_a_wait_for_acknowledgements_that_never_come_ends_at_its_timeout() -> None:
    """10.5 ms: after one 10 ms read, half a millisecond is left, which was rounded down to a
    read that waits for nothing, again and again, without the clock ever moving on (an update
    call of `RolloutClient` hung there in the trainer flag set)."""
    clock = VirtualClock()
    loop = VirtualLoop(clock)
    cluster = Cluster(History(lambda: clock.now))
    cluster.create_topic("status", 1)
    cluster.create_topic("control", 1)
    reads = 0

    async def body() -> tuple[dict[str, Any], float]:
        nonlocal reads
        process = Process("trainer", cluster, random.Random(0))
        fleet = Fleet(
            {"bootstrap_servers": "sim:9092", "client_id": "trainer"},
            control_topic="control",
            status_topic="status",
            kafka_clients=SimKafkaClients.of_process(process),
            clock=clock,
        )
        async with fleet:
            consumer = fleet._consumer
            real = consumer.getmany

            async def counted(*args: Any, **kwargs: Any) -> Any:
                nonlocal reads
                reads += 1
                if reads > 1_000:
                    raise AssertionError("the wait reads without end")
                return await real(*args, **kwargs)

            consumer.getmany = counted
            started = loop.time()
            got = await fleet.acks("cmd-1", ["w0"], {TopicPartition("status", 0): 0}, 0.0105)
            return got, loop.time() - started

    try:
        got, waited = loop.run_until_complete(body())
    finally:
        loop.close()
    assert got == {}
    assert 0.0105 <= waited < 0.1
    assert reads <= 3
