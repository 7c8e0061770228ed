"""bench/engine_overhead.py's arithmetic and its CPU accounting: what its figures rest on."""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from worker.dev.harness.clients import produce
from worker.dev.harness.topics import TopicFactory

BENCH = Path(__file__).resolve().parents[2] / "bench" / "engine_overhead.py"


def load_bench() -> ModuleType:
    # bench/ is scripts, not a package: load the file itself.
    spec = importlib.util.spec_from_file_location("engine_overhead_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


bench = load_bench()


@pytest.mark.parametrize(
    ("rate", "seconds", "max_tokens", "batch"),
    [(4000.0, 10.0, 32, 32), (9500.0, 10.0, 32, 32), (120.0, 10.0, 64, 8), (1.0, 0.5, 32, 4)],
)
def test_a_round_lasts_at_least_its_length_at_the_calibrated_rate(
    rate: float, seconds: float, max_tokens: int, batch: int
) -> None:
    jobs = bench.jobs_per_round(rate, seconds, max_tokens, batch)
    assert jobs % batch == 0
    assert jobs * max_tokens / rate >= seconds * bench.ROUND_MARGIN
    # and not a whole batch more than needed
    assert (jobs - batch) * max_tokens / rate < seconds * bench.ROUND_MARGIN or jobs == batch


def test_round_sizing_refuses_a_rate_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="positive"):
        bench.jobs_per_round(0.0, 10.0, 32, 32)


def test_ratios_pair_rounds_and_the_spread_is_median_min_max() -> None:
    ratios = bench.paired_ratios([90.0, 200.0, 50.0], [100.0, 200.0, 40.0])
    assert ratios == pytest.approx([0.9, 1.0, 1.25])
    spread = bench.Spread.of(ratios)
    assert (spread.median, spread.low, spread.high) == pytest.approx((1.0, 0.9, 1.25))
    with pytest.raises(ValueError, match="longer"):
        bench.paired_ratios([1.0], [1.0, 2.0])


def test_resolution_is_the_relative_half_width_of_the_means_95_percent_interval() -> None:
    # Three rounds: mean 1.0, stdev 0.02, t(2) = 4.303 -> 4.303 * 0.02 / sqrt(3).
    assert bench.resolution([0.98, 1.0, 1.02]) == pytest.approx(4.303 * 0.02 / 3**0.5)
    # Beyond the table (df 29): t = 2.045; the approximation gives 2.043.
    thirty = [1.0 + (0.01 if i % 2 else -0.01) for i in range(30)]
    sd = statistics.stdev(thirty)
    assert bench.resolution(thirty) == pytest.approx(2.045 * sd / 30**0.5, rel=0.003)
    # Twice the rounds at the same spread resolve finer; one round resolves nothing.
    assert bench.resolution([0.98, 1.02] * 4) < bench.resolution([0.98, 1.02] * 2)
    assert bench.resolution([1.0]) is None


def test_the_steady_rate_is_read_between_the_ramps_even_from_waves() -> None:
    # 40 waves of 32 jobs, one every 0.25 s (128 jobs/s), but the first wave only after 2 s and
    # the last 3 s after the one before: ramps the whole-round rate counts and this one leaves
    # out. Jobs of one wave finish microseconds apart, as vLLM hands them out.
    finished = [
        2.0 + 0.25 * wave + (3.0 if wave == 39 else 0.0) + 1e-6 * i
        for wave in range(40)
        for i in range(32)
    ]
    assert bench.steady_rate(finished, 10) == pytest.approx(1280.0, rel=0.01)
    assert len(finished) * 10 / max(finished) < 1280 * 0.7  # what the ramps do to the whole
    # Spread evenly, with an outlier at each end.
    even = [0.0, *(1.0 + 0.01 * i for i in range(100)), 60.0]
    assert bench.steady_rate(even, 1) == pytest.approx(100.0, rel=0.01)
    with pytest.raises(ValueError, match="too few"):
        bench.steady_rate([1.0, 1.0, 1.0, 1.0], 32)


def test_cpu_deltas_compare_only_processes_seen_both_times() -> None:
    # A process that started or ended in between has no delta to give.
    assert bench.cpu_delta({1: 1.0, 2: 5.0}, {1: 1.5, 3: 9.0}) == pytest.approx(0.5)


