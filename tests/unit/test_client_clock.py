"""The trainer's client reads the time from the clock it is given (`worker.core.clock.Clock`),
not from the `time` module: on the simulation's virtual clock, with `time` left alone, its
heartbeats are judged live and its weight updates dated by that clock. The virtual clock
starts at `EPOCH_S`, weeks away from the machine's, so a reading of the machine's clock
shows."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from aiokafka.structs import TopicPartition

from schemas import UpdateWeights, WorkerStatus, decode_command, encode
from worker.client.fleet import MISSED_HEARTBEATS, Fleet
from worker.client.inflight import RolloutError
from worker.client.rollout import RolloutClient
from worker.dev.sim.clients import Process
from worker.dev.sim.clock import VirtualClock, VirtualLoop
from worker.dev.sim.cluster import Cluster
from worker.dev.sim.history import History
from worker.dev.sim.kafka_clients import SimKafkaClients

T = TypeVar("T")

STATUS, CONTROL = "status", "control"
INTERVAL_S = 5.0


def run_on(clock: VirtualClock, body: Callable[[], Awaitable[T]]) -> T:
    loop = VirtualLoop(clock)
    try:
        return loop.run_until_complete(body())
    finally:
        loop.close()


def fleet_cluster(clock: VirtualClock) -> tuple[Cluster, SimKafkaClients]:
    cluster = Cluster(History(lambda: clock.now))
    cluster.create_topic(STATUS, 1)
    cluster.create_topic(CONTROL, 1)
    return cluster, SimKafkaClients.of_process(Process("trainer", cluster, random.Random(0)))


def heartbeat(worker: str, at: float) -> WorkerStatus:
    return WorkerStatus(
        worker=worker,
        group="g",
        model="m",
        weight_version=0,
        paused=False,
        in_flight=0,
        lag=None,
        engine_healthy=True,
        uptime_s=1.0,
        at=at,
        interval_s=INTERVAL_S,
    )


def test_live_workers_are_those_heard_from_recently_on_the_fleets_clock() -> None:
    clock = VirtualClock()
    clock.now = 30.0
    cluster, clients = fleet_cluster(clock)
    window_s = MISSED_HEARTBEATS * INTERVAL_S
    beats = [
        heartbeat("recent", clock.wall() - 1.0),
        heartbeat("gone", clock.wall() - window_s - 1),
    ]
    cluster.produce(
        "workers",
        TopicPartition(STATUS, 0),
        [(b.worker.encode(), encode(b), []) for b in beats],
        producer_id=None,
        now_ms=0,
    )

    async def body() -> list[str]:
        async with Fleet(
            {"bootstrap_servers": "sim:9092", "client_id": "trainer"},
            control_topic=CONTROL,
            status_topic=STATUS,
            kafka_clients=clients,
            clock=clock,
        ) as fleet:
            return sorted(await fleet.live_workers(timeout_s=5.0))

    assert run_on(clock, body) == ["recent"]


def test_a_weight_update_is_dated_on_the_clients_clock() -> None:
    clock = VirtualClock()
    clock.now = 30.0
    cluster, clients = fleet_cluster(clock)
    client = RolloutClient(
        bootstrap_servers="sim:9092",
        control_topic=CONTROL,
        status_topic=STATUS,
        group_id="g",
        kafka_clients=clients,
        clock=clock,
        client_id="trainer",
    )
    before = clock.wall()

    async def body() -> None:
        await client.update_weights("/ckpt/3", 3, timeout_s=5.0)

    with pytest.raises(RolloutError, match="no live worker"):
        run_on(clock, body)
    (record,) = cluster.read(TopicPartition(CONTROL, 0), 0, 10)
    assert record.value is not None
    command = decode_command(record.value)
    assert isinstance(command, UpdateWeights)
    assert command.issued_at is not None
    # Workers refuse a command older than --command-max-age-s: it is dated on the clock the
    # client was given, at the send.
    assert before <= command.issued_at <= clock.wall()
