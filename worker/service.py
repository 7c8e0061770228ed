"""The consume loop: fetch jobs, run them concurrently, publish answers, commit what is answered."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any, Final, Literal, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import (
    CommitFailedError,
    IllegalStateError,
    KafkaError,
    MessageSizeTooLargeError,
)

from schemas import (
    Completed,
    ErrorCode,
    ErrorInfo,
    Failed,
    Job,
    SchemaError,
    Timings,
    decode_job,
    peek_job_id,
)
from worker.config import Settings
from worker.engine import Engine
from worker.errors import (
    BrokerError,
    FatalError,
    JobError,
    ResultTooLargeError,
)
from worker.kafka import topic_max_message_bytes
from worker.metrics import Metrics, MetricsServer
from worker.offsets import OffsetTracker, PartitionOffsets
from worker.outbox import Outbox
from worker.result_encoder import encode_result

__all__ = ["DLQ_HEADERS", "Worker"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Headers added to a dead-letter copy; the original key, value and headers are kept as they were.
DLQ_HEADERS: Final = (
    "vkw.error.code",
    "vkw.error.detail",
    "vkw.source.topic",
    "vkw.source.partition",
    "vkw.source.offset",
)

Headers = list[tuple[str, bytes]]

# Allocations between young-generation collections while serving (CPython's default: 700).
_GC_YOUNG_THRESHOLD: Final = 20_000

# Key, headers and record-batch framing around a result, as the broker counts them.
_RECORD_FRAMING_BYTES: Final = 16 * 1024

# Larger records are produced on their own, not in the outbox's batches: a record the broker
# refuses for its size then fails alone, and a batch of small answers is not held up behind it.
_BATCHED_RECORD_MAX_BYTES: Final = 256 * 1024


class _Answer:
    """What one job record turns into: zero or one result plus zero or one dead-letter copy."""

    __slots__ = ("dead_letter", "job_id", "result", "result_bytes")

    def __init__(
        self,
        job_id: str | None,
        result: Completed | Failed | None,
        dead_letter: tuple[bytes | None, bytes | None, Headers] | None = None,
    ) -> None:
        self.job_id = job_id
        self.result = result
        self.result_bytes = encode_result(result) if result is not None else None
        self.dead_letter = dead_letter


class _Part(enum.Enum):
    DEAD_LETTER = enum.auto()
    RESULT = enum.auto()


class _Publication:
    """An answer on its way to the broker, and the offset it answers."""

    __slots__ = ("answer", "offset", "partition", "parts_left", "started", "tp")

    def __init__(
        self, tp: TopicPartition, partition: PartitionOffsets, offset: int, answer: _Answer
    ) -> None:
        self.tp = tp
        self.partition = partition
        self.offset = offset
        self.answer = answer
        self.started = time.perf_counter()
        # Parts not yet acknowledged; the offset is answered when none is left.
        self.parts_left: set[_Part] = set()
        if answer.dead_letter is not None:
            self.parts_left.add(_Part.DEAD_LETTER)
        if answer.result is not None:
            self.parts_left.add(_Part.RESULT)


# One part of one answer: what a delivery acknowledges.
_Member = tuple[_Publication, _Part]


class Worker:
    """Consumes jobs, runs them on an engine, publishes results, commits answered offsets.

    The consumer, producer and engine are given, not built here, so tests pass fakes or clients
    pointed at a test broker. `run()` starts them, serves until `request_stop()` or a fatal
    error, drains, and returns the process exit status (0 clean, 1 fatal). With
    `own_process`, the worker may tune process-wide state for serving (the garbage
    collector); `serve` sets it. `topic_limits` holds the answer topics' `max.message.bytes`
    when the caller has read them (`serve` does, to size the producer's batches); otherwise
    the worker reads the results topic's at start.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer,
        engine: Engine,
        metrics: Metrics | None = None,
        own_process: bool = False,
        topic_limits: Mapping[str, int | None] | None = None,
    ) -> None:
        self._settings = settings
        self._own_process = own_process
        self._consumer = consumer
        self._producer = producer
        self._engine = engine
        self.metrics = metrics or Metrics()
        self.max_in_flight = settings.max_in_flight or 2 * engine.max_concurrency
        # Read when scraped, not written twice per job.
        self.metrics.in_flight.set_function(self._in_flight)
        self._tracker = OffsetTracker()
        self._tasks: dict[asyncio.Task[None], tuple[TopicPartition, int]] = {}
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._fatal: FatalError | None = None
        self._engine_ready = False
        self._last_commit = 0.0
        self._last_health_check = time.monotonic()
        self._signals = 0
        self.metrics_server: MetricsServer | None = None
        self._topic_limits = topic_limits
        self._result_limit = settings.max_result_bytes
        self._result_limit_source = "max_result_bytes"
        self._send_lock = asyncio.Lock()
        # Unacknowledged deliveries: when each was sent (oldest first) and whose answers it has.
        self._deliveries: dict[asyncio.Future[Any], tuple[float, list[_Member]]] = {}
        self._outbox: Outbox[_Member] = Outbox(producer, self._watch, self._outbox_crashed)
        self._resending = True

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Engine started and partitions held: what /readyz reports."""
        return self._engine_ready and bool(self._consumer.assignment())

    def request_stop(self) -> None:
        """Stop fetching and drain (the first signal); the second one exits at once."""
        self._stopping.set()
        self._wake.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        if self._signals > 1:
            logger.warning(
                "second signal %s: exiting now; unanswered jobs will be redelivered", signum
            )
            os._exit(128 + signum)
        logger.info("signal %s: draining for up to %.1fs", signum, self._settings.shutdown_grace_s)
        self.request_stop()

    async def run(self) -> int:
        """Serve until stopped; return the exit status."""
        s = self._settings
        async with AsyncExitStack() as stack:
            if s.metrics_port is not None:
                self.metrics_server = MetricsServer(
                    self.metrics, lambda: self.ready, s.metrics_host, s.metrics_port
                )
                await self.metrics_server.start()
                stack.push_async_callback(self.metrics_server.stop)
            await self._engine.start()
            stack.push_async_callback(self._bounded, self._engine.close(), "engine close")
            self._engine_ready = True
            await self._producer.start()
            stack.push_async_callback(self._bounded, self._producer.stop(), "producer stop")
            self._outbox.start()
            stack.push_async_callback(self._outbox.close)
            await self._learn_result_limit()
            if self._own_process:
                _tune_gc_for_serving()
            self._consumer.subscribe([s.jobs_topic], listener=_RebalanceListener(self))
            await self._consumer.start()
            stack.push_async_callback(self._bounded, self._consumer.stop(), "consumer stop")
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
                await self._drain()
        if self._fatal is not None:
            logger.error("stopped on a fatal error: %s", self._fatal)
            return 1
        logger.info("stopped cleanly")
        return 0

    async def _learn_result_limit(self) -> None:
        s = self._settings
        if self._topic_limits is not None and s.results_topic in self._topic_limits:
            topic_limit = self._topic_limits[s.results_topic]
        else:
            topic_limit = await topic_max_message_bytes(s, s.results_topic)
        if topic_limit is not None and topic_limit - _RECORD_FRAMING_BYTES < s.max_result_bytes:
            self._result_limit = max(topic_limit - _RECORD_FRAMING_BYTES, 0)
            self._result_limit_source = (
                f"{s.results_topic}'s max.message.bytes ({topic_limit}) less framing"
            )
            logger.warning(
                "results larger than %d bytes will be answered result_too_large: %s",
                self._result_limit,
                self._result_limit_source,
            )

    # ---- the loop --------------------------------------------------------------------------

    async def _consume_loop(self) -> None:
        s = self._settings
        while not self._stopping.is_set() and self._fatal is None:
            free = self.max_in_flight - self._in_flight()
            if free <= 0:
                # Full. Any free slot is filled at once: waiting for several (this once waited
                # for a quarter) left the engine's batch short and cost vLLM a third of its
                # throughput at max_in_flight = max_num_seqs. Short jobs free slots soon: wait
                # without touching the fetcher. Long ones: pause the partitions and poll anyway,
                # so the group does not evict us for exceeding max_poll_interval_ms (aiokafka
                # #848).
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), s.poll_timeout_ms / 1000)
                except TimeoutError:
                    self._consumer.pause(*self._consumer.assignment())
                    await self._consumer.getmany(timeout_ms=0)
            else:
                paused = self._consumer.paused()
                if paused:
                    self._consumer.resume(*paused)
                try:
                    batch = await self._consumer.getmany(
                        timeout_ms=s.poll_timeout_ms, max_records=free
                    )
                except KafkaError as exc:
                    if exc.retriable:
                        logger.warning("fetch failed (%r); retrying", exc)
                        continue
                    self._fatal = BrokerError(f"cannot fetch from {s.jobs_topic}: {exc!r}")
                    break
                self._start_jobs(batch)
            await self._maybe_commit()
            await self._maybe_check_engine()
            self._check_deliveries()

    def _check_deliveries(self) -> None:
        """Give up when the broker has not acknowledged an answer for `publish_timeout_s`."""
        if not self._deliveries:
            return
        waited = time.monotonic() - next(iter(self._deliveries.values()))[0]
        if waited > self._settings.publish_timeout_s:
            self._fatal = BrokerError(
                f"no acknowledgement from the broker for {waited:.1f}s "
                f"(publish_timeout_s={self._settings.publish_timeout_s})"
            )
            logger.error("%s; stopping", self._fatal)

    async def _maybe_check_engine(self) -> None:
        """A dead engine must stop the worker even when no job is running to notice it."""
        now = time.monotonic()
        if now - self._last_health_check < self._settings.health_check_interval_s:
            return
        self._last_health_check = now
        try:
            await self._engine.check_health()
        except FatalError as exc:
            logger.exception("engine health check failed")
            self._fatal = exc

    def _start_jobs(self, batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> None:
        assigned = self._consumer.assignment()
        for tp, records in batch.items():
            if tp not in assigned:
                continue  # revoked between the fetch and now: the next owner reads them
            for record in records:
                partition = self._tracker.start(tp, record.offset)
                # Unnamed: naming a task costs more than the rest of starting it; self._tasks
                # maps each task to its record.
                task = asyncio.create_task(self._handle(tp, partition, record))
                self._tasks[task] = (tp, record.offset)
                task.add_done_callback(self._job_done)

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        if self._in_flight() < self.max_in_flight:
            self._wake.set()

    def _in_flight(self) -> int:
        """Jobs running, and answers the outbox has yet to hand to the producer.

        Counting the latter keeps the outbox bounded: while the broker is slower than the
        engine, the worker fetches no more than it can deliver. A job leaves `_tasks` as its
        answer enters the outbox (see `_handle`), so it is never counted twice.
        """
        return len(self._tasks) + self._outbox.pending

    async def _maybe_commit(self) -> None:
        now = time.monotonic()
        if (now - self._last_commit) * 1000 >= self._settings.commit_interval_ms:
            await self._commit()
            self._last_commit = now
            # Lag is measured from the committed position, so it moves only with commits.
            self._update_lag()

    async def _commit(self, partitions: set[TopicPartition] | None = None) -> None:
        offsets = self._tracker.to_commit(partitions)
        if not offsets:
            return
        try:
            # aiokafka waits for a lost coordinator indefinitely; the loop must keep turning.
            await asyncio.wait_for(self._consumer.commit(offsets), self._settings.commit_timeout_s)
        except TimeoutError:
            self.metrics.commits.labels("retry").inc()
            logger.warning("commit of %s timed out; retrying at the next commit", _fmt(offsets))
            return
        except (CommitFailedError, IllegalStateError) as exc:
            # The group rebalanced under us: these records will be redelivered to the new owner.
            self.metrics.commits.labels("failed").inc()
            logger.warning(
                "commit of %s failed (%s); the records will be redelivered", _fmt(offsets), exc
            )
            return
        except KafkaError as exc:
            self.metrics.commits.labels("retry").inc()
            logger.warning(
                "commit of %s failed (%s); retrying at the next commit", _fmt(offsets), exc
            )
            return
        self._tracker.committed(offsets)
        self.metrics.commits.labels("ok").inc()
        logger.debug("committed %s", _fmt(offsets))

    def _update_lag(self) -> None:
        for tp in self._consumer.assignment():
            highwater = self._consumer.highwater(tp)
            position = self._tracker.committed_position(tp)
            if highwater is not None and position is not None:
                self.metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(
                    max(highwater - position, 0)
                )

    # ---- rebalance and shutdown ------------------------------------------------------------

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Let the revoked partitions' jobs finish for a bounded time, abort the rest, commit."""
        busy = sum(tp in revoked for tp, _ in self._tasks.values())
        if busy:
            logger.info(
                "rebalance: %d jobs of %s get %.1fs",
                busy,
                sorted(map(str, revoked)),
                self._settings.revoke_grace_s,
            )
        await self._settle(revoked, self._settings.revoke_grace_s)
        await self._commit(revoked)
        self._tracker.forget(revoked)
        for tp in revoked:
            with contextlib.suppress(KeyError):
                self.metrics.consumer_lag.remove(tp.topic, str(tp.partition))

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.metrics.assigned_partitions.set(len(self._consumer.assignment()))
        logger.info("assigned %s", sorted(map(str, assigned)))

    async def _drain(self) -> None:
        """Stop: let jobs finish within the grace period, cancel the rest, commit what finished."""
        grace = 0.0 if self._fatal is not None else self._settings.shutdown_grace_s
        if self._tasks:
            logger.info("draining %d jobs (grace %.1fs)", len(self._tasks), grace)
        await self._settle(None, grace)
        await self._bounded(self._producer.flush(), "flush")
        await asyncio.sleep(0)  # acknowledgements the flush resolved mark their offsets
        await self._bounded(self._commit(), "final commit")
        # From here on a failed delivery is left to redelivery: the producer is closing.
        self._resending = False

    async def _bounded(self, step: Awaitable[object], what: str) -> None:
        """Run one shutdown step for at most `close_timeout_s`: a dead broker must not hang exit."""
        try:
            await asyncio.wait_for(step, self._settings.close_timeout_s)
        except TimeoutError:
            logger.warning(
                "%s did not finish in %.1fs; going on", what, self._settings.close_timeout_s
            )
        except KafkaError as exc:
            logger.warning("%s failed: %r", what, exc)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # aiokafka's fetcher lets its own task's cancellation escape stop() when the broker
            # is gone; that is a failed step, not a request to cancel us.
            logger.warning("%s was interrupted; going on", what)

    async def _settle(self, partitions: set[TopicPartition] | None, grace_s: float) -> None:
        """Give the jobs of `partitions` (all when None) `grace_s` to be answered and
        acknowledged, then cancel those still running. Their offsets stay unfinished, so their
        records are redelivered."""

        def ours(tp: TopicPartition) -> bool:
            return partitions is None or tp in partitions

        deadline = time.monotonic() + grace_s
        tasks = [t for t, (tp, _) in self._tasks.items() if ours(tp)]
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)
        # Answers those jobs sent are acknowledged in the same grace.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._outbox.flush(), max(deadline - time.monotonic(), 0))
        deliveries = [
            d for d, (_, members) in self._deliveries.items() if any(ours(p.tp) for p, _ in members)
        ]
        remaining = deadline - time.monotonic()
        if deliveries and remaining > 0:
            await asyncio.wait(deliveries, timeout=remaining)
        await asyncio.sleep(0)  # let the acknowledgements' callbacks mark their offsets
        # Including re-sends that failed deliveries started meanwhile.
        pending = [t for t, (tp, _) in self._tasks.items() if ours(tp) and not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            logger.info(
                "aborted %d unfinished jobs; they stay uncommitted and will be redelivered",
                len(pending),
            )
            await asyncio.gather(*pending, return_exceptions=True)

    # ---- one job ---------------------------------------------------------------------------

    async def _handle(
        self, tp: TopicPartition, partition: PartitionOffsets, record: ConsumerRecord[bytes, bytes]
    ) -> None:
        """Answer one record and hand the answer to the producer; its offset is finished when
        the broker acknowledges it. Only cancellation and fatal errors leave without an
        answer; both leave the offset unfinished, so the record is redelivered.
        """
        try:
            try:
                answer = await self._answer(tp, record)
            except (asyncio.CancelledError, FatalError):
                raise
            except Exception as exc:  # The one broad catch: one job's bug must not stop the worker.
                logger.exception(
                    "unexpected error answering %s-%s@%s", tp.topic, tp.partition, record.offset
                )
                answer = self._internal_error(tp, record, exc)
            await self._publish(_Publication(tp, partition, record.offset, answer))
            # The answer is the outbox's or the producer's now. Left in `_tasks` until the
            # done-callback runs (the next loop turn), the job would count twice in flight.
            if (task := asyncio.current_task()) is not None:
                self._tasks.pop(task, None)
        except asyncio.CancelledError:
            logger.info(
                "job at %s-%s@%s cancelled; left uncommitted for redelivery",
                tp.topic,
                tp.partition,
                record.offset,
            )
            raise
        except FatalError as exc:
            self._fail(exc, f"{tp.topic}-{tp.partition}@{record.offset}")

    def _fail(self, exc: FatalError, where: str) -> None:
        if self._fatal is None:
            self._fatal = exc
            logger.error("fatal error at %s: %s", where, exc, exc_info=exc)
        self._wake.set()

    async def _answer(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> _Answer:
        started = time.time()
        raw = record.value
        if raw is None:
            return self._invalid_record(
                tp, record, SchemaError("the record has no value (a tombstone)")
            )
        try:
            job = decode_job(raw)
        except SchemaError as exc:
            return self._invalid_record(tp, record, exc)
        if job.deadline is not None and job.deadline < started:
            logger.info(
                "job %s at %s-%s@%s expired before it started",
                job.job_id,
                tp.topic,
                tp.partition,
                record.offset,
            )
            return self._failed(
                job,
                ErrorCode.EXPIRED,
                f"deadline {job.deadline:.3f} passed before the job started ({started:.3f})",
            )
        queue_wait = max(started - record.timestamp / 1000, 0.0)
        self.metrics.queue_wait.observe(queue_wait)
        request_id = f"{job.job_id}@{tp.topic}-{tp.partition}-{record.offset}"
        if job.return_routed_experts and not self._engine.supports_routed_experts:
            return self._failed(
                job,
                ErrorCode.INVALID_JOB,
                f"engine {self._engine.model_name} cannot return routed experts",
            )
        t0 = time.perf_counter()
        try:
            output = await self._engine.generate(job, request_id)
        except JobError as exc:
            logger.info(
                "job %s at %s-%s@%s failed: %s %s",
                job.job_id,
                tp.topic,
                tp.partition,
                record.offset,
                exc.code,
                exc.detail,
            )
            return self._failed(job, exc.code, exc.detail, retryable=exc.retryable)
        engine_s = time.perf_counter() - t0
        self.metrics.engine_time.observe(engine_s)
        result = Completed(
            job_id=job.job_id,
            completions=output.completions,
            prompt_token_count=len(output.prompt_token_ids),
            prompt_token_ids=output.prompt_token_ids if job.prompt is not None else None,
            metadata=job.metadata,
            model=self._engine.model_name,
            worker=self._settings.worker_id,
            timings=Timings(queue_wait_s=queue_wait, engine_s=engine_s),
        )
        answer = _Answer(job.job_id, result)
        size = len(answer.result_bytes or b"")
        if size > self._result_limit:
            return self._failed(
                job,
                ErrorCode.RESULT_TOO_LARGE,
                f"result is {size} bytes; the limit is {self._result_limit} ({self._result_limit_source})",
            )
        self.metrics.generated_tokens.inc(sum(len(c.token_ids) for c in output.completions))
        self.metrics.routed_experts_bytes.inc(
            sum(
                len(c.routed_experts.data)
                for c in output.completions
                if c.routed_experts is not None
            )
        )
        return answer

    def _failed(
        self, job: Job, code: ErrorCode, detail: str, *, retryable: bool = False
    ) -> _Answer:
        error = ErrorInfo(code=code, detail=detail, retryable=retryable)
        return _Answer(
            job.job_id,
            Failed(
                job_id=job.job_id,
                error=error,
                metadata=job.metadata,
                worker=self._settings.worker_id,
            ),
        )

    def _internal_error(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], exc: Exception
    ) -> _Answer:
        detail = f"internal error: {type(exc).__name__}: {exc}"
        # A readable job gets a failed result; only an unreadable one needs the dead-letter copy.
        return self._reject(tp, record, ErrorCode.INTERNAL_ERROR, detail, dead_letter="if_no_id")

    def _dead_letter(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], code: ErrorCode, detail: str
    ) -> tuple[bytes | None, bytes | None, Headers]:
        headers: Headers = [(k, v) for k, v in record.headers or ()]
        headers += [
            ("vkw.error.code", code.value.encode()),
            ("vkw.error.detail", detail.encode()[:4096]),
            ("vkw.source.topic", tp.topic.encode()),
            ("vkw.source.partition", str(tp.partition).encode()),
            ("vkw.source.offset", str(record.offset).encode()),
        ]
        return (record.key, record.value, headers)

    def _invalid_record(
        self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], exc: SchemaError
    ) -> _Answer:
        detail = (
            f"invalid job at {exc.path}: {exc.message}"
            if exc.path
            else f"invalid job: {exc.message}"
        )
        return self._reject(tp, record, ErrorCode.INVALID_JOB, detail, dead_letter="always")

    def _reject(
        self,
        tp: TopicPartition,
        record: ConsumerRecord[bytes, bytes],
        code: ErrorCode,
        detail: str,
        *,
        dead_letter: Literal["always", "if_no_id"],
    ) -> _Answer:
        """Answer a record that did not become a job: a failed result when its job_id can be
        read, and a dead-letter copy of the original record as `dead_letter` says."""
        job_id = peek_job_id(record.value) if record.value is not None else None
        logger.warning(
            "record %s-%s@%s (job_id %s): %s", tp.topic, tp.partition, record.offset, job_id, detail
        )
        failed = None
        if job_id is not None:
            failed = Failed(
                job_id=job_id,
                error=ErrorInfo(code=code, detail=detail),
                worker=self._settings.worker_id,
            )
        copy = None
        if dead_letter == "always" or job_id is None:
            copy = self._dead_letter(tp, record, code, detail)
        return _Answer(job_id, failed, dead_letter=copy)

    async def _publish(self, publication: _Publication) -> None:
        """Hand each part of the answer to the producer. Acknowledgements arrive as callbacks:
        a job does not wait for its own. Its slot frees when the outbox hands the answer to the
        producer (see `_in_flight`)."""
        answer = publication.answer
        if answer.dead_letter is not None:
            await self._post(publication, _Part.DEAD_LETTER)
        if answer.result is not None:
            await self._post(publication, _Part.RESULT)
        if not publication.parts_left:  # nothing to send: cannot happen, but never stick
            self._answered(publication)

    async def _post(self, publication: _Publication, part: _Part) -> None:
        """Queue one part in the outbox, or, when large, produce it on its own."""
        topic, key, value, headers = self._record(publication, part)
        if value is None or len(value) <= _BATCHED_RECORD_MAX_BYTES:
            self._outbox.add(topic, key, value, headers, (publication, part))
            return
        delivery = await self._deliver(publication, part, self._enqueue)
        self._watch([(publication, part)], delivery)

    async def _deliver(
        self,
        publication: _Publication,
        part: _Part,
        send: Callable[[str, bytes | None, bytes | None, Headers], Awaitable[_T]],
    ) -> _T:
        """Send one part with `send`; when it is refused for its size, send what fits instead:
        a dead-letter copy without its value, a result answered `result_too_large`."""
        try:
            return await send(*self._record(publication, part))
        except ResultTooLargeError as exc:
            answer = publication.answer
            if part is _Part.DEAD_LETTER and answer.dead_letter is not None:
                answer.dead_letter = _without_value(answer.dead_letter)
            else:
                publication.answer = self._too_large(answer, exc)
            return await send(*self._record(publication, part))

    def _record(
        self, publication: _Publication, part: _Part
    ) -> tuple[str, bytes | None, bytes | None, Headers]:
        """Topic, key, value and headers of the record that carries `part` of the answer."""
        answer = publication.answer
        if part is _Part.DEAD_LETTER and answer.dead_letter is not None:
            key, value, headers = answer.dead_letter
            return self._settings.dead_letter_topic, key, value, headers
        key = answer.job_id.encode() if answer.job_id is not None else None
        return self._settings.results_topic, key, answer.result_bytes, []

    def _watch(self, members: list[_Member], delivery: asyncio.Future[Any]) -> None:
        """Follow the delivery of a batch (or of one large record) holding `members`."""
        self._deliveries[delivery] = (time.monotonic(), members)
        delivery.add_done_callback(functools.partial(self._on_delivery, members))
        if self._in_flight() < self.max_in_flight:
            self._wake.set()

    def _outbox_crashed(self, exc: BaseException) -> None:
        self._fail(BrokerError(f"answers could not be handed to the producer: {exc!r}"), "outbox")

    def _on_delivery(self, members: list[_Member], delivery: asyncio.Future[Any]) -> None:
        self._deliveries.pop(delivery, None)
        if delivery.cancelled():
            return  # the producer closed with it unsent: the offsets stay unfinished
        error = delivery.exception()
        if error is None:
            for publication, part in members:
                self._acknowledged(publication, part)
            return
        if not self._resending:
            return
        logger.warning(
            "delivery of %d answers failed (%r); sending each again on its own", len(members), error
        )
        # Rare: each part is sent again alone (one refused for its size then fails alone), in a
        # task that drain and revoke treat like a job's.
        for publication, part in members:
            task = asyncio.create_task(self._resend(publication, part))
            self._tasks[task] = (publication.tp, publication.offset)
            task.add_done_callback(self._job_done)

    async def _resend(self, publication: _Publication, part: _Part) -> None:
        where = f"{publication.tp.topic}-{publication.tp.partition}@{publication.offset}"
        try:
            await self._deliver(
                publication, part, functools.partial(self._send, member=(publication, part))
            )
        except asyncio.CancelledError:
            logger.info("re-send for %s cancelled; left uncommitted for redelivery", where)
            raise
        except FatalError as exc:
            self._fail(exc, where)
            return
        self._acknowledged(publication, part)

    def _acknowledged(self, publication: _Publication, part: _Part) -> None:
        """One part acknowledged; with the last one, the offset is answered."""
        publication.parts_left.discard(part)
        if not publication.parts_left:
            self._answered(publication)

    def _answered(self, publication: _Publication) -> None:
        publication.partition.finish(publication.offset)
        answer = publication.answer
        if answer.dead_letter is not None:
            code = _header(answer.dead_letter[2], "vkw.error.code")
            self.metrics.jobs.inc(labels=("dead_lettered", code))
        if isinstance(answer.result, Failed):
            self.metrics.jobs.inc(labels=("failed", answer.result.error.code.value))
        elif answer.result is not None:
            self.metrics.jobs.inc(labels=("completed", ""))
        self.metrics.publish_time.observe(time.perf_counter() - publication.started)

    def _too_large(self, answer: _Answer, exc: ResultTooLargeError) -> _Answer:
        """The broker or client refused the result's size: answer that instead, it is small."""
        metadata = answer.result.metadata if answer.result is not None else {}
        failed = Failed(
            job_id=answer.job_id,
            error=ErrorInfo(code=ErrorCode.RESULT_TOO_LARGE, detail=exc.detail),
            metadata=metadata,
            worker=self._settings.worker_id,
        )
        return _Answer(answer.job_id, failed)

    async def _enqueue(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Headers
    ) -> asyncio.Future[Any]:
        """Append one record to the producer's batches (retrying what the broker says is
        transient) and return the future of its acknowledgement."""
        backoff = _Backoff(self._settings.publish_timeout_s)
        while True:
            try:
                # One task at a time appends to the producer's batches: with hundreds of jobs
                # finishing together, unserialised sends thrash waiting for full batches to drain.
                async with self._send_lock:
                    delivery: asyncio.Future[Any] = await self._producer.send(
                        topic, value=value, key=key, headers=headers
                    )
            except MessageSizeTooLargeError as exc:
                raise self._size_refused(value, exc) from None
            except KafkaError as exc:
                await backoff.after(exc, f"sending to {topic}")
            else:
                return delivery

    async def _send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers,
        member: _Member,
    ) -> None:
        """Produce one record and await its acknowledgement, retrying what the broker says is
        transient. The path for re-sends; first sends go through `_publish`."""
        backoff = _Backoff(self._settings.publish_timeout_s)
        while True:
            delivery = await self._enqueue(topic, key, value, headers)
            # aiokafka retries an unreachable broker forever; the loop's watchdog bounds our
            # patience (one check per loop turn is far cheaper than a timer per record).
            self._deliveries[delivery] = (time.monotonic(), [member])
            try:
                # Not shielded: aiokafka checks done() before resolving, so cancelling a job
                # while it waits here is harmless.
                await delivery
            except MessageSizeTooLargeError as exc:
                raise self._size_refused(value, exc) from None
            except KafkaError as exc:
                await backoff.after(exc, f"delivery to {topic}")
            else:
                return
            finally:
                self._deliveries.pop(delivery, None)

    def _size_refused(self, value: bytes | None, exc: Exception) -> ResultTooLargeError:
        return ResultTooLargeError(
            f"result is {len(value or b'')} bytes; the broker or producer limit "
            f"({self._settings.max_result_bytes} + framing) refused it: {exc}"
        )