def test_a_front_end_is_charged_its_own_cpu_not_its_childrens() -> None:
    # The bench's premise: vLLM's EngineCore runs in a child process, and the front end's
    # CPU figure must not include it.
    busy = (
        "import sys, time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.5: pass\n"
        "print('spun', flush=True)\n"
        "sys.stdin.read()\n"
    )
    me = psutil.Process()
    before = bench.own_cpu_s(me)
    with subprocess.Popen(
        [sys.executable, "-c", busy], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None and child.stdin is not None
        try:
            assert child.stdout.readline().strip() == "spun"  # blocks until the child has spun
            spent = bench.children_cpu_s(me)
            assert spent[child.pid] >= 0.45
            assert bench.own_cpu_s(me) - before < 0.3
            assert child.pid not in bench.children_cpu_s(me, skip=child.pid)
        finally:
            child.stdin.close()  # the child exits; leaving the block waits for it


@pytest.mark.parametrize(
    ("env", "no_fetch_hold", "expected"),
    [(None, False, True), (None, True, False), ("kafka:9092", False, False)],
)
def test_empty_fetches_are_held_only_on_the_local_broker(
    monkeypatch: pytest.MonkeyPatch, env: str | None, no_fetch_hold: bool, expected: bool
) -> None:
    # A real Kafka holds empty fetches itself; the local broker does not, and the flag opts out.
    if env is None:
        monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    else:
        monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", env)
    args = argparse.Namespace(no_fetch_hold=no_fetch_hold)
    assert bench.holds_fetches(args) is expected


@pytest.mark.parametrize(
    ("threads", "cpus", "expected"),
    [
        # vLLM binds each compute thread to one CPU; its other threads may run anywhere.
        ([{0}, {0, 1}, {0, 1}], {0, 1}, {1}),
        ([{0}, {1}, {0, 1, 2, 3}], {0, 1, 2, 3}, {2, 3}),
        ([{0, 1}, {0, 1}], {0, 1}, set()),  # nothing bound: nothing to keep apart
        ([{0}, {1}], {0, 1}, set()),  # every CPU bound
    ],
)
def test_the_front_ends_get_the_cpus_no_engine_thread_is_bound_to(
    threads: list[set[int]], cpus: set[int], expected: set[int]
) -> None:
    assert bench.cpus_beside_the_engines(threads, cpus) == expected


def test_pinning_moves_every_thread_of_a_process() -> None:
    usable = sorted(os.sched_getaffinity(0))
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, threading; threading.Thread(target=sys.stdin.read).start(); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        process = psutil.Process(child.pid)
        while len(process.threads()) < 2:
            time.sleep(0.01)
        bench.pin(process, {usable[-1]})
        assert bench.thread_cpus(process) == [{usable[-1]}] * len(process.threads())
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)


def test_the_local_broker_is_the_process_listening_on_the_bootstrap_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        found = bench.local_listener(f"127.0.0.1:{port},elsewhere:9092")
        assert found is not None and found.pid == os.getpid()
    assert bench.local_listener(f"kafka.example:{port}") is None  # not on this machine


def test_the_background_nice_reaches_every_thread_and_is_undone_after() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, threading; threading.Thread(target=sys.stdin.read).start(); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
    )

    def nices(process: psutil.Process) -> list[int]:
        return [os.getpriority(os.PRIO_PROCESS, t.id) for t in process.threads()]

    try:
        process = psutil.Process(child.pid)
        while len(process.threads()) < 2:
            time.sleep(0.01)
        if os.geteuid() != 0:
            # Raising nice needs no privilege, lowering it does: the bench refuses to start.
            bench.renice(process, bench.BACKGROUND_NICE)
            assert nices(process) == [bench.BACKGROUND_NICE] * 2
            with pytest.raises(SystemExit, match="--no-nice"):
                bench.check_renice_back()
            return
        bench.check_renice_back()
        with bench.in_background(process, enabled=True):
            assert nices(process) == [bench.BACKGROUND_NICE] * 2
        assert nices(process) == [0, 0]
        with bench.in_background(process, enabled=False):
            assert nices(process) == [0, 0]
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)


async def test_after_a_round_the_topics_records_are_deleted(
    kafka_bootstrap_servers: str, new_topic: TopicFactory
) -> None:
    bs = kafka_bootstrap_servers
    topics = [await new_topic(1), await new_topic(1)]
    for topic in topics:
        await produce(bs, topic, [(None, b"x" * 100, [])] * 50)
    reader = AIOKafkaConsumer(bootstrap_servers=bs, enable_auto_commit=False)
    await reader.start()
    try:
        assert await bench.delete_all_records(bs, reader, topics) is None
        partitions = [TopicPartition(topic, 0) for topic in topics]
        assert await reader.beginning_offsets(partitions) == dict.fromkeys(partitions, 50)
    finally:
        await reader.stop()


def test_engine_steps_are_the_step_histograms_count_summed_over_engines() -> None:
    # vLLM 0.32, vllm/v1/metrics/loggers.py: PrometheusStatLogger.record observes one
    # histogram_iteration_tokens sample per engine step, labelled by engine; StatLoggerManager
    # always adds that logger. The series below are shaped as it exposes them.
    exposition = "\n".join(
        [
            "# HELP vllm:iteration_tokens_total Number of tokens per engine_step.",
            "# TYPE vllm:iteration_tokens_total histogram",
            'vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 1537.0',
            'vllm:iteration_tokens_total_count{engine="0"} 1537.0',
            'vllm:iteration_tokens_total_sum{engine="0"} 98304.0',
            'vllm:iteration_tokens_total_count{engine="1"} 3.0',
            "# TYPE vkw_jobs_total counter",
            'vkw_jobs_total{code="",outcome="completed"} 9.0',
            "",
        ]
    )
    assert bench.engine_steps(exposition) == 1540
    assert bench.engine_steps("# no engine here\n") == 0


