"""Helpers for the process-level chaos tests: metrics scraping, RSS sampling, spread producing,
and the history checker."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas import Failed, Job, SamplingSpec, decode_result
from tests.kafka_helpers import Record, committed, job_record, wait_for
from tests.workers import stop_all

MiB = 1024 * 1024

_METRICS_LINE = re.compile(rb"metrics on http://[^:/]+:(\d+)/metrics")


async def metrics_port(log: Path, timeout_s: float = 30.0) -> int:
    """The port a worker started with `--metrics-port 0` bound, read from its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if match := _METRICS_LINE.search(await asyncio.to_thread(_read, log)):
            return int(match[1])
        await asyncio.sleep(0.05)
    raise AssertionError(f"no metrics port in {log} after {timeout_s}s")


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


class Scraper:
    """Reads a worker's /metrics as {series: value}; `series` is the name with its labels."""

    def __init__(self, port: int) -> None:
        self._url = f"http://127.0.0.1:{port}/metrics"
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Scraper:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._http is not None
        await self._http.close()

    async def sample(self) -> dict[str, float]:
        assert self._http is not None
        async with self._http.get(self._url) as response:
            text = await response.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                out[series] = float(value)
        return out

    async def value(self, series: str) -> float | None:
        return (await self.sample()).get(series)


