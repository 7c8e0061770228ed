"""Scale out and in under load: worker A alone, B joins, C joins, A leaves by SIGTERM.

Run `python bench/elastic.py [--jobs N] [--broker noida|tansu|both]`. Starts its own local
brokers: noida-db (the embedded broker) and tansu (which behaves like Apache Kafka around a
rebalance: it takes the old generation's commits until the rebalance completes; no idempotent
producer there), or uses $KAFKA_BOOTSTRAP_SERVERS when set.

3,000 jobs over 8 partitions on the mock engine (8 tokens x 50 ms: 0.4 s a job, 32 at once per
worker); B joins once 500 are answered, C at 1,200, A leaves (SIGTERM, `--leave-group-on-stop`)
at 2,000; every worker is a static member with its own `--group-instance-id`. Printed per
broker: jobs lost, jobs answered twice and duplicates against the jobs in flight at the events,
healthy jobs dead-lettered or failed, the breaker's log lines (a scale event taken for a death),
and for each event the answers per second before it, its longest stall (the gap between two
answers) and how long after the event answers were steady again. The tests run a short plan on both brokers
(tests/integration/chaos/test_elastic.py). Figures only; the exit code says whether the run held its promises.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

from worker.dev.broker import LocalBroker, TansuBroker
from worker.dev.harness.elastic import Elastic, ElasticPlan
from worker.dev.harness.runs import spawner
from worker.dev.harness.topics import new_run_topics


async def elastic(name: str, bootstrap: str, plan: ElasticPlan, logs: Path) -> bool:
    topics = await new_run_topics(bootstrap, "elastic", plan.partitions)
    spawn = spawner(bootstrap, logs, f"{name}-worker")
    figures = await Elastic(bootstrap, topics, spawn, plan).run()
    print(f"[{name}]")
    print("\n".join(figures.lines()))
    held = (
        figures.lost == 0
        and figures.dead_lettered == 0
        and figures.failed == 0
        and figures.blamed == 0
        and figures.committed_at_end
    )
    if name == "tansu":
        return held and figures.answered_twice == 0
    return held and figures.duplicates <= figures.in_flight_at_events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=ElasticPlan().jobs)
    parser.add_argument("--broker", choices=("noida", "tansu", "both"), default="both")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="vkw-elastic-"))
    print(f"worker logs in {logs}")
    ok = True
    if from_env := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return 0 if asyncio.run(elastic("env", from_env, ElasticPlan(jobs=args.jobs), logs)) else 1
    if args.broker in ("noida", "both"):
        with LocalBroker() as broker:
            plan = ElasticPlan(jobs=args.jobs)
            ok &= asyncio.run(elastic("noida", broker.bootstrap_servers, plan, logs))
    if args.broker in ("tansu", "both"):
        with TansuBroker() as tansu:
            plan = ElasticPlan(jobs=args.jobs, flags={"enable_idempotence": False})
            ok &= asyncio.run(elastic("tansu", tansu.bootstrap_servers, plan, logs))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
