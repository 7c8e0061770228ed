"""One commit at a time, each planned once the one before it ended.

Found by the fleet simulation (`bench/sim.py --seed 32 --workers 64 --partitions 512`): during a
coordinator outage a revoke's hand-over commit waited, the interval's commit went out beside
it, planned while the partition was still held, and landed after the revoke had forgotten the
partition. The same member was assigned it back, read the hand-over's older position (the later
commit had not landed yet) and committed behind the position its own late commit had left.
"""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from tests.fakes import FakeConsumer
from worker.core.config import settings_from
from worker.core.metrics import Metrics
from worker.delivery.commits import Committer
from worker.dev.harness.waiting import wait_for

TP = TopicPartition("jobs", 0)


async def test_the_intervals_commit_waits_for_a_hand_over_on_its_way_and_skips_what_it_handed_over():
    consumer = FakeConsumer()
    settings = settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {})
    committer = Committer(consumer, settings, Metrics())
    committer.partition(TP).start(0)
    consumer.commit_gate = asyncio.Event()  # the coordinator does not answer for now

    hand_over = asyncio.create_task(committer.revoked({TP}))
    await wait_for(lambda: consumer.commits_started == 1, what="the hand-over sent")
    committer.partition(TP).finish(0)  # answered while the hand-over waits
    committer.tick(due=True)
    for _ in range(20):  # the interval's commit gets every chance to go out beside it
        await asyncio.sleep(0)
    assert consumer.commits_started == 1

    consumer.commit_gate.set()
    await hand_over
    await committer.commit_now()  # after the interval's commit, which has nothing left to say
    assert consumer.commits == [{TP: 0}]
