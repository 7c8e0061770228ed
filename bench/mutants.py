"""The net's own test: run each planted defect (`worker.dev.sim.mutants.MUTANTS`) on fresh
seeds until the checker flags it, and print how many seeds each took.

Run `python bench/mutants.py [--first-seed S] [--cap 200] [--processes P] [--flags SET]
[NAME ...]`: run k of a mutant's search takes seed S + k and the flag set and fleet size
`worker.dev.sim.run.drawn(k)` names (the flag sets of `FLAG_SETS` in turn: the default fleet;
hostile records with weight updates that kill the engine; static members on noida-db; the
trainer's whole control plane; trainers on the real client; noida-db with outages after late
hand-overs; hostile records with stops during hand-overs; hostile records with offset maps
capped at 48 bytes); with `--flags SET`, that set only and
fleet size (3, 5, 1)[k mod 3]. A seed counts as a catch only where the real worker passes it.
A row per mutant: the seeds it took to the first catch, the invariants that caught it, the
flag set and the command that replays it. A mutant not caught within the cap is a hole in the
net (a fault no schedule draws, or an invariant the checker lacks): the exit status is then 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
from dataclasses import dataclass
from pathlib import Path

# Run as a script from anywhere: the repository's packages first, and `bench/sim.py` beside.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim

from worker.dev.sim.hash_seed import run_under_the_sim_hash_seed
from worker.dev.sim.mutants import MUTANTS
from worker.dev.sim.run import FLAG_SETS, FLEET_SIZES, drawn, replay_command, run


@dataclass(frozen=True)
class Caught:
    mutant: str
    #: Seeds run up to and including the one that caught it (None: not caught within the cap).
    seeds: int | None
    seed: int | None = None
    flags: str = ""
    workers: int = 0
    invariants: tuple[str, ...] = ()

    def replay(self) -> str:
        if self.seed is None:
            return ""
        return replay_command(self.flags, self.seed, self.workers, self.mutant)


def search(mutant: str, first_seed: int, cap: int, only: str | None = None) -> Caught:
    """Run `mutant` on seeds from `first_seed` until the checker flags one, at most `cap`;
    `only`: that flag set's runs alone, its fleet sizes in turn."""
    for k in range(cap):
        flags, workers = drawn(k) if only is None else (only, FLEET_SIZES[k % len(FLEET_SIZES)])
        seed = first_seed + k
        args = sim.parser().parse_args([*FLAG_SETS[flags], "--mutant", mutant])
        outcome = run(sim.scenario(args, seed, workers))
        # A catch counts only where the real worker passes the same seed: a seed on which the
        # real worker breaks an invariant too reveals its defect, not the mutant's.
        if outcome.violations and not run(sim.scenario(real(args), seed, workers)).violations:
            return Caught(
                mutant,
                k + 1,
                seed,
                flags,
                workers,
                tuple(sorted({v.invariant for v in outcome.violations})),
            )
    return Caught(mutant, None)


def real(args: argparse.Namespace) -> argparse.Namespace:
    """The same options, running the real worker."""
    return argparse.Namespace(**{**vars(args), "mutant": None})


def table(rows: list[Caught], cap: int) -> str:
    lines = [f"{'mutant':<32} {'seeds':>5}  {'flag set':<8} {'seed':>7}  invariants"]
    for row in rows:
        lines.append(
            f"{row.mutant:<32} {row.seeds if row.seeds is not None else f'>{cap}':>5}  "
            f"{row.flags or '-':<8} {row.seed if row.seed is not None else '-':>7}  "
            f"{', '.join(row.invariants) or 'NOT CAUGHT'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--first-seed", type=int, default=700_000)
    parser.add_argument("--cap", type=int, default=200, help="seeds per mutant at most")
    parser.add_argument("--processes", type=int, default=1, help="mutants searched side by side")
    parser.add_argument(
        "--flags",
        choices=sorted(FLAG_SETS),
        help="search this flag set only (default: each in turn)",
    )
    args = parser.parse_args(argv)
    names = args.names or list(MUTANTS)
    unknown = sorted(set(names) - set(MUTANTS))
    if unknown:
        parser.error(f"no such mutant: {', '.join(unknown)} (known: {', '.join(MUTANTS)})")
    rows: list[Caught] = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.processes) as pool:
        futures = [
            pool.submit(search, name, args.first_seed, args.cap, args.flags) for name in names
        ]
        for future in concurrent.futures.as_completed(futures):
            caught = future.result()
            rows.append(caught)
            print(
                f"{caught.mutant}: "
                + (
                    f"caught after {caught.seeds} seeds ({', '.join(caught.invariants)}): "
                    f"{caught.replay()}"
                    if caught.seeds is not None
                    else f"NOT CAUGHT in {args.cap} seeds"
                ),
                flush=True,
            )
    rows.sort(key=lambda row: names.index(row.mutant))
    print(table(rows, args.cap))
    return 0 if all(row.seeds is not None for row in rows) else 1


if __name__ == "__main__":
    run_under_the_sim_hash_seed()
    sys.exit(main())
