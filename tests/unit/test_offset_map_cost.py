"""What a commit's offset map costs behind a long head-of-line job: one slow job at the head of a
partition while the short ones behind it keep finishing. Counted in operations (encodes) and
memory touched, never in time."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from worker.delivery import offset_map
from worker.delivery.offset_map import decode_offset_map, encode_offset_map
from worker.delivery.offsets import PartitionOffsets


def _behind_a_slow_head(finished: int) -> PartitionOffsets:
    partition = PartitionOffsets()
    for offset in range(finished + 1):
        partition.start(offset)
    for offset in range(1, finished + 1):
        partition.finish(offset)
    return partition


def _plan_peak_bytes(partition: PartitionOffsets) -> int:
    tracemalloc.start()
    try:
        partition.plan(limit=3072)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def test_a_commits_cost_does_not_grow_with_the_offsets_finished_behind_the_gap():
    # Every commit sorted and copied every finished offset behind the head (4 ms at 10k, 43 ms
    # at 100k, on the event loop): memory touched per plan grew with them.
    small = _plan_peak_bytes(_behind_a_slow_head(1_000))
    large = _plan_peak_bytes(_behind_a_slow_head(100_000))
    assert large < 2 * small + 16_384, (small, large)


def test_a_commit_encodes_its_map_once_and_not_again_until_it_changes(monkeypatch):
    encodes = 0
    real = offset_map._encode

    def counted(*args, **kwargs):
        nonlocal encodes
        encodes += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(offset_map, "_encode", counted)
    partition = _behind_a_slow_head(50)
    partition.plan(limit=3072)
    assert encodes == 1
    partition.plan(limit=3072)
    assert encodes == 1  # nothing changed: the map is not built again
    partition.start(51)
    partition.finish(51)
    partition.plan(limit=3072)
    assert encodes == 2


@pytest.mark.parametrize("seed", range(20))
def test_the_map_and_its_size_match_a_map_built_from_scratch(seed):
    rng = random.Random(seed)
    partition = PartitionOffsets()
    started: list[int] = []
    finished: set[int] = set()
    offset = rng.randrange(0, 1000)
    for _ in range(300):
        if rng.random() < 0.6 or len(started) == len(finished):
            offset += rng.choice((1, 1, 1, 2, 5))
            partition.start(offset)
            started.append(offset)
        else:
            candidate = rng.choice(started)
            partition.finish(candidate)
            finished.add(candidate)
        unfinished = [o for o in started if o not in finished]
        position = unfinished[0] if unfinished else started[-1] + 1
        answered = [o for o in finished if o >= position]
        planned = partition.plan()
        assert planned is not None
        expected = encode_offset_map(position, answered, running=unfinished)
        assert planned.commit == (position, expected)
        assert planned.own_bytes == (len(encode_offset_map(position, answered)) if answered else 0)
        decoded = decode_offset_map(position, planned.commit[1])
        assert decoded.answered == frozenset(answered)
        assert decoded.running == frozenset(unfinished)
