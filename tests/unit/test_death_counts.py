"""Death counts in the offset map while the records they count are still in flight."""

from __future__ import annotations

from aiokafka import TopicPartition

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
