"""Prometheus metrics and the /metrics, /healthz and /readyz endpoints."""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence

import prometheus_client as prom
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["LoopCounter", "LoopHistogram", "Metrics", "MetricsServer"]

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class LoopCounter:
    """A counter updated only from the event loop's thread, so it needs no lock.

    prometheus_client takes a threading lock on every increment; at a few thousand jobs a
    second, with a handful of updates per job, that was 9% of the worker's CPU.
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        # An unlabelled counter reads 0 from the start, as prometheus_client's does.
        self.values: dict[tuple[str, ...], float] = {} if self.labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, labels: tuple[str, ...] = ()) -> None:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels}")
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in sorted(self.values.items()):
            family.add_metric(list(labels), value)
        return family


class LoopHistogram:
    """A histogram updated only from the event loop's thread (see LoopCounter)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Bucket `le=b` counts values <= b: the first bound not below the value.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        cumulative = list(itertools.accumulate(self.counts))
        bounds = [*map(floatToGoString, self.bounds), "+Inf"]
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], list(zip(bounds, cumulative, strict=True)), self.sum)
        return family


class _LoopMetrics(Collector):
    def __init__(self, metrics: Sequence[LoopCounter | LoopHistogram]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield metric.family()


class Metrics:
    """The worker's metrics, in a registry of their own so tests and several workers don't clash.

    Those updated per job are loop-local (no lock); the rest are prometheus_client's.
    """

    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry or prom.CollectorRegistry()
        r = self.registry
        self.jobs = LoopCounter(
            "vkw_jobs",
            "Jobs answered, by outcome (completed, failed, dead_lettered)",
            ["outcome", "code"],
        )
        self.queue_wait = LoopHistogram(
            "vkw_queue_wait_seconds", "Time from produce to start", _LATENCY_BUCKETS
        )
        self.engine_time = LoopHistogram(
            "vkw_engine_seconds", "Time in the engine per job", _LATENCY_BUCKETS
        )
        self.publish_time = LoopHistogram(
            "vkw_publish_seconds",
            "Time until the broker acknowledged the answer",
            _LATENCY_BUCKETS,
        )
        self.generated_tokens = LoopCounter("vkw_generated_tokens", "Tokens generated")
        self.routed_experts_bytes = LoopCounter(
            "vkw_routed_experts_bytes", "Raw bytes of routed-expert arrays published"
        )
        r.register(
            _LoopMetrics(
                [
                    self.jobs,
                    self.queue_wait,
                    self.engine_time,
                    self.publish_time,
                    self.generated_tokens,
                    self.routed_experts_bytes,
                ]
            )
        )
        self.in_flight = prom.Gauge(
            "vkw_jobs_in_flight",
            "Jobs running now, or answered and not yet handed to the producer",
            registry=r,
        )
        self.consumer_lag = prom.Gauge(
            "vkw_consumer_lag",
            "Records behind the partition's end, from the committed position",
            ["topic", "partition"],
            registry=r,
        )
        self.commits = prom.Counter(
            "vkw_commits", "Offset commits, by result", ["result"], registry=r
        )
        self.assigned_partitions = prom.Gauge(
            "vkw_assigned_partitions", "Partitions held", registry=r
        )


class MetricsServer:
    """Serves /metrics, /healthz (the event loop answers) and /readyz (engine up, partitions held)."""

    def __init__(
        self, metrics: Metrics, is_ready: Callable[[], bool], host: str, port: int
    ) -> None:
        self._metrics = metrics
        self._is_ready = is_ready
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.bound_port: int | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._serve_metrics)
        app.router.add_get("/healthz", self._serve_health)
        app.router.add_get("/readyz", self._serve_ready)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        server = site._server  # aiohttp exposes the bound port only through the asyncio server
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self._port
        logger.info("metrics on http://%s:%s/metrics", self._host, self.bound_port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _serve_metrics(self, _: web.Request) -> web.Response:
        body = prom.generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": prom.CONTENT_TYPE_LATEST})

    async def _serve_health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _serve_ready(self, _: web.Request) -> web.Response:
        if self._is_ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")
