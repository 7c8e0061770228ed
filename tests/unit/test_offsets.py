"""The commit rule: highest contiguous answered offset + 1, per partition."""

import pytest
from aiokafka import TopicPartition

from worker.delivery.offset_map import OffsetMap, decode_offset_map, encode_offset_map
from worker.delivery.offsets import OffsetTracker, PartitionOffsets

TP0 = TopicPartition("jobs", 0)
TP1 = TopicPartition("jobs", 1)


def test_out_of_order_completion_commits_only_contiguous_prefix():
    p = PartitionOffsets()
    for offset in range(10, 15):
        p.start(offset)
    assert p.commit_position() == 10
    p.finish(12)
    p.finish(14)
    assert p.commit_position() == 10  # 10 and 11 are still running: a hole blocks the rest
    p.finish(10)
    assert p.commit_position() == 11
    p.finish(11)
    assert p.commit_position() == 13  # 12 finished earlier, 13 is the next hole
    p.finish(13)
    assert p.commit_position() == 15
    assert p.pending == 0


def test_skipped_offsets_from_compaction_do_not_block_commit():
    p = PartitionOffsets()
    for offset in (3, 7, 8):
        p.start(offset)
    p.finish(8)
    p.finish(3)
    assert p.commit_position() == 7
    p.finish(7)
    assert p.commit_position() == 9


def test_nothing_started_means_nothing_to_commit():
    assert PartitionOffsets().commit_position() is None
    assert OffsetTracker().to_commit() == {}


def test_records_out_of_order_are_refused():
    p = PartitionOffsets()
    p.start(5)
    with pytest.raises(ValueError, match="in order"):
        p.start(5)


def positions(commits: dict[TopicPartition, tuple[int, str]]) -> dict[TopicPartition, int]:
    return {tp: position for tp, (position, _) in commits.items()}


def test_tracker_reports_only_moved_positions_and_forgets_revoked_partitions():
    t = OffsetTracker()
    p0 = t.start(TP0, 0)
    assert t.start(TP0, 1) is p0
    p1 = t.start(TP1, 100)
    p0.finish(1)
    commits = t.to_commit()
    assert positions(commits) == {TP0: 0, TP1: 100}
    t.committed(commits)
    assert t.to_commit() == {}
    p0.finish(0)
    p1.finish(100)
    assert t.to_commit() == {TP0: (2, ""), TP1: (101, "")}
    assert t.to_commit({TP1}) == {TP1: (101, "")}
    t.forget({TP1})
    p1.finish(101)  # a job of a revoked partition finishing late changes nothing
    assert t.to_commit() == {TP0: (2, "")}
    # Nor once the partition is assigned back: the new assignment's offsets are its own.
    t.start(TP1, 101)
    p1.finish(101)
    assert positions(t.to_commit()) == {TP0: 2, TP1: 101}


def test_the_map_names_what_finished_behind_a_gap_and_what_was_answered_before():
    t = OffsetTracker()
    t.assigned(TP0, OffsetMap(answered=frozenset({12, 13}), clean=True))
    p = t.partition(TP0)
    assert [p.start(o) for o in (10, 11, 12)] == [True, True, False]  # 12 is not run again
    p.finish(11)
    position, metadata = t.to_commit()[TP0]
    assert position == 10
    state = decode_offset_map(position, metadata)
    # 11 finished here, 12 before (and now passed again), 13 before and not fetched yet.
    assert state.answered == {11, 12, 13}
    assert state.running == {10}
    assert not state.clean
    p.finish(10)
    assert t.to_commit()[TP0] == (13, encode_offset_map(13, [13]))
    assert p.start(13) is False
    assert t.to_commit()[TP0] == (14, "")


def test_records_in_flight_at_an_unclean_end_count_a_death_each():
    t = OffsetTracker()
    died = OffsetMap(answered=frozenset({5}), running=frozenset({4, 6}), deaths={6: 1})
    t.assigned(TP0, died)
    assert t.partition(TP0).deaths == {4: 1, 6: 2}
    handed_over = OffsetMap(running=frozenset({4, 6}), deaths={6: 2}, clean=True)
    t.forget({TP0})
    t.assigned(TP0, handed_over)
    assert t.partition(TP0).deaths == {6: 2}  # a clean hand-over blames nobody
    p = t.partition(TP0)
    p.start(6)
    p.finish(6)
    assert p.deaths == {}


