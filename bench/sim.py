"""The fleet simulation over many seeds and fleet sizes (`worker.dev.sim`).

Run `python bench/sim.py [--seeds N] [--first-seed S] [--workers 3,16,64] [--partitions 512]
[--hostile invalid,crash,long,reply_small,reply_locked] [--weight-update-every-s S
[--engine-killing-updates SHARE]] [--flavour kafka|noida|tansu] [--processes P]`: each seed
runs the real worker code, N workers on a simulated Kafka cluster and a virtual clock, under a
fault schedule drawn from the seed, and the checker judges the history; P processes run seeds
side by side. Printed per run: simulated
jobs answered per wall-clock second, virtual seconds per wall second, the violations and the
seed that found each; at the end, each invariant broken with the seeds that broke it.

`python bench/sim.py --seed N [same options]` replays one seed and prints its trace up to the
first violation (all of it when none). Exit status 1 when any run broke an invariant.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Run as a script from anywhere: the repository's packages first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.dev.sim.checker import Kind
from worker.dev.sim.cluster import Flavour
from worker.dev.sim.hash_seed import run_under_the_sim_hash_seed
from worker.dev.sim.mutants import MUTANTS
from worker.dev.sim.paths import PATHS
from worker.dev.sim.run import HOSTILE_SHARES, Outcome, Scenario, drawn, flag_set_scenario, run


def scenario(args: argparse.Namespace, seed: int, workers: int) -> Scenario:
    return Scenario(
        seed=seed,
        workers=workers,
        partitions=args.partitions or max(6, 8 * workers),
        duration_s=args.duration_s,
        settle_s=args.settle_s,
        jobs_per_s=args.jobs_per_s or 4.0 * workers,
        hostile={
            **{Kind(k): HOSTILE_SHARES[Kind(k)] for k in args.hostile.split(",") if k},
            **({Kind.SLOW: args.slow_jobs} if args.slow_jobs else {}),
        },
        weight_update_every_s=args.weight_update_every_s,
        bad_update_share=0.2 if args.weight_update_every_s else 0.0,
        engine_killing_update_share=args.engine_killing_updates,
        flavour=Flavour(args.flavour),
        static_members=args.static or args.flavour == "noida",
        offset_metadata_max_bytes=args.offset_metadata_max_bytes,
        offset_map_max_bytes=args.offset_map_max_bytes,
        mutant=args.mutant,
        control=args.control,
        trainer=args.trainer,
        late_hand_over_outages=args.late_hand_over_outages,
        stops_in_hand_overs=args.stops_in_hand_overs,
    )


def paths_of(outcome: Outcome) -> dict[str, int]:
    """How many times each path of `PATHS` ran, with what the history counts itself."""
    history = outcome.history
    counted = dict(history.paths)
    for kind in ("kill", "rebalance", "commit_refused", "poll_timeout", "static_rejoin"):
        counted[kind] = sum(1 for _ in history.of(kind))
    counted["members_removed"] = sum(
        1 for e in history.of("member_removed") if e.fields["why"] != "left"
    )
    return counted


def path_line(counted: dict[str, int]) -> str:
    return "  paths: " + " ".join(f"{k}={v}" for k, v in sorted(counted.items()) if v)


def report(outcome: Outcome) -> str:
    s = outcome.scenario
    rate = outcome.answered / outcome.wall_s if outcome.wall_s else 0.0
    return (
        f"seed {s.seed:>5}  workers {s.workers:>3}  partitions {s.partitions:>4}  "
        f"answered {outcome.answered:>6}  {rate:8.0f} jobs/s  "
        f"{outcome.virtual_s / outcome.wall_s:6.1f}x  violations {len(outcome.violations)}"
        + (
            ""
            if outcome.wedged_at is None
            else f"  (liveness not judged: from {outcome.wedged_at:.1f}s the group waits for a "
            "member that could not leave, and this broker evicts nobody)"
        )
    )


def parser() -> argparse.ArgumentParser:
    """The command line's options (also `bench/mutants.py`'s flag sets)."""
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
        help=f"hostile record kinds to send, comma-separated: {', '.join(k.value for k in HOSTILE_SHARES)}",
    )
    parser.add_argument(
        "--slow-jobs",
        type=float,
        default=0.0,
        help="share of valid jobs about as long as the revoke grace (rebalances find them running)",
    )
    parser.add_argument(
        "--late-hand-over-outages",
        type=float,
        default=0.0,
        help="share of hand-overs landed after their rebalance that a coordinator outage follows",
    )
    parser.add_argument(
        "--stops-in-hand-overs",
        type=float,
        default=0.0,
        help="share of hand-overs made in a rebalance answered late while a SIGTERM comes",
    )
    parser.add_argument(
        "--weight-update-every-s", type=float, default=0.0, help="weight updates (0: none)"
    )
    parser.add_argument(
        "--engine-killing-updates", type=float, default=0.0, help="share that kill the engine"
    )
    parser.add_argument("--flavour", choices=[f.value for f in Flavour], default="kafka")
    parser.add_argument("--static", action="store_true", help="static group members")
    parser.add_argument(
        "--offset-metadata-max-bytes", type=int, default=4096, help="the broker's cap"
    )
    parser.add_argument(
        "--offset-map-max-bytes",
        type=int,
        default=2048,
        help="the workers' cap (--offset-map-max-bytes): a map over it leaves sections out",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="the trainer's whole control plane and its faults (worker/dev/sim/control.py)",
    )
    parser.add_argument(
        "--trainer",
        action="store_true",
        help="trainers on the real RolloutClient beside the raw one (worker/dev/sim/trainer.py)",
    )
    parser.add_argument(
        "--processes", type=int, default=1, help="seeds run side by side, one per process"
    )
    parser.add_argument(
        "--net",
        action="store_true",
        help="run k takes the flag set and fleet size worker/dev/sim/run.py:drawn(k) names "
        "(other options ignored but --seeds, --first-seed and --processes)",
    )
    parser.add_argument(
        "--mutant",
        choices=sorted(MUTANTS),
        help="run a planted defect instead of the real worker (see bench/mutants.py)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sizes = [int(n) for n in args.workers.split(",")]
    if args.seed is not None:
        outcome = run(scenario(args, args.seed, sizes[0]))
        for line in outcome.trace():
            print(line)
        print(report(outcome))
        print(path_line(paths_of(outcome)))
        for violation in outcome.violations:
            print(f"  {violation}")
        return 1 if outcome.violations else 0
    first_to_last = range(args.first_seed, args.first_seed + args.seeds)
    runs: list[tuple[int, int, str | None]] = (
        [(drawn(k)[1], seed, drawn(k)[0]) for k, seed in enumerate(first_to_last)]
        if args.net
        else [(workers, seed, None) for workers in sizes for seed in first_to_last]
    )
    failed = 0
    wedged: list[int] = []
    broken: dict[str, list[int]] = {}
    rates: dict[int, list[float]] = {}
    totals: Counter[str] = Counter(dict.fromkeys(PATHS, 0))
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.processes) as pool:
        for summary in pool.map(functools.partial(run_one, args), runs, chunksize=4):
            print(summary.line, flush=True)
            print(path_line(summary.paths), flush=True)
            totals.update(summary.paths)
            for described in summary.violations[:5]:
                print(f"  seed {summary.seed}: {described}")
            failed += bool(summary.violations)
            if summary.wedged:
                wedged.append(summary.seed)
            rates.setdefault(summary.workers, []).append(summary.jobs_per_s)
            for invariant in summary.invariants:
                broken.setdefault(invariant, []).append(summary.seed)
    print(f"{failed} of {len(runs)} runs broke an invariant")
    if wedged:
        print(
            f"  liveness not judged in {len(wedged)} (a member that could not leave, on a broker "
            f"that evicts nobody): seeds {', '.join(map(str, wedged))}"
        )
    for workers, per_run in sorted(rates.items()):
        print(
            f"  {workers} workers: {len(per_run)} seeds, simulated jobs per wall second "
            f"min {min(per_run):.0f} mean {statistics.fmean(per_run):.0f} max {max(per_run):.0f}"
            f" (per process)"
        )
    for invariant, seeds in sorted(broken.items()):
        print(f"  {invariant}: seeds {', '.join(map(str, seeds))}")
    print("paths run, in all (a path at 0 is one no seed reached):")
    for path, times in totals.items():
        print(f"  {path:<26} {times:>7}  {PATHS.get(path, '')}")
    if unreached := [path for path in PATHS if not totals[path]]:
        print(f"NOT REACHED by any seed: {', '.join(unreached)}")
    return 1 if failed else 0


@dataclass(frozen=True)
class Summary:
    """What a run in a pool process sends back (an `Outcome` holds the whole cluster)."""

    workers: int
    seed: int
    line: str
    jobs_per_s: float
    violations: list[str]
    invariants: list[str]
    wedged: bool
    paths: dict[str, int]


def run_one(args: argparse.Namespace, workers_seed_flags: tuple[int, int, str | None]) -> Summary:
    workers, seed, flags = workers_seed_flags
    outcome = run(
        scenario(args, seed, workers) if flags is None else flag_set_scenario(flags, seed, workers)
    )
    return Summary(
        workers=workers,
        seed=seed,
        line=report(outcome),
        jobs_per_s=outcome.answered / outcome.wall_s if outcome.wall_s else 0.0,
        violations=[str(v) for v in outcome.violations],
        invariants=sorted({v.invariant for v in outcome.violations}),
        wedged=outcome.wedged_at is not None,
        paths=paths_of(outcome),
    )


if __name__ == "__main__":
    run_under_the_sim_hash_seed()
    sys.exit(main())
