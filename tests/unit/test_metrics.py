"""The loop-local metrics expose exactly what prometheus_client's own would."""

from __future__ import annotations

import urllib.request

import prometheus_client as prom
import pytest
from prometheus_client.parser import text_string_to_metric_families

from worker.core.metrics import LoopCounter, LoopHistogram, Metrics, MetricsServer

BUCKETS = (0.01, 0.1, 1.0, 10.0)
# On a bound, between bounds, below the first, above the last, and zero.
VALUES = (0.01, 0.05, 0.1, 0.5, 1.0, 0.0, 0.001, 42.0, 10.0)


def samples(
    registry: prom.CollectorRegistry,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = prom.generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_a_loop_histogram_exposes_what_prometheus_clients_histogram_does() -> None:
    ours, theirs = prom.CollectorRegistry(), prom.CollectorRegistry()
    histogram = LoopHistogram("latency_seconds", "help", BUCKETS)
    reference = prom.Histogram("latency_seconds", "help", buckets=BUCKETS, registry=theirs)
    ours.register(_Single(histogram))

    for value in VALUES:
        histogram.observe(value)
        reference.observe(value)

    assert samples(ours) == samples(theirs)
    assert sum(histogram.counts) == len(VALUES)


def test_a_loop_counter_exposes_what_prometheus_clients_counter_does() -> None:
    ours, theirs = prom.CollectorRegistry(), prom.CollectorRegistry()
    counter = LoopCounter("jobs", "help", ["outcome", "code"])
    reference = prom.Counter("jobs", "help", ["outcome", "code"], registry=theirs)
    ours.register(_Single(counter))

    for labels, amount in [
        (("completed", ""), 1),
        (("failed", "expired"), 2),
        (("completed", ""), 3),
    ]:
        counter.inc(amount, labels=labels)
        reference.labels(*labels).inc(amount)

    assert samples(ours) == samples(theirs)
    assert counter.values[("completed", "")] == 4


def test_a_counter_refuses_the_wrong_labels() -> None:
    counter = LoopCounter("jobs", "help", ["outcome", "code"])

    with pytest.raises(ValueError, match=r"takes labels \('outcome', 'code'\)"):
        counter.inc(labels=("completed",))


def test_the_worker_registry_serves_every_metric() -> None:
    metrics = Metrics()
    metrics.jobs.inc(labels=("completed", ""))
    metrics.queue_wait.observe(0.2)

    names = {name for name, _ in samples(metrics.registry)}

    assert {
        "vkw_jobs_total",
        "vkw_queue_wait_seconds_bucket",
        "vkw_engine_seconds_count",
        "vkw_publish_seconds_sum",
        "vkw_generated_tokens_total",
        "vkw_routed_experts_bytes_total",
        "vkw_jobs_in_flight",
        "vkw_assigned_partitions",
    } <= names


class _Single(prom.registry.Collector):
    def __init__(self, metric: LoopCounter | LoopHistogram) -> None:
        self._metric = metric

    def collect(self) -> list[prom.Metric]:
        return [self._metric.family()]


def test_the_server_serves_more_registries_after_the_workers_own() -> None:
    """vLLM keeps its metrics in the process's default registry; the worker's endpoint serves
    them beside its own, as one exposition that parses into distinct families."""
    engine_registry = prom.CollectorRegistry()
    steps = prom.Histogram(
        "vllm:iteration_tokens_total", "tokens per step", buckets=(1, 32), registry=engine_registry
    )
    steps.observe(32)
    metrics = Metrics()
    metrics.jobs.inc(labels=("completed", ""))
    server = MetricsServer(metrics, "127.0.0.1", 0, also=(engine_registry,))
    server.start()
    try:
        url = f"http://127.0.0.1:{server.bound_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    finally:
        server.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vkw_jobs"].samples[0].value == 1.0
    count = {s.name: s.value for s in families["vllm:iteration_tokens_total"].samples}
    assert count["vllm:iteration_tokens_total_count"] == 1.0
    assert count["vllm:iteration_tokens_total_sum"] == 32.0
