"""A hand-over that did not land blames nobody while its writer is alive: incarnations announced
to the group, named in the offset maps, and checked by the next owner."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, KafkaConnectionError
from aiokafka.protocol.admin import DescribeGroupsResponse_v1

from tests.fakes import FakeConsumer, run_on_virtual_time
from worker.core.config import Settings, settings_from
from worker.core.incarnation import (
    incarnation_assignor,
    incarnations_of_members,
    new_incarnation,
)
from worker.core.metrics import Metrics
from worker.delivery.commits import Committer
from worker.delivery.offset_map import decode_offset_map, encode_offset_map

TP, TP1 = TopicPartition("jobs", 0), TopicPartition("jobs", 1)


def _settings(**values: Any) -> Settings:
    return settings_from(
        {"jobs_topic": "jobs", "results_topic": "results", "engine": "mock", **values}, {}
    )


def _member(member_id: str, metadata: bytes) -> tuple[str, str, str, bytes, bytes]:
    return (member_id, "client", "/127.0.0.1", metadata, b"")


def test_the_group_description_gives_back_what_each_live_worker_announced() -> None:
    ours, other = new_incarnation(), new_incarnation()
    announced = [incarnation_assignor(n).metadata(["jobs"]).encode() for n in (ours, other)]
    response = DescribeGroupsResponse_v1(
        throttle_time_ms=0,
        groups=[
            (
                0,
                "g",
                "Stable",
                "consumer",
                "roundrobin",
                [
                    _member("a", announced[0]),
                    _member("b", announced[1]),
                    _member("plain", b""),  # a member whose metadata is missing
                    _member("garbage", b"\x00\x01junk"),
                ],
            ),
            (0, "another-group", "Stable", "consumer", "roundrobin", [_member("c", b"")]),
        ],
    )
    assert incarnations_of_members([response], "g") == {ours, other}
    # No member's metadata at all: a broker that never returns it (tansu) says nothing.
    assert incarnations_of_members([response], "another-group") is None


class _Group:
    """What the group says is alive, and how often it was asked."""

    def __init__(self, live: set[int] | Exception) -> None:
        self.live = live
        self.asked = 0

    async def __call__(self) -> set[int]:
        self.asked += 1
        if isinstance(self.live, Exception):
            raise self.live
        return set(self.live)


async def _assigned(
    maps: dict[TopicPartition, str], group: _Group, incarnation: int | None = None
) -> Committer:
    consumer = FakeConsumer()
    for tp in maps:
        for _ in range(10):
            consumer.add(tp, b"{}")

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        return {tp: (0, maps[tp]) for tp in tps}

    committer = Committer(
        consumer,
        _settings(),
        Metrics(),
        read_committed,
        live_incarnations=group,
        incarnation=incarnation,
    )
    await committer.assigned(set(maps))
    return committer


async def test_records_a_live_member_was_running_when_its_hand_over_failed_blame_nobody() -> None:
    writer = new_incarnation()
    failed_hand_over = encode_offset_map(0, [2], running=[1, 3], writer=writer)
    group = _Group({writer, new_incarnation()})
    committer = await _assigned({TP: failed_hand_over, TP1: failed_hand_over}, group)
    for tp in (TP, TP1):
        partition = committer.partition(tp)
        assert partition.deaths == {}
        assert partition.answered_before == {2}
    assert group.asked == 1  # once per assignment, not per partition


async def test_records_a_member_gone_from_the_group_was_running_count_a_death() -> None:
    writer = new_incarnation()
    died = encode_offset_map(0, [2], running=[1, 3], deaths={5: 1}, writer=writer)
    committer = await _assigned({TP: died}, _Group({new_incarnation()}))
    assert committer.partition(TP).deaths == {1: 1, 3: 1, 5: 1}


async def test_a_process_reading_its_own_map_back_after_a_rebalance_blames_nobody() -> None:
    own = new_incarnation()
    group = _Group(set())
    committer = await _assigned(
        {TP: encode_offset_map(0, [], running=[0, 1], writer=own)}, group, own
    )
    assert committer.partition(TP).deaths == {}
    assert group.asked == 0


@pytest.mark.parametrize(
    "group", [_Group(KafkaConnectionError("coordinator gone")), _Group(TimeoutError())]
)
def test_a_group_that_cannot_be_asked_counts_the_writer_as_dead(group: _Group) -> None:
    # On virtual time: the new owner waits for the hand-over, then asks again for up to
    # --commit-timeout-s before it counts the writer as dead.
    writer = new_incarnation()
    committer = run_on_virtual_time(
        _assigned({TP: encode_offset_map(0, [], running=[4], writer=writer)}, group)
    )
    assert committer.partition(TP).deaths == {4: 1}
    assert group.asked > 2


async def test_a_map_that_names_no_writer_counts_as_written_by_the_dead() -> None:
    # Maps of earlier versions name no incarnation: the breaker's counts stay on the safe side.
    group = _Group(set())
    committer = await _assigned({TP: encode_offset_map(0, [], running=[4])}, group)
    assert committer.partition(TP).deaths == {4: 1}
    assert group.asked == 0


async def test_every_commit_names_the_incarnation_of_its_process() -> None:
    own = new_incarnation()
    committer = await _assigned({TP: ""}, _Group(set()), own)
    partition = committer.partition(TP)
    partition.start(0)
    partition.start(1)
    partition.finish(1)
    planned = committer.tracker.plan()
    assert decode_offset_map(0, planned[TP].commit[1]).writer == own


class Refusing(FakeConsumer):
    """A member whose commits the group refuses while `refuse` (its generation moved on)."""

    refuse = False

    async def commit(self, offsets: dict[TopicPartition, tuple[int, str]]) -> None:
        if self.refuse:
            raise CommitFailedError("IllegalGenerationError")
        await super().commit(offsets)


async def test_a_hand_over_refused_during_the_rebalance_lands_once_the_member_rejoins() -> None:
    # noida-db refuses the old generation's commits from the moment another member asks to
    # join, before this member hears of the rebalance; the new generation's commit lands for
    # any partition (bench/rebalance_probe.py).
    consumer = Refusing()
    read: list[int] = []

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        read.append(len(consumer.commits))
        return {}

    committer = Committer(consumer, _settings(), Metrics(), read_committed)
    await committer.assigned({TP, TP1})
    consumer.refuse = False
    for tp in (TP, TP1):
        partition = committer.partition(tp)
        for offset in range(3):
            partition.start(offset)
        partition.finish(0)
    await committer.commit_now({TP, TP1})  # lands: 1 and 2 running, what a next owner waits on
    consumer.refuse = True
    for tp in (TP, TP1):
        committer.partition(tp).finish(2)
    await committer.commit_now({TP, TP1}, clean=True)
    committer.forget({TP, TP1})
    assert consumer.commits == [{TP: 1, TP1: 1}]

    consumer.refuse = False
    await committer.assigned({TP})
    assert consumer.commits[1:] == [{TP: 1, TP1: 1}]
    landed = decode_offset_map(1, consumer.metadata[1][TP1])
    assert landed.clean and landed.answered == {2}
    # Read once to check nobody committed there since, landed, and only then were the maps
    # of the new assignment read back.
    assert read == [0, 1, 2]


async def _refused_hand_over(consumer: Refusing) -> Committer:
    """A committer on `consumer` that held TP, landed a commit naming 1 and 2 as running, then
    answered them and had its revoke's hand-over (at 3) refused; TP is revoked, and the group
    takes commits again."""

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        return {}

    committer = Committer(consumer, _settings(), Metrics(), read_committed)
    await committer.assigned({TP})
    partition = committer.partition(TP)
    for offset in range(3):
        partition.start(offset)
    partition.finish(0)
    await committer.commit_now({TP})  # lands: 1 and 2 running
    consumer.refuse = True
    partition.finish(1)
    partition.finish(2)
    await committer.commit_now({TP}, clean=True)  # the revoke's hand-over, refused
    committer.forget({TP})
    consumer.refuse = False
    return committer


def test_a_stopping_worker_waits_for_the_hand_over_its_assignment_callback_is_landing() -> None:
    # Seed 94081 of `--flavour noida --static --weight-update-every-s 4
    # --engine-killing-updates 0.3`: an update left no engine just as the member rejoined. The
    # assignment callback had taken the refused hand-over on its way; the stopping worker found
    # nothing left to land, left the group, and that landing failed with it: the next owner
    # counted a death against the jobs the last landed map named as running.
    consumer = Refusing()

    async def scenario() -> None:
        committer = await _refused_hand_over(consumer)
        consumer.commit_gate = asyncio.Event()  # the landing's commit is on its way
        started = consumer.commits_started
        rejoined = asyncio.create_task(committer.assigned({TP}))
        await asyncio.sleep(1)
        assert consumer.commits_started == started + 1
        stopping = asyncio.create_task(committer.hand_over_until(time.monotonic() + 30))
        await asyncio.sleep(5)
        assert not stopping.done()  # it waits for the landing on its way
        consumer.commit_gate.set()
        assert await stopping
        await rejoined
        assert consumer.commits[-1] == {TP: 3}  # everything answered: nothing left running

    run_on_virtual_time(scenario())


async def test_a_refused_hand_over_is_not_landed_later_over_a_map_the_next_owner_does_not_wait_for():
    """Found by the fleet simulation (`bench/sim.py --seed 12606 --workers 3`): a stopping
    worker's last landed commit was a clean hand-over; its revoke's hand-over then did not land,
    and made again after rejoining it landed after the new owner had read the clean map (which
    it does not wait past): that owner's first commit moved the position back. Over a clean map,
    or one naming nothing running, or none, the answers since run again instead."""

    consumer = Refusing()

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        return {}

    committer = Committer(consumer, _settings(), Metrics(), read_committed)
    await committer.assigned({TP, TP1})
    for offset in range(3):
        committer.partition(TP).start(offset)
    committer.partition(TP).finish(0)
    await committer.commit_now({TP}, clean=True)  # a clean hand-over (a stop began) lands
    committer.partition(TP1).start(0)
    committer.partition(TP1).finish(0)  # TP1: nothing of this member's landed yet
    consumer.refuse = True
    committer.partition(TP).finish(2)
    await committer.commit_now({TP, TP1}, clean=True)
    committer.forget({TP, TP1})

    consumer.refuse = False
    await committer.assigned(set())
    assert len(consumer.commits) == 1


async def test_a_new_owner_waits_briefly_for_the_hand_over_of_a_live_member() -> None:
    # The live member commits its refused hand-over again as soon as it rejoins, in the round
    # that assigned the partition here: read again, its answers are not run twice.
    writer = new_incarnation()
    reads = [
        encode_offset_map(0, [2], running=[0, 1, 3], writer=writer),
        encode_offset_map(0, [2], running=[0, 1, 3], writer=writer),
        encode_offset_map(0, [0, 1, 2, 3], clean=True, writer=writer),
    ]
    consumer = FakeConsumer()
    for _ in range(10):
        consumer.add(TP, b"{}")

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        return {TP: (0, reads.pop(0) if len(reads) > 1 else reads[0])}

    committer = Committer(
        consumer, _settings(), Metrics(), read_committed, live_incarnations=_Group({writer})
    )
    await committer.assigned({TP})
    partition = committer.partition(TP)
    assert partition.answered_before == {0, 1, 2, 3}
    assert partition.deaths == {}
