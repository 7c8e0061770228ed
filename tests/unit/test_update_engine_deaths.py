"""A weight update that leaves no engine (a failed in-place load, a failed rebuild) is no job's
doing: the worker stops, but its final commit blames none of the jobs in flight, so after the
restart they run together again instead of one at a time as suspects of a crash."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition

from schemas import InflightMode, decode_job
from tests.lives import JOBS, Process, job, process_settings, run
from worker.core.clock import SYSTEM_CLOCK
from worker.core.errors import EngineDeadError, FatalError
from worker.core.limits import RecordLimits
from worker.delivery.offset_map import decode_offset_map
from worker.delivery.offsets import OffsetTracker
from worker.dev.harness.waiting import wait_for
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.steerable import SteerableEngine
from worker.loop.breaker import stop_blames_running_jobs
from worker.loop.worker import Worker

P0 = TopicPartition(JOBS, 0)


class _LoadKillsEngine(MockEngine):
    """A mock engine whose weight load fails and takes the engine down with it, as a vLLM
    reload that cannot load the old checkpoint again, or a rebuild that does not start."""

    async def load_weights(self, path: str, version: int) -> None:
        await self.close()
        raise EngineDeadError("the vLLM engine did not start again: out of memory")


def _engine(*, in_place: bool) -> SteerableEngine:
    inner = _LoadKillsEngine(
        MockEngineSettings(
            per_token_latency_ms=200,
            num_layers=2,
            top_k=1,
            num_experts=4,
            in_place_updates=in_place,
        )
    )
    return SteerableEngine(inner, clock=SYSTEM_CLOCK)


@pytest.mark.parametrize(
    ("mode", "in_place"), [("restart", False), ("keep", True), ("wait", False)]
)
async def test_an_update_that_kills_the_engine_blames_no_job_in_flight(
    tmp_path, mode: InflightMode, in_place: bool
):
    process = Process({})
    for i in range(3):
        process.consumer.add(P0, job(f"j{i}"))
    process.consumer.assign({P0})
    engine = _engine(in_place=in_place)
    settings = process_settings(shutdown_grace_s=0.05)
    worker = Worker(
        settings,
        consumer=process.consumer,
        producer=process.producer,
        engine=engine,
        limits=RecordLimits.from_topic_limits(settings, {}),
        clock=SYSTEM_CLOCK,
    )
    task = run(worker)
    await wait_for(lambda: engine.inside == 3, 5, "three jobs in the engine")
    checkpoint = tmp_path / "step-1"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"num_hidden_layers": 2}')
    # What the control plane does with an update that raised a fatal error.
    with pytest.raises(FatalError) as raised:
        await engine.load_checkpoint(str(checkpoint), 1, mode)
    worker.fail(raised.value, "control command update-1")
    assert await asyncio.wait_for(task, 10) == 1
    position, metadata = process.committed[P0]
    handed_over = decode_offset_map(position, metadata)
    # The next owner reads this map: none of the three was in flight at a death.
    tracker = OffsetTracker()
    tracker.assigned(P0, handed_over, anchor=position)
    assert tracker.partition(P0).deaths == {}
    assert handed_over.clean or not handed_over.running


async def test_after_an_update_killed_the_engine_every_later_engine_death_is_the_updates(
    tmp_path,
):
    # Jobs that were waiting at the gate meet the dead engine once it opens, and the health
    # check finds it dead: whichever reaches the worker first decides what the stop blames.
    engine = _engine(in_place=False)
    checkpoint = tmp_path / "step-1"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"num_hidden_layers": 2}')
    with pytest.raises(FatalError) as update:
        await engine.load_checkpoint(str(checkpoint), 1, "wait")
    assert not stop_blames_running_jobs(update.value)
    with pytest.raises(EngineDeadError) as generating:
        await engine.generate(decode_job(job("late")), "late")
    assert not stop_blames_running_jobs(generating.value)
    with pytest.raises(EngineDeadError) as health:
        await engine.check_health()
    assert not stop_blames_running_jobs(health.value)


async def test_an_engine_that_dies_under_its_jobs_still_blames_them():
    assert stop_blames_running_jobs(EngineDeadError("vLLM engine died"))
