"""One commit at a time, each planned once the one before it ended.

Found by the fleet simulation (`bench/sim.py --seed 32 --workers 64 --partitions 512`): during a
coordinator outage a revoke's hand-over commit waited, the interval's commit went out beside
it, planned while the partition was still held, and landed after the revoke had forgotten the
partition. The same member was assigned it back, read the hand-over's older position (the later
commit had not landed yet) and committed behind the position its own late commit had left.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError

from tests.fakes import FakeConsumer
from tests.unit.test_loop import reads_commits_of
from worker.core.config import settings_from
from worker.core.metrics import Metrics
from worker.delivery.commits import Committer
from worker.delivery.offset_map import decode_offset_map
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


async def _offset_1_running_after_a_landed_commit(
    consumer: FakeConsumer, **settings: Any
) -> Committer:
    """A committer whose landed commit names offsets 1 and 2 as running; 2 answered since."""
    committer = Committer(
        consumer,
        settings_from(
            {"jobs_topic": "jobs", "results_topic": "r", "engine": "mock", **settings}, {}
        ),
        Metrics(),
    )
    partition = committer.partition(TP)
    for offset in (0, 1, 2):
        partition.start(offset)
    partition.finish(0)
    await committer.commit_now()  # lands, naming 1 and 2 as running
    partition.finish(2)  # offset 1 is still running
    return committer


async def test_a_hand_over_the_coordinator_did_not_answer_at_a_revoke_lands_before_the_worker_stops():
    """Found by the fleet simulation (`bench/sim.py --seed 2568 --workers 3`): a rebalance began,
    the coordinator went away, the revoke's hand-over timed out and the partitions were
    forgotten; SIGTERM came, the final hand-over found nothing of its own to commit and the
    worker stopped. The next owner read a map naming jobs as running, by a writer gone, and
    counted a death against each."""
    consumer = FakeConsumer()
    committer = await _offset_1_running_after_a_landed_commit(consumer, commit_timeout_s=0.2)
    consumer.commit_gate = asyncio.Event()  # the coordinator is away

    await committer.revoked({TP})
    assert consumer.commits == [{TP: 1}]
    assert not committer.tracker.holds(TP)

    stopping = asyncio.create_task(
        committer.hand_over_until(asyncio.get_running_loop().time() + 30)
    )
    await wait_for(lambda: consumer.commits_started >= 4, what="the hand-over tried again")
    consumer.commit_gate.set()  # the coordinator is back within the grace
    assert await stopping
    assert consumer.commits == [{TP: 1}, {TP: 1}]
    handed_over = decode_offset_map(1, consumer.metadata[-1][TP])
    assert handed_over.clean
    assert handed_over.answered == {2}


class _Rejoining(FakeConsumer):
    """A member as `worker.core.kafka` sees it through aiokafka's `_coordinator`: while its
    generation is forgotten (-1: the group refused a commit of it, and a join is under way),
    every commit is refused, as noida-db refuses the old generation's from the moment another
    member asks to join; once the join completes, commits are taken."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 1
        self.refused = 0
        self._coordinator = self

    async def commit_offsets(self, assignment: Any, offsets: dict[TopicPartition, Any]) -> None:
        await self.commit({tp: (o.offset, o.metadata) for tp, o in offsets.items()})

    async def commit(self, offsets: dict[TopicPartition, tuple[int, str]]) -> None:
        if self.generation < 0:
            self.refused += 1
            raise CommitFailedError("the group has already rebalanced")
        await super().commit(offsets)


async def test_a_stopping_worker_lands_a_refused_hand_over_once_its_join_completes():
    """Found by the fleet simulation (`bench/sim.py --seed 71272 --workers 3 --flavour noida
    --static`, and 71040, 71134, 71231): SIGTERM, then a member joined; noida-db refused the
    revoke's hand-over at once, and the stopping worker's final try, made while aiokafka was
    still rejoining, was refused for the same reason and dropped. The worker exited within its
    grace with its jobs named running, and the next owner counted a death against each."""
    consumer = _Rejoining()
    committer = await _offset_1_running_after_a_landed_commit(consumer)
    consumer.generation = -1  # another member asked to join

    await committer.revoked({TP})
    assert consumer.refused == 1
    stopping = asyncio.create_task(
        committer.hand_over_until(asyncio.get_running_loop().time() + 30)
    )
    await wait_for(
        lambda: consumer.refused >= 3 or stopping.done(), what="the final hand-over refused"
    )
    consumer.generation = 2  # the join completed within the grace
    assert await stopping
    handed_over = decode_offset_map(1, consumer.metadata[-1][TP])
    assert handed_over.clean
    assert handed_over.answered == {2}


