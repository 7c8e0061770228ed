"""The consume loop: fetch job records, start a job for each, keep polling, drain on stop.

A fetched record goes down, never back: `JobStarts` (`worker.loop.starts`) decides which start
and runs each, `AnswerBuilder` turns it into an answer, `Delivery` gets that acknowledged and
finishes the offset on the `Committer`'s tracker, which commits it. The worker coordinates: the
in-flight cap, the fatal flag, the stop (`Shutdown`, `worker.loop.shutdown`); `Rebalances`
(`worker.loop.rebalance`) does what the group's rebalances ask of the partitions it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError

from worker.answering.answers import AnswerBuilder
from worker.answering.topics import TopicLimitLookup, TopicLookup, broker_lookups
from worker.core.clients import AIOKAFKA, KafkaClients
from worker.core.clock import Clock
from worker.core.config import Settings
from worker.core.consumer_port import GroupConsumer
from worker.core.errors import BrokerError, FatalError
from worker.core.limits import RecordLimits
from worker.core.metrics import Metrics
from worker.delivery.commits import CommittedReader, Committer, LiveIncarnations
from worker.delivery.publish import Delivery
from worker.delivery.renewal import RenewableProducer
from worker.engines.protocol import Engine
from worker.loop.breaker import CrashLoopBreaker
from worker.loop.gate import PartitionGate
from worker.loop.inflight import InFlight
from worker.loop.partition_states import PartitionStates
from worker.loop.rebalance import Rebalances
from worker.loop.shutdown import Shutdown
from worker.loop.starts import JobStarts
from worker.loop.version_holds import VersionHolds
from worker.loop.watchdog import Watchdog

__all__ = ["Worker", "max_in_flight_for"]

logger = logging.getLogger(__name__)


def max_in_flight_for(configured: int | None, engine_concurrency: int) -> int:
    """Jobs the worker runs at once: `--max-in-flight` when given, else twice what the engine
    runs at once (the rest wait in its queue, ready to take a finished job's place)."""
    return configured or 2 * engine_concurrency


@dataclass(frozen=True)
class _Pacing:
    """How many jobs the loop runs, and how often it wakes."""

    max_in_flight: int
    #: While the engine has a backlog, the loop refills in lots of this many.
    refill_lot: int
    #: How often the loop polls at the cap.
    keepalive_s: float
    #: How long the loop waits, at the cap, for a freed slot, a stop or a fatal error.
    full_wait_s: float

    @classmethod
    def of(cls, settings: Settings, engine: Engine) -> _Pacing:
        max_in_flight = max_in_flight_for(settings.max_in_flight, engine.max_concurrency)
        # At the cap, polled as often as the group hears from the worker (its heartbeats):
        # well inside max_poll_interval_ms, and a coordinator error surfaces as soon.
        keepalive_s = min(settings.heartbeat_interval_ms, settings.max_poll_interval_ms / 4) / 1000
        return cls(
            max_in_flight,
            # Jobs beyond what the engine runs at once wait in its queue and take a finished
            # job's place there at once. While the engine has such a backlog the loop refills
            # in lots of half the room for one: the engine stays busy on the rest meanwhile,
            # and each lot costs one fetch and one write-ahead commit, where refilling every
            # freed slot cost a commit per job or two. Without a backlog every freed slot is
            # filled at once.
            max(1, (max_in_flight - engine.max_concurrency) // 2),
            keepalive_s,
            # Otherwise it wakes only for the commit interval's tick and the keepalive poll:
            # each wake-up with nothing to do is CPU taken beside the engine.
            min(max(settings.poll_timeout_ms, settings.commit_interval_ms) / 1000, keepalive_s),
        )


class Worker:
    """Consumes jobs, runs them on an engine, publishes answers, commits answered offsets.

    Its parts are given (`worker.build` wires them; tests pass fakes): `limits` are those the
    producer was built with, `read_committed` reads the offset maps on assignment,
    `live_incarnations` the incarnations the group's live members announce (the consumer
    announces `incarnation`; see `worker.core.incarnation`). The engine is started and closed
    by its owner; `topic_lookup` and `topic_limit_lookup` say whether the broker has a job's
    `reply_to` and its `max.message.bytes` (default: the broker's, `broker_lookups`).
    `producer_factory` makes a producer like `producer`, to take over when a refused record
    broke its idempotent sequence (without it, the worker stops then). `run()` starts the
    clients, serves until `request_stop()` or a fatal error, drains, closes the clients, and
    returns the exit status (0 clean, 1 fatal).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        consumer: GroupConsumer,
        producer: AIOKafkaProducer,
        engine: Engine,
        limits: RecordLimits,
        metrics: Metrics | None = None,
        read_committed: CommittedReader | None = None,
        live_incarnations: LiveIncarnations | None = None,
        incarnation: int | None = None,
        topic_lookup: TopicLookup | None = None,
        topic_limit_lookup: TopicLimitLookup | None = None,
        producer_factory: Callable[[], AIOKafkaProducer] | None = None,
        kafka_clients: KafkaClients = AIOKAFKA,
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._clock = clock
        if producer_factory is not None:
            # A refusal that breaks the idempotent sequence renews the producer, not the process.
            producer = RenewableProducer(producer, producer_factory)
        self._producer = producer
        self._engine = engine
        self.metrics = metrics or Metrics()
        self._pacing = pacing = _Pacing.of(settings, engine)
        self.max_in_flight = pacing.max_in_flight
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._fatal: FatalError | None = None
        self._serving = False
        # The admin client of the default limit lookup is closed with the other clients.
        topic_lookup, topic_limit_lookup, topic_configs = broker_lookups(
            settings, producer, kafka_clients, topic_lookup, topic_limit_lookup
        )
        self._answers = AnswerBuilder(
            settings,
            engine,
            limits,
            self.metrics,
            topic_lookup,
            topic_limit_lookup=topic_limit_lookup,
            clock=clock,
        )
        self._committer = Committer(
            consumer,
            settings,
            self.metrics,
            read_committed,
            live_incarnations=live_incarnations,
            incarnation=incarnation,
            on_background_done=self._wake_breaker,
            uncommitted_answers_max=self.max_in_flight,
            clock=clock,
        )
        self._jobs = InFlight(self._wake.set, self._job_crashed)
        self._breaker = CrashLoopBreaker(
            settings.max_crash_attempts,
            self.metrics,
            self._committer.tracker,
            consumer.assignment,
            clock=clock,
        )
        self._holds = VersionHolds(
            lambda: engine.weight_version, settings.max_version_hold_s, clock=clock
        )
        # The gate asks each part afresh before every fetch: paused while a partition's
        # offset map nears its cap or is being read, while it runs a suspect of a crash, and
        # while its next job waits for newer weights. A revoke forgets them all there too.
        states = PartitionStates(self._committer, self._breaker, self._holds)
        self._gate = PartitionGate(consumer, (states,), keepalive_s=pacing.keepalive_s, clock=clock)
        self._delivery = Delivery(
            producer,
            settings,
            limits,
            self.metrics,
            smaller=self._answers.smaller,
            unwritable=self._answers.unwritable,
            on_free=self._wake.set,
            on_fatal=lambda exc: self._fail(exc, "delivery"),
            on_acknowledged=self._wake_breaker,
            topic_limit=self._answers.reply_topic_limit,
            clock=clock,
        )
        self._watchdog = Watchdog(settings, engine, self._delivery, clock=clock)
        self._rebalances = Rebalances(
            settings,
            self.metrics,
            jobs=self._jobs,
            delivery=self._delivery,
            committer=self._committer,
            states=states,
            gate=self._gate,
            has_room=lambda: self._in_flight() < self.max_in_flight,
            clock=clock,
        )
        self._starts = JobStarts(
            answers=self._answers,
            committer=self._committer,
            breaker=self._breaker,
            holds=self._holds,
            gate=self._gate,
            rebalances=self._rebalances,
            jobs=self._jobs,
            delivery=self._delivery,
            metrics=self.metrics,
            fail=self._fail,
        )
        self._shutdown = Shutdown(
            settings,
            clock=clock,
            rebalances=self._rebalances,
            committer=self._committer,
            jobs=self._jobs,
            delivery=self._delivery,
            producer=producer,
            gate=self._gate,
            topic_configs=topic_configs,
        )
        # Read when scraped, not written twice per job.
        self.metrics.in_flight.set_function(self._in_flight)
        self.metrics.crash_suspects.set_function(self._breaker.suspects)
        self.metrics.uncommitted.set_function(self._committer.uncommitted)

    @property
    def ready(self) -> bool:
        """Serving and holding partitions: what /readyz reports."""
        return self._serving and bool(self._gate.assignment())

    def request_stop(self) -> None:
        """Stop fetching and drain."""
        self._stopping.set()
        self._wake.set()

    async def run(self) -> int:
        """Serve until stopped; return the exit status."""
        s = self._settings
        async with AsyncExitStack() as stack:
            # Closed however far the start got, in reverse: the consumer leaves the group first.
            stack.push_async_callback(self.close_clients)
            await self._producer.start()
            self._delivery.start()
            stack.push_async_callback(self._delivery.close)
            stack.push_async_callback(self._committer.close)
            stack.push_async_callback(self._rebalances.close)
            self._serving = True
            await self._gate.start(s.jobs_topic, _RebalanceListener(self))
            logger.info(
                "worker %s serving %s -> %s (group %s, max_in_flight %d, engine %s)",
                s.worker_id,
                s.jobs_topic,
                s.results_topic,
                s.group_id,
                self.max_in_flight,
                self._engine.model_name,
            )
            try:
                await self._consume_loop()
            finally:
                await self._shutdown.drain(self._fatal)
        if self._fatal is not None:
            logger.error("stopped on a fatal error: %s", self._fatal)
            return 1
        logger.info("stopped cleanly")
        return 0

    async def _consume_loop(self) -> None:
        s = self._settings
        gate = self._gate
        while not self._stopping.is_set() and self._fatal is None:
            # Cleared before the reasons to wait (and the commit due) are read: whatever
            # changes them from here on wakes the waits below.
            self._wake.clear()
            self._committer.tick(due=self._breaker.commit_due())
            free = self.max_in_flight - self._in_flight()
            if free <= 0 or (free < self._pacing.refill_lot and self._engine_has_backlog()):
                # Full, or short of a lot while the engine has a backlog to run meanwhile.
                # Otherwise any free slot is filled at once: waiting for several leaves the
                # engine's batch short, which costs vLLM throughput. Short jobs free slots
                # soon: wait without touching the fetcher. Long ones: poll with every
                # partition paused. A freed slot, a stop and a fatal error all wake this wait;
                # its end only keeps the commit interval's ticks.
                try:
                    async with asyncio.timeout(self._pacing.full_wait_s):
                        await self._wake.wait()
                except TimeoutError:
                    await self._starts.start(await gate.poll_paused())
            elif gate.holds_everything():
                # Nothing may be fetched: a fetch would wait out its whole timeout, however soon
                # the hold ends. After a death the breaker holds every partition around each
                # suspect's run, and the acknowledgement and commits that end each hold wake
                # this wait (a suspect cost two fetch timeouts more than its own run).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(s.poll_timeout_ms / 1000):
                        await self._wake.wait()
                await self._starts.start(await gate.poll_paused())
            else:
                try:
                    batch = await gate.fetch(free, s.poll_timeout_ms)
                except KafkaError as exc:
                    if exc.retriable:
                        logger.warning("fetch failed (%r); retrying", exc)
                        continue
                    self._fatal = BrokerError(f"cannot fetch from {s.jobs_topic}: {exc!r}")
                    break
                await self._starts.start(batch)
            if (found := await self._watchdog.check()) is not None:
                self._fail(*found)

    async def close_clients(self) -> None:
        """Stop the consumer (leaving the group), then the producer. `run` does it on its way
        out; whoever built the worker does it when `run` never started. Stopping twice is a
        no-op."""
        await self._shutdown.close_clients()

    def assignment(self) -> set[TopicPartition]:
        """The partitions this worker holds now."""
        return self._gate.assignment()

    @property
    def jobs_in_flight(self) -> int:
        """Jobs started and not yet answered (running, or having their answer built)."""
        return len(self._jobs)

    @property
    def held_partitions(self) -> int:
        """Partitions waiting for a newer weight version."""
        return len(self._holds.held())

    def lag(self) -> int | None:
        """Jobs behind the ends of this worker's partitions, from the committed positions."""
        return self._committer.lag()

    async def answers_acknowledged(self, timeout_s: float) -> bool:
        """Wait until every answer handed on so far is acknowledged; False on timeout."""
        return await self._delivery.acknowledged(self._clock.monotonic() + timeout_s)

    def fail(self, exc: FatalError, where: str) -> None:
        """Stop on a fatal error found outside the loop (the control plane's engine calls)."""
        self._fail(exc, where)

    def _in_flight(self) -> int:
        """Jobs running, and answers not yet handed to the producer.

        Counting the latter keeps the outbox bounded: while the broker is slower than the
        engine, the worker fetches no more than it can deliver.
        """
        return len(self._jobs) + self._delivery.pending

    def _engine_has_backlog(self) -> bool:
        """More jobs running than the engine runs at once: some wait in its queue."""
        return len(self._jobs) > self._engine.max_concurrency

    def _fail(self, exc: FatalError, where: str) -> None:
        if self._fatal is None:
            self._fatal = exc
            logger.error("fatal error at %s: %s", where, exc, exc_info=exc)
        self._wake.set()

    def _wake_breaker(self) -> None:
        """An acknowledgement came or a commit ended: the breaker may let the next record go."""
        if self._breaker.engaged:
            self._wake.set()

    def _job_crashed(self, exc: BaseException) -> None:
        self._fail(BrokerError(f"a job's answer was lost to a bug: {exc!r}"), "job task")

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._rebalances.revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._rebalances.assigned(assigned)


class _RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._worker.on_partitions_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._worker.on_partitions_assigned(set(assigned))