def test_memory_holds_only_the_unfinished_window():
    p = PartitionOffsets()
    for offset in range(10_000):
        p.start(offset)
        p.finish(offset)
    assert p.pending == 0
    assert p.commit_position() == 10_000


def test_an_answer_acknowledged_twice_does_not_break_the_commit():
    # Finishing an offset again after the position moved past it left it below the position
    # in the map's set, and every later commit of every partition raised ValueError.
    p = PartitionOffsets()
    for offset in range(3):
        p.start(offset)
    p.finish(0)
    p.finish(1)
    p.finish(0)  # again, after the position passed it
    p.finish(2)
    p.finish(1)
    assert p.to_commit() == (3, "")
    p.start(3)
    p.start(4)
    p.finish(4)
    p.finish(4)
    position, metadata = p.to_commit() or (0, "")
    assert position == 3
    assert decode_offset_map(3, metadata).answered == {4}


def test_a_map_read_below_the_position_it_was_written_for_is_dropped():
    # An out-of-range reset (offsets reused after an unclean leader election) fetches from
    # below the committed offset: the map's offsets name other records now.
    t = OffsetTracker()
    t.assigned(TP0, OffsetMap(answered=frozenset({12, 13}), deaths={14: 2}), anchor=10)
    p = t.partition(TP0)
    assert p.start(0) is True
    for offset in range(1, 16):
        assert p.start(offset) is True, offset
    assert p.deaths == {}


def test_a_map_read_at_its_position_applies():
    t = OffsetTracker()
    t.assigned(TP0, OffsetMap(answered=frozenset({12, 13}), deaths={14: 2}), anchor=10)
    p = t.partition(TP0)
    assert p.start(10) is True
    assert p.start(12) is False  # compaction took 11
    assert p.deaths == {14: 2}


def test_suspects_the_log_no_longer_holds_blame_nobody():
    p = PartitionOffsets()
    p.deaths.update({3: 1, 4: 2, 9: 1})
    p.start(5)  # 3 and 4 were compacted away
    assert p.deaths == {9: 1}


def test_a_start_taken_back_leaves_the_position_where_it_was():
    p = PartitionOffsets()
    p.start(7)
    p.finish(7)
    p.start(9)
    p.unstart(9)
    assert p.idle
    assert p.commit_position() == 9
    assert p.start(9) is True


def test_a_commit_that_overtook_this_owner_moves_its_position_and_what_it_skips():
    # Another member's commit at 13 (answering 15) landed after this owner read the map.
    p = PartitionOffsets()
    for offset in range(10, 15):
        p.start(offset)
    p.finish(11)
    p.finish(14)
    p.deaths[12] = 1
    assert p.overtaken(13, OffsetMap(answered=frozenset({15}), clean=True)) == 2  # 10, 12
    assert p.commit_position() == 13  # 13 still runs; never below the other commit
    p.finish(10)  # answered twice: acknowledged after it was taken over, changes nothing
    p.unstart(12)  # below the floor: nothing to take back
    assert p.commit_position() == 13 and p.deaths == {}
    assert not p.start(15) and p.start(16)
    p.finish(13)
    assert p.commit_position() == 16
    p.finish(16)
    assert p.commit_position() == 17 and p.pending == 0
    commit = p.to_commit()
    assert commit is not None and decode_offset_map(*commit) == OffsetMap()


def test_records_fetched_below_a_commit_that_overtook_this_owner_are_skipped():
    p = PartitionOffsets()
    p.anchor = 5  # assigned at 5, nothing fetched yet
    assert p.overtaken(8, None) == 0
    assert p.commit_position() == 8
    assert not p.start(5) and not p.start(7)
    assert p.start(8) and p.commit_position() == 8
