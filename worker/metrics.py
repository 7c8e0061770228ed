"""Prometheus metrics and the /metrics, /healthz and /readyz endpoints."""

from __future__ import annotations

import logging
from collections.abc import Callable

import prometheus_client as prom
from aiohttp import web

__all__ = ["Metrics", "MetricsServer"]

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The worker's metrics, in a registry of their own so tests and several workers don't clash."""

    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry or prom.CollectorRegistry()
        r = self.registry
        self.jobs = prom.Counter(
            "vkw_jobs",
            "Jobs answered, by outcome (completed, failed, dead_lettered)",
            ["outcome", "code"],
            registry=r,
        )
        # Resolved once: labels() costs a locked dict lookup, and this one is taken per job.
        self.jobs_completed = self.jobs.labels("completed", "")
        self.in_flight = prom.Gauge("vkw_jobs_in_flight", "Jobs running now", registry=r)
        self.queue_wait = prom.Histogram(
            "vkw_queue_wait_seconds",
            "Time from produce to start",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_time = prom.Histogram(
            "vkw_engine_seconds", "Time in the engine per job", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.publish_time = prom.Histogram(
            "vkw_publish_seconds",
            "Time until the broker acknowledged the answer",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generated_tokens = prom.Counter("vkw_generated_tokens", "Tokens generated", registry=r)
        self.routed_experts_bytes = prom.Counter(
            "vkw_routed_experts_bytes", "Raw bytes of routed-expert arrays published", registry=r
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
