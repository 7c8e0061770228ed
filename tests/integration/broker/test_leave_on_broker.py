"""A static member scaled in leaves the group on a real broker, also under an id the group no
longer knows (LeaveGroup v3 by instance id, which aiokafka does not speak), and from inside
aiokafka's close, where the worker leaves."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer

from worker.core.kafka import leave_group, leave_group_on_close
from worker.dev.harness.waiting import wait_for

#: Long enough that a partition moving within the test is the leave's doing, not an eviction.
SESSION_TIMEOUT_MS = 60_000


def _static_member(bootstrap: str, topic: str, group: str, instance: str) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        group_instance_id=instance,
        # As the worker's (`make_consumer`): aiokafka's last auto-commit in its close retries
        # for ever while it holds the coordinator for dead.
        enable_auto_commit=False,
        session_timeout_ms=SESSION_TIMEOUT_MS,
        heartbeat_interval_ms=1_000,
        rebalance_timeout_ms=SESSION_TIMEOUT_MS,
    )


async def _polled(*consumers: AIOKafkaConsumer) -> None:
    await asyncio.gather(*(c.getmany(timeout_ms=200) for c in consumers))


@pytest.mark.broker
@pytest.mark.parametrize(
    "how", ["by member id", "by instance id", "on close", "on close, coordinator held dead"]
)
async def test_a_static_member_that_leaves_hands_its_partitions_over_at_once(
    kafka_bootstrap_servers: str, new_topic: Any, how: str
) -> None:
    topic = await new_topic(2)
    group = f"g-{uuid.uuid4().hex}"
    leaving = _static_member(kafka_bootstrap_servers, topic, group, "pod-0")
    staying = _static_member(kafka_bootstrap_servers, topic, group, "pod-1")
    await leaving.start()
    await staying.start()
    try:

        async def both_hold_one() -> bool:
            await _polled(leaving, staying)
            return len(leaving.assignment()) == len(staying.assignment()) == 1

        await wait_for(both_hold_one, 60, "both members to hold a partition")
        if how == "by instance id":
            # What aiokafka knows is an id the group replaced (its rejoin under the instance
            # id got a new one, whose JoinGroup answer had not come back): the broker answers
            # UNKNOWN_MEMBER_ID, and the instance id does it.
            leaving._coordinator.member_id = ""
            await leave_group(leaving, "an-id-the-group-replaced")
        elif how == "by member id":
            await leave_group(leaving)
        else:
            # Without it aiokafka's close leaves no static member: the partition would stay
            # with the instance for the whole session timeout.
            leave_group_on_close(leaving, within_s=5.0)
            if how == "on close, coordinator held dead":
                # As after an error reaching it: aiokafka's `_send_req` refuses until its
                # coordination task, which the close ends, looks the coordinator up again.
                leaving._coordinator.coordinator_dead()
        await leaving.stop()

        async def staying_holds_both() -> bool:
            await _polled(staying)
            return len(staying.assignment()) == 2

        await wait_for(staying_holds_both, SESSION_TIMEOUT_MS / 2000, "the partition to move")
    finally:
        await leaving.stop()
        await staying.stop()
