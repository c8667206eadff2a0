"""How soon a campaign on a large pool ends after SIGTERM: one worker and two, on a pool of
16 full-attention groups of up to 1,048,576 blocks (every op then takes about a second).

Each run starts `python -m kvfuzz run` on the pool, waits until it has run for a while, sends
SIGTERM and prints the seconds until the process has exited (the summary printed, the workers
gone), with the summary's examples and operations. Figures only: nothing is asserted.

    python bench/bench_stop_latency.py [--blocks 1048576] [--wait 25]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def stop_latency(config: Path, workers: int, wait: float) -> tuple[float, int, str]:
    """Seconds from SIGTERM to exit, the exit code and the summary's operations line."""
    proc = subprocess.Popen([sys.executable, "-m", "kvfuzz", "run", "--config-file", str(config),
                             "--seconds", "600", "--level", "api", "--workers", str(workers),
                             "--corpus", str(config.parent / "corpus")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(wait)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    took = time.monotonic() - start
    ops = next((line.split()[-1] for line in out.splitlines()
                if line.strip().startswith("operations")), "?")
    return took, proc.returncode, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1 << 20)
    parser.add_argument("--wait", type=float, default=25.0,
                        help="seconds the campaign runs before SIGTERM")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    config = folder / "pool.toml"
    config.write_text(f'name = "pool"\nnum_blocks = {args.blocks}\nmax_model_len = 4096\n'
                      + '[[groups]]\nkind = "full"\nblock_size = 16\n' * 16)
    print(f"16 groups, {args.blocks:,} blocks, SIGTERM after {args.wait:g} s")
    for workers in (1, 2):
        took, code, ops = stop_latency(config, workers, args.wait)
        print(f"  --workers {workers}: exit {code} {took:.2f} s after SIGTERM ({ops} ops run)",
              flush=True)


if __name__ == "__main__":
    main()
