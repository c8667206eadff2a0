"""Campaign throughput against executor replay, memory over a campaign, and time to the first
counterexample with and without swarm testing and weighting; everything measured in one run.

Throughput, per built-in config and engine (both levels, model and every check on): the
Hypothesis engine runs a seeded campaign and keeps the traces it generated; replaying those
same traces with `run_trace` gives the executor's ops/s on exactly those ops; the ratio is
campaign / replay (goal >= 0.5, with the target's code coverage recorded: `code cov`, and
without it: `no code cov`), each the median of rounds that run one then the other. The
atheris engine runs as `kvfuzz run --engine atheris` does (a libFuzzer subprocess, kvcache
instrumented), less the worker's start-up (Python imports and instrumentation, timed with a
1-example run of the same config just before); its ratio is against the same replay figure,
so it also pays for libFuzzer and the instrumentation.

Memory: the resident set size of this process, sampled after batches of a longer Hypothesis
campaign over every config.

Time to counterexample: per planted bug, seconds and ops to the first finding over `--seeds`
seeds, with swarm and weighting off (before) and on (after), interleaved seed by seed, on the
bug's configs (`--every-config`: on every built-in config).

The machine this runs on may be shared: compare the figures of one run with each other.
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import tempfile
import time
from pathlib import Path

from kvfuzz.core.configs import BUILTIN
from kvfuzz.fuzz.campaign import Campaign, CampaignOptions
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.mutants import MUTANTS, REQUIRED

REPLAYS = 3
ATHERIS_SCALE = 3
"""The atheris run has this many times the examples, so that its ops outweigh the noise of the
start-up subtracted."""
PLANTS = (*REQUIRED, "lookup-ignores-bound", "watermark-ignored", "reset-while-held", "cow-unretained",
          "no-eviction-on-pop", "window-never-freed")


def hypothesis_rate(config: str, examples: int, code_coverage: bool = True) -> tuple[float, float]:
    """(campaign ops/s, replay ops/s of the same traces): medians of REPLAYS rounds, each a
    seeded campaign (the same examples every round) then a replay of its traces, so that both
    sides of the ratio see the same load on a shared machine."""
    rates, replays = [], []
    for _ in range(REPLAYS):
        with tempfile.TemporaryDirectory() as corpus:
            campaign = Campaign(CampaignOptions(seconds=None, examples=examples, seed=7,
                                                configs=(config,), corpus=Path(corpus),
                                                code_coverage=code_coverage))
            traces: list = []
            campaign.runner.on_execution = lambda execution: traces.append(execution.trace)
            start = time.perf_counter()
            stats = campaign.run()
            rates.append(stats.operations / (time.perf_counter() - start))
        replays.append(replay_rate([t for t in traces if t.ops]))
    return statistics.median(rates), statistics.median(replays)


def replay_rate(traces: list) -> float:
    ops = sum(len(t.ops) for t in traces)
    start = time.perf_counter()
    for trace in traces:
        assert run_trace(trace, ["kvcache"]).passed
    return ops / (time.perf_counter() - start)


def atheris_run(config: str, examples: int) -> tuple[int, float]:
    """(ops, seconds) of `kvfuzz run --engine atheris --examples N` on one config."""
    from kvfuzz.fuzz.atheris_engine import run_atheris

    with tempfile.TemporaryDirectory() as corpus:
        stats = run_atheris(CampaignOptions(seconds=None, examples=examples, seed=7,
                                            configs=(config,), corpus=Path(corpus),
                                            engine="atheris"), lambda s: None)
    return stats.operations, stats.elapsed


def throughput(examples: int, configs: list[str] | None = None) -> None:
    try:
        import atheris  # noqa: F401
    except ImportError:
        has_atheris = False
    else:
        has_atheris = True
    print(f"throughput, {examples} examples per config and engine, model + every check on; "
          f"Hypothesis campaign and replay of its traces: medians of {REPLAYS} rounds of both, "
          f"interleaved; atheris: {ATHERIS_SCALE} times the examples, less its worker's start-up "
          "(a 1-example run of the same config just before)")
    print(f"{'config':18} {'replay ops/s':>12} {'no code cov':>11} {'ratio':>6} "
          f"{'code cov':>11} {'ratio':>6} {'atheris':>8} {'ratio':>6}")
    hypothesis_rate("full", 5)  # warm-up: imports, first-use caches
    for name in configs or BUILTIN:
        plain, plain_replay = hypothesis_rate(name, examples, code_coverage=False)
        rate, replay = hypothesis_rate(name, examples)
        ath_text = "       -      -"
        if has_atheris:
            startup = atheris_run(name, 1)[1]
            ops, seconds = atheris_run(name, examples * ATHERIS_SCALE)
            ath = ops / max(seconds - startup, 1e-9)
            ath_text = f"{ath:8.0f} {ath / replay:6.2f}"
        print(f"{name:18} {replay:12.0f} {plain:11.0f} {plain / plain_replay:6.2f} "
              f"{rate:11.0f} {rate / replay:6.2f} {ath_text}", flush=True)


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**20


def memory(seconds: float) -> None:
    samples: list[tuple[float, float]] = []
    last = [0.0]

    def sample(stats) -> None:
        if stats.elapsed - last[0] >= seconds / 10:
            last[0] = stats.elapsed
            samples.append((stats.elapsed, rss_mb()))

    with tempfile.TemporaryDirectory() as corpus:
        stats = Campaign(CampaignOptions(seconds=seconds, seed=3, corpus=Path(corpus)),
                         report=sample).run()
    print(f"\nRSS over a {seconds:g} s campaign ({stats.examples} examples, "
          f"{stats.operations} ops): " + ", ".join(f"{t:.0f}s {m:.1f}MB" for t, m in samples))
    if len(samples) > 2:
        (t1, m1), (t2, m2) = samples[len(samples) // 2], samples[-1]
        print(f"growth over the second half: {(m2 - m1) / max(t2 - t1, 1e-9) * 60:.2f} MB/min")


def hunt(name: str, seed: int, budget: int, tuned: bool,
         every_config: bool) -> tuple[float, int, bool]:
    """(seconds, ops, found) until the first counterexample, or until `budget` examples ran
    (an examples budget, so that the ops do not depend on the machine's load)."""
    mutant = MUTANTS[name]
    configs = CampaignOptions().configs if every_config else mutant.configs
    with tempfile.TemporaryDirectory() as corpus:
        options = CampaignOptions(
            target=f"bug:{name}", seconds=None, examples=budget, seed=seed,
            corpus=Path(corpus), configs=configs or CampaignOptions().configs, max_findings=1,
            data="cpu" if mutant.needs_data else None, swarm=tuned, weighting=tuned,
            shrink_seconds=0.1,
        )
        stats = Campaign(options).run()
    if stats.findings:
        return stats.findings[0].found_after_s, stats.operations, True
    return stats.elapsed, stats.operations, False


def time_to_counterexample(seeds: int, budget: int, every_config: bool) -> None:
    where = "every built-in config" if every_config else "the configs where the bug can show"
    print(f"\nto the first counterexample on {where}, {seeds} seeds, at most {budget} examples "
          "(not found: counted as the budget, shown under found); before (swarm and weighting "
          "off) and after run interleaved, seed by seed; ops: ops run until the campaign stopped "
          "at it (deterministic, so the ratio is taken on them)")
    print(f"{'planted bug':22} {'before median s':>15} {'max s':>6} {'ops':>6} {'max ops':>7} "
          f"{'after median s':>14} {'max s':>6} {'ops':>6} {'max ops':>7} {'after/before ops':>16}"
          f" {'found':>7}")
    medians: dict[bool, list[float]] = {False: [], True: []}
    for name in PLANTS:
        runs: dict[bool, list[tuple[float, int, bool]]] = {False: [], True: []}
        for seed in range(seeds):
            for tuned in (False, True):
                runs[tuned].append(hunt(name, seed, budget, tuned, every_config))
        row: list[float] = []
        for tuned in (False, True):
            times = [r[0] for r in runs[tuned]]
            ops = [r[1] for r in runs[tuned]]
            row += [statistics.median(times), max(times), statistics.median(ops), max(ops)]
            medians[tuned].append(row[-2])
        found = "/".join(str(sum(r[2] for r in runs[t])) for t in (False, True))
        print(f"{name:22} {row[0]:15.2f} {row[1]:6.2f} {row[2]:6.0f} {row[3]:7.0f} "
              f"{row[4]:14.2f} {row[5]:6.2f} {row[6]:6.0f} {row[7]:7.0f} "
              f"{row[6] / max(row[2], 1):16.2f} {found:>7}", flush=True)
    before, after = (statistics.median(medians[t]) for t in (False, True))
    print(f"{'median over the plants':22} {'':22} {before:6.0f} {'':30} {after:6.0f} {'':7} "
          f"{after / max(before, 1):16.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=60, help="per config and engine")
    parser.add_argument("--rss-seconds", type=float, default=60.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=3000, help="examples per hunt")
    parser.add_argument("--every-config", action="store_true",
                        help="hunt each bug over every built-in config (default: its own)")
    parser.add_argument("--only", choices=("throughput", "memory", "ttc"))
    parser.add_argument("--config", nargs="+", choices=BUILTIN, help="throughput: only these")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    if args.only in (None, "throughput"):
        throughput(args.examples, args.config)
    if args.only in (None, "memory"):
        memory(args.rss_seconds)
    if args.only in (None, "ttc"):
        time_to_counterexample(args.seeds, args.budget, args.every_config)


if __name__ == "__main__":
    main()
