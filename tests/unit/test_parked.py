"""Parked partitions: one record of the verdict each awaits and of its offsets kept aside."""

from __future__ import annotations

from aiokafka import TopicPartition

from worker.delivery.offsets import OffsetTracker, PartitionOffsets
from worker.delivery.parked import ParkedPartitions

TP = TopicPartition("jobs", 0)
OTHER = TopicPartition("jobs", 1)


async def test_a_partition_adopted_back_is_told_it_stays_and_goes_on_with_the_same_offsets():
    tracker = OffsetTracker()
    partition = tracker.partition(TP)
    partition.start(0)
    tracker.parked_partitions.await_verdicts({TP})
    tracker.park({TP})
    assert not tracker.holds(TP)
    assert tracker.partition(TP) is partition  # an answer finished meanwhile lands there
    verdict = tracker.parked_partitions.verdict(TP)
    assert verdict is not None and not verdict.done()

    assert tracker.unpark(TP) is partition
    assert tracker.parked_partitions.decide_all({TP}) == set()
    assert verdict.result() is True
    assert tracker.holds(TP)


async def test_a_parked_partition_whose_offsets_were_dropped_still_learns_that_it_moved():
    """Its jobs still run: they are cancelled when the next assignment gives it to another
    member, so the verdict outlives the offsets."""
    parked: ParkedPartitions[PartitionOffsets] = ParkedPartitions()
    tracker = OffsetTracker()
    tracker.partition(TP).start(0)
    tracker.parked_partitions = parked
    parked.await_verdicts({TP, OTHER})
    tracker.park({TP})
    tracker.forget({TP})
    assert dict(parked.offsets()) == {}
    verdict = parked.verdict(TP)
    assert verdict is not None and not verdict.done()

    parked.decide(OTHER, stays=False)
    assert parked.awaiting() == {TP}
    assert parked.decide_all(set()) == {TP}
    assert verdict.result() is False
    assert parked.awaiting() == set()