class _Backoff:
    """Retries of one delivery: transient broker errors wait and retry, doubling the wait, until
    `timeout_s` has passed; anything else, or later, is a BrokerError."""

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s
        self._delay = 0.1

    async def after(self, exc: KafkaError, what: str) -> None:
        if not exc.retriable or time.monotonic() > self._deadline:
            raise BrokerError(f"{what} failed: {exc!r}") from exc
        logger.warning("%s failed (%r); retrying in %.1fs", what, exc, self._delay)
        await asyncio.sleep(self._delay)
        self._delay = min(self._delay * 2, 5.0)


class _RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._worker.on_partitions_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._worker.on_partitions_assigned(set(assigned))


def _without_value(
    copy: tuple[bytes | None, bytes | None, Headers],
) -> tuple[bytes | None, bytes | None, Headers]:
    """A dead-letter copy too large to produce, without its value: the original record stays
    in its topic at the offset the headers name."""
    key, value, headers = copy
    return key, None, [*headers, ("vkw.value.dropped", str(len(value or b"")).encode())]


def _tune_gc_for_serving() -> None:
    """Keep the cyclic garbage collector off the hot path once everything is loaded.

    Freezing moves what exists now (modules, the engine, its model: with vLLM, millions of
    objects) out of the collector's reach, as vLLM does after start-up. A higher first
    threshold lets a job's short-lived objects die young instead of being promoted and
    scanned again; on the mock engine the collector took up to a fifth of the worker's time.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, older, oldest)


def _header(headers: Headers, name: str) -> str:
    return next((v.decode() for k, v in reversed(headers) if k == name), "")


def _fmt(offsets: dict[TopicPartition, int]) -> str:
    return ", ".join(f"{tp.topic}-{tp.partition}@{o}" for tp, o in sorted(offsets.items()))
