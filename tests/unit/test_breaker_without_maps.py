"""The crash-loop breaker once the broker refuses offset maps: commits then carry positions
alone, and a suspect inherited from an earlier death must still run alone, be cleared, and let
every partition go on, without the loop fetching and rewinding in a spin."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import RequestTimedOutError

from schemas import Job
from tests.fakes import ScriptedEngine
from tests.lives import JOBS, Process, job, process_settings, run, worker_on
from worker.delivery.offset_map import encode_offset_map
from worker.delivery.offsets import Commit
from worker.dev.harness.waiting import wait_for

P0, P1 = TopicPartition(JOBS, 0), TopicPartition(JOBS, 1)


class _CountingFetches:
    """Fetches, and rewinds of the suspect's partition (a spin rewinds it after each fetch)."""

    def __init__(self, process: Process) -> None:
        self.count = 0
        self.rewinds = 0
        consumer = process.consumer
        getmany = consumer.getmany
        seek = consumer.seek

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            await asyncio.sleep(0)  # a real fetch always yields to the loop
            return await getmany(*args, **kwargs)

        def counted_seek(tp: TopicPartition, offset: int) -> None:
            self.rewinds += tp == P0
            seek(tp, offset)

        consumer.getmany = counted  # type: ignore[method-assign]
        consumer.seek = counted_seek  # type: ignore[method-assign]


#: The suspect's map: in flight at one death (retried beside the others), or at two (alone).
SUSPECT_OF = {
    "one death": encode_offset_map(0, [], running=[0]),
    "two deaths": encode_offset_map(0, [], running=[0], deaths={0: 1}),
}


def _process(committed: dict[TopicPartition, Commit]) -> Process:
    process = Process(committed)
    process.consumer.add(P0, job("suspect"))
    process.consumer.add(P0, job("after"))
    process.consumer.add(P1, job("other-0"))
    process.consumer.add(P1, job("other-1"))
    process.consumer.assign({P0, P1})
    return process


@pytest.mark.parametrize("deaths", list(SUSPECT_OF))
async def test_a_suspect_runs_and_every_partition_goes_on_after_the_broker_refuses_maps(deaths):
    # The broker's offset.metadata.max.bytes is below --offset-map-max-bytes: the first commit
    # (it names the inherited suspect) is refused and from then on commits carry positions
    # alone. The commit that was to name the suspect alone never counted as landed: the
    # suspect was taken back, fetched again at once, and no job of any partition ever ran.
    committed: dict[TopicPartition, Commit] = {P0: (0, SUSPECT_OF[deaths])}

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, Commit]:
        return {tp: committed[tp] for tp in tps if tp in committed}

    process = _process(committed)
    process.consumer.metadata_limit = 4
    fetches = _CountingFetches(process)
    engine = ScriptedEngine()
    alone_at_start: list[bool] = []

    def on_start(started: Job) -> None:
        if started.job_id == "suspect":
            alone_at_start.append(engine.running == 1)

    engine.on_start = on_start
    worker = worker_on(process, engine, process_settings(), read_committed)
    task = run(worker)
    try:
        await wait_for(
            lambda: committed.get(P0, (0, ""))[0] == 2 and committed.get(P1, (0, ""))[0] == 2,
            10,
            lambda: f"every job to be committed (committed {committed}, started {engine.started})",
        )
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 10)
    assert engine.started[0] == "suspect"
    assert alone_at_start == [True] or deaths == "one death"
    assert sorted(engine.started) == ["after", "other-0", "other-1", "suspect"]
    (suspects,) = next(iter(worker.metrics.crash_suspects.collect())).samples
    assert suspects.value == 0
    # No fetch-and-rewind spin: a handful of fetches, not thousands.
    assert fetches.count < 200


@pytest.mark.parametrize("deaths", list(SUSPECT_OF))
async def test_a_suspect_whose_commit_keeps_failing_waits_without_spinning(deaths):
    # The coordinator answers every commit with an error at once: the suspect never runs
    # (nothing may say it runs), and the loop asks again at a bounded rate.
    committed: dict[TopicPartition, Commit] = {P0: (0, SUSPECT_OF[deaths])}

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, Commit]:
        return {tp: committed[tp] for tp in tps if tp in committed}

    process = _process(committed)

    async def refuse(offsets: dict[TopicPartition, Commit]) -> None:
        raise RequestTimedOutError()

    process.consumer.commit = refuse  # type: ignore[method-assign]
    fetches = _CountingFetches(process)
    engine = ScriptedEngine()
    worker = worker_on(process, engine, process_settings(), read_committed)
    task = run(worker)
    try:
        await wait_for(lambda: fetches.count > 0, 5, "the first fetch")
        await asyncio.sleep(1.0)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 10)
    assert "suspect" not in engine.started
    # Taken back and tried again every `RETRY_ALONE_S` (0.5 s), two rewinds a try, not after
    # every fetch (a spin: hundreds). The other partition's idle polls go on (the fake
    # consumer's empty fetch returns in 10 ms).
    assert fetches.rewinds < 20
    assert fetches.count < 200


@pytest.mark.parametrize("deaths", list(SUSPECT_OF))
async def test_a_suspect_whose_partition_moved_while_its_commit_was_awaited_is_left_to_its_owner(
    deaths,
):
    # The commit that was to name the suspect running did not land, and a whole rebalance ran
    # while it was awaited (aiokafka's coordinator task runs beside the loop; the commit first
    # waits for the one already on its way): the suspect's partition now belongs to another
    # member. Taking the suspect back seeked a partition no longer assigned, and aiokafka's
    # IllegalStateError ended the worker.
    committed: dict[TopicPartition, Commit] = {P0: (0, SUSPECT_OF[deaths])}

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, Commit]:
        return {tp: committed[tp] for tp in tps if tp in committed}

    process = _process(committed)
    engine = ScriptedEngine()
    worker = worker_on(process, engine, process_settings(), read_committed)
    write_ahead_exact = worker._committer.write_ahead_exact
    moved: list[bool] = []

    async def rebalanced_meanwhile() -> bool:
        if moved:
            return await write_ahead_exact()
        moved.append(True)
        await process.consumer.rebalance_now({P1})
        return False

    worker._committer.write_ahead_exact = rebalanced_meanwhile  # type: ignore[method-assign]
    task = run(worker)
    try:
        await wait_for(
            lambda: committed.get(P1, (0, ""))[0] == 2 or task.done(),
            10,
            lambda: f"the other partition's jobs to be committed (committed {committed})",
        )
        assert not task.done(), f"the worker stopped: {task.result()}"
    finally:
        worker.request_stop()
        assert await asyncio.wait_for(task, 10) == 0
    assert moved
    assert sorted(engine.started) == ["other-0", "other-1"]
