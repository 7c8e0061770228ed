"""PartitionGate at the in-flight cap: everything paused, polled only as often as the group needs.

aiokafka drops the records it has fetched for a partition when asked for records while that
partition is paused, and fetches them again after the resume; a poll on every wake at the cap
fetched the same records again and again.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import GroupCoordinatorNotAvailableError, UnknownMemberIdError

from tests.fakes import FakeConsumer, ManualClock, run_on_virtual_time
from worker.core.clock import SYSTEM_CLOCK
from worker.core.kafka import LeaveGroupByInstanceId
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


async def at_the_cap() -> tuple[CountingConsumer, PartitionGate, ManualClock]:
    """A gate whose consumer holds P0 and P1 (two jobs each) and has fetched one job."""
    consumer = CountingConsumer()
    for tp in (P0, P1):
        consumer.add(tp, b"job-0")
        consumer.add(tp, b"job-1")
    consumer.assign({P0, P1})
    clock = ManualClock()
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
    """aiokafka's group coordinator, as far as leaving the group goes, and the group behind it:
    its members, and which of them holds this worker's instance id (a static member)."""

    def __init__(self, instance_id: str | None = "pod-0") -> None:
        self.group_id = "g"
        self._group_instance_id = instance_id
        self.generation, self.member_id = 3, "worker-3"
        self.members = {"worker-3"}
        self.holding_instance = "worker-3"
        self.left_as: list[str] = []
        #: Requests that fail before the coordinator answers (it is moving, or away).
        self.unreachable = 0
        #: aiokafka's: None while it holds the coordinator for dead (its `_send_req` then
        #: refuses), until its coordination task, or a FindCoordinator of `_client`, finds it.
        self.coordinator_id: int | None = 0
        self._client = _Client(self)

    async def _send_req(self, request: Any) -> Any:
        if self.coordinator_id is None:
            raise GroupCoordinatorNotAvailableError()
        return await self.answer(request)

    async def answer(self, request: Any) -> Any:
        if self.unreachable:
            self.unreachable -= 1
            raise GroupCoordinatorNotAvailableError()
        if isinstance(request, LeaveGroupByInstanceId):
            self.left_as.append(f"instance {request.instance_id}")
            found = request.instance_id == self._group_instance_id
            leaving = self.holding_instance if found else ""
        else:
            self.left_as.append(request._member_id)
            leaving = request._member_id
        if leaving not in self.members:
            return SimpleNamespace(error_code=UnknownMemberIdError.errno)
        self.members.discard(leaving)
        return SimpleNamespace(error_code=0)

    def reset_generation(self) -> None:
        self.generation, self.member_id = -1, ""

    async def _maybe_leave_group(self) -> None:
        """aiokafka's, run by its close once its coordination has stopped: a static member
        does not leave (and this fake has no dynamic one of a generation to leave)."""
        assert self._group_instance_id is not None or self.generation < 0
        self.reset_generation()

    def rejoin(self, as_member: str) -> None:
        """aiokafka's coordination joins again under the instance id, as `as_member`."""
        self.members = (self.members - {self.holding_instance}) | {as_member}
        self.holding_instance = as_member
        self.generation, self.member_id = 4, as_member


class _Client:
    """aiokafka's client as a leave uses it: FindCoordinator, and a request to that node."""

    def __init__(self, coordinator: _Coordinator) -> None:
        self._coordinator = coordinator
        self.lookups = 0

    async def coordinator_lookup(self, coordination_type: Any, group_id: str) -> int:
        self.lookups += 1
        return 0

    async def send(self, node_id: int, request: Any, *, group: Any) -> Any:
        return await self._coordinator.answer(request)


def _gate_on(coordinator: _Coordinator) -> PartitionGate:
    consumer = FakeConsumer()
    consumer._coordinator = coordinator  # type: ignore[attr-defined]
    return PartitionGate(consumer, [], keepalive_s=KEEPALIVE_S, clock=SYSTEM_CLOCK)


async def test_a_static_member_scaled_in_leaves_under_the_id_aiokafka_forgot():
    # Found by the fleet simulation (`bench/sim.py --seed 403 --workers 3 --flavour noida`):
    # a commit refused because the generation moved on (another worker joining) makes aiokafka
    # reset its member id, though the group keeps the member and waits for it to rejoin. A
    # worker stopping just then sent no LeaveGroup, and on a broker that never evicts the
    # group waited for it for ever: no partition moved again.
    coordinator = _Coordinator()
    gate = _gate_on(coordinator)
    gate.joined()
    coordinator.reset_generation()
    await gate.stop(leave=True)
    assert coordinator.left_as == ["worker-3"]
    assert coordinator.members == set()
    await gate.stop(leave=True)  # stopping again leaves no more
    assert coordinator.left_as == ["worker-3"]


