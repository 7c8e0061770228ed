"""The alert rules fire on their faults, by Prometheus's own rule tester (promtool).

`deploy/prometheus/alerts_test.yaml` holds the cases: input series and the alerts expected at
given times. `make setup` puts promtool beside the venv's Python; under `CI=true` a missing
promtool fails these tests rather than skipping them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_deploy import (
    ALERTS,
    dashboard_expressions,
    exported_series,
    rules,
)

RULE_TESTS = ALERTS.parent / "alerts_test.yaml"
SERIES_NAME = re.compile(r"^\s*([A-Za-z_:][A-Za-z0-9_:]*)")
# What Grafana puts in place of the dashboard's variables before Prometheus sees a query.
GRAFANA_VARIABLES = {
    "$job": "vllm-kafka-worker",
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "6h",
}


def promtool() -> str:
    """promtool beside this Python (where `make setup` puts it), else on PATH."""
    beside = Path(sys.executable).parent / "promtool"
    found = str(beside) if beside.is_file() else shutil.which("promtool")
    if found is None:
        reason = "promtool not found beside the venv's Python or on PATH (`make setup` installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: the rule tests must not skip)", pytrace=False)
        pytest.skip(reason)
    return found


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def rule_tests() -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    return tests


def test_promtool_accepts_the_rules() -> None:
    checked = run_promtool("check", "rules", ALERTS.name, cwd=ALERTS.parent)

    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_every_alert_fires_on_its_fault_and_stays_silent_otherwise() -> None:
    tested = run_promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)

    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_the_rule_tester_fails_an_alert_that_does_not_fire(tmp_path: Path) -> None:
    """A case that expects a firing alert where none fires fails promtool: the rule tests can
    fail."""
    silent = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": 'vkw_crash_suspects{job="vllm-kafka-worker", instance="w0"}',
                        "values": "0x60",
                    }
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "45m",
                        "alertname": "VkwCrashSuspectsLinger",
                        "exp_alerts": [{"exp_labels": {"severity": "info", "instance": "w0"}}],
                    }
                ],
            }
        ],
    }
    (tmp_path / "silent_test.yaml").write_text(yaml.safe_dump(silent))

    tested = run_promtool("test", "rules", "silent_test.yaml", cwd=tmp_path)

    assert tested.returncode != 0
    assert "VkwCrashSuspectsLinger" in tested.stdout + tested.stderr


def test_every_alert_is_tested_firing_and_silent() -> None:
    fired: set[str] = set()
    silent: set[str] = set()
    for case in rule_tests():
        for check in case["alert_rule_test"]:
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = {rule["alert"] for rule in rules()}

    assert alerts - fired == set(), "never expected to fire"
    assert alerts - silent == set(), "never expected to stay silent"
    assert fired | silent <= alerts


def test_the_rule_tests_feed_only_series_the_worker_exports() -> None:
    # `up` is Prometheus's own, one per scrape target.
    known = exported_series().keys() | {"up"}
    fed = {
        match.group(1)
        for case in rule_tests()
        for series in case["input_series"]
        if (match := SERIES_NAME.match(series["series"]))
    }

    assert fed
    assert fed <= known, f"not exported by the worker: {sorted(fed - known)}"


def test_every_dashboard_query_is_promql_prometheus_parses(tmp_path: Path) -> None:
    """Each query, with Grafana's variables put in, as a recording rule: `promtool check rules`
    parses every expression of a rule file with Prometheus's own parser."""
    expressions = dashboard_expressions()
    recorded = []
    for number, query in enumerate(expressions):
        expr = query
        # Longest first: `$__rate_interval` before any variable it starts with.
        for variable, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
            expr = expr.replace(variable, value)
        assert "$" not in expr, query
        recorded.append({"record": f"dashboard:query_{number}", "expr": expr})
    (tmp_path / "dashboard.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]})
    )

    checked = run_promtool("check", "rules", "dashboard.yaml", cwd=tmp_path)

    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in checked.stdout


def test_the_dashboard_check_catches_a_query_that_does_not_parse(tmp_path: Path) -> None:
    broken = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {
                        "record": "dashboard:query",
                        "expr": 'sum by (topic (vkw_consumer_lag{job="x"})',
                    }
                ],
            }
        ]
    }
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump(broken))

    checked = run_promtool("check", "rules", "dashboard.yaml", cwd=tmp_path)

    assert checked.returncode != 0
