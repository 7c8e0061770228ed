"""The jobs running now: one task each, counted against the in-flight cap.

Every task's outcome is read when it ends, so no job dies unnoticed: a job handles its own
errors, so an exception that reaches here is a bug, and `on_crash` hears of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import TopicPartition

__all__ = ["InFlight"]

logger = logging.getLogger(__name__)


class InFlight:
    """Job tasks by partition. `on_free` is called whenever one leaves."""

    def __init__(
        self, on_free: Callable[[], None], on_crash: Callable[[BaseException], None]
    ) -> None:
        self._on_free = on_free
        self._on_crash = on_crash
        self._tasks: dict[asyncio.Task[None], TopicPartition] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, tp: TopicPartition, job: Coroutine[Any, Any, None]) -> None:
        # Unnamed: naming a task costs more than the rest of starting it.
        task = asyncio.create_task(job)
        self._tasks[task] = tp
        task.add_done_callback(self._done)

    def release_current(self) -> None:
        """The running job has handed its answer on: it no longer holds a slot. Left counted
        until its done-callback runs (the next loop turn), it would count twice with the
        answer that waits in the outbox."""
        if (task := asyncio.current_task()) is not None and self._tasks.pop(task, None):
            self._on_free()

    def busy(self, partitions: set[TopicPartition] | None = None) -> int:
        return sum(partitions is None or tp in partitions for tp in self._tasks.values())

    async def settle(self, partitions: set[TopicPartition] | None, grace_s: float) -> None:
        """Give the jobs of `partitions` (all when None) up to `grace_s` to hand on answers."""
        tasks = [t for t, tp in self._tasks.items() if partitions is None or tp in partitions]
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)

    async def cancel(self, partitions: set[TopicPartition] | None) -> int:
        """Cancel the jobs of `partitions` still running (their engine requests abort and their
        offsets stay unfinished, so the records are redelivered); return how many."""
        pending = [
            t
            for t, tp in self._tasks.items()
            if (partitions is None or tp in partitions) and not t.done()
        ]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)

    def _done(self, task: asyncio.Task[None]) -> None:
        if self._tasks.pop(task, None) is not None:
            self._on_free()
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("a job task died with an unexpected error", exc_info=exc)
            self._on_crash(exc)
