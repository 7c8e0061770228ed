"""PartitionGate at the in-flight cap: everything paused, polled only as often as the group needs.

aiokafka drops the records it has fetched for a partition when asked for records while that
partition is paused, and fetches them again after the resume; a poll on every wake at the cap
fetched the same records again and again.
"""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition

from tests.fakes import FakeConsumer
from worker.loop.gate import PartitionGate

P0 = TopicPartition("jobs", 0)
P1 = TopicPartition("jobs", 1)
KEEPALIVE_S = 3.0


class CountingConsumer(FakeConsumer):
    def __init__(self) -> None:
        super().__init__()
        self.polls = 0

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> Any:
        self.polls += 1
        return await super().getmany(timeout_ms=timeout_ms, max_records=max_records)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def at_the_cap() -> tuple[CountingConsumer, PartitionGate, Clock]:
    """A gate whose consumer holds P0 and P1 (two jobs each) and has fetched one job."""
    consumer = CountingConsumer()
    for tp in (P0, P1):
        consumer.add(tp, b"job-0")
        consumer.add(tp, b"job-1")
    consumer.assign({P0, P1})
    clock = Clock()
    gate = PartitionGate(consumer, (), keepalive_s=KEEPALIVE_S, clock=clock)
    fetched = await gate.fetch(1, 0)
    assert sum(map(len, fetched.values())) == 1
    return consumer, gate, clock


async def test_at_the_cap_nothing_is_polled_before_the_keepalive_is_due() -> None:
    consumer, gate, clock = await at_the_cap()
    polls = consumer.polls
    for _ in range(5):
        clock.now += KEEPALIVE_S / 10
        assert await gate.poll_paused() == {}
    assert consumer.polls == polls, "a poll at the cap makes aiokafka fetch its records again"
    assert consumer.paused() == {P0, P1}


async def test_at_the_cap_the_gate_polls_once_the_keepalive_is_due_and_then_waits_again() -> None:
    # The group evicts a member that does not poll for max_poll_interval_ms.
    consumer, gate, clock = await at_the_cap()
    polls = consumer.polls
    clock.now += KEEPALIVE_S
    assert await gate.poll_paused() == {}  # paused: no records
    assert consumer.polls == polls + 1
    clock.now += KEEPALIVE_S / 2
    assert await gate.poll_paused() == {}
    assert consumer.polls == polls + 1


async def test_a_fetch_counts_as_the_poll_the_keepalive_waits_for() -> None:
    consumer, gate, clock = await at_the_cap()
    clock.now += KEEPALIVE_S * 0.9
    assert sum(map(len, (await gate.fetch(1, 0)).values())) == 1
    polls = consumer.polls
    clock.now += KEEPALIVE_S * 0.9
    assert await gate.poll_paused() == {}
    assert consumer.polls == polls


class _Coordinator:
    """aiokafka's group coordinator, as far as leaving the group goes."""

    def __init__(self) -> None:
        self.group_id = "g"
        self.generation, self.member_id = 3, "worker-3"
        self.left_as: list[str] = []

    async def _send_req(self, request: Any) -> None:
        self.left_as.append(request._member_id)

    def reset_generation(self) -> None:
        self.generation, self.member_id = -1, ""


async def test_a_static_member_scaled_in_leaves_under_the_id_aiokafka_forgot():
    # Found by the fleet simulation (`bench/sim.py --seed 403 --workers 3 --flavour noida`):
    # a commit refused because the generation moved on (another worker joining) makes aiokafka
    # reset its member id, though the group keeps the member and waits for it to rejoin. A
    # worker stopping just then sent no LeaveGroup, and on a broker that never evicts the
    # group waited for it for ever: no partition moved again.
    consumer = FakeConsumer()
    coordinator = consumer._coordinator = _Coordinator()  # type: ignore[attr-defined]
    gate = PartitionGate(consumer, [], keepalive_s=KEEPALIVE_S)
    gate.joined()
    coordinator.reset_generation()
    await gate.stop(leave=True)
    assert coordinator.left_as == ["worker-3"]


async def test_a_member_that_never_joined_sends_no_leave():
    consumer = FakeConsumer()
    coordinator = consumer._coordinator = _Coordinator()  # type: ignore[attr-defined]
    coordinator.reset_generation()
    await PartitionGate(consumer, [], keepalive_s=KEEPALIVE_S).stop(leave=True)
    assert coordinator.left_as == []
