"""The fleet-level alerts fire when their fault is injected in the simulation, and only then.

`test_alerts.py` checks the rules on series written by hand; here the series are what the real
worker code exported, scraped every 15 virtual seconds (`worker.dev.sim.scrape`) from a
simulated fleet of two while a fault is on, and Prometheus's own rule tester evaluates the rules
on them: `ALERTS{alertstate="firing"}` at chosen times, before the fault, while it lasts and
after it is over. Under `CI=true` a missing promtool fails these tests (`test_alerts.promtool`).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas import Pause, Resume, Target, UpdateWeights, encode
from tests.unit.test_alerts import run_promtool
from tests.unit.test_deploy import ALERTS
from worker.dev.sim.clients import Process, SimProducer
from worker.dev.sim.fleet import Fleet
from worker.dev.sim.run import CONTROL, WEIGHTS_ROOT, Scenario, run
from worker.dev.sim.scrape import Scraper, rule_metric_names

MINUTE = 60.0
#: Long enough for every rule's window and `for` to pass with the fault on, and to clear after.
RUN_S = 30 * MINUTE
WORKERS = ("w0", "w1")

Script = Callable[[Fleet, "Operator"], Coroutine[Any, Any, None]]


class Operator:
    """Writes control commands as `vllm-kafka-worker control` would."""

    def __init__(self, fleet: Fleet) -> None:
        self._producer = SimProducer(Process("operator", fleet.cluster, fleet.rng), client_id="op")
        self._started = False

    async def send(self, command: Any) -> None:
        if not self._started:
            await self._producer.start()
            self._started = True
        await (await self._producer.send(CONTROL, value=encode(command), key=b"operator"))


@dataclass(frozen=True)
class Expect:
    """At `minute`, `alert` fires for exactly the workers in `firing`."""

    minute: int
    alert: str
    firing: tuple[str, ...]


@functools.cache
def simulated_series(script: Script) -> list[dict[str, Any]]:
    """Run a fleet of two for `RUN_S` with `script`'s faults; return the scraped series (a run
    is a function of its seed and script: the no-progress run serves two tests)."""
    scraped: list[Scraper] = []

    async def beside(fleet: Fleet) -> None:
        scraper = Scraper(fleet, rule_metric_names(ALERTS))
        scraped.append(scraper)
        faults = asyncio.create_task(script(fleet, Operator(fleet)))
        try:
            await scraper.run()
        finally:
            faults.cancel()

    run(
        Scenario(
            seed=5,
            workers=len(WORKERS),
            partitions=4,
            duration_s=RUN_S,
            settle_s=30.0,
            jobs_per_s=1.0,
            faults=(),
            script=beside,
        )
    )
    (scraper,) = scraped
    assert scraper.scrapes >= RUN_S / scraper.interval_s  # it scraped all along
    return scraper.input_series()


def promtool_verdict(
    series: list[dict[str, Any]], expected: list[Expect], tmp_path: Path, rules: Path = ALERTS
) -> tuple[int, str]:
    cases = [
        {
            # By worker: an alert may carry more labels (VkwNoProgress: the topic).
            "expr": f'count by (instance) (ALERTS{{alertstate="firing", alertname="{e.alert}"}})',
            "eval_time": f"{e.minute}m",
            "exp_samples": [
                {"labels": f'{{instance="{worker}"}}', "value": 1} for worker in e.firing
            ],
        }
        for e in expected
    ]
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": cases}],
    }
    (tmp_path / "sim_test.yaml").write_text(yaml.safe_dump(tests, width=1 << 20))
    tested = run_promtool("test", "rules", "sim_test.yaml", cwd=tmp_path)
    return tested.returncode, tested.stdout + tested.stderr


def checkpoint(name: str, **config: Any) -> str:
    """A mock checkpoint the workers may load (under the simulation's weights root)."""
    directory = WEIGHTS_ROOT / f"alerts-{name}"
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(
        {"num_hidden_layers": 2, "num_experts_per_tok": 2, "num_experts": 8, **config}
    )
    path = directory / "config.json"
    if not path.exists() or path.read_text() != text:
        staged = directory / f".config.json.{name}"
        staged.write_text(text)
        staged.replace(path)
    return str(directory)


# -- the faults ---------------------------------------------------------------------------


async def coordinator_away_from_5_to_25_minutes(fleet: Fleet, _: Operator) -> None:
    # Every commit times out (result="retry") while answers go on.
    await asyncio.sleep(5 * MINUTE)
    fleet.cluster.coordinator_down = True
    await asyncio.sleep(20 * MINUTE)
    fleet.cluster.coordinator_down = False
    fleet.cluster.coordinator_back(fleet.clock.now)


async def w1_paused_and_w0_engine_hung_from_5_to_25_minutes(fleet: Fleet, op: Operator) -> None:
    # The operator pauses w1 on purpose; w0's engine stops answering: both hold lag, only w0's
    # silence is a fault.
    await asyncio.sleep(3 * MINUTE)
    await op.send(Pause(command_id="pause-w1", target=Target(workers=["w1"])))
    await asyncio.sleep(2 * MINUTE)
    fleet.hung_engines.add("w0")
    await asyncio.sleep(20 * MINUTE)
    fleet.hung_engines.discard("w0")
    await op.send(Resume(command_id="resume-w1", target=Target(workers=["w1"])))


async def weights_lost_from_2_to_20_minutes(fleet: Fleet, op: Operator) -> None:
    # An update fails its check and the weights before it cannot be put back: every worker
    # needs weights (and holds its jobs) until the next update loads.
    await asyncio.sleep(2 * MINUTE)
    lost = checkpoint("lost", mock_check="fails_for_good")
    await op.send(UpdateWeights(command_id="update-1", version=1, path=lost))
    await asyncio.sleep(18 * MINUTE)
    await op.send(UpdateWeights(command_id="update-2", version=2, path=checkpoint("good")))


CASES = {
    # The last commit lands just before 5m; the 5-minute window is empty of landed commits from
    # about 10m, and `for: 10m` runs out about 20m.
    "commits failing": (
        coordinator_away_from_5_to_25_minutes,
        [
            Expect(4, "VkwCommitsFailing", ()),
            Expect(19, "VkwCommitsFailing", ()),
            Expect(21, "VkwCommitsFailing", WORKERS),
            Expect(24, "VkwCommitsFailing", WORKERS),
            Expect(27, "VkwCommitsFailing", ()),
        ],
    ),
    # w0 answers its last job just before 5m: its 5-minute window is empty from about 10m,
    # firing about 20m; w1, paused by the operator, never.
    "no progress beside a paused worker": (
        w1_paused_and_w0_engine_hung_from_5_to_25_minutes,
        [
            Expect(4, "VkwNoProgress", ()),
            Expect(19, "VkwNoProgress", ()),
            Expect(21, "VkwNoProgress", ("w0",)),
            Expect(24, "VkwNoProgress", ("w0",)),
            Expect(28, "VkwNoProgress", ()),
        ],
    ),
    # needs_weights from about 2m (the failed load); `for: 10m`.
    "needs weights": (
        weights_lost_from_2_to_20_minutes,
        [
            Expect(1, "VkwNeedsWeights", ()),
            Expect(11, "VkwNeedsWeights", ()),
            Expect(13, "VkwNeedsWeights", WORKERS),
            Expect(19, "VkwNeedsWeights", WORKERS),
            Expect(22, "VkwNeedsWeights", ()),
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_alert_fires_while_its_fault_is_injected_and_not_before_or_after(
    case: str, tmp_path: Path
) -> None:
    script, expected = CASES[case]

    code, said = promtool_verdict(simulated_series(script), expected, tmp_path)

    assert code == 0, said


def test_a_rule_that_one_paused_worker_silences_fails_the_no_progress_case(
    tmp_path: Path,
) -> None:
    """The rule as it was (`unless on () max(vkw_paused) > 0`): w1's pause hid w0's stall. On
    the same simulated series, the rule tester must flag it."""
    series = simulated_series(w1_paused_and_w0_engine_hung_from_5_to_25_minutes)
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "VkwNoProgress":
                rule["expr"] = (
                    'sum by (instance, topic) (vkw_consumer_lag{job="vllm-kafka-worker"}) > 0\n'
                    "unless on (instance)\n"
                    'sum by (instance) (increase(vkw_jobs_total{job="vllm-kafka-worker"}[5m])) > 0'
                    "\nunless on () max(vkw_paused) > 0"
                )
    old = tmp_path / "alerts.yaml"
    old.write_text(yaml.safe_dump(rules))
    expected = [Expect(21, "VkwNoProgress", ("w0",))]

    code, said = promtool_verdict(series, expected, tmp_path, rules=old)

    assert code != 0
    assert "VkwNoProgress" in said
