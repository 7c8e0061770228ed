"""Worker variants with a defect planted on purpose: the checker must flag each (its tests).

Each is a context manager that patches the real worker code for the length of a run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

from worker.delivery.publish import Delivery
from worker.loop.worker import Worker

__all__ = ["MUTANTS"]


@contextlib.contextmanager
def commit_before_ack() -> Iterator[None]:
    """Finishes a job's offset when its answer is queued, not when the broker acknowledges
    it: a death (or a refused send) before the acknowledgement loses the answer."""
    real_queue = Delivery.queue

    def queue(self: Delivery, ticket: Any) -> bool:
        ticket.partition.finish(ticket.offset)
        return bool(real_queue(self, ticket))

    with (
        mock.patch.object(Delivery, "queue", queue),
        mock.patch.object(Delivery, "_acknowledged", lambda self, ticket: None),
    ):
        yield


@contextlib.contextmanager
def skip_record() -> Iterator[None]:
    """Marks every 41st record answered without running it."""
    real = Worker._runnable

    def runnable(self: Worker, tp: Any, fetched: list[Any]) -> Any:
        kept = []
        for record in fetched:
            if record.offset % 41 == 7:
                partition = self._committer.partition(tp)
                if partition.start(record.offset):
                    partition.finish(record.offset)
            else:
                kept.append(record)
        return real(self, tp, kept) if kept else []

    with mock.patch.object(Worker, "_runnable", runnable):
        yield


MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "commit_before_ack": commit_before_ack,
    "skip_record": skip_record,
}
