"""A seed's history is the seed's alone: not what ran before it in the same process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker.dev.sim.run import flag_set_scenario, replay_command, run

REPO = Path(__file__).resolve().parents[2]


def test_a_seed_whose_killed_processes_leave_generations_behind_replays_in_one_process() -> None:
    # Engines killed mid-generation leave tasks that wait on nothing; when the cyclic collector
    # closed them depended on the allocations of the runs before (the second run of this seed
    # in one process gave another history until collection was held off during a run).
    scenario = flag_set_scenario("hostile", 700001, 1)

    first = run(scenario)
    second = run(scenario)

    assert any(e.kind == "kill" for e in first.history.events)
    assert first.digest == second.digest


def test_a_seed_replays_alike_in_processes_of_different_hash_seeds() -> None:
    # Seed 6173 of the control flag set at five workers made three histories in three
    # processes: the worker walks sets of partitions, whose order follows the process's hash
    # seed. bench/sim.py now starts itself again under the simulation's own.
    command = [sys.executable, "bench/sim.py", *replay_command("control", 6173, 5).split()[2:]]
    traces = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
        ).stdout
        # The trace's lines, not the summary's wall-clock rates.
        traces.append([line for line in out.splitlines() if line[:12].strip()[:1].isdigit()])
    assert len(traces[0]) > 1000
    assert traces[0] == traces[1]
