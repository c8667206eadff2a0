"""What a pool block costs in memory when a trace replays: kvcache and the reference model in
lockstep, every invariant checked, as `kvfuzz replay` holds them.

For each pool size and number of groups, a fresh process runs `kvfuzz replay` on a 3-op trace
(one request allocated and freed), or `kvfuzz run` for two examples of up to 16 steps, and
reports its peak resident memory less that of the same command on an 8-block pool; the figure is that
difference per pool block (the groups share one pool). For the campaigns it also prints the
seconds per op divided by the pool size: snapshots and checks read every block, so an op's
cost grows with the pool. `kvfuzz run` checks a campaign's configs against the memory and the time
available with `kvfuzz.fuzz.bounds.BYTES_PER_BLOCK` and `SECONDS_PER_BLOCK_OP`, the largest
figures this prints, rounded up.
Figures only: nothing is asserted.

    python bench/bench_block_memory.py [--max-blocks 1048576]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, tempfile, time
from pathlib import Path
from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main
n, groups = int(sys.argv[1]), int(sys.argv[2])
config = Config(n, tuple(GroupConfig("full", 16) for _ in range(groups)), max_model_len=4096)
trace = Trace(config, "api", [
    {"op": "add_request", "request_id": "r", "prompt": list(range(40))},
    {"op": "allocate_slots", "request_id": "r", "num_new_tokens": 40},
    {"op": "free", "request_id": "r"}])
path = Path(tempfile.mkdtemp()) / "t.json"
trace.save(path)
seconds_per_op = 0.0
if sys.argv[3] == "replay":
    assert main(["replay", str(path), "--quiet"]) == 0
else:
    Path(path.parent / "c.json").write_text(json.dumps({**config.to_dict(), "name": "pool"}))
    report = path.parent / "r.json"
    assert main(["run", "--config-file", str(path.parent / "c.json"), "--examples", "2",
                 "--steps", "16", "--level", "api", "--corpus", str(path.parent / "corpus"),
                 "--json", str(report)]) == 0
    done = json.loads(report.read_text())
    seconds_per_op = done["seconds"] / max(done["operations"], 1)
print(json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, seconds_per_op]))
"""


def peak_bytes(blocks: int, groups: int, command: str) -> tuple[int, float]:
    """Peak resident bytes of a process that replays a 3-op trace on this pool (`replay`), or
    runs a campaign of two examples of up to 16 steps on it (`run`: also its seconds per op)."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(blocks), str(groups), command],
                          capture_output=True, text=True, check=True)
    peak, per_op = json.loads(done.stdout.strip().splitlines()[-1])
    return int(peak), float(per_op)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-blocks", type=int, default=1 << 20)
    args = parser.parse_args()
    print(f"{'command':>7} {'blocks':>9} {'groups':>6} {'peak MB':>8} {'bytes/block':>11} "
          f"{'µs/block/op':>11}")
    worst = {"replay": 0.0, "run": 0.0}
    slowest = 0.0
    for command, groups in (("replay", 1), ("replay", 4), ("run", 1), ("run", 16)):
        base, _ = peak_bytes(8, groups, command)
        blocks = 1 << 16
        while blocks <= args.max_blocks:
            peak, per_op = peak_bytes(blocks, groups, command)
            per = (peak - base) / blocks
            worst[command] = max(worst[command], per)
            cost = f"{1e6 * per_op / blocks:>11.2f}" if command == "run" else f"{'':>11}"
            slowest = max(slowest, 1e6 * per_op / blocks)
            print(f"{command:>7} {blocks:>9} {groups:>6} {peak / 2**20:>8.0f} {per:>11.0f} "
                  f"{cost}", flush=True)
            blocks *= 4
    print(f"largest: {worst['replay']:.0f} bytes a pool block for a replay, "
          f"{worst['run']:.0f} for a campaign (kvcache and the model together); "
          f"{slowest:.2f} µs a pool block per op of a campaign")

if __name__ == "__main__":
    main()
