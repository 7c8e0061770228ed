"""Jobs started eagerly, then handed to a task of their own (`worker.loop.inflight`)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from worker.loop.inflight import _finish


class _Pending:
    """What a job waits on, never done."""

    def __await__(self) -> Generator[Any, None, None]:
        yield self


def test_a_dropped_job_task_closes_in_either_order_without_an_error():
    # A task dropped unfinished (a process killed in the fleet simulation) is closed by the
    # garbage collector together with the job it resumes, in no set order. Closing the job
    # first then the task raised "cannot reuse already awaited coroutine" as an unraisable
    # error, which failed whichever test happened to collect it.
    async def job() -> None:
        await _Pending()

    for job_closed_first in (True, False):
        inner = job()
        awaited = inner.send(None)  # started eagerly: now waits on the future
        task_coroutine = _finish(inner, awaited)
        task_coroutine.send(None)
        if job_closed_first:
            inner.close()
        task_coroutine.close()
        inner.close()
