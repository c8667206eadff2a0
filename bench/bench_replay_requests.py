"""How a replay's time grows with the number of requests in a trace (docs/traces.md, Bounds).

Replays, on kvcache with the reference model and every check, api-level traces of N
`add_request` ops (3-token prompts, the `full` config on 64 blocks), and prints the seconds of
one replay, the microseconds per op and the ratio to the previous N. The traces are built
directly, past the loader's `MAX_REQUESTS` bound, since the figures are what that bound rests
on. Every op snapshots each side and runs every check over every request added so far, so the
time per op grows with N and the total with N squared. Figures only: nothing is asserted.

    python bench/bench_replay_requests.py [N ...]      (default: 250 500 1000 2000)
"""

from __future__ import annotations

import logging
import sys
import time

from kvfuzz.core.configs import builtin_config
from kvfuzz.core.limits import MAX_REQUESTS
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace

SIZES = (250, 500, 1000, 2000)


def requests_trace(n: int) -> Trace:
    """N add_request ops, nothing else."""
    config = builtin_config("full").replace(num_blocks=64)
    ops = [{"op": "add_request", "request_id": f"r{i}", "prompt": [1 + i % 7, 2, 3]}
           for i in range(n)]
    return Trace(config, "api", ops)


def main(sizes: list[int]) -> None:
    logging.disable(logging.WARNING)
    print(f"replay of N add_request ops on kvcache + model + every check (bound: {MAX_REQUESTS})")
    print(f"{'N':>6} {'seconds':>8} {'us/op':>8} {'x prev':>7}")
    previous = None
    for n in sizes:
        trace = requests_trace(n)
        start = time.perf_counter()
        result = run_trace(trace, ["kvcache"])
        seconds = time.perf_counter() - start
        assert result.passed, result.finding and result.finding.report()
        ratio = f"{seconds / previous:6.1f}x" if previous else ""
        print(f"{n:6d} {seconds:8.2f} {seconds / n * 1e6:8.0f} {ratio:>7}")
        previous = seconds


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or list(SIZES))