class InBackground:
    """An async context that runs one task while it is open and cancels it on exit."""

    _task: asyncio.Task[None] | None = None

    def _run_in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.create_task(coroutine)

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class RssSampler(InBackground):
    """Samples a process's RSS in the background, each sample tagged with `progress()`."""

    def __init__(self, pid: int, progress: Callable[[], int], interval_s: float = 0.1) -> None:
        self._process = psutil.Process(pid)
        self._progress = progress
        self._interval_s = interval_s
        self.samples: list[tuple[int, int]] = []  # (progress, rss bytes)

    async def __aenter__(self) -> RssSampler:
        self._run_in_background(self._run())
        return self

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(psutil.Error):
                self.samples.append((self._progress(), self._process.memory_info().rss))
            await asyncio.sleep(self._interval_s)

    @property
    def peak(self) -> int:
        return max((rss for _, rss in self.samples), default=0)

    def peaks_by_quarter(self, total: int) -> list[int]:
        """Peak RSS while progress was in each quarter of `total` (0 for an unsampled quarter)."""
        peaks = [0, 0, 0, 0]
        for progress, rss in self.samples:
            quarter = min(progress * 4 // max(total, 1), 3)
            peaks[quarter] = max(peaks[quarter], rss)
        return peaks


async def produce_spread(
    bootstrap: str, topic: str, records: Iterable[Record], partitions: int
) -> None:
    """Produce record i to partition i % partitions: an exactly even load, whatever the keys."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        futures = [
            await producer.send(
                topic, value=value, key=key, headers=headers, partition=i % partitions
            )
            for i, (key, value, headers) in enumerate(records)
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def mib(n: int) -> str:
    return f"{n / MiB:.0f}MiB"


@dataclass
class History:
    """What a chaos test did and saw, checked in the manner of Jepsen's Kafka workload.

    `produced` are the job ids written to the jobs topic, `answers` every job id read back from
    the results topic (in order, repeats kept), `dead_lettered` the job ids copied to the
    dead-letter topic, `kills` the worker processes the test killed. A job is lost when it has
    neither a result nor a dead-letter copy; every answer beyond a job's first is a duplicate.
    """

    produced: set[str] = field(default_factory=set)
    answers: list[str] = field(default_factory=list)
    dead_lettered: set[str] = field(default_factory=set)
    kills: int = 0

    @property
    def lost(self) -> set[str]:
        return self.produced - set(self.answers) - self.dead_lettered

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in Counter(self.answers).values())

    def check(self) -> int:
        """Assert nothing was lost; return the duplicates."""
        assert not self.lost, f"{len(self.lost)} jobs lost, e.g. {sorted(self.lost)[:5]}"
        return self.duplicates


# ---- chaos at scale: workers killed at random over many partitions ---------------------------


@dataclass
class ChaosPlan:
    """What `Chaos` does: `jobs` jobs spread over `partitions`, served by `workers` processes
    (static members, each restarted under its own instance id), of which `kills` are SIGKILLed
    at random and `term_kills` SIGTERMed and SIGKILLed `term_kill_after_s` later if still
    running; `crash_jobs` jobs hold the mock engine's crash token and kill whoever runs them.
    Every `long_every`-th job runs long, so stops cut some jobs short."""

    jobs: int = 5000
    partitions: int = 8
    workers: int = 2
    kills: int = 50
    term_kills: int = 10
    term_kill_after_s: float = 2.0
    crash_jobs: int = 3
    crash_token: int = 99_999
    max_in_flight: int = 16
    per_token_ms: int = 10
    long_every: int = 100
    long_tokens: int = 300
    seed: int = 0
    timeout_s: float = 900.0
    #: Jobs are produced in 20 even parts over this many seconds (0: all at once), so that the
    #: kills, planned at shares of the jobs answered, land over the whole run and under load:
    #: a worker restarts in seconds, and a run whose jobs were all there at the start is over
    #: before most of its kills.
    produce_over_s: float = 0.0


@dataclass
class ChaosFigures:
    """What a chaos run saw."""

    jobs: int
    lost: int
    dead_lettered: set[str]
    crash_jobs: set[str]
    failed_innocent: set[str]
    duplicates: int
    in_flight_at_kills: int
    kills: int
    term_kills: int
    crash_deaths: int
    committed: dict[int, int | None]
    ends: dict[int, int]
    seconds: float
    #: Kills that landed before 90 % of the jobs were answered (under load).
    kills_under_load: int = 0

    def line(self) -> str:
        return (
            f"chaos: jobs={self.jobs} lost={self.lost} dead_lettered={len(self.dead_lettered)} "
            f"(crash-token {len(self.dead_lettered & self.crash_jobs)} of "
            f"{len(self.crash_jobs)}, others {len(self.dead_lettered - self.crash_jobs)}) "
            f"failed_innocent={len(self.failed_innocent)} duplicates={self.duplicates} "
            f"in_flight_at_kills={self.in_flight_at_kills} sigkills={self.kills} "
            f"sigterm_then_sigkill={self.term_kills} crash_deaths={self.crash_deaths} "
            f"kills_before_90%_answered={self.kills_under_load} "
            f"committed_at_end={self.committed == self.ends} committed={self.committed} "
            f"seconds={self.seconds:.1f}"
        )


class AnswersSeen(InBackground):
    """Every result and dead-letter copy, read from the beginning in the background."""

    def __init__(self, bootstrap: str, results: str, dlq: str) -> None:
        self._bootstrap = bootstrap
        self._results, self._dlq = results, dlq
        self.answers: list[tuple[str, bool]] = []  # (job_id, failed)
        self.times: list[float] = []  # when each answer was read (time.monotonic())
        self.dead_lettered: set[str] = set()

    async def __aenter__(self) -> AnswersSeen:
        consumer = AIOKafkaConsumer(
            self._results,
            self._dlq,
            bootstrap_servers=self._bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_bytes=64 * MiB,
            max_partition_fetch_bytes=32 * MiB,
        )
        await consumer.start()
        self._run_in_background(self._run(consumer))
        return self

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while True:
                for tp, batch in (await consumer.getmany(timeout_ms=100)).items():
                    for record in batch:
                        if tp.topic == self._dlq:
                            self.dead_lettered.add((record.key or b"").decode())
                        else:
                            result = decode_result(record.value or b"")
                            self.answers.append((result.job_id or "", isinstance(result, Failed)))
                            self.times.append(time.monotonic())
        finally:
            await consumer.stop()

    def answered(self) -> set[str]:
        return {job_id for job_id, _ in self.answers}


class Chaos:
    """Runs a `ChaosPlan` on a broker: `spawn(topics, **flags)` starts `python -m worker serve`
    (a `tests.workers.WorkerProcess`).

    Kills land at random moments spread over the run (once a random share of the jobs is
    answered), on a worker that serves normally: one that is running the suspects of an
    earlier death one at a time is spared, as a death then blames the suspect that runs (which
    the breaker cannot tell from the suspect killing the process; see the README).
    """

    def __init__(
        self,
        bootstrap: str,
        topics: Any,
        spawn: Callable[..., Any],
        plan: ChaosPlan,
        log: Callable[[str], None] = print,
    ) -> None:
        self._bootstrap = bootstrap
        self._topics = topics
        self._spawn = spawn
        self.plan = plan
        self._log = log
        self._rng = random.Random(plan.seed)
        self._workers: list[Any] = []
        self._ports: list[int | None] = []
        self._ours: set[int] = set()  # slots whose current exit the harness caused
        self.crash_deaths = 0
        self.in_flight_at_kills = 0
        self.kills = self.term_kills = 0
        #: Jobs answered at each kill: how the kills spread over the run.
        self.answered_at_kills: list[int] = []
        self._sampled = ""  # what the victim's metrics said when it was chosen

    def _jobs(self) -> list[Job]:
        plan, prefix = self.plan, uuid.uuid4().hex[:6]
        jobs = [
            Job(
                job_id=f"{prefix}-{i}",
                prompt="hello",
                sampling=SamplingSpec(
                    max_tokens=plan.long_tokens if i % plan.long_every == 7 else 2 + i % 5
                ),
            )
            for i in range(plan.jobs - plan.crash_jobs)
        ]
        for k in range(plan.crash_jobs):
            killer = Job(job_id=f"{prefix}-killer-{k}", prompt_token_ids=[1, plan.crash_token, 2])
            jobs.insert(self._rng.randrange(len(jobs) // 10, len(jobs)), killer)
        return jobs

    def _start(self, slot: int) -> None:
        plan = self.plan
        worker = self._spawn(
            self._topics,
            group_instance_id=f"{self._topics.instance}-{slot}",
            max_in_flight=plan.max_in_flight,
            mock_per_token_latency_ms=plan.per_token_ms,
            mock_crash_token_id=plan.crash_token,
            max_crash_attempts=3,
            metrics_port=0,
            metrics_host="127.0.0.1",
            revoke_grace_s=2,
        )
        if slot < len(self._workers):
            self._workers[slot], self._ports[slot] = worker, None
        else:
            self._workers.append(worker)
            self._ports.append(None)

    async def _sample(self, slot: int) -> tuple[Any, dict[str, float]] | None:
        """The worker now in `slot` and its metrics, read from the port in its own log. The
        port is kept per process, not per slot: a slot restarted while its port was being read
        would otherwise be sampled at a dead process's port, which another process may have
        bound since."""
        worker = self._workers[slot]
        port = self._ports[slot]
        if port is None:
            try:
                port = await metrics_port(worker.log, timeout_s=0.5)
            except AssertionError:
                return None
            if self._workers[slot] is not worker:
                return None  # restarted meanwhile: sample the new one next time
            self._ports[slot] = port
        try:
            async with Scraper(port) as scraper:
                metrics = await scraper.sample()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        if self._workers[slot] is not worker or worker.proc.poll() is not None:
            return None  # what answered may not have been this process
        return worker, metrics

    async def _supervise(self) -> None:
        """Restart every worker that exits; count those that died by themselves."""
        while True:
            for slot, worker in enumerate(self._workers):
                if worker.proc.poll() is not None:
                    if slot not in self._ours:
                        self.crash_deaths += 1
                        self._log(f"  worker {slot} died by itself (rc {worker.proc.returncode})")
                    self._ours.discard(slot)
                    worker.stop_now()
                    self._start(slot)
            await asyncio.sleep(0.05)

    async def _victim(self) -> int:
        """A worker serving normally: holding partitions, no suspects (near the end it may be
        idle). What it has started and not committed (what the kill may repeat) is counted."""
        while True:
            slots = list(range(self.plan.workers))
            self._rng.shuffle(slots)
            for slot in slots:
                sampled = await self._sample(slot)
                if sampled is None:
                    continue
                worker, metrics = sampled
                if (
                    metrics.get("vkw_assigned_partitions", 0) > 0
                    and metrics.get("vkw_crash_suspects", 1) == 0
                    and self._workers[slot] is worker
                ):
                    self.in_flight_at_kills += int(metrics.get("vkw_jobs_uncommitted", 0))
                    self._sampled = (
                        f"pid {worker.proc.pid}, "
                        f"{metrics.get('vkw_assigned_partitions')} partitions, "
                        f"{metrics.get('vkw_crash_suspects')} suspects"
                    )
                    return slot
            await asyncio.sleep(0.1)

    async def _kill(self, kind: str, seen: AnswersSeen) -> None:
        slot = await self._victim()
        worker = self._workers[slot]
        self._ours.add(slot)
        if kind == "kill":
            self.kills += 1
            worker.signal(signal.SIGKILL)
        else:
            self.term_kills += 1
            worker.signal(signal.SIGTERM)
            with contextlib.suppress(AssertionError):
                await worker.wait(self.plan.term_kill_after_s)
            if worker.proc.poll() is None:
                worker.signal(signal.SIGKILL)
        self.answered_at_kills.append(len(seen.answered()))
        self._log(
            f"  {time.strftime('%H:%M:%S')} {kind} {self.kills + self.term_kills} of worker "
            f"{slot} ({self._sampled}) at {len(seen.answered())} answered"
        )
        await wait_for(lambda: worker.proc.poll() is not None, 30, "the kill")

    async def run(self) -> ChaosFigures:
        """Produce, serve under the kills, and return what happened once every job is answered
        and every partition committed to its end."""
        plan, bs, topics = self.plan, self._bootstrap, self._topics
        t0 = time.monotonic()
        jobs = self._jobs()
        job_ids = {j.job_id for j in jobs}
        crash_ids = {j.job_id for j in jobs if "-killer-" in j.job_id}
        ends = {p: len(range(p, plan.jobs, plan.partitions)) for p in range(plan.partitions)}
        producing = asyncio.create_task(self._produce(jobs))
        if not plan.produce_over_s:
            await producing
        kinds = ["kill"] * plan.kills + ["term"] * plan.term_kills
        self._rng.shuffle(kinds)
        low, high = plan.jobs // 20, plan.jobs * 9 // 10
        thresholds = sorted(self._rng.randrange(low, high) for _ in kinds)
        async with AnswersSeen(bs, topics.results, topics.dlq) as seen:
            for slot in range(plan.workers):
                self._start(slot)
            supervisor = asyncio.create_task(self._supervise())
            try:
                for kind, threshold in zip(kinds, thresholds, strict=True):
                    await wait_for(
                        lambda t=threshold: len(seen.answered()) >= t,
                        plan.timeout_s,
                        f"{threshold} jobs answered",
                    )
                    await self._kill(kind, seen)
                await wait_for(
                    lambda: seen.answered() >= job_ids,
                    plan.timeout_s,
                    lambda: f"every job answered ({len(job_ids - seen.answered())} to go)",
                )

                async def at_end() -> bool:
                    return await committed(bs, topics.group, topics.jobs) == ends

                await wait_for(at_end, 60, "every partition committed to its end")
            finally:
                supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await supervisor
                await producing
                await self._stop_all()
            final = await committed(bs, topics.group, topics.jobs)
            await wait_for(lambda: seen.dead_lettered >= crash_ids, 30, "the dead-letter copies")
            history = History(
                produced=job_ids,
                answers=[j for j, _ in seen.answers],
                dead_lettered=set(seen.dead_lettered),
            )
            failed = {j for j, is_failed in seen.answers if is_failed}
        return ChaosFigures(
            jobs=len(jobs),
            lost=len(history.lost),
            dead_lettered=set(seen.dead_lettered),
            crash_jobs=crash_ids,
            failed_innocent=failed - crash_ids,
            duplicates=history.duplicates,
            in_flight_at_kills=self.in_flight_at_kills,
            kills=self.kills,
            term_kills=self.term_kills,
            crash_deaths=self.crash_deaths,
            committed=final,
            ends=ends,
            seconds=time.monotonic() - t0,
            kills_under_load=sum(a < plan.jobs * 9 // 10 for a in self.answered_at_kills),
        )

    async def _produce(self, jobs: list[Job]) -> None:
        """Produce the jobs, job i to partition i % partitions: all at once, or in 20 even
        parts over `produce_over_s` (each part a multiple of the partitions, so the mapping
        holds across parts)."""
        plan, records = self.plan, [job_record(j) for j in jobs]
        if not plan.produce_over_s:
            await produce_spread(self._bootstrap, self._topics.jobs, records, plan.partitions)
            return
        part = max(plan.partitions, len(records) // 20 // plan.partitions * plan.partitions)
        pause_s = plan.produce_over_s / max(len(records) // part, 1)
        for start in range(0, len(records), part):
            if start:
                await asyncio.sleep(pause_s)
            chunk = records[start : start + part]
            await produce_spread(self._bootstrap, self._topics.jobs, chunk, plan.partitions)

    async def _stop_all(self) -> None:
        await stop_all(self._workers, 30)
