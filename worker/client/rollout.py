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
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeAlias

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from schemas import (
    CommandAck,
    Completed,
    ErrorCode,
    ErrorInfo,
    Failed,
    InflightMode,
    Job,
    PayloadError,
    Result,
    ResultAssembler,
    SamplingSpec,
    SchemaError,
    Target,
    UpdateWeights,
    WorkerStatus,
    as_job,
    decode_result,
    encode,
)
from schemas.payloads import payload_root as to_payload_root
from worker.client.conversation import Conversation, new_submission_id
from worker.client.fleet import Fleet, new_command_id, start_clients
from worker.core.errors import BrokerError
from worker.core.paced_consumer import PacedConsumer
from worker.core.tracing import TraceContext, current_trace_context, trace_context

__all__ = ["RolloutClient", "RolloutError"]

logger = logging.getLogger(__name__)

# A resubmitted job gets the original id with this and the attempt number appended, so its
# answer is not taken for a duplicate of the failed one.
RETRY_SEPARATOR: Final = "~retry"
_SWEEP_S: Final = 0.2


#: What `submit` and `generate` take: a `Job`, or a mapping of its fields as on the wire.
JobLike: TypeAlias = Job | Mapping[str, Any]


class RolloutError(Exception):
    """The client cannot do what was asked (not started, a payload that cannot be read)."""