async def test_a_static_member_whose_rejoin_gave_its_instance_a_new_id_leaves_by_instance():
    # Seed 71294 of `bench/sim.py --flavour noida --static`: aiokafka rejoined under the
    # instance id while the worker drained, and the group gave the instance a new member id
    # whose JoinGroup answer had not come back. The leave under the old id was refused
    # (UNKNOWN_MEMBER_ID), and the new member held its partitions for ever.
    coordinator = _Coordinator()
    gate = _gate_on(coordinator)
    gate.joined()
    coordinator.reset_generation()
    coordinator.members = {"worker-5"}
    coordinator.holding_instance = "worker-5"
    await gate.stop(leave=True)
    assert coordinator.left_as == ["worker-3", "instance pod-0"]
    assert coordinator.members == set()


async def test_a_static_member_scaled_in_before_its_first_join_completed_leaves_by_instance():
    # Seed 71250: started and scaled in at once; its JoinGroup made it a member, the answer
    # never came, and the group waited for it for ever.
    coordinator = _Coordinator()
    coordinator.reset_generation()
    await _gate_on(coordinator).stop(leave=True)
    assert coordinator.left_as == ["instance pod-0"]
    assert coordinator.members == set()


async def test_a_static_member_leaves_as_the_member_its_last_join_made_it():
    # Seed 99100 of `bench/sim.py --flavour noida --static`: a restarted static member was
    # scaled in during a coordinator outage, before its first join completed. Its leave by
    # instance id removed its dead predecessor's member; aiokafka's coordination, still
    # running, then joined again under the instance id, the process exited, and the group held
    # the new member and its partitions for ever. The leave belongs after the last join: in
    # the close, once aiokafka's coordination has stopped.
    coordinator = _Coordinator()
    coordinator.reset_generation()

    class RejoiningConsumer(FakeConsumer):
        async def stop(self) -> None:
            coordinator.rejoin("worker-7")  # the join its close lets finish
            await super().stop()

    consumer = RejoiningConsumer()
    consumer._coordinator = coordinator  # type: ignore[attr-defined]
    gate = PartitionGate(consumer, [], keepalive_s=KEEPALIVE_S, clock=SYSTEM_CLOCK)
    await gate.stop(leave=True)
    assert coordinator.left_as == ["worker-7"]
    assert coordinator.members == set()
    assert coordinator.generation < 0


async def test_a_leave_in_the_close_finds_a_coordinator_aiokafka_holds_for_dead():
    # Once a coordinator outage has marked the coordinator dead, aiokafka's `_send_req` refuses
    # every request, and only its coordination task, which the close has ended, looks it up
    # again: a scaled-in static member leaving in its close would be refused for its whole
    # window, the coordinator back or not (seeds 71294 and 99100 of `--flavour noida
    # --static`, once the simulation held the coordinator for dead as aiokafka does).
    coordinator = _Coordinator()
    gate = _gate_on(coordinator)
    gate.joined()
    coordinator.coordinator_id = None
    await gate.stop(leave=True)
    assert coordinator.left_as == ["worker-3"]
    assert coordinator.members == set()
    assert coordinator._client.lookups == 1


async def test_a_dynamic_member_that_never_joined_sends_no_leave():
    coordinator = _Coordinator(instance_id=None)
    coordinator.reset_generation()
    await _gate_on(coordinator).stop(leave=True)
    assert coordinator.members == {"worker-3"}


def test_a_leave_is_tried_again_while_the_coordinator_cannot_be_reached():
    # Seed 71238: a worker scaled in during a broker outage stopped at once; its one leave
    # failed and the group kept it for ever.
    async def stop(unreachable: int) -> list[str]:
        coordinator = _Coordinator()
        coordinator.unreachable = unreachable
        gate = _gate_on(coordinator)
        gate.joined()
        await gate.stop(leave=True, leave_within_s=5.0)
        return coordinator.left_as

    assert run_on_virtual_time(stop(3)) == ["worker-3"]
    assert run_on_virtual_time(stop(100)) == []  # given up after 5 s


def test_a_leave_measures_its_patience_on_the_workers_clock():
    # Every wait of a worker reads the clock it was built with (`build_worker(clock=)`); a
    # leave reading the process's clock instead would keep another time than the rest of it.
    # Here the worker's clock stands still while the loop's moves: 30 refusals, 15 s of the
    # loop's time, use up none of the 5 s, and the leave lands.
    async def stop() -> list[str]:
        coordinator = _Coordinator()
        coordinator.unreachable = 30
        consumer = FakeConsumer()
        consumer._coordinator = coordinator  # type: ignore[attr-defined]
        gate = PartitionGate(consumer, [], keepalive_s=KEEPALIVE_S, clock=ManualClock())
        gate.joined()
        await gate.stop(leave=True, leave_within_s=5.0)
        return coordinator.left_as

    assert run_on_virtual_time(stop()) == ["worker-3"]
