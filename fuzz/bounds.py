"""The bounds `kvfuzz run` checks before it starts (exit 2, nothing run or written): worker
processes, steps per example, and each config's pool against the memory and the time there is.

The figures come from `bench/bench_block_memory.py`: a campaign holds about 1.1 KB a pool
block (kvcache and the reference model together, in each worker and in the driver, which
shrinks), and an op costs 1.0-1.4 µs a pool block, building included (every snapshot and check
reads every block).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from kvfuzz.core.config import Config
from kvfuzz.core.errors import KvfuzzError
from kvfuzz.core.limits import MAX_OPS

BYTES_PER_BLOCK = 1100
"""Memory a campaign holds per pool block, rounded up from bench/bench_block_memory.py."""
SECONDS_PER_BLOCK_OP = 1.4e-6
"""Time an op takes per pool block, rounded up from bench/bench_block_memory.py."""
MIN_WORKERS_CAP = 2


class OutOfBounds(KvfuzzError):
    """An option or a config would overrun the machine's memory or the run's time."""


def max_workers() -> int:
    """The most `--workers`: the CPUs this process may run on (at least 2)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(MIN_WORKERS_CAP, cpus)


def check_workers(workers: int) -> None:
    if workers > max_workers():
        raise OutOfBounds(f"--workers {workers} is more than the {max_workers()} CPUs this "
                          f"process may run on: give --workers {max_workers()} or fewer")


def check_steps(steps: int) -> None:
    if steps > MAX_OPS:
        raise OutOfBounds(f"--steps {steps} is more than a trace may hold ({MAX_OPS} ops, "
                          "docs/traces.md, Bounds)")


def available_memory() -> int | None:
    """Bytes of memory available to new work (Linux: MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_configs(configs: Iterable[Config], workers: int, steps: int,
                  seconds: float | None, memory: int | None = None) -> None:
    """Each config's pool fits the memory available, held by every worker and the driver at
    once, and (with a time budget) one example of `steps` ops fits the budget."""
    memory = available_memory() if memory is None else memory
    holders = workers + 1 if workers > 1 else 1
    for config in configs:
        for why in (_too_big(config, holders, memory), _too_slow(config, steps, seconds)):
            if why:
                raise OutOfBounds(f"config {config.name!r}: {why}")


def _too_big(config: Config, holders: int, memory: int | None) -> str:
    need = config.num_blocks * BYTES_PER_BLOCK * holders
    if memory is None or need <= memory:
        return ""
    return (f"{config.num_blocks:,} blocks take about {need / 2**30:.1f} GiB ({BYTES_PER_BLOCK} "
            f"bytes a block in each of {holders} process(es)), more than the "
            f"{memory / 2**30:.1f} GiB available: a smaller pool or fewer --workers")


def _too_slow(config: Config, steps: int, seconds: float | None) -> str:
    example = steps * config.num_blocks * SECONDS_PER_BLOCK_OP
    if seconds is None or example <= seconds:
        return ""
    return (f"an example of up to {steps} steps on {config.num_blocks:,} blocks takes about "
            f"{example:.0f} s (about {SECONDS_PER_BLOCK_OP * 1e6:g} µs a block an op), more "
            f"than --seconds {seconds:g}: more --seconds, fewer --steps or a smaller pool")
