"""Prometheus's view of a simulated fleet: each live worker's metrics scraped on the virtual
clock, as the series Prometheus would store, ready for its own rule tester (`promtool test
rules`). The alert rules in `deploy/` are then judged on what the real worker code exported
while the simulation injected a fault, not on series written by hand.

A dead process answers no scrape: its series have no sample until it runs again, and its
counters start again from zero, as a restarted process's do (PromQL's `increase` takes the
reset).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from worker.dev.sim.fleet import Fleet

__all__ = ["JOB_LABEL", "Scraper", "rule_metric_names"]

#: The `job` label the rules select on (`deploy/prometheus/prometheus.yml`'s scrape job).
JOB_LABEL: Final = "vllm-kafka-worker"
_METRIC_NAME: Final = re.compile(r"\b(vkw_[a-z0-9_]+)")


def rule_metric_names(rule_file: Path) -> frozenset[str]:
    """The worker's metric names a rule file's expressions read."""
    return frozenset(_METRIC_NAME.findall(rule_file.read_text()))


class Scraper:
    """Scrapes every live worker of `fleet` every `interval_s` virtual seconds, keeping the
    samples of the metrics named in `names`; `input_series()` gives them in the rule tester's
    notation."""

    def __init__(self, fleet: Fleet, names: Iterable[str], *, interval_s: float = 15.0) -> None:
        self._fleet = fleet
        self._names = frozenset(names)
        self.interval_s = interval_s
        #: Scrapes made so far.
        self.scrapes = 0
        # series (as written in a rule test) -> scrape number -> value
        self._samples: dict[str, dict[int, float]] = {}

    async def run(self) -> None:
        """Scrape now and every `interval_s` after, until cancelled."""
        while True:
            self.scrape()
            await asyncio.sleep(self.interval_s)

    def scrape(self) -> None:
        for worker_id in self._fleet.alive():
            service = self._fleet.services.get(worker_id)
            if service is None:
                continue
            text = prometheus_client.generate_latest(service.metrics.registry).decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name not in self._names:
                        continue
                    labels = {**sample.labels, "job": JOB_LABEL, "instance": worker_id}
                    self._samples.setdefault(_series(sample.name, labels), {})[self.scrapes] = (
                        sample.value
                    )
        self.scrapes += 1

    def input_series(self) -> list[dict[str, Any]]:
        """Every series scraped, as `promtool test rules` reads them at `interval_s`: a value
        per scrape, `_` where the series had none (its process down, or not yet exported)."""
        return [
            {
                "series": series,
                "values": " ".join(
                    _number(values[n]) if n in values else "_" for n in range(self.scrapes)
                ),
            }
            for series, values in sorted(self._samples.items())
        ]


def _series(name: str, labels: dict[str, str]) -> str:
    inner = ", ".join(f'{k}="{_escaped(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return repr(int(value)) if value.is_integer() else repr(value)
