"""The trainer's side of the fleet: submit jobs, get one whole result per job, steer the fleet.

`RolloutClient` needs aiokafka and `schemas` only (no engine). It keeps a Kafka loop that every
trainer would otherwise write: produce jobs keyed by `job_id` (by `session_id` when a job has
one: the turns of a conversation, see `turn`), read the results topic from the
moment it starts, reassemble split results, drop redelivered duplicates, read payload
references, resubmit `retryable` failures a bounded number of times, give up on a job after
its timeout (a `Failed` answer, never a hang), and report progress.

    async with RolloutClient(bootstrap_servers="kafka:9092") as client:
        results = await client.generate(jobs)            # one per job, in job order
        await client.turn(conversation, new_tokens)      # a multi-turn rollout's next turn
        await client.update_weights("/ckpt/step-3", 3, mode="keep")
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeAlias

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import (
    CommandAck,
    InflightMode,
    Job,
    PayloadError,
    Result,
    SamplingSpec,
    SchemaError,
    Target,
    WorkerStatus,
    as_job,
)
from schemas.payloads import payload_root as to_payload_root
from worker.client.conversation import Conversation
from worker.client.fleet import start_clients
from worker.client.inflight import RETRY_SEPARATOR, InFlight, RolloutError
from worker.client.sending import Sender
from worker.client.steering import Steering
from worker.core.clients import AIOKAFKA, KafkaClients
from worker.core.clock import SYSTEM_CLOCK, Clock
from worker.core.errors import BrokerError
from worker.core.tracing import current_trace_context, trace_context

__all__ = ["RETRY_SEPARATOR", "RolloutClient", "RolloutError"]

logger = logging.getLogger(__name__)

_SWEEP_S: Final = 0.2


#: What `submit` and `generate` take: a `Job`, or a mapping of its fields as on the wire.
JobLike: TypeAlias = Job | Mapping[str, Any]


class RolloutClient:
    """Submit generation jobs to the fleet and await their results (see the module docstring).

    `reply_to`: ask the workers to answer on `results_topic` rather than their own results
    topic (they must allow it with `--reply-topics`), so many trainers share one fleet.
    `timeout_s`: per job; the job's `deadline` is set to it too, so no worker starts it later.
    `max_retries`: how often a `retryable` failure is resubmitted before it is returned.
    `resolve_payloads`: read and check routed experts kept in a payload store, so results
    come back self-contained (`data` filled in). `payload_root` (a path or `file://` URI: the
    workers' `--payload-store` as mounted here) is the only place they are read from: a
    reference to anything outside it, or any reference when it is unset, fails that job with
    `RolloutError`, as does a payload that is missing, altered, not a regular file or not the
    shape and dtype its record says. `client_options`: aiokafka's connection and
    security arguments (`security_protocol`, `ssl_context`, `sasl_*`, ...), given to every
    client it opens, those of `update_weights` and `status` too. `control_hmac_key`: the
    fleet's `--control-hmac-key`, which `update_weights` signs its commands with.
    `kafka_clients`: where its Kafka clients come from (aiokafka's by default; a simulation or
    a test passes its own). `clock`: what jobs' deadlines are dated and checked on, and weight
    updates dated and waited for (the system's by default).
    """

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        jobs_topic: str = "vkw.jobs",
        results_topic: str = "vkw.results",
        control_topic: str = "vkw.control",
        status_topic: str = "vkw.status",
        group_id: str = "vllm-kafka-worker",
        reply_to: bool = False,
        timeout_s: float = 600.0,
        max_retries: int = 2,
        resolve_payloads: bool = True,
        payload_root: str | Path | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        control_hmac_key: str | None = None,
        kafka_clients: KafkaClients = AIOKAFKA,
        clock: Clock = SYSTEM_CLOCK,
        **client_options: Any,
    ) -> None:
        if timeout_s <= 0 or max_retries < 0:
            raise ValueError("timeout_s must be > 0 and max_retries >= 0")
        try:
            root = None if payload_root is None else to_payload_root(payload_root)
        except PayloadError as exc:
            raise ValueError(str(exc)) from None
        self._connection: dict[str, Any] = {
            "bootstrap_servers": bootstrap_servers,
            **client_options,
        }
        self._jobs_topic = jobs_topic
        self._results_topic = results_topic
        self._steering = Steering(
            self._connection,
            control_topic=control_topic,
            status_topic=status_topic,
            group_id=group_id,
            control_hmac_key=control_hmac_key,
            kafka_clients=kafka_clients,
            clock=clock,
        )
        self._kafka_clients = kafka_clients
        self._inflight = InFlight(
            timeout_s=timeout_s,
            max_retries=max_retries,
            resolve=resolve_payloads,
            payload_root=root,
            resend=lambda pending: self._sender.send(pending),  # noqa: PLW0108 - made below
            on_progress=on_progress,
            clock=clock,
        )
        self._clock = clock
        self._producer: AIOKafkaProducer | None = None
        self._sender = Sender(
            self._inflight,
            lambda: self._producer,
            jobs_topic=jobs_topic,
            reply_to=results_topic if reply_to else None,
        )
        self._consumer: AIOKafkaConsumer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Why the client cannot answer jobs any more (a background task ended), or None.
        self._stopped: str | None = None

    async def __aenter__(self) -> RolloutClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        self._producer = self._kafka_clients.producer(**self._connection, acks="all", linger_ms=5)
        self._consumer = self._kafka_clients.consumer(
            **self._connection,
            group_id=None,
            enable_auto_commit=False,
            max_partition_fetch_bytes=32 * 1024 * 1024,
            fetch_max_bytes=64 * 1024 * 1024,
        )
        try:
            await start_clients(
                (self._producer, self._consumer),
                str(self._connection["bootstrap_servers"]),
                f"writing {self._jobs_topic} and reading {self._results_topic}",
            )
        except BrokerError as exc:
            self._consumer = self._producer = None
            raise RolloutError(str(exc)) from None
        try:
            await _read_from_now(self._consumer, self._results_topic)
        except RolloutError:
            await self.close()
            raise
        self._tasks = [
            asyncio.create_task(self._read(), name="rollout-client-read"),
            asyncio.create_task(self._sweep(), name="rollout-client-timeouts"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._background_stopped)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, self._sender.cancel(), return_exceptions=True)
        self._tasks = []
        self._inflight.fail_all(RolloutError("the client was closed"))
        for client in (self._consumer, self._producer):
            if client is not None:
                await client.stop()
        self._consumer = self._producer = None

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet answered."""
        return len(self._inflight.pending)

    def submit(
        self,
        job: JobLike,
        *,
        traceparent: str | None = None,
        tracestate: str | None = None,
        request_id: str | None = None,
    ) -> asyncio.Future[Result]:
        """Send `job`; the returned future resolves to its result (its `job_id` as sent).

        `job` is checked as a worker checks it on the wire: a bad one raises `SchemaError`
        naming the field, and nothing is sent.

        The job record carries a W3C trace context, which the workers pass to vLLM and copy
        onto the job's result records: `traceparent` (and `tracestate`) when given, else the
        current OpenTelemetry span's when OpenTelemetry is installed and a span is current;
        `request_id` as `x-request-id`. A value not in the W3C format raises
        `TraceContextError` (a `ValueError`) naming it, and nothing is sent."""
        trace = trace_context(traceparent, tracestate, request_id)
        if trace.traceparent is None:
            trace = msgspec.structs.replace(current_trace_context(), request_id=trace.request_id)
        if self._producer is None:
            raise RolloutError("the client is not started (use `async with RolloutClient(...)`)")
        if self._stopped is not None:
            raise RolloutError(f"the client stopped: {self._stopped}")
        pending = self._inflight.add(as_job(job), trace)
        self._sender.send(pending)
        return pending.future

    async def generate(
        self,
        jobs: Iterable[JobLike],
        *,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> list[Result]:
        """Submit every job and return their results in job order. Every job is checked
        before any is sent: a bad one raises `SchemaError` naming it and its field. Every job
        is sent in the trace context `submit` takes (`traceparent`, or the current
        OpenTelemetry span's). A job that fails (`RolloutError`: the broker refused it) fails
        the call, and its other jobs are no longer waited for: the same jobs may be run again
        at once."""
        checked = []
        for index, job in enumerate(jobs):
            try:
                checked.append(as_job(job))
            except SchemaError as exc:
                raise SchemaError(f"job {index}: {exc.message}", exc.path) from None
        trace = trace_context(traceparent, tracestate)  # checked before any job is sent
        futures: list[asyncio.Future[Result]] = []
        try:
            for job in checked:
                futures.append(
                    self.submit(job, traceparent=trace.traceparent, tracestate=trace.tracestate)
                )
            return list(await asyncio.gather(*futures))
        except BaseException:
            # gather leaves the others running when one fails: each would stay in flight
            # until its timeout, and its id could not be submitted again until then.
            for future in futures:
                future.cancel()
            raise

    async def turn(
        self,
        conversation: Conversation,
        new_tokens: Sequence[int],
        *,
        sampling: SamplingSpec | None = None,
        min_weight_version: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Result:
        """Run the next turn of `conversation`: its job (`Conversation.next_job`: the
        conversation so far + `new_tokens`, routing from where the last turn's rows end, keyed
        by the session) is submitted and its answer recorded. A failed turn leaves the
        conversation where it was, so the same turn can be run again: one whose answer does not
        continue the conversation (`ConversationError`) too."""
        job = conversation.next_job(
            new_tokens, sampling=sampling, min_weight_version=min_weight_version, metadata=metadata
        )
        try:
            result = await self.submit(job)
            conversation.record(result)
        except BaseException:
            conversation.abandon()
            raise
        return result

    async def update_weights(
        self,
        path: str,
        version: int,
        *,
        mode: InflightMode = "wait",
        target: Target | None = None,
        timeout_s: float = 600.0,
        force: bool = False,
    ) -> dict[str, CommandAck]:
        """Have every live worker of `target` (default: `group_id`) serve `path` as `version`;
        their acknowledgements (RolloutError if one failed or did not answer). Workers refuse
        a version older than the one they serve unless `force` (a rollback). `timeout_s`
        bounds the whole call, the reads of the status topic before the send included: past
        it, RolloutError (saying whether the command was sent)."""
        return await self._steering.update_weights(
            path, version, mode=mode, target=target, timeout_s=timeout_s, force=force
        )

    async def status(
        self, target: Target | None = None, *, timeout_s: float = 60.0
    ) -> dict[str, WorkerStatus]:
        """The latest heartbeat of every live worker of `target` (default: `group_id`);
        RolloutError when the status topic cannot be read within `timeout_s`."""
        return await self._steering.status(target, timeout_s=timeout_s)

    def _background_stopped(self, task: asyncio.Task[None]) -> None:
        """The reader and the sweeper run until `close`: if one ends, no pending job can be
        answered any more, so every one fails now rather than at its timeout."""
        if task.cancelled():
            return
        exc = task.exception()
        logger.error("the client's %s task stopped", task.get_name(), exc_info=exc)
        self._stopped = f"{task.get_name()} stopped: {exc!r}"
        self._inflight.fail_all(RolloutError(f"the client's {self._stopped}"))

    async def _read(self) -> None:
        assert self._consumer is not None  # noqa: S101
        while True:
            batch = await self._consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for record in records:
                    try:
                        await self._inflight.take_record(record.value)
                    except Exception:  # The one broad catch: no record may end the reader.
                        logger.exception(
                            "result at %s-%s@%s skipped",
                            record.topic,
                            record.partition,
                            record.offset,
                        )

    async def _sweep(self) -> None:
        """Answer jobs past their timeout, so no caller waits forever."""
        while True:
            await asyncio.sleep(_SWEEP_S)
            self._inflight.expire(self._clock.wall())


async def _read_from_now(consumer: AIOKafkaConsumer, topic: str) -> None:
    """Assign every partition of `topic` to `consumer`, positioned at its end: only answers to
    jobs sent from now on are read. `RolloutError` when the topic does not exist."""
    partitions = consumer.partitions_for_topic(topic)
    if partitions is None:
        await consumer.topics()
        partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        raise RolloutError(f"results topic {topic} does not exist")
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)
