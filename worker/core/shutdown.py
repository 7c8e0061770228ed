"""One shutdown step at a time, each bounded: a dead broker must not hang the exit."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokafka.errors import KafkaError

__all__ = ["bounded"]

logger = logging.getLogger(__name__)


async def bounded(step: Callable[[], Awaitable[object]], what: str, timeout_s: float) -> None:
    """Run `step` for at most `timeout_s`; a timeout or a broker error is logged, not raised."""
    try:
        async with asyncio.timeout(timeout_s):
            await step()
    except TimeoutError:
        logger.warning("%s did not finish in %.1fs; going on", what, timeout_s)
    except KafkaError as exc:
        logger.warning("%s failed: %r", what, exc)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        # aiokafka's fetcher lets its own task's cancellation escape stop() when the broker
        # is gone; that is a failed step, not a request to cancel us.
        logger.warning("%s was interrupted; going on", what)
