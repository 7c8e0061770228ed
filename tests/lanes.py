"""Run the test lanes one after another and say where the time went.

`make test` (and so CI) runs every lane; `make unit` runs the first alone. Each lane is one pytest
run over one folder, so a lane's failure names its kind (unit, RL frameworks' released code,
broker, vLLM, chaos) at once. After the lanes, a table gives each lane's wall time, its counts
and its slowest tests, read from the JUnit report pytest writes for it; the last line is the
total, in the form CI reads.

    python -m tests.lanes [LANE ...] [-- PYTEST_ARGS ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from worker.dev.sim.hash_seed import SIM_HASH_SEED

REPO: Final = Path(__file__).resolve().parents[1]

#: Lane name -> (folder, extra pytest arguments). Unit tests wait on no process but their own, so
#: they run on four pytest workers (most of their time is asyncio waits, not CPU). Broker tests
#: mostly wait on the broker, and run on six, each with a broker of its own (69 s on three, 56 s
#: on six, idle two-core machine). Chaos tests wait on worker processes being killed and
#: restarted, and run on four, each with its own brokers (109 s on two, 76 s on four). vLLM
#: tests keep the cores busy (engine processes importing vLLM, Triton's interpreter): on two
#: workers, each with its engines bound to a core of its own, 1.25x faster than on one.
LANES: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "unit": ("tests/unit", ("-n", "4")),
    "frameworks": ("tests/integration/frameworks", ()),
    "broker": ("tests/integration/broker", ("-n", "6")),
    "vllm": ("tests/integration/vllm", ("-n", "2")),
    "chaos": ("tests/integration/chaos", ("-n", "4")),
}
_SLOWEST: Final = 5


def lane_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a lane's pytest (and every process it starts) runs in: `environ`, with
    Python allowed to write bytecode (into `__pycache__` folders, which git ignores).

    Machines that set PYTHONDONTWRITEBYTECODE otherwise compile every module of ours from
    source in every process a lane starts, and pytest rewrites the assertions of every test
    module in every pytest worker again (it caches them only where bytecode may be written):
    5.0 s of a unit lane worker's 6.5 s collection, 1.8 s with the cache, measured. Not a cache
    folder of its own (PYTHONPYCACHEPREFIX): Python then ignores the bytecode pip wrote beside
    the installed packages, and the first process to import vLLM compiles it and torch again
    (27 s instead of 11 s, measured)."""
    env = dict(environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # The simulation's seeds replay only under one hash seed (`worker.dev.sim.hash_seed`).
    env["PYTHONHASHSEED"] = SIM_HASH_SEED
    return env


@dataclass
class LaneResult:
    name: str
    exit_code: int
    wall_s: float
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    slowest: list[tuple[float, str]] = field(default_factory=list)


def _read_report(lane: LaneResult, report: Path) -> None:
    if not report.exists():
        return
    root = ET.parse(report).getroot()  # noqa: S314 - our own pytest's report
    cases = list(root.iter("testcase"))
    timed: list[tuple[float, str]] = []
    for case in cases:
        outcome = {child.tag for child in case}
        if "failure" in outcome:
            lane.failed += 1
        elif "error" in outcome:
            lane.errors += 1
        elif "skipped" in outcome:
            lane.skipped += 1
        else:
            lane.passed += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        timed.append((float(case.get("time", "0")), name))
    lane.slowest = sorted(timed, reverse=True)[:_SLOWEST]


def run_lane(name: str, pytest_args: list[str], reports: Path) -> LaneResult:
    folder, lane_args = LANES[name]
    report = reports / f"{name}.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        folder,
        *lane_args,
        f"--junitxml={report}",
        "--durations=10",
        *pytest_args,
    ]
    print(f"\n=== lane {name}: {' '.join(command[3:])}", flush=True)
    start = time.monotonic()
    exit_code = subprocess.call(command, cwd=REPO, env=lane_environment(os.environ))
    lane = LaneResult(name, exit_code, time.monotonic() - start)
    _read_report(lane, report)
    print(f"=== lane {name}: exit {exit_code} in {lane.wall_s:.0f} s", flush=True)
    return lane


def summary(lanes: list[LaneResult]) -> str:
    lines = [
        "",
        "=== lanes",
        f"{'lane':<10} {'wall s':>7} {'passed':>7} {'failed':>7} {'skipped':>8}",
    ]
    for lane in lanes:
        lines.append(
            f"{lane.name:<10} {lane.wall_s:>7.0f} {lane.passed:>7} "
            f"{lane.failed + lane.errors:>7} {lane.skipped:>8}"
            + ("" if lane.exit_code == 0 else f"   (pytest exit {lane.exit_code})")
        )
    for lane in lanes:
        if lane.slowest:
            lines.append(f"slowest in {lane.name}:")
            lines.extend(f"  {seconds:7.1f} s  {test}" for seconds, test in lane.slowest)
    total_s = sum(lane.wall_s for lane in lanes)
    passed = sum(lane.passed for lane in lanes)
    failed = sum(lane.failed + lane.errors for lane in lanes)
    lines.append(f"all lanes, {total_s:.0f} s:")
    # The closing line in the form CI reads ('N passed, N failed').
    lines.append(f"lanes: {passed} passed, {failed} failed")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        names, pytest_args = argv[:split], argv[split + 1 :]
    else:
        names, pytest_args = argv, []
    unknown = [name for name in names if name not in LANES]
    if unknown:
        print(f"unknown lane(s) {unknown}; lanes: {', '.join(LANES)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="vkw-lanes-") as tmp:
        lanes = [run_lane(name, pytest_args, Path(tmp)) for name in names or list(LANES)]
    print(summary(lanes), flush=True)
    return 0 if all(lane.exit_code == 0 for lane in lanes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
