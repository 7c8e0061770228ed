"""No new records while answers wait for commits that have stopped landing.

Found by the fleet simulation (`bench/sim.py --seed 2326 --workers 3`, and 2760): a worker held
every partition through a coordinator outage and kept answering, no commit landing, until it
was killed; the next owners ran everything it had answered since its last landed commit again
(152 answers twice, where the deaths and unclean rebalances allowed 112).
"""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from tests.fakes import FakeConsumer, ManualClock, run_on_virtual_time
from worker.core.config import settings_from
from worker.core.metrics import Metrics
from worker.delivery.commits import Committer

TP = TopicPartition("jobs", 0)
OTHER = TopicPartition("jobs", 1)


def committer_on(
    consumer: FakeConsumer, answers_max: int = 4, offset_map_max_bytes: int = 2048
) -> Committer:
    settings = settings_from(
        {
            "jobs_topic": "jobs",
            "results_topic": "r",
            "engine": "mock",
            "commit_timeout_s": 0.5,
            "commit_interval_ms": 100,
            "offset_map_max_bytes": offset_map_max_bytes,
            "max_crash_attempts": 3 if offset_map_max_bytes else 0,
        },
        {},
    )
    return Committer(consumer, settings, Metrics(), uncommitted_answers_max=answers_max)


def answer(committer: Committer, tp: TopicPartition, offsets: range) -> None:
    partition = committer.partition(tp)
    for offset in offsets:
        partition.start(offset)
        partition.finish(offset)


def test_fetching_stops_once_answers_past_the_cap_wait_for_commits_that_do_not_land() -> None:
    async def body() -> None:
        consumer = FakeConsumer()
        committer = committer_on(consumer)
        committer.partition(OTHER).start(0)  # a partition with nothing answered is held too
        consumer.commit_gate = asyncio.Event()  # the coordinator is away
        answer(committer, TP, range(5))
        committer.tick(due=True)
        await asyncio.sleep(1.9)  # under the 2 s in which commits normally land
        assert committer.held() == set()
        await asyncio.sleep(0.2)
        assert committer.held() == {TP, OTHER}

        consumer.commit_gate.set()  # back: the next commit lands and lifts the hold
        await committer.commit_now()
        assert consumer.commits[-1][TP] == 5
        assert committer.held() == set()

    run_on_virtual_time(body())


def test_answers_up_to_the_cap_or_commits_that_land_hold_nothing() -> None:
    async def body() -> None:
        consumer = FakeConsumer()
        committer = committer_on(consumer)
        consumer.commit_gate = asyncio.Event()
        answer(committer, TP, range(4))  # at the cap: a death would redo no more than that
        committer.tick(due=True)
        await asyncio.sleep(10)
        assert committer.held() == set()
        consumer.commit_gate.set()

        # Many answers between commits that land: nothing waits long, nothing is held.
        for step in range(20):
            answer(committer, TP, range(4 + 10 * step, 14 + 10 * step))
            await committer.commit_now()
            await asyncio.sleep(0.5)
            assert committer.held() == set()
        assert consumer.commits[-1][TP] == 204

    run_on_virtual_time(body())


def test_an_answer_that_leaves_the_commit_as_the_broker_holds_it_does_not_wait() -> None:
    """Without offset maps, an answer behind a running job changes nothing to commit: no
    commit is sent for it, and what the broker holds covers it."""

    async def body() -> None:
        consumer = FakeConsumer()
        committer = committer_on(consumer, answers_max=0, offset_map_max_bytes=0)
        partition = committer.partition(TP)
        partition.start(0)
        partition.start(1)
        await committer.commit_now()
        partition.finish(1)  # position 0 still, and no map: the same commit
        await committer.commit_now()
        assert consumer.commits == [{TP: 0}]
        await asyncio.sleep(10)
        assert committer.held() == set()

    run_on_virtual_time(body())


def test_how_long_answers_waited_for_a_commit_is_read_on_the_committers_clock() -> None:
    """The wait is timed on the clock the worker is built with, not the machine's: under the
    simulation's virtual clock, or a test's, a stall is seen when that clock says so."""
    settings = settings_from(
        {"jobs_topic": "jobs", "results_topic": "r", "engine": "mock", "commit_interval_ms": 100},
        {},
    )
    clock = ManualClock()
    committer = Committer(
        FakeConsumer(), settings, Metrics(), uncommitted_answers_max=4, clock=clock
    )
    answer(committer, TP, range(5))
    clock.now += 1.9  # under the 2 s in which commits normally land
    assert committer.held() == set()
    clock.now += 0.2
    assert committer.held() == {TP}
