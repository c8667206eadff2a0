"""What turning the data layer on costs: executor ops/s with and without the data checks.

Traces are generated once by the state machines (seeded, structural checks only), then
replayed with `run_trace` on kvcache with the reference model in lockstep: with every
registered invariant, with the invariants plus D1, and with the invariants plus D1 and D2
(`properties.data.data_checks()`, CPU float32). Traces that stop on a data finding (the real
hazards of tests/data/test_data_hazards.py: priority policy, same-step copy-on-write) are left
out so that every column replays the same ops. Figures only: nothing is asserted about time.

    python bench/bench_data_layer.py
"""

from __future__ import annotations

import logging


from common import generated_traces, ops_per_second
from kvfuzz.harness.executor import run_trace
from kvfuzz.properties import REGISTRY
from kvfuzz.properties.data import data_checks

CONFIGS = ("full", "sliding_window", "hybrid", "partial_hits", "priority")
EXAMPLES = 30
REPEATS = 3


def main() -> None:
    logging.disable(logging.WARNING)
    structural = list(REGISTRY)
    d1 = structural + data_checks(names=["D1"])
    both = structural + data_checks()
    print(f"executor ops/s on kvcache with the model, median of {REPEATS} replays; "
          f"{len(structural)} invariants, data layer on CPU float32")
    print(f"{'config':15} {'level':9} {'ops':>5} {'left out':>8} {'invariants':>11} "
          f"{'+D1':>8} {'+D1+D2':>8} {'us/op added':>11}")
    for name in CONFIGS:
        for level in ("api", "scheduler"):
            generated = generated_traces(level, name, EXAMPLES, 40,
                                         checks=tuple(REGISTRY))
            traces = [t for t in generated if run_trace(t, ["kvcache"], checks=both).passed]
            ops = sum(len(t.ops) for t in traces)
            base, with_d1, with_both = (ops_per_second(traces, REPEATS, checks=c) for c in (structural, d1, both))
            added = (1 / with_both - 1 / base) * 1e6
            print(f"{name:15} {level:9} {ops:5d} {len(generated) - len(traces):8d} "
                  f"{base:9.0f}/s {with_d1:6.0f}/s {with_both:6.0f}/s {added:11.0f}")


if __name__ == "__main__":
    main()