def _round(tokens_per_s: float, *, tokens: int = 3200, steps: int = 100) -> Any:
    return bench.Round(
        seconds=tokens / tokens_per_s,
        tokens=tokens,
        front_end_cpu_s=0.1,
        engine_core_cpu_s=1.0,
        steady_tokens_per_s=tokens_per_s,
        beside_cpu_s=0.0,
        engine_steps=steps,
    )


def test_tokens_per_step_is_how_full_the_batch_was() -> None:
    assert _round(4000.0, tokens=3200, steps=100).tokens_per_step == pytest.approx(32.0)
    assert _round(4000.0, tokens=3200, steps=110).tokens_per_step == pytest.approx(29.09, 1e-3)


@pytest.mark.parametrize(
    ("ratios", "sense", "expected"),
    [
        # Mean 0.99, +-1.5 %: the whole interval is above 0.97.
        ([0.98, 0.99, 1.0, 0.98, 0.99, 1.0], ">=", "meets"),
        # Median 1.06, but the interval reaches below 0.97: the run cannot tell.
        ([0.76, 0.95, 1.25, 1.05, 1.12, 1.07], ">=", "not resolved"),
        ([0.90, 0.91, 0.92, 0.90, 0.91, 0.92], ">=", "MISSES"),
        ([1.02, 1.03, 1.04, 1.02, 1.03, 1.04], "<=", "meets"),
        ([1.20, 1.21, 1.22, 1.20, 1.21, 1.22], "<=", "MISSES"),
        ([0.90, 1.30, 1.00, 1.20], "<=", "not resolved"),
        ([1.0], ">=", "not resolved"),
    ],
)
def test_a_goal_is_met_or_missed_only_when_the_whole_interval_says_so(
    ratios: list[float], sense: str, expected: str
) -> None:
    goal = 0.97 if sense == ">=" else 1.10
    assert bench.verdict(ratios, sense, goal) == expected


async def test_rounds_go_on_past_the_least_only_while_a_goal_is_unresolved(capsys) -> None:
    # Raw is steady; the worker swings by 4-5 % for four rounds, then matches raw on every
    # figure: the intervals close on the goals' side only once enough steady rounds are in.
    swings = iter([1.05, 0.95, 1.04, 0.96] + [1.0] * 40)
    order: list[str] = []

    async def run(name: str, jobs: int) -> Any:
        order.append(name)
        if name == "raw":
            return _round(4000.0, steps=100)
        factor = next(swings)
        return bench.Round(
            seconds=1.0,
            tokens=3200,
            front_end_cpu_s=0.1 * factor,
            engine_core_cpu_s=1.0,
            steady_tokens_per_s=4000.0 * factor,
            beside_cpu_s=0.0,
            engine_steps=round(100 / factor),
        )

    def same(jobs: int, rate: float) -> int:
        return jobs

    rounds = await bench.interleaved_rounds(run, 100, same, least=3, most=30, target=0.03)
    done = len(rounds["raw"])
    assert len(rounds["worker"]) == done
    assert 3 < done < 30, done
    assert bench.unresolved_goals(rounds, 0.03) == []
    assert bench.unresolved_goals(rounds, 0.001) != []  # resolved, but not that finely
    assert order[:4] == ["raw", "worker", "worker", "raw"]  # pairs alternate their order
    assert "not resolved to 3% yet" in capsys.readouterr().out
    # Without room to go on, the least is what runs.
    swings = iter([1.05, 0.95, 1.04, 0.96] + [1.0] * 40)
    assert (
        len(
            (await bench.interleaved_rounds(run, 100, same, least=3, most=None, target=0.03))["raw"]
        )
        == 3
    )


async def test_both_rounds_of_a_pair_run_as_many_jobs_and_a_fast_pair_lengthens_the_next() -> None:
    # The machine speeds up from the third round on: rounds sized at the calibrated rate would
    # end short of their length, so the next pair is sized from the faster rate seen.
    seen: list[tuple[str, int]] = []
    rates = iter([4000.0, 4000.0, 6000.0, 5000.0] + [6000.0] * 10)

    async def run(name: str, jobs: int) -> Any:
        seen.append((name, jobs))
        return _round(next(rates), tokens=jobs * 32)

    def resized(jobs: int, fastest: float) -> int:
        fit: int = bench.jobs_per_round(fastest, 10.0, 32, 32)
        return max(jobs, fit)

    first = bench.jobs_per_round(4000.0, 10.0, 32, 32)
    await bench.interleaved_rounds(run, first, resized, least=4, most=None, target=0.03)
    jobs = [j for _, j in seen]
    assert jobs[0] == jobs[1] == jobs[2] == jobs[3] == first
    assert jobs[4] == jobs[5] == bench.jobs_per_round(6000.0, 10.0, 32, 32) > first
    assert jobs[6] == jobs[7] == jobs[4]  # never shorter again
