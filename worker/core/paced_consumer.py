"""An aiokafka consumer that does not spin on a broker answering empty fetches at once.

A Kafka broker holds a fetch that finds no record until `fetch.max.wait.ms` passes (500 ms by
default) or records arrive, so an idle consumer sends about two requests a second. Some brokers
speaking the Kafka protocol answer at once instead (noida-db, the local broker of the demo and
the tests, does), and aiokafka then fetches again at once: measured here, an idle consumer took
88 % of a core, and every worker, trainer client and test reader a core of its own. Here the
client keeps the wait it asked for, up to `EMPTY_FETCH_FLOOR_S`: on Kafka, which already waited,
nothing changes; on such a broker a record waits at most that long to be fetched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, TopicPartition

from worker.core import kafka
from worker.core.clock import Clock

__all__ = [
    "EMPTY_FETCH_FLOOR_S",
    "GroupCallsThroughKafka",
    "PacedConsumer",
    "empty_fetch_floor_s",
    "pace_empty_fetches",
]

log = logging.getLogger(__name__)

#: The most an empty fetch is held on the client: about 50 requests a second per broker when
#: idle (about 3 % of a core measured on noida-db), 20 ms at most added to a record's trip.
EMPTY_FETCH_FLOOR_S: Final = 0.02

FetchRequest = Callable[[Any, int, Any], Awaitable[bool]]


def empty_fetch_floor_s(fetch_max_wait_ms: int) -> float:
    """How long an empty fetch is held on the client for a consumer that asks the broker to wait
    `fetch_max_wait_ms`: never longer than that (a consumer asking for no wait asked Kafka to
    answer at once)."""
    return min(EMPTY_FETCH_FLOOR_S, fetch_max_wait_ms / 1000)


def pace_empty_fetches(fetcher: Any, floor_s: float) -> bool:
    """Have `fetcher` (aiokafka's `Fetcher`) complete a fetch that brought no record no sooner
    than `floor_s` after it was sent; False, leaving it as it is, where aiokafka's internals are
    not what this expects.

    Relies on aiokafka 0.14's fetch routine, which sends the next request to a broker only once
    the task running `Fetcher._proc_fetch_request` for it has ended (the broker stays in
    `_in_flight` until then) and calls that method through the instance, on the method
    returning whether the answer held records, and on its cancelling that task (at close, or as
    the assignment changes) and awaiting its answer."""
    original: FetchRequest | None = getattr(fetcher, "_proc_fetch_request", None)
    if original is None or not hasattr(fetcher, "_in_flight") or floor_s <= 0:
        return False
    loop = asyncio.get_running_loop()

    async def paced(assignment: Any, node_id: int, request: Any) -> bool:
        sent = loop.time()
        has_records = await original(assignment, node_id, request)
        left = floor_s - (loop.time() - sent)
        if not has_records and left > 0:
            try:
                await asyncio.sleep(left)
            except asyncio.CancelledError:
                # As aiokafka's own method answers a cancelled request: the consumer closes or
                # the assignment changed, and the fetcher awaits the task it cancelled for it.
                return False
        return has_records

    fetcher._proc_fetch_request = paced
    return True


class GroupCallsThroughKafka:
    """The `GroupConsumer` calls beyond aiokafka's public ones, made on aiokafka's internals
    through `worker.core.kafka` (the one module that touches them): for an aiokafka consumer,
    or a double that gives itself the internals they reach (a `_coordinator`)."""

    async def commit_hand_over(self, offsets: Mapping[TopicPartition, tuple[int, str]]) -> None:
        await kafka.commit_handed_over(self, offsets)

    def group_member_id(self) -> str | None:
        return kafka.member_id(self)

    def rejoining(self) -> bool:
        return kafka.rejoining(self)

    def leave_on_stop(
        self, last_member_id: str | None, /, *, within_s: float, clock: Clock
    ) -> None:
        kafka.leave_group_on_close(self, last_member_id, within_s=within_s, clock=clock)


class PacedConsumer(GroupCallsThroughKafka, AIOKafkaConsumer):  # type: ignore[misc]
    """`AIOKafkaConsumer` whose empty fetches take at least the wait it asks the broker for, up
    to `EMPTY_FETCH_FLOOR_S` (why: this module's docstring); the worker's `GroupConsumer`.
    (The ignore: aiokafka has no type hints.)"""

    def __init__(self, *topics: str, **kwargs: Any) -> None:
        super().__init__(*topics, **kwargs)
        # 500: aiokafka's default, as Kafka's.
        self._empty_fetch_floor_s = empty_fetch_floor_s(kwargs.get("fetch_max_wait_ms", 500))

    async def start(self) -> None:
        await super().start()
        if not pace_empty_fetches(self._fetcher, self._empty_fetch_floor_s):
            log.debug("aiokafka's fetcher is not the one paced here; empty fetches are not held")
