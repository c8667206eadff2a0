"""Median seconds to the first counterexample and the shrunk trace length, per planted bug.

One core, the default campaign (Hypothesis engine, every built-in config in turn, both levels,
reference model on), five seeds per plant. Goal: under 5 s and at most 10 ops for each of the
six plants of the checker issue. `--all` also times the other plants of harness/mutants.py,
with the data checks on CPU for the plants only they can see (`Mutant.needs_data`).

Each hunt runs twice, seed by seed: before (the schedule weighed by behaviour features alone,
`code_coverage=False`) and after (the target's own code coverage recorded and weighing the
pairs, the default); the last line gives the median over the plants of each.
"""

from __future__ import annotations

import argparse
import logging
import statistics

from common import first_counterexample

from kvfuzz.fuzz.campaign import CampaignOptions
from kvfuzz.harness.mutants import MUTANTS, REQUIRED


def hunt(name: str, seed: int, budget: float,
         code_coverage: bool = True) -> tuple[float | None, int | None, str]:
    mutant = MUTANTS[name]
    return first_counterexample(target=f"bug:{name}", seconds=budget, seed=seed,
                                configs=mutant.configs or CampaignOptions().configs,
                                data="cpu" if mutant.needs_data else None,
                                code_coverage=code_coverage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every plant, not only the six")
    parser.add_argument("--plant", nargs="+", choices=sorted(MUTANTS), help="only these plants")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per hunt")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    names = args.plant or (list(MUTANTS) if args.all else list(REQUIRED))
    print(f"{'planted bug':26} {'code cov':>8} {'median s':>9} {'max s':>7} {'median ops':>11} "
          f"{'max ops':>8} {'found':>6}  checks")
    medians: dict[bool, list[float]] = {False: [], True: []}
    for name in names:
        runs: dict[bool, list] = {False: [], True: []}
        for seed in range(args.seeds):
            for code in (False, True):
                runs[code].append(hunt(name, seed, args.budget, code))
        for code in (False, True):
            times = [t if t is not None else args.budget for t, _, _ in runs[code]]
            lengths = [n for _, n, _ in runs[code] if n is not None]
            checks = sorted({c for _, _, c in runs[code] if c != "-"})
            medians[code].append(statistics.median(times))
            label = "after" if code else "before"
            if lengths:
                print(f"{name:26} {label:>8} {statistics.median(times):9.2f} {max(times):7.2f} "
                      f"{statistics.median(lengths):11.0f} {max(lengths):8d} "
                      f"{len(lengths):3d}/{len(times):<2d}  {', '.join(checks)}", flush=True)
            else:
                print(f"{name:26} {label:>8} {'not found in budget':>40}", flush=True)
    before, after = (statistics.median(medians[c]) for c in (False, True))
    print(f"{'median over the plants':26} before {before:.2f} s, after {after:.2f} s "
          "(a hunt not found counts as the budget)")


if __name__ == "__main__":
    main()