async def test_a_hand_over_that_landed_is_not_made_again_with_the_answers_that_came_after_it():
    """Found by the fleet simulation (`bench/sim.py --seed 10166 --workers 3`): the revoke's
    hand-over landed while one more job was answered; made again with it after rejoining, it
    landed after the new owner had read the clean hand-over (which it does not wait past), and
    that owner's first commit moved the position back."""
    consumer = FakeConsumer()
    settings = settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {})
    committer = Committer(consumer, settings, Metrics())
    partition = committer.partition(TP)
    partition.start(0)
    partition.start(1)
    partition.finish(0)
    consumer.commit_gate = asyncio.Event()

    hand_over = asyncio.create_task(committer.revoked({TP}))
    await wait_for(lambda: consumer.commits_started == 1, what="the hand-over sent")
    partition.finish(1)  # answered while the hand-over is on its way
    consumer.commit_gate.set()
    await hand_over

    assert await committer.hand_over_until(asyncio.get_running_loop().time() + 5)
    assert consumer.commits == [{TP: 1}]


async def test_an_adopted_partition_whose_hand_over_landed_late_names_its_job_running_again():
    """The group refused the revoke's hand-over (noida-db does from the moment another member
    asks to join), the partition came back unchanged and was adopted with offset 1 still
    running, and the hand-over, landed on rejoining, was left standing: the tracker still took
    the write-ahead commit below it for what the group held, so it planned nothing new. The
    group kept a clean map over a running job, and a death then blamed nobody."""
    consumer = _Rejoining()
    committer = Committer(
        consumer,
        settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {}),
        Metrics(),
        read_committed=reads_commits_of(consumer),
    )
    partition = committer.partition(TP)
    for offset in (0, 1):
        partition.start(offset)
    partition.finish(0)
    await committer.commit_now()  # lands, naming 1 as running
    consumer.generation = -1  # another member asked to join

    assert await committer.revoked({TP}, keep={TP}) == {TP}
    assert consumer.refused == 1
    consumer.generation = 2  # rejoined, and given the partition back
    assert await committer.adopt({TP}) == {TP}
    await committer.assigned({TP})
    assert decode_offset_map(1, consumer.metadata[-1][TP]).clean  # the hand-over, landed

    committer.tick(due=True)
    await committer.commit_now()
    held = decode_offset_map(1, consumer.metadata[-1][TP])
    assert consumer.commits[-1] == {TP: 1}
    assert not held.clean
    assert held.running == {1}


async def test_an_assigned_partition_held_already_is_not_held_for_a_read_that_never_comes():
    """`adopt` holds every assigned partition until `assigned` reads its map, and `assigned`
    reads only those the tracker does not hold yet. One it held already (taken on by a look
    at its deaths before the read: seed 700098 of the simulation's hostile flag set) stayed
    held for ever, and the worker never fetched it again."""
    consumer = FakeConsumer()
    settings = settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {})
    committer = Committer(consumer, settings, Metrics(), read_committed=reads_commits_of(consumer))
    committer.partition(TP).start(0)
    committer.tracker.park({TP})  # revoked with its job running
    other = TopicPartition("jobs", 1)
    committer.partition(other)  # held already as it is assigned

    assert await committer.adopt({other}) == set()
    assert committer.held() == {other}  # until its map is read
    await committer.assigned({other})
    assert committer.held() == set()


async def test_a_final_hand_over_the_broker_takes_only_as_a_position_ends_the_stop_once_it_lands():
    """The broker's offset.metadata.max.bytes is below --offset-map-max-bytes and the stop's
    hand-over is the first commit to learn it: refused with its map, it is made again as a
    position alone and lands. The stop then has nothing left to wait for; judged by the map
    it could no longer commit, it tried again until its whole grace was spent."""
    consumer = FakeConsumer()
    consumer.metadata_limit = 0  # every map refused, positions taken
    settings = settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {})
    committer = Committer(consumer, settings, Metrics())
    partition = committer.partition(TP)
    for offset in (0, 1, 2):
        partition.start(offset)
    partition.finish(0)
    partition.finish(2)

    loop = asyncio.get_running_loop()
    began = loop.time()
    assert await committer.hand_over_until(began + 1.0)
    assert loop.time() - began < 0.5
    assert not committer.maps_on
    assert consumer.commits == [{TP: 1}]
    assert consumer.metadata == [{TP: ""}]
