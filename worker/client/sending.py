"""How a `RolloutClient` produces the jobs it has in flight: each sending in a task of its own,
kept until it ends, and a broker's refusal answered as the job's failure."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas import encode
from worker.client.inflight import InFlight, Pending, RolloutError

__all__ = ["Sender"]

logger = logging.getLogger(__name__)


class Sender:
    """Produces the sendings of the jobs in `inflight` to `jobs_topic` on the producer
    `producer()` returns, each with the `reply_to` given here (None: the job's own)."""

    def __init__(
        self,
        inflight: InFlight,
        producer: Callable[[], AIOKafkaProducer | None],
        *,
        jobs_topic: str,
        reply_to: str | None,
    ) -> None:
        self._inflight = inflight
        self._producer = producer
        self._jobs_topic = jobs_topic
        self._reply_to = reply_to
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, pending: Pending) -> None:
        """Produce the sending of `pending` in flight (its `wire_id` and `submission`) in a
        task of its own."""
        task = asyncio.create_task(self._send(pending))
        # The loop holds tasks only weakly: each is kept here until it ends.
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def cancel(self) -> None:
        """Stop every sending still under way."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _send(self, pending: Pending) -> None:
        producer = self._producer()
        assert producer is not None  # noqa: S101 - the client checked it before sending
        job, wire_id = pending.job, pending.wire_id
        deadline = pending.deadline if job.deadline is None else min(job.deadline, pending.deadline)
        wire = msgspec.structs.replace(
            job,
            job_id=wire_id,
            submission_id=pending.submission,
            deadline=deadline,
            reply_to=self._reply_to or job.reply_to,
        )
        # One task at a time appends to the producer's batches: thousands of jobs submitted
        # at once, each waiting for room in a full batch, would wake each other for nothing.
        try:
            async with self._lock:
                # A session's turns share a key, so they share a partition and its worker.
                delivery = await producer.send(
                    self._jobs_topic,
                    value=encode(wire),
                    key=(job.session_id or wire_id).encode(),
                    headers=pending.trace.record_headers(),
                )
            await delivery
        except KafkaError as exc:
            logger.exception("job %s could not be produced", job.job_id)
            error = RolloutError(f"job {job.job_id} could not be produced: {exc!r}")
            self._inflight.not_sent(pending, error)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # `_send` handles the broker's refusals itself; anything else is a bug, said now.
            logger.error("a job's send failed", exc_info=exc)
            self._inflight.fail_all(RolloutError(f"a send failed: {exc!r}"))