class _Pending:
    __slots__ = ("deadline", "future", "job", "retries", "submission", "trace", "wire_id")

    def __init__(
        self, job: Job, future: asyncio.Future[Result], deadline: float, trace: TraceContext
    ) -> None:
        self.job = job
        # Sent with the job, and with each resubmission of it: one trace for all its tries.
        self.trace = trace
        self.future = future
        self.deadline = deadline
        self.retries = 0
        # The id the job travels under now: its own, or its latest resubmission's.
        self.wire_id = job.job_id
        # The submission it travels under now: new for every sending, so an answer to an
        # earlier sending of the same id (a re-run, an earlier trainer) is told apart.
        self.submission = new_submission_id()


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
        **client_options: Any,
    ) -> None:
        if timeout_s <= 0 or max_retries < 0:
            raise ValueError("timeout_s must be > 0 and max_retries >= 0")
        try:
            self._payload_root = None if payload_root is None else to_payload_root(payload_root)
        except PayloadError as exc:
            raise ValueError(str(exc)) from None
        self._connection: dict[str, Any] = {
            "bootstrap_servers": bootstrap_servers,
            **client_options,
        }
        self._jobs_topic = jobs_topic
        self._results_topic = results_topic
        self._control_topic = control_topic
        self._status_topic = status_topic
        self._control_hmac_key = control_hmac_key
        self._group_id = group_id
        self._reply_to = results_topic if reply_to else None
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._resolve = resolve_payloads
        self._on_progress = on_progress
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[str, _Pending] = {}
        self._assembler = ResultAssembler()
        self._submitted = 0
        self._answered = 0
        self._send_lock = asyncio.Lock()
        self._sends: set[asyncio.Task[None]] = set()
        # Why the client cannot answer jobs any more (a background task ended), or None.
        self._stopped: str | None = None

    async def __aenter__(self) -> RolloutClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        self._producer = AIOKafkaProducer(**self._connection, acks="all", linger_ms=5)
        self._consumer = PacedConsumer(
            **self._connection,
            group_id=None,
            enable_auto_commit=False,
            max_partition_fetch_bytes=32 * 1024 * 1024,
            fetch_max_bytes=64 * 1024 * 1024,
        )
        servers = str(self._connection["bootstrap_servers"])
        try:
            await start_clients(
                (self._producer, self._consumer),
                servers,
                f"writing {self._jobs_topic} and reading {self._results_topic}",
            )
        except BrokerError as exc:
            self._consumer = self._producer = None
            raise RolloutError(str(exc)) from None
        partitions = self._consumer.partitions_for_topic(self._results_topic)
        if partitions is None:
            await self._consumer.topics()
            partitions = self._consumer.partitions_for_topic(self._results_topic)
        if not partitions:
            await self.close()
            raise RolloutError(f"results topic {self._results_topic} does not exist")
        tps = [TopicPartition(self._results_topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        # Only answers to jobs of this client, which come after this point.
        await self._consumer.seek_to_end(*tps)
        for tp in tps:
            await self._consumer.position(tp)
        self._tasks = [
            asyncio.create_task(self._read(), name="rollout-client-read"),
            asyncio.create_task(self._sweep(), name="rollout-client-timeouts"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._background_stopped)

    async def close(self) -> None:
        for task in [*self._tasks, *self._sends]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._sends, return_exceptions=True)
        self._tasks = []
        self._fail_pending(RolloutError("the client was closed"))
        for client in (self._consumer, self._producer):
            if client is not None:
                await client.stop()
        self._consumer = self._producer = None

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet answered."""
        return len(self._pending)

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
        job = as_job(job)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        deadline = time.time() + self._timeout_s
        if (holder := self._pending.get(job.job_id)) is not None:
            if holder.job.job_id != job.job_id:
                raise RolloutError(
                    f"job {job.job_id}: a resubmission of job {holder.job.job_id} travels under "
                    "that id until it is answered"
                )
            raise RolloutError(f"job {job.job_id} is already in flight on this client")
        pending = _Pending(job, future, deadline, trace)
        self._pending[job.job_id] = pending
        # An answer to the id's earlier submission was remembered as answered: a worker that
        # echoes no submission answers this one under the same name.
        self._assembler.forget(job.job_id)
        # A caller that stops waiting (a cancelled `generate`, `wait_for` around the future)
        # cancels the future: the job is then forgotten, so `in_flight` drops and its id may be
        # submitted again.
        future.add_done_callback(lambda _: self._forget_if_cancelled(pending))
        self._submitted += 1
        self._track(asyncio.create_task(self._send(job.job_id, pending)))
        return future

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
        OpenTelemetry span's)."""
        checked = []
        for index, job in enumerate(jobs):
            try:
                checked.append(as_job(job))
            except SchemaError as exc:
                raise SchemaError(f"job {index}: {exc.message}", exc.path) from None
        trace = trace_context(traceparent, tracestate)  # checked before any job is sent
        futures = [
            self.submit(job, traceparent=trace.traceparent, tracestate=trace.tracestate)
            for job in checked
        ]
        return list(await asyncio.gather(*futures))

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
        conversation where it was, so the same turn can be run again."""
        job = conversation.next_job(
            new_tokens, sampling=sampling, min_weight_version=min_weight_version, metadata=metadata
        )
        try:
            result = await self.submit(job)
        except BaseException:
            conversation.abandon()
            raise
        conversation.record(result)
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
        command = UpdateWeights(
            command_id=new_command_id(),
            target=target or Target(group=self._group_id),
            version=version,
            path=path,
            on_inflight=mode,
            issued_at=time.time(),
            force=force,
        )
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(deadline - time.monotonic(), 0.0)

        sent = False
        try:
            async with self._fleet() as fleet:
                live = await fleet.live_workers(command.target, timeout_s=left())
                since = await fleet.status_end(timeout_s=left())
                await fleet.send(command, timeout_s=left())
                sent = True
                acks = await fleet.acks(command.command_id, live, since, left())
        except (TimeoutError, BrokerError, KafkaError) as exc:
            raise RolloutError(
                f"update to version {version}: {exc} "
                f"({'sent, acknowledgements not read' if sent else 'not sent'})"
            ) from None
        _check_every_worker_updated(version, live, acks, timeout_s)
        return acks

    async def status(
        self, target: Target | None = None, *, timeout_s: float = 60.0
    ) -> dict[str, WorkerStatus]:
        """The latest heartbeat of every live worker of `target` (default: `group_id`);
        RolloutError when the status topic cannot be read within `timeout_s`."""
        try:
            async with self._fleet() as fleet:
                return await fleet.live_workers(
                    target or Target(group=self._group_id), timeout_s=timeout_s
                )
        except (TimeoutError, BrokerError, KafkaError) as exc:
            raise RolloutError(f"fleet status: {exc}") from None

    @contextlib.asynccontextmanager
    async def _fleet(self) -> AsyncIterator[Fleet]:
        fleet = Fleet(
            self._connection,
            control_topic=self._control_topic,
            status_topic=self._status_topic,
            control_hmac_key=self._control_hmac_key,
        )
        async with fleet:
            yield fleet

    # ---- internals ---------------------------------------------------------------------------

    async def _send(self, wire_id: str, pending: _Pending) -> None:
        assert self._producer is not None  # noqa: S101 - submit checked
        job = pending.job
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
            async with self._send_lock:
                # A session's turns share a key, so they share a partition and its worker.
                delivery = await self._producer.send(
                    self._jobs_topic,
                    value=encode(wire),
                    key=(job.session_id or wire_id).encode(),
                    headers=pending.trace.record_headers(),
                )
            await delivery
        except KafkaError as exc:
            logger.exception("job %s could not be produced", job.job_id)
            if self._pending.pop(wire_id, None) is pending and not pending.future.done():
                pending.future.set_exception(
                    RolloutError(f"job {job.job_id} could not be produced: {exc!r}")
                )

    def _forget_if_cancelled(self, pending: _Pending) -> None:
        if not pending.future.cancelled():
            return
        if self._pending.get(pending.wire_id) is pending:
            del self._pending[pending.wire_id]
            self._discard_parts(pending)

    def _track(self, task: asyncio.Task[None]) -> None:
        """Keep a send task referenced until it ends (the loop holds tasks only weakly)."""
        self._sends.add(task)
        task.add_done_callback(self._send_done)

    def _send_done(self, task: asyncio.Task[None]) -> None:
        self._sends.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # `_send` answers the broker's refusals itself; anything else is a bug, said now.
            logger.error("a job's send failed", exc_info=exc)
            self._fail_pending(RolloutError(f"a send failed: {exc!r}"))

    def _background_stopped(self, task: asyncio.Task[None]) -> None:
        """The reader and the sweeper run until `close`: if one ends, no pending job can be
        answered any more, so every one fails now rather than at its timeout."""
        if task.cancelled():
            return
        exc = task.exception()
        logger.error("the client's %s task stopped", task.get_name(), exc_info=exc)
        self._stopped = f"{task.get_name()} stopped: {exc!r}"
        self._fail_pending(RolloutError(f"the client's {self._stopped}"))

    def _fail_pending(self, error: RolloutError) -> None:
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)
        self._pending.clear()

    async def _read(self) -> None:
        assert self._consumer is not None  # noqa: S101
        while True:
            batch = await self._consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for record in records:
                    try:
                        await self._take(record.value)
                    except Exception:  # The one broad catch: no record may end the reader.
                        logger.exception(
                            "result at %s-%s@%s skipped",
                            record.topic,
                            record.partition,
                            record.offset,
                        )

    async def _take(self, value: bytes | None) -> None:
        try:
            result = decode_result(value or b"")
        except SchemaError as exc:
            logger.warning("undecodable result skipped: %s", exc)
            return
        pending = None if result.job_id is None else self._pending.get(result.job_id)
        if pending is None:
            return  # another client's job, or one answered already: nothing of it is kept
        if not _answers(pending, result):
            # A late answer to an earlier sending of this id: another prompt, or the same one
            # generated for a caller who has since stopped waiting for it.
            logger.info("an answer to an earlier submission of job %s skipped", result.job_id)
            return
        try:
            whole = self._assembler.add(result)
        except SchemaError as exc:  # a part that disagrees with its attempt's other parts
            logger.warning("result part skipped: %s", exc)
            return
        if whole is None or whole.job_id is None:
            return
        if self._pending.get(whole.job_id) is not pending or pending.future.done():
            return
        original = pending.job.job_id
        if (
            isinstance(whole, Failed)
            and whole.error.retryable
            and (pending.retries < self._max_retries)
        ):
            pending.retries += 1
            del self._pending[whole.job_id]
            wire_id = self._retry_id(original, pending.retries)
            logger.info(
                "job %s failed (%s): resubmitting as %s", original, whole.error.code, wire_id
            )
            pending.wire_id = wire_id
            pending.submission = new_submission_id()
            self._pending[wire_id] = pending
            self._assembler.forget(wire_id)
            self._track(asyncio.create_task(self._send(wire_id, pending)))
            return
        del self._pending[whole.job_id]
        # The caller sees its own job: its id and submission, whichever sending was answered.
        answer: Result = msgspec.structs.replace(
            whole,
            job_id=original,
            submission_id=msgspec.UNSET
            if pending.job.submission_id is None
            else pending.job.submission_id,
        )
        if self._resolve and isinstance(answer, Completed) and _has_references(answer):
            try:
                answer = await asyncio.to_thread(_resolved, answer, self._payload_root)
            except SchemaError as exc:  # PayloadError, RoutedExpertsError: the reason
                pending.future.set_exception(RolloutError(f"job {original}: {exc}"))
                self._progress()
                return
        pending.future.set_result(answer)
        self._progress()

    async def _sweep(self) -> None:
        """Answer jobs past their timeout, so no caller waits forever."""
        while True:
            await asyncio.sleep(_SWEEP_S)
            now = time.time()
            for wire_id, pending in list(self._pending.items()):
                if now < pending.deadline or pending.future.done():
                    continue
                del self._pending[wire_id]
                self._discard_parts(pending)
                pending.future.set_result(_expired(pending, self._timeout_s))
                self._progress()

    def _retry_id(self, original: str, retries: int) -> str:
        """The id a job's resubmission travels under: `<id>~retry<n>`, the first such `n` from
        `retries` that no job in flight here holds (a caller may have submitted that very id)."""
        number = retries
        while (wire_id := f"{original}{RETRY_SEPARATOR}{number}") in self._pending:
            number += 1
        return wire_id

    def _discard_parts(self, pending: _Pending) -> None:
        """Drop the parts held for the sending of `pending` that is in flight."""
        self._assembler.discard(pending.wire_id, pending.submission)
        self._assembler.discard(pending.wire_id)

    def _progress(self) -> None:
        self._answered += 1
        if self._on_progress is not None:
            self._on_progress(self._answered, self._submitted)


def _expired(pending: _Pending, timeout_s: float) -> Failed:
    """The answer to a job no worker answered within the client's timeout."""
    detail = (
        f"no result within {timeout_s:.0f}s of submitting "
        f"(client timeout; {pending.retries} resubmissions)"
    )
    return Failed(
        job_id=pending.job.job_id,
        error=ErrorInfo(code=ErrorCode.EXPIRED, detail=detail, retryable=True),
        metadata=pending.job.metadata,
        worker="rollout-client",
    )


def _answers(pending: _Pending, result: Result) -> bool:
    """Whether `result` answers the sending of `pending` in flight: the submission it echoes,
    or, from a worker that echoes none, the prompt and completion count it echoes. A failure
    without one (a worker that could not read the job) cannot be told apart, and is taken."""
    if not isinstance(result.submission_id, msgspec.UnsetType):
        return result.submission_id == pending.submission
    if isinstance(result, Failed):
        return True
    job = pending.job
    if len(result.completions) > job.sampling.n:
        return False
    prompt = job.prompt_token_ids
    if prompt is None:
        return True  # a text prompt: its tokens are the worker's to say
    echoed = result.prompt_token_ids
    return result.prompt_token_count == len(prompt) and (echoed is None or echoed == prompt)


def _check_every_worker_updated(
    version: int, live: Iterable[str], acks: dict[str, CommandAck], timeout_s: float
) -> None:
    """Raise `RolloutError` unless every live worker acknowledged the update `ok`."""
    live = sorted(live)
    if not live:
        raise RolloutError("no live worker of the target to update")
    bad = {w: a for w, a in acks.items() if a.outcome != "ok"}
    missing = sorted(set(live) - set(acks))
    if bad or missing:
        details = [f"{w}: {a.detail}" for w, a in bad.items()] + [
            f"{w}: no answer in {timeout_s:.0f}s" for w in missing
        ]
        raise RolloutError(f"update to version {version} failed: " + "; ".join(details))


def _has_references(result: Completed) -> bool:
    return any(
        c.routed_experts is not None and c.routed_experts.is_reference for c in result.completions
    )


def _resolved(result: Completed, root: Path | None) -> Completed:
    """`result` with every payload reference read from under `root`, checked and inlined
    (blocking: files); PayloadError or RoutedExpertsError for the first that cannot be."""
    completions = []
    for c in result.completions:
        routed = c.routed_experts
        if routed is not None and routed.is_reference:
            if root is None:
                raise PayloadError(
                    f"payload {routed.uri} not read: the client has no payload_root (pass "
                    "RolloutClient(payload_root=...), the store as mounted here)"
                )
            completions.append(msgspec.structs.replace(c, routed_experts=routed.resolved(root)))
        else:
            completions.append(c)
    return msgspec.structs.replace(result, completions=completions)
