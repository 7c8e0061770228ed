"""Empty fetches held on the client for the wait the consumer asked the broker for.

Kafka holds a fetch that finds nothing for `fetch.max.wait.ms`; a broker that answers at once
(noida-db) had every idle aiokafka consumer fetch again at once, a core each.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaConsumer

from worker.core.paced_consumer import (
    EMPTY_FETCH_FLOOR_S,
    PacedConsumer,
    empty_fetch_floor_s,
    pace_empty_fetches,
)


class FakeFetcher:
    """What `pace_empty_fetches` relies on in aiokafka's `Fetcher`: the per-broker request
    method called through the instance, and the in-flight set it keeps."""

    def __init__(self, answers: list[bool]) -> None:
        self._in_flight: set[int] = set()
        self.answers = answers

    async def _proc_fetch_request(self, assignment: Any, node_id: int, request: Any) -> bool:
        return self.answers.pop(0)


async def test_an_empty_answer_completes_no_sooner_than_the_floor_after_its_request() -> None:
    fetcher = FakeFetcher([False])
    assert pace_empty_fetches(fetcher, 0.05)
    loop = asyncio.get_running_loop()
    sent = loop.time()
    assert await fetcher._proc_fetch_request(None, 0, None) is False
    assert loop.time() - sent >= 0.05


async def test_an_answer_with_records_is_not_held() -> None:
    fetcher = FakeFetcher([True])
    assert pace_empty_fetches(fetcher, 60.0)
    # Held for the floor, this would outlast the test's timeout many times over.
    assert await asyncio.wait_for(fetcher._proc_fetch_request(None, 0, None), 5) is True


async def test_a_fetcher_of_another_shape_or_no_floor_is_left_as_it_is() -> None:
    class Other:
        async def fetch(self) -> bool:
            return False

    assert not pace_empty_fetches(Other(), EMPTY_FETCH_FLOOR_S)
    fetcher = FakeFetcher([False])
    method = fetcher._proc_fetch_request
    assert not pace_empty_fetches(fetcher, 0.0)
    assert fetcher._proc_fetch_request == method


def test_the_floor_never_exceeds_the_wait_the_consumer_asks_the_broker_for() -> None:
    assert empty_fetch_floor_s(0) == 0
    assert empty_fetch_floor_s(5) == 0.005
    assert empty_fetch_floor_s(500) == EMPTY_FETCH_FLOOR_S


async def test_the_consumer_holds_what_its_wait_allows() -> None:
    asks_no_wait = PacedConsumer(fetch_max_wait_ms=0)
    default = PacedConsumer()
    try:
        assert isinstance(default, AIOKafkaConsumer)
        assert asks_no_wait._empty_fetch_floor_s == 0
        assert default._empty_fetch_floor_s == EMPTY_FETCH_FLOOR_S
    finally:
        await asks_no_wait.stop()
        await default.stop()


async def test_a_held_answer_cancelled_by_the_fetcher_ends_with_no_records() -> None:
    # aiokafka's Fetcher.close (aiokafka/consumer/fetcher.py) cancels each pending request's
    # task and awaits it; its own `_proc_fetch_request` answers False when cancelled.
    fetcher = FakeFetcher([False])
    assert pace_empty_fetches(fetcher, 60.0)
    task = asyncio.create_task(fetcher._proc_fetch_request(None, 0, None))
    await asyncio.sleep(0.01)  # the answer came; now held
    task.cancel()
    assert await asyncio.wait_for(task, 5) is False
