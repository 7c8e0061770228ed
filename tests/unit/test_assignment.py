"""What a member does with a partition between its assignment and the first record it starts.

Found by the fleet simulation (`bench/sim.py --seed 402 --workers 3 --flavour noida`): the
consumer looks the committed positions up as it joins, and the last owner's refused hand-over
can land just after. The new owner read the later position into its offset map but fetched from
the earlier one, ran the records between again, and committed the position back.
"""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from tests.fakes import FakeConsumer
from worker.core.config import settings_from
from worker.core.metrics import Metrics
from worker.delivery.commits import Committer
from worker.delivery.offset_map import encode_offset_map
from worker.dev.harness.waiting import wait_for

TP, OTHER = TopicPartition("jobs", 0), TopicPartition("jobs", 1)


def _committer(
    consumer: FakeConsumer, committed: dict[TopicPartition, tuple[int, str]]
) -> Committer:
    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        return {tp: committed[tp] for tp in tps if tp in committed}

    settings = settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {})
    return Committer(consumer, settings, Metrics(), read_committed)


async def test_the_fetch_position_is_the_committed_one_read_after_joining():
    consumer = FakeConsumer()
    for _ in range(10):
        consumer.add(TP, b"{}")
    committer = _committer(consumer, {TP: (7, "")})  # it was 6 when the consumer looked
    assert await committer.assigned({TP}) == {TP: 7}


async def test_a_position_past_the_end_of_the_log_leaves_the_consumers_reset_alone():
    consumer = FakeConsumer()
    for _ in range(5):
        consumer.add(TP, b"{}")  # truncated under the commit at 7
    committer = _committer(consumer, {TP: (7, "")})
    assert await committer.assigned({TP}) == {}


async def test_new_partitions_are_held_while_the_members_own_hand_over_lands_first():
    consumer = FakeConsumer()
    committer = _committer(consumer, {})
    # This member's hand-over of OTHER was refused during the rebalance; its last landed map
    # names a job running, so the next owner waits for it, and it lands on rejoining.
    running = (2, encode_offset_map(2, [], running=[2]))
    committer._hand_overs.refused({OTHER: (3, "")}, {OTHER: running})
    consumer.commit_gate = asyncio.Event()
    assigning = asyncio.create_task(committer.assigned({TP}))
    await wait_for(lambda: consumer.commits_started == 1, what="the hand-over sent")
    assert TP in committer.held()  # the loop must not fetch it from the old position meanwhile
    consumer.commit_gate.set()
    await assigning
    assert TP not in committer.held()
