"""vLLM's own Scheduler as a target: scheduler steps per second, and median seconds to the first
counterexample per bug planted in it (`vllm-scheduler-bug:NAME`).

Run with the python of a vLLM venv (ci/install-vllm.sh). Steps per second: the same generated
scheduler-level traces replayed three ways, each the median of `--repeats` replays: vLLM's
Scheduler alone (the adapter's `apply`, no snapshot or check), kvfuzz's driver on kvcache
alone, and checked through the executor (target `vllm-scheduler` against the model, every
check after every op). Then one campaign per plant and seed (`--level scheduler`, the plant's
config, one core, model on), stopped at its first finding; a plant that cannot apply on this
vLLM (`cannot_apply`, probed) is not hunted, and its line says why.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from common import first_counterexample, generated_traces

from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.vllm_scheduler_plants import PLANT_CONFIGS, PLANTS, cannot_apply


def steps_per_second(traces: list[Trace], target: str, repeats: int) -> float:
    """Median over `repeats` of the steps a side alone runs per second (its `apply` only)."""
    steps = sum(op["op"] == "step" for t in traces for op in t.ops)
    rates = []
    info = get_target(target)
    for _ in range(repeats):
        elapsed = 0.0
        for trace in traces:
            side = info.build(trace.config, "scheduler")
            for op in trace.ops:
                start = time.perf_counter()
                side.apply(op)
                elapsed += time.perf_counter() - start
        rates.append(steps / elapsed)
    return statistics.median(rates)


def checked_steps_per_second(traces: list[Trace], repeats: int) -> float:
    """Median over `repeats` of the steps per second through the executor, model on."""
    steps = sum(op["op"] == "step" for t in traces for op in t.ops)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for trace in traces:
            assert run_trace(trace, ("vllm-scheduler",)).passed
        rates.append(steps / (time.perf_counter() - start))
    return statistics.median(rates)


def hunt(name: str, seed: int, budget: float) -> tuple[float | None, int | None, str]:
    names, target = PLANTS[name][2], f"vllm-scheduler-bug:{name}"
    # A plant's config file under the loop rules this vLLM follows, as `cannot_apply` probes it.
    engine = get_target(target).engine_config
    return first_counterexample(target=target, seconds=budget, seed=seed,
                                configs=names, levels=("scheduler",),
                                config_files=tuple(engine(PLANT_CONFIGS[n]) for n in names
                                                   if n in PLANT_CONFIGS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*",
                        default=["full", "hybrid", "qwen3_5_align", "eagle"],
                        help="configs timed in steps per second (none: plants only)")
    parser.add_argument("--examples", type=int, default=40, help="traces per config")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per hunt")
    parser.add_argument("--plants", nargs="+", default=list(PLANTS), choices=list(PLANTS),
                        help="planted bugs to hunt (default: all)")
    args = parser.parse_args()
    logging.disable(logging.ERROR)  # vLLM logs each request a failing load fails as an error
    from vllm import __version__

    print(f"vLLM {__version__}: scheduler steps per second (median of {args.repeats})")
    print(f"{'config':16} {'steps':>6} {'vLLM Scheduler':>15} {'kvfuzz driver':>14} "
          f"{'checked':>8}")
    for name in args.configs:
        traces = generated_traces("scheduler", name, args.examples, 30,
                                  targets=("vllm-scheduler",), allow_misuse=False)
        steps = sum(op["op"] == "step" for t in traces for op in t.ops)
        ours = steps_per_second(traces, "vllm-scheduler", args.repeats)
        driver = steps_per_second(traces, "kvcache", args.repeats)
        checked = checked_steps_per_second(traces, args.repeats)
        print(f"{name:16} {steps:6d} {ours:15.0f} {driver:14.0f} {checked:8.0f}")
    print()
    print(f"{'planted bug':24} {'config':14} {'median s':>9} {'max s':>7} {'median ops':>11} "
          f"{'found':>6}  checks")
    for name in args.plants:
        why = cannot_apply(name)
        if why is not None:
            print(f"{name:24} cannot apply: {why}")
            continue
        runs = [hunt(name, seed, args.budget) for seed in range(args.seeds)]
        times = [t for t, _, _ in runs if t is not None]
        lengths = [n for _, n, _ in runs if n is not None]
        checks = sorted({c for _, _, c in runs if c != "-"})
        config = ",".join(PLANTS[name][2])
        if times:
            print(f"{name:24} {config:14} {statistics.median(times):9.2f} {max(times):7.2f} "
                  f"{statistics.median(lengths):11.0f} {len(times):3d}/{len(runs):<2d}  "
                  f"{', '.join(checks)}")
        else:
            print(f"{name:24} {config:14} {'not found in budget':>30}")


if __name__ == "__main__":
    main()
