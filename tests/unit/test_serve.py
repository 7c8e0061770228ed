"""`serve` as a process entry: health endpoints from the first moment, one-line errors."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from worker.cli import main as cli
from worker.core.config import Settings, settings_from
from worker.core.errors import EngineDeadError
from worker.core.limits import RecordLimits
from worker.dev.broker import free_port
from worker.engines.mock import MockEngine

#: Probes the health server must answer while the model loads; the load gives up after
#: `_LOAD_LIMIT_S`, so a server that does not answer then fails the test instead of hanging it.
_ANSWERS_WANTED = 10
_LOAD_LIMIT_S = 60.0


class SlowLoadingEngine(MockEngine):
    """Builds its model synchronously, as vLLM's AsyncLLM does, blocking the event loop, until
    `loaded` is set (or the limit passes)."""

    def __init__(self, loaded: threading.Event) -> None:
        super().__init__()
        self._loaded = loaded

    async def start(self) -> None:
        self._loaded.wait(_LOAD_LIMIT_S)  # the point: the loop is blocked meanwhile
        raise EngineDeadError("the model did not load (on purpose)")


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:  # noqa: S310 - our own server
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0  # no answer


async def test_healthz_answers_and_readyz_refuses_while_the_model_loads(monkeypatch):
    port = free_port()
    settings = settings_from(
        {"engine": "mock", "metrics_port": str(port), "metrics_host": "127.0.0.1"}, {}
    )
    loaded = threading.Event()
    monkeypatch.setattr("worker.build.build_engine", lambda *_: SlowLoadingEngine(loaded))

    async def no_broker(s: Settings, **_: Any) -> Any:
        return RecordLimits.from_topic_limits(s, {})

    monkeypatch.setattr("worker.build.read_record_limits", no_broker)
    seen: list[tuple[int, int]] = []
    scraped: list[str] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            if not scraped and _status(f"http://127.0.0.1:{port}/healthz") == 200:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as reply:
                    scraped.append(reply.read().decode())
            seen.append(
                (
                    _status(f"http://127.0.0.1:{port}/healthz"),
                    _status(f"http://127.0.0.1:{port}/readyz"),
                )
            )
            if sum(1 for s in seen if s[0] != 0) >= _ANSWERS_WANTED:
                loaded.set()  # the model "loads" once the server has answered enough probes
            time.sleep(0.1)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with pytest.raises(EngineDeadError):
            await cli._serve(settings, [])
    finally:
        done.set()
        prober.join()
    answered = [s for s in seen if s[0] != 0]
    # The loop was blocked until the server had answered enough probes, each as "alive, not
    # ready"; had it not answered, the load would have given up first.
    assert len(answered) >= _ANSWERS_WANTED, seen
    assert all(s == (200, 503) for s in answered)
    # /metrics serves the process's default registry after the worker's own: where vLLM's stat
    # logger keeps its vllm:* metrics, and where prometheus_client puts python_info.
    names = {f.name for f in text_string_to_metric_families(scraped[0])}
    assert {"vkw_jobs", "python_info"} <= names, sorted(names)
