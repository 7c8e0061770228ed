"""Chaos at scale: worker processes killed at random while they serve, and jobs that kill them.

Run `python bench/chaos.py [--jobs N] [--kills N] [--term-kills N] [--crash-jobs N] [--seed N]`.
Uses $KAFKA_BOOTSTRAP_SERVERS when set, else starts a local noida-db broker
(worker.dev.broker.LocalBroker).

Two `python -m worker serve --engine mock` processes (static members) share a jobs topic of 8
partitions, fed 5,000 jobs in 20 even parts over 200 s (--produce-over-s), so the kills land
under load rather than after the last job (mock engine, 10 ms a token, 2-6 tokens, every 100th
job 300 tokens). While they serve, 50 SIGKILLs and 10 SIGTERM-then-SIGKILL-after-2-s stops land at
random moments on a worker that is serving normally (not one running the suspects of a death
one at a time), and each is restarted under its own instance id; 3 jobs hold the mock
engine's crash token (`--mock-crash-token-id`) and kill whoever runs them, until the breaker
answers them failed. Printed: jobs lost (neither answered nor dead-lettered), dead-lettered
(and whether only the crash-token jobs), healthy jobs answered failed, duplicates against the
jobs in flight at the kills, the deaths the crash-token jobs caused, and the committed offsets
at the end against the partitions' ends. The tests run a 10-kill variant
(tests/integration/chaos/test_chaos.py). Figures only; the exit code says whether the run held its promises.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from worker.dev.broker import env_or_local_broker
from worker.dev.harness.chaos import Chaos, ChaosPlan
from worker.dev.harness.runs import spawner
from worker.dev.harness.topics import new_run_topics


async def chaos(bootstrap: str, plan: ChaosPlan, logs: Path) -> bool:
    topics = await new_run_topics(bootstrap, "chaos", plan.partitions)
    spawn = spawner(bootstrap, logs, "worker")
    figures = await Chaos(bootstrap, topics, spawn, plan).run()
    print(figures.line())
    print(
        f"lost {figures.lost}; dead-lettered {len(figures.dead_lettered)} "
        f"(only the crash-token jobs: {figures.dead_lettered == figures.crash_jobs}); "
        f"duplicates {figures.duplicates} vs {figures.in_flight_at_kills} in flight at the "
        f"kills (+ up to {plan.max_in_flight} at each of {figures.crash_deaths} crash deaths); "
        f"committed {figures.committed} vs ends {figures.ends}; worker logs in {logs}"
    )
    return (
        figures.lost == 0
        and figures.dead_lettered == figures.crash_jobs
        and not figures.failed_innocent
        and figures.committed == figures.ends
    )


def main() -> int:
    defaults = ChaosPlan()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=defaults.jobs)
    parser.add_argument("--kills", type=int, default=defaults.kills)
    parser.add_argument("--term-kills", type=int, default=defaults.term_kills)
    parser.add_argument("--crash-jobs", type=int, default=defaults.crash_jobs)
    parser.add_argument("--max-in-flight", type=int, default=defaults.max_in_flight)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--produce-over-s",
        type=float,
        default=200.0,
        help="produce the jobs over this many seconds, so the kills land under load (0: at once)",
    )
    args = parser.parse_args()
    plan = ChaosPlan(
        jobs=args.jobs,
        kills=args.kills,
        term_kills=args.term_kills,
        crash_jobs=args.crash_jobs,
        max_in_flight=args.max_in_flight,
        seed=args.seed,
        produce_over_s=args.produce_over_s,
    )
    logs = Path(tempfile.mkdtemp(prefix="vkw-chaos-"))
    with env_or_local_broker() as bootstrap:
        return 0 if asyncio.run(chaos(bootstrap, plan, logs)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
