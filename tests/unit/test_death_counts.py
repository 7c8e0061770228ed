"""Death counts and hand-overs in the offset map: a count kept while its record is in flight,
and a late hand-over that must not overwrite a newer owner's commit."""

from __future__ import annotations

from aiokafka import TopicPartition

from tests.fakes import FakeConsumer
from worker.core.metrics import Metrics
from worker.delivery.hand_overs import RefusedHandOvers
from worker.delivery.offset_map import decode_offset_map, encode_offset_map
from worker.delivery.offsets import OffsetTracker

P0 = TopicPartition("jobs", 0)


def test_a_dead_lettered_records_count_stays_in_the_map_until_its_answer_is_acknowledged():
    # Offset 0 was in flight at 3 deaths: answered failed and dead-lettered without running.
    # The records behind it started before that answer was acknowledged, and starting them
    # dropped its count as if the log no longer held it; a death before the acknowledgement
    # then counted 1 for it, and the next owner ran the killer again.
    tracker = OffsetTracker()
    tracker.assigned(P0, decode_offset_map(0, encode_offset_map(0, [], deaths={0: 3})), anchor=0)
    partition = tracker.partition(P0)
    assert partition.start(0)  # answered as crash-looped: in flight until acknowledged
    assert partition.start(1)
    assert partition.start(2)
    position, metadata = partition.to_commit() or (None, "")
    assert position == 0
    committed = decode_offset_map(0, metadata)
    assert committed.deaths == {0: 3}
    assert committed.running == {0, 1, 2}
    # The process dies now: the next owner counts a fourth death for it, not a first.
    after = OffsetTracker()
    after.assigned(P0, committed, anchor=0)
    assert after.partition(P0).deaths[0] == 4
    partition.finish(0)
    position, metadata = partition.to_commit() or (None, "")
    assert position == 1 and decode_offset_map(1, metadata).deaths == {}


def test_the_count_of_a_record_the_log_no_longer_holds_is_dropped():
    tracker = OffsetTracker()
    inherited = encode_offset_map(0, [], deaths={0: 1, 1: 2})
    tracker.assigned(P0, decode_offset_map(0, inherited), anchor=0)
    partition = tracker.partition(P0)
    partition.start(2)  # 0 and 1 were compacted away: nothing left to blame
    assert partition.deaths == {}


class _Group:
    """The group's committed offsets, as another member's commits leave them."""

    def __init__(self, committed: dict[TopicPartition, tuple[int, str]]) -> None:
        self.committed = committed

    async def read(self, tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        return {tp: self.committed[tp] for tp in tps if tp in self.committed}


def _hand_overs(group: _Group, consumer: FakeConsumer) -> RefusedHandOvers:
    return RefusedHandOvers(consumer, Metrics(), timeout_s=1.0, read_committed=group.read)


async def test_a_late_hand_over_does_not_move_back_a_position_the_new_owner_committed():
    # This member's hand-over at 5 was refused during the rebalance; the new owner read the
    # map without it and committed 9 (its own map). Landed on rejoining, the hand-over moved
    # the position back to 5 and replaced the new owner's map.
    mine = (3, encode_offset_map(3, [4], running=[3], writer=7))
    hand_over = (5, encode_offset_map(5, [], running=[5], clean=True, writer=7))
    theirs = (9, encode_offset_map(9, [], running=[9], writer=8))
    consumer = FakeConsumer()
    hand_overs = _hand_overs(_Group({P0: theirs}), consumer)
    hand_overs.refused({P0: hand_over}, {P0: mine})
    await hand_overs.land()
    assert consumer.commits == []


async def test_a_late_hand_over_lands_where_nobody_committed_since():
    mine = (3, encode_offset_map(3, [4], running=[3], writer=7))
    hand_over = (5, encode_offset_map(5, [], running=[5], clean=True, writer=7))
    consumer = FakeConsumer()
    hand_overs = _hand_overs(_Group({P0: mine}), consumer)
    hand_overs.refused({P0: hand_over}, {P0: mine})
    await hand_overs.land()
    assert consumer.commits == [{P0: 5}]
