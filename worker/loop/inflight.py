"""The jobs running now, each holding a slot of the in-flight cap until its answer is handed on.

A job starts eagerly, as Python 3.12's eager tasks do: its coroutine runs at once, inside the
loop's turn, up to its first real wait. A job answered without waiting (an invalid record, an
expired job, a fast engine) then costs no task at all; one that waits (every vLLM generation)
continues in a task. A task here cost more than the rest of a mock-engine job. Every task's
outcome is read when it ends, so no job dies unnoticed: a job handles its own errors, so an
exception that reaches here is a bug, and `on_crash` hears of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from aiokafka import TopicPartition

__all__ = ["InFlight"]

logger = logging.getLogger(__name__)

Job = Coroutine[Any, Any, None]


class InFlight:
    """Jobs by slot and partition. `on_free` is called whenever a slot frees."""

    def __init__(
        self, on_free: Callable[[], None], on_crash: Callable[[BaseException], None]
    ) -> None:
        self._on_free = on_free
        self._on_crash = on_crash
        self._slots: dict[int, TopicPartition] = {}
        self._tasks: dict[asyncio.Task[None], tuple[int, TopicPartition]] = {}
        self._next_slot = 0
        self._eager_slot = -1

    def __len__(self) -> int:
        return len(self._slots)

    def start(self, tp: TopicPartition, job: Callable[[int], Job]) -> None:
        """Run `job(slot)` until it first waits; then go on in a task. The job calls
        `release(slot)` once its answer is handed on."""
        slot = self._next_slot
        self._next_slot += 1
        self._slots[slot] = tp
        coro = job(slot)
        self._eager_slot = slot
        try:
            awaited = coro.send(None)
        except StopIteration:
            # Answered without waiting; the job released its slot unless it ended early.
            self._slots.pop(slot, None)
            return
        except BaseException as exc:  # noqa: BLE001 - reported, as a task's done-callback would
            self._slots.pop(slot, None)
            self._crashed(exc)
            return
        finally:
            self._eager_slot = -1
        # Unnamed: naming a task costs more than the rest of starting it.
        task = asyncio.create_task(_finish(coro, awaited))
        self._tasks[task] = (slot, tp)
        task.add_done_callback(self._done)

    def release(self, slot: int) -> None:
        """The job's answer was handed on: counted from now on where it waits, not here."""
        # A job running eagerly runs inside the loop's turn: nothing waits to be woken.
        if self._slots.pop(slot, None) is not None and slot != self._eager_slot:
            self._on_free()

    def busy(self, partitions: set[TopicPartition] | None = None) -> int:
        return sum(partitions is None or tp in partitions for tp in self._slots.values())

    async def settle(self, partitions: set[TopicPartition] | None, grace_s: float) -> None:
        """Give the jobs of `partitions` (all when None) up to `grace_s` to hand on answers."""
        tasks = self._tasks_of(partitions)
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)

    async def cancel(self, partitions: set[TopicPartition] | None) -> int:
        """Cancel the jobs of `partitions` still running (their engine requests abort and their
        offsets stay unfinished, so the records are redelivered); return how many."""
        pending = [t for t in self._tasks_of(partitions) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)

    async def abort(self, partitions: set[TopicPartition] | None) -> None:
        """`cancel`, and say so in the log: what a stop or a revoke does past its grace."""
        if aborted := await self.cancel(partitions):
            logger.info(
                "aborted %d unfinished jobs; they stay uncommitted and will be redelivered",
                aborted,
            )

    def _tasks_of(self, partitions: set[TopicPartition] | None) -> list[asyncio.Task[None]]:
        return [t for t, (_, tp) in self._tasks.items() if partitions is None or tp in partitions]

    def _done(self, task: asyncio.Task[None]) -> None:
        slot, _ = self._tasks.pop(task)
        self.release(slot)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._crashed(exc)

    def _crashed(self, exc: BaseException) -> None:
        logger.error("a job died with an unexpected error", exc_info=exc)
        self._on_crash(exc)


async def _finish(coro: Job, awaited: Any) -> None:
    """The rest of a job started eagerly, which now waits on `awaited`."""
    await _Resumed(coro, awaited)


class _Resumed:
    """Hands the task the future the started coroutine waits on, and the coroutine whatever the
    task sends or throws back (a result, a cancellation), as if the task had run it all along."""

    __slots__ = ("_awaited", "_coro")

    def __init__(self, coro: Job, awaited: Any) -> None:
        self._coro = coro
        self._awaited = awaited

    def __await__(self) -> Generator[Any, None, None]:
        coro, awaited = self._coro, self._awaited
        while True:
            try:
                yield awaited
            except GeneratorExit:
                # Closed, not thrown into: the task was dropped unfinished (its process killed
                # in the simulation, a loop closed) and the garbage collector closes both
                # coroutines, in no set order; throwing into one it closed first raises.
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - thrown in by the task: passed on
                try:
                    awaited = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    awaited = coro.send(None)
                except StopIteration:
                    return
