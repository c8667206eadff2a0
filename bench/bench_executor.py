"""Checked operations per second of the executor (goal: >= 5,000 on a 64-block pool, one core,
all invariants on, reference model in lockstep).

Traces are generated once by the state machines (seeded), then replayed with `run_trace`, so
the figure is the executor's own cost: the op on the target and on the model, two snapshots,
the comparison and every registered check.

How the checks stay cheap: a snapshot is plain tuples and dicts read once per op, and derived
views (holders per block, the free set) are computed once per snapshot and shared by every check
(`Snapshot.holders`, `Snapshot.free_set`); checks are O(blocks + table entries), transition
checks look only at the ops they concern (I7 returns at once when the queue did not change and
the op released nothing), and the model only copies the small lists the predictor trial needs.
Both sides rebuild only what reads differently from the last op (a request's view, the block
keys, the cache map), so a request that did not change is the same object in both snapshots;
and checks settle the common case with whole-tuple comparisons before any per-block loop (I5
visits only keyed blocks, I6 stops when no block lost its key, I14 skips equal tables).
"""

from __future__ import annotations

import dataclasses
import logging


from common import generated_traces, ops_per_second
from kvfuzz.core.configs import BUILTIN
from kvfuzz.properties import REGISTRY

REPEATS = 5


def traces_for(config_name: str, level: str, num_blocks: int, examples: int) -> list:
    base = BUILTIN[config_name][1]
    BUILTIN[f"bench-{config_name}"] = ("bench", dataclasses.replace(
        base, name=f"bench-{config_name}", num_blocks=num_blocks))
    return generated_traces(level, f"bench-{config_name}", examples, 60, vary_configs=False)


def main() -> None:
    logging.disable(logging.WARNING)
    print(f"executor throughput, 64-block pools, median of 5 replays, {len(REGISTRY)} checks")
    print(f"{'config':14} {'level':9} {'ops':>6} {'model+checks':>13} {'checks only':>12} "
          f"{'model only':>11} {'bare':>9}")
    for name in ("full", "sliding_window", "hybrid", "partial_hits"):
        for level in ("api", "scheduler"):
            traces = traces_for(name, level, 64, 40)
            ops = sum(len(t.ops) for t in traces)
            full = ops_per_second(traces, REPEATS)
            checks_only = ops_per_second(traces, REPEATS, model=False)
            model_only = ops_per_second(traces, REPEATS, checks=[])
            bare = ops_per_second(traces, REPEATS, model=False, checks=[])
            print(f"{name:14} {level:9} {ops:6d} {full:11.0f}/s {checks_only:10.0f}/s "
                  f"{model_only:9.0f}/s {bare:7.0f}/s")


if __name__ == "__main__":
    main()
