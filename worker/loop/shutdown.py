"""The worker's way out: its jobs drained within the grace, what they answered handed over,
then its clients closed (the consumer first: it leaves the group)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaProducer, TopicPartition

from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.errors import FatalError
from worker.core.kafka import TopicConfigReader
from worker.core.shutdown import bounded
from worker.delivery.commits import Committer
from worker.delivery.publish import Delivery
from worker.loop.breaker import stop_blames_running_jobs
from worker.loop.gate import PartitionGate
from worker.loop.inflight import InFlight
from worker.loop.rebalance import Rebalances

__all__ = ["Shutdown"]

logger = logging.getLogger(__name__)


class Shutdown:
    """Drains the worker (`drain`) and closes its clients (`close_clients`)."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Clock,
        rebalances: Rebalances,
        committer: Committer,
        jobs: InFlight,
        delivery: Delivery,
        producer: AIOKafkaProducer,
        gate: PartitionGate,
        topic_configs: TopicConfigReader | None,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._rebalances = rebalances
        self._committer = committer
        self._jobs = jobs
        self._delivery = delivery
        self._producer = producer
        self._gate = gate
        self._topic_configs = topic_configs
        #: When the stop's grace ends (`clock.monotonic()`), once a drain has begun.
        self._grace_ends = 0.0

    async def close_clients(self) -> None:
        """Stop the consumer (leaving the group), then the producer. `run` does it on its way
        out; whoever built the worker does it when `run` never started. Stopping twice is a
        no-op."""
        close_s = self._settings.close_timeout_s
        # A scaled-in static member leaves as its consumer closes, after the join it may
        # have under way; the leave is tried while the coordinator is away, for what the drain
        # left of the grace (the supervisor waits that long anyway) and half of
        # --close-timeout-s; its other half is for the rest of the close.
        leave_within_s = max(self._grace_ends - self._clock.monotonic(), 0.0) + close_s / 2
        stop = functools.partial(
            self._gate.stop,
            leave=self._settings.leave_group_on_stop
            and self._settings.group_instance_id is not None,
            leave_within_s=leave_within_s,
        )
        await bounded(stop, "consumer stop", leave_within_s + close_s / 2)
        await bounded(self._producer.stop, "producer stop", self._settings.close_timeout_s)
        if self._topic_configs is not None:
            await bounded(self._topic_configs.close, "admin client close", close_s)

    async def drain(self, fatal: FatalError | None) -> None:
        """Let jobs finish within the grace period, cancel the rest, commit what finished;
        `fatal`: what stopped the worker, if an error did."""
        # Jobs get the grace unless a fatal error stopped the worker (they cannot finish then);
        # the hand-over gets it either way, to wait out a coordinator that is away.
        grace = 0.0 if fatal is not None else self._settings.shutdown_grace_s
        # Revoked and never assigned back: their jobs are the next owner's to run.
        await self._rebalances.stopping()
        grace_ends = self._grace_ends = self._clock.monotonic() + self._settings.shutdown_grace_s
        # Clean unless the jobs in flight may be what stopped the worker (see the breaker).
        clean = not stop_blames_running_jobs(fatal)
        if clean:
            # Handed over at once: a supervisor's kill before the drain ends blames no job.
            await bounded(
                self._committer.hand_over, "hand-over commit", self._settings.close_timeout_s
            )
        if busy := self._jobs.busy():
            logger.info("draining %d jobs (grace %.1fs)", busy, grace)
        await self._settle(None, grace)
        await bounded(self._producer.flush, "flush", self._settings.close_timeout_s)
        await asyncio.sleep(0)  # acknowledgements the flush resolved mark their offsets
        close_s = self._settings.close_timeout_s
        final_commit: Callable[[], Awaitable[object]]
        if clean:
            # Tried again until the grace ends (and --close-timeout-s past what the drain
            # took of it), also after a fatal error that blames nobody (a weight update that
            # left no engine: seeds 73476 and 73583 of `--weight-update-every-s 4
            # --engine-killing-updates 0.3`, during a coordinator outage): a hand-over that
            # never lands makes the next owner blame these jobs for a death, and the grace is
            # there to wait out a coordinator that is away.
            budget_s = max(grace_ends - self._clock.monotonic(), 0.0) + close_s
            final_commit = functools.partial(
                self._committer.hand_over_until, self._clock.monotonic() + budget_s
            )
        else:
            budget_s = close_s
            final_commit = functools.partial(self._committer.commit_now, clean=False)
        await bounded(final_commit, "final commit", budget_s)
        self._delivery.stop_resending()

    async def _settle(self, partitions: set[TopicPartition] | None, grace_s: float) -> None:
        """Give the jobs of `partitions` (all when None) `grace_s` to be answered and
        acknowledged, then cancel what is still running. Their offsets stay unfinished, so
        their records are redelivered."""
        deadline = self._clock.monotonic() + grace_s
        await self._jobs.settle(partitions, grace_s)
        await self._delivery.settle(partitions, deadline)
        await self._jobs.abort(partitions)
