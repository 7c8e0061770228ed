"""The results producer, replaced by a new one when its idempotent sequence broke.

aiokafka's idempotent producer numbers each partition's batches. A batch the broker refuses (too
large for the topic, or a topic this worker may not write to) still took its numbers, so the
next batch to that partition is refused as out of order (`OutOfOrderSequenceNumber`), and from
then on the producer fails everything it holds and everything sent to it. The Java client
resets the partition's sequence; aiokafka does not. A new producer (a new producer id, every
sequence from 0) is the way on without stopping the worker: `RenewableProducer.renew` makes one,
and everyone holding the `RenewableProducer` sends through it from then on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final

from aiokafka import AIOKafkaProducer

__all__ = ["RenewableProducer"]

logger = logging.getLogger(__name__)

# The longest the replaced producer gets to flush and close in the background.
_RETIRE_TIMEOUT_S: Final = 30.0


class RenewableProducer:
    """Stands for the producer `factory` made last; anything not defined here (`send`,
    `send_batch`, `create_batch`, `partitions_for`, `flush`, `client`, ...) is the current
    producer's. `generation` counts the renewals: a caller that saw a producer break asks to
    renew that generation, so callers that saw the same break share one renewal."""

    def __init__(self, producer: AIOKafkaProducer, factory: Callable[[], AIOKafkaProducer]) -> None:
        self._current = producer
        self._factory = factory
        self.generation = 0
        self._renewing: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[None]] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._current, name)

    async def renew(self, generation: int) -> None:
        """Replace the producer of `generation` by a new, started one (unless it was replaced
        already). The replaced one flushes what it holds and closes in the background: what
        fails there is sent again by its owners, on the new producer."""
        if generation != self.generation:
            return
        if self._renewing is None:
            self._renewing = asyncio.create_task(self._renew(), name="producer renewal")
        await asyncio.shield(self._renewing)

    async def stop(self) -> None:
        """Stop the current producer, and wait for the replaced ones to close."""
        if self._renewing is not None:
            await asyncio.gather(self._renewing, return_exceptions=True)
        await self._current.stop()
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def _renew(self) -> None:
        try:
            fresh = self._factory()
            await fresh.start()
            retired, self._current = self._current, fresh
            self.generation += 1
        finally:
            self._renewing = None
        logger.warning(
            "the producer's idempotent sequence broke on a refused record; a new producer "
            "(generation %d) takes over",
            self.generation,
        )
        task = asyncio.create_task(_retire(retired), name="retired producer")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)


async def _retire(producer: AIOKafkaProducer) -> None:
    try:
        async with asyncio.timeout(_RETIRE_TIMEOUT_S):
            await producer.stop()
    except Exception as exc:  # noqa: BLE001 - a broken producer's close may fail any way
        logger.info("the replaced producer closed with %r", exc)
