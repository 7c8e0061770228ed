"""The simulated consumer closes as aiokafka's does (`GroupCoordinator.close`): no join begun
once closing, a join under way let finish, then the leave (aiokafka's `_maybe_leave_group`), at
once otherwise."""

from __future__ import annotations

import asyncio
import random

from tests.fakes import run_on_virtual_time
from worker.core.clock import SYSTEM_CLOCK
from worker.dev.harness.waiting import wait_for
from worker.dev.sim.clients import Process, SimConsumer
from worker.dev.sim.cluster import Cluster, Flavour
from worker.dev.sim.history import History


def _member_at_close(*, stop_after_join: bool) -> tuple[int, float]:
    """The generation the close's leave found, and how long the stop took (virtual s)."""

    async def body() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        cluster = Cluster(History(loop.time), flavour=Flavour.NOIDA)
        cluster.create_topic("jobs", 2)
        consumer = SimConsumer(
            Process("p", cluster, random.Random(0)),
            client_id="c",
            group_id="g",
            group_instance_id="pod-0",
        )
        consumer.subscribe(["jobs"])
        found: list[int] = []

        async def maybe_leave_group() -> None:
            found.append(consumer.generation)

        consumer._leave_at_close = maybe_leave_group
        await consumer.start()
        if stop_after_join:
            await wait_for(lambda: consumer.generation > 0, 10, "the member to join")
            await asyncio.sleep(5.0)  # the heartbeat sleeps between beats
        started = loop.time()
        await asyncio.wait_for(consumer.stop(), 60)
        stopped_in = loop.time() - started
        await consumer.stop()  # closing again does nothing
        assert len(found) == 1
        return found[0], stopped_in

    return run_on_virtual_time(body())


def test_a_join_under_way_at_the_close_is_let_finish_before_the_leave() -> None:
    generation, _ = _member_at_close(stop_after_join=False)
    assert generation > 0


def test_a_member_between_heartbeats_closes_at_once() -> None:
    generation, stopped_in = _member_at_close(stop_after_join=True)
    assert generation > 0
    assert stopped_in < 0.1


def _members_after_stop(*, leave: bool, coordinator_dead: bool) -> set[str]:
    """The group's members once a joined static member has stopped, told to leave or not."""

    async def body() -> set[str]:
        loop = asyncio.get_running_loop()
        cluster = Cluster(History(loop.time), flavour=Flavour.NOIDA)
        cluster.create_topic("jobs", 2)
        consumer = SimConsumer(
            Process("p", cluster, random.Random(0)),
            client_id="c",
            group_id="g",
            group_instance_id="pod-0",
        )
        consumer.subscribe(["jobs"])
        await consumer.start()
        await wait_for(lambda: consumer.generation > 0, 10, "the member to join")
        assert consumer.group_member_id() == consumer.member_id != ""
        if coordinator_dead:
            # As aiokafka after an error reaching it: the leave looks the coordinator up itself.
            consumer.coordinator_id = None
        if leave:
            consumer.leave_on_stop(None, within_s=5.0, clock=SYSTEM_CLOCK)
        await asyncio.wait_for(consumer.stop(), 60)
        assert consumer.group_member_id() is None
        return set(cluster.group("g").members)

    return run_on_virtual_time(body())


def test_a_static_member_told_to_leave_on_stop_leaves_the_group() -> None:
    assert _members_after_stop(leave=True, coordinator_dead=False) == set()
    assert _members_after_stop(leave=True, coordinator_dead=True) == set()


def test_a_static_member_not_told_to_leave_stays_in_the_group_for_its_restart() -> None:
    # KIP-345: aiokafka's close sends no LeaveGroup for a static member.
    assert len(_members_after_stop(leave=False, coordinator_dead=False)) == 1
