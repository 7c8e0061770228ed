"""The fleet simulation over many seeds and fleet sizes (`worker.dev.sim`).

Run `python bench/sim.py [--seeds N] [--first-seed S] [--workers 3,16,64] [--partitions 512]
[--hostile invalid,crash,long,reply_small,reply_locked] [--weight-update-every-s S
[--engine-killing-updates SHARE]] [--flavour kafka|noida|tansu]`: each seed runs the real
worker code, N workers on a simulated Kafka cluster and a virtual clock, under a fault
schedule drawn from the seed, and the checker judges the history. Printed per run: simulated
jobs answered per wall-clock second, virtual seconds per wall second, the violations and the
seed that found each; at the end, each invariant broken with the seeds that broke it.

`python bench/sim.py --seed N [same options]` replays one seed and prints its trace up to the
first violation (all of it when none). Exit status 1 when any run broke an invariant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Final

# Run as a script from anywhere: the repository's packages first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.dev.sim.checker import Kind
from worker.dev.sim.cluster import Flavour
from worker.dev.sim.run import Outcome, Scenario, run

#: Share of the records of each hostile kind named by --hostile.
HOSTILE: Final = {
    Kind.INVALID: 0.02,
    Kind.CRASH: 0.003,
    Kind.LONG: 0.005,
    Kind.REPLY_SMALL: 0.005,
    Kind.REPLY_LOCKED: 0.005,
}


def scenario(args: argparse.Namespace, seed: int, workers: int) -> Scenario:
    return Scenario(
        seed=seed,
        workers=workers,
        partitions=args.partitions or max(6, 8 * workers),
        duration_s=args.duration_s,
        settle_s=args.settle_s,
        jobs_per_s=args.jobs_per_s or 4.0 * workers,
        hostile={Kind(k): HOSTILE[Kind(k)] for k in args.hostile.split(",") if k},
        weight_update_every_s=args.weight_update_every_s,
        bad_update_share=0.2 if args.weight_update_every_s else 0.0,
        engine_killing_update_share=args.engine_killing_updates,
        flavour=Flavour(args.flavour),
        static_members=args.static or args.flavour == "noida",
        offset_metadata_max_bytes=args.offset_metadata_max_bytes,
    )


def report(outcome: Outcome) -> str:
    s = outcome.scenario
    rate = outcome.answered / outcome.wall_s if outcome.wall_s else 0.0
    return (
        f"seed {s.seed:>5}  workers {s.workers:>3}  partitions {s.partitions:>4}  "
        f"answered {outcome.answered:>6}  {rate:8.0f} jobs/s  "
        f"{outcome.virtual_s / outcome.wall_s:6.1f}x  violations {len(outcome.violations)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, help="replay this seed and print its trace")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--workers", default="3,16", help="fleet sizes, comma-separated")
    parser.add_argument("--partitions", type=int, default=0, help="default: 8 per worker")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--settle-s", type=float, default=90.0)
    parser.add_argument("--jobs-per-s", type=float, default=0.0, help="default: 4 per worker")
    parser.add_argument(
        "--hostile",
        default="",
        help=f"hostile record kinds to send, comma-separated: {', '.join(k.value for k in HOSTILE)}",
    )
    parser.add_argument(
        "--weight-update-every-s", type=float, default=0.0, help="weight updates (0: none)"
    )
    parser.add_argument(
        "--engine-killing-updates", type=float, default=0.0, help="share that kill the engine"
    )
    parser.add_argument("--flavour", choices=[f.value for f in Flavour], default="kafka")
    parser.add_argument("--static", action="store_true", help="static group members")
    parser.add_argument("--offset-metadata-max-bytes", type=int, default=4096)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.workers.split(",")]
    if args.seed is not None:
        outcome = run(scenario(args, args.seed, sizes[0]))
        for line in outcome.trace():
            print(line)
        print(report(outcome))
        for violation in outcome.violations:
            print(f"  {violation}")
        return 1 if outcome.violations else 0
    failed = 0
    broken: dict[str, list[int]] = {}
    for workers in sizes:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            outcome = run(scenario(args, seed, workers))
            print(report(outcome), flush=True)
            for violation in outcome.violations[:5]:
                print(f"  seed {seed}: {violation}")
            failed += bool(outcome.violations)
            for invariant in sorted({v.invariant for v in outcome.violations}):
                broken.setdefault(invariant, []).append(seed)
    print(f"{failed} of {args.seeds * len(sizes)} runs broke an invariant")
    for invariant, seeds in sorted(broken.items()):
        print(f"  {invariant}: seeds {', '.join(map(str, seeds))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
