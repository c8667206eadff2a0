"""Median seconds to the first counterexample and the shrunk trace length, per planted bug.

One core, the default campaign (Hypothesis engine, every built-in config in turn, both levels,
reference model on), five seeds per plant. Goal: under 5 s and at most 10 ops for each of the
six plants of the checker issue. `--all` also times the other plants of harness/mutants.py,
with the data checks on CPU for the plants only they can see (`Mutant.needs_data`).
"""

from __future__ import annotations

import argparse
import logging
import statistics

from common import first_counterexample

from kvfuzz.fuzz.campaign import CampaignOptions
from kvfuzz.harness.mutants import MUTANTS, REQUIRED


def hunt(name: str, seed: int, budget: float) -> tuple[float | None, int | None, str]:
    mutant = MUTANTS[name]
    return first_counterexample(target=f"bug:{name}", seconds=budget, seed=seed,
                                configs=mutant.configs or CampaignOptions().configs,
                                data="cpu" if mutant.needs_data else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every plant, not only the six")
    parser.add_argument("--plant", nargs="+", choices=sorted(MUTANTS), help="only these plants")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per hunt")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    names = args.plant or (list(MUTANTS) if args.all else list(REQUIRED))
    print(f"{'planted bug':26} {'median s':>9} {'max s':>7} {'median ops':>11} {'max ops':>8} "
          f"{'found':>6}  checks")
    for name in names:
        runs = [hunt(name, seed, args.budget) for seed in range(args.seeds)]
        times = [t for t, _, _ in runs if t is not None]
        lengths = [n for _, n, _ in runs if n is not None]
        checks = sorted({c for _, _, c in runs if c != "-"})
        if times:
            print(f"{name:26} {statistics.median(times):9.2f} {max(times):7.2f} "
                  f"{statistics.median(lengths):11.0f} {max(lengths):8d} "
                  f"{len(times):3d}/{len(runs):<2d}  {', '.join(checks)}")
        else:
            print(f"{name:26} {'not found in budget':>40}")


if __name__ == "__main__":
    main()
