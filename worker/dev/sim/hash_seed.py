"""The hash seed the simulation runs under, so that a seed replays in any process.

Python salts the hashes of strings per process (`PYTHONHASHSEED`), and with them the order in
which a set of strings, or of `TopicPartition`s, is walked. The worker walks such sets (the
partitions of a commit, a pause, a revoke), so one seed made different histories in different
processes (seed 6173 of the control flag set at five workers: three digests in three
processes), and a violation a sweep found could fail to replay. Every process that runs the
simulation runs under this hash seed: `bench/sim.py` and `bench/mutants.py` start themselves
again under it, and the test lanes set it for pytest and every process it starts.
"""

from __future__ import annotations

import os
import sys
from typing import Final

__all__ = ["SIM_HASH_SEED", "run_under_the_sim_hash_seed"]

SIM_HASH_SEED: Final = "0"


def run_under_the_sim_hash_seed() -> None:
    """Start this script again under `SIM_HASH_SEED` unless it runs under it already."""
    if os.environ.get("PYTHONHASHSEED") == SIM_HASH_SEED:
        return
    os.environ["PYTHONHASHSEED"] = SIM_HASH_SEED
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *sys.argv])  # noqa: S606 - this script again
