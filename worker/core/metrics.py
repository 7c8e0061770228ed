"""Prometheus metrics and the /metrics, /healthz and /readyz endpoints."""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from schemas import ErrorCode

__all__ = ["LoopCounter", "LoopHistogram", "Metrics", "MetricsServer"]

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class LoopCounter:
    """A counter updated only from the event loop's thread, so it needs no lock.

    prometheus_client takes a threading lock on every increment; at a few thousand jobs a
    second, with a handful of updates per job, that lock is a visible share of the CPU.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        zeroed: Sequence[tuple[str, ...]] = (),
    ) -> None:
        """`zeroed`: label values whose series read 0 from the start (see `Metrics`)."""
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        # An unlabelled counter reads 0 from the start, as prometheus_client's does.
        self.values: dict[tuple[str, ...], float] = {} if self.labelnames else {(): 0.0}
        for labels in zeroed:
            self.inc(0.0, labels)

    def inc(self, amount: float = 1.0, labels: tuple[str, ...] = ()) -> None:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels}")
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        # Scraped from the server's thread while the loop updates: copy first (one C call).
        for labels, value in sorted(list(self.values.items())):
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
        cumulative = list(itertools.accumulate(list(self.counts)))
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

    The labelled counters that alert rules watch for an increase read 0 from the start for the
    label values they watch: a labelled series otherwise appears with its first increment, and
    Prometheus counts no increase into a series' first sample, so a process's first crash-looped
    job or failed weight update would raise no alert.
    """

    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry or prom.CollectorRegistry()
        r = self.registry
        self.jobs = LoopCounter(
            "vkw_jobs",
            "Jobs answered, by outcome (completed, failed, dead_lettered)",
            ["outcome", "code"],
            zeroed=[("completed", ""), *(("dead_lettered", code.value) for code in ErrorCode)],
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
        self.result_parts = LoopCounter(
            "vkw_result_parts", "Records of results split by completion (results too large for one)"
        )
        self.payload_bytes = LoopCounter(
            "vkw_payload_bytes", "Routed-expert bytes written to the payload store"
        )
        self.prompt_tokens = LoopCounter(
            "vkw_prompt_tokens",
            "Prompt tokens of completed jobs, by source: cached (KV from the prefix cache) or "
            "computed (prefilled)",
            ["source"],
        )
        self.skipped = LoopCounter(
            "vkw_records_skipped",
            "Records not run again: answered before a crash or rebalance (the offset map)",
        )
        self.trace_headers_dropped = LoopCounter(
            "vkw_trace_headers_dropped",
            "Trace headers of job records not passed on (the job runs without them), by header "
            "and reason (malformed, too_long, repeated, orphaned)",
            ["header", "reason"],
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
                    self.result_parts,
                    self.payload_bytes,
                    self.prompt_tokens,
                    self.skipped,
                    self.trace_headers_dropped,
                ]
            )
        )
        self.in_flight = prom.Gauge(
            "vkw_jobs_in_flight",
            "Jobs running now, or answered and not yet handed to the producer",
            registry=r,
        )
        self.uncommitted = prom.Gauge(
            "vkw_jobs_uncommitted",
            "Records started and not yet below the committed position: what a death now may "
            "have run again",
            registry=r,
        )
        self.crash_suspects = prom.Gauge(
            "vkw_crash_suspects",
            "Records in flight at an earlier process death still to run or be answered, and "
            "those running alone or together until a commit past each lands (the crash-loop "
            "breaker): "
            "above 0 a death blames them, so a supervisor that can choose spares this worker",
            registry=r,
        )
        self.consumer_lag = prom.Gauge(
            "vkw_consumer_lag",
            "Records behind the partition's end, from the committed position",
            ["topic", "partition"],
            registry=r,
        )
        self.commits = prom.Counter(
            "vkw_commits",
            "Offset commits, by result (ok; retry: timed out or refused by the broker, made "
            "again; failed: refused by a rebalance)",
            ["result"],
            registry=r,
        )
        for result in ("ok", "retry", "failed"):
            self.commits.labels(result)
        self.offset_map_degraded = prom.Counter(
            "vkw_offset_map_degraded",
            "Commits whose offset map left a section out to fit --offset-map-max-bytes, by "
            "section (answered: plain at-least-once for those records)",
            ["dropped"],
            registry=r,
        )
        for section in ("answered", "running", "deaths"):
            self.offset_map_degraded.labels(section)
        self.assigned_partitions = prom.Gauge(
            "vkw_assigned_partitions", "Partitions held", registry=r
        )
        self.weight_version = prom.Gauge(
            "vkw_weight_version", "Version of the weights being served", registry=r
        )
        self.paused = prom.Gauge(
            "vkw_paused", "1 while the control plane has paused the worker", registry=r
        )
        self.needs_weights = prom.Gauge(
            "vkw_needs_weights",
            "1 while the worker holds its jobs for want of weights it may serve (an update "
            "failed and the weights before it could not be put back, or the latest update "
            "at start cannot be repeated)",
            registry=r,
        )
        self.commands = prom.Counter(
            "vkw_commands",
            "Control commands applied, by kind and outcome",
            ["kind", "outcome"],
            registry=r,
        )
        self.commands.labels("update_weights", "failed")
        self.control_records_dropped = prom.Counter(
            "vkw_control_records_dropped",
            "Control records dropped unanswered, by reason (unreadable; unsigned under a key)",
            ["reason"],
            registry=r,
        )
        self.weight_update_time = prom.Histogram(
            "vkw_weight_update_seconds",
            "Time from a weight update's start to the new weights serving",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    # One call per job and stage from the hot path, where a call costs a measurable share.

    def job_generated(
        self, queue_wait_s: float, engine_s: float, tokens: int, routed_experts_bytes: int
    ) -> None:
        """A job's engine call finished with a result that is sent (a job the engine failed
        observes `queue_wait` alone)."""
        self.queue_wait.observe(queue_wait_s)
        self.engine_time.observe(engine_s)
        self.generated_tokens.inc(tokens)
        self.routed_experts_bytes.inc(routed_experts_bytes)

    def prompt_prefilled(self, prompt_tokens: int, cached: int) -> None:
        """A completed job's prompt: `cached` of its `prompt_tokens` came from the prefix cache."""
        cached = min(cached, prompt_tokens)
        self.prompt_tokens.inc(cached, ("cached",))
        self.prompt_tokens.inc(prompt_tokens - cached, ("computed",))

    def job_answered(self, labels: tuple[tuple[str, str], ...], publish_s: float) -> None:
        """A job's answer was acknowledged; `labels` are its `vkw_jobs_total` labels."""
        for label in labels:
            self.jobs.inc(labels=label)
        self.publish_time.observe(publish_s)


class MetricsServer:
    """Serves /metrics, /healthz (the process answers) and /readyz (engine up, partitions held)
    from a thread of its own.

    A thread, not the event loop: vLLM builds its engine synchronously (minutes for a large
    model), and a liveness probe that goes unanswered meanwhile has the pod killed in a loop.
    Started before the engine, it answers from the first moment; `is_ready` may be set later.
    """

    def __init__(
        self,
        metrics: Metrics,
        host: str,
        port: int,
        is_ready: Callable[[], bool] = lambda: False,
        *,
        also: Sequence[prom.CollectorRegistry] = (),
    ) -> None:
        """`also`: more registries served on /metrics after the worker's own, such as the
        process's default registry, where vLLM's stat logger keeps its `vllm:*` metrics."""
        self._metrics = metrics
        self._also = tuple(also)
        self.is_ready = is_ready
        self._host = host
        self._port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.bound_port: int | None = None

    def start(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, content_type, body = server.respond(self.path)
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # no access log

        self._server = ThreadingHTTPServer((self._host, self._port), Handler)
        self._server.daemon_threads = True
        self.bound_port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-server", daemon=True
        )
        self._thread.start()
        logger.info("metrics on http://%s:%s/metrics", self._host, self.bound_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def respond(self, path: str) -> tuple[int, str, bytes]:
        """Status, content type and body for a GET of `path`."""
        path = path.split("?", 1)[0]
        if path == "/metrics":
            body = b"".join(prom.generate_latest(r) for r in (self._metrics.registry, *self._also))
            return 200, prom.CONTENT_TYPE_LATEST, body
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            if self.is_ready():
                return 200, "text/plain", b"ready\n"
            return 503, "text/plain", b"not ready\n"
        return 404, "text/plain", b"not found\n"
