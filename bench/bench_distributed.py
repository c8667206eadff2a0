"""Campaign throughput on one process, `--workers 2` and `--ray` on a local 2-CPU Ray, with the
start-up cost of each and where Ray's overhead goes; everything measured in one run.

Each mode runs the same campaign (kvcache, every built-in config, both levels, model and every
check on, the same seed) for `--seconds`, through `run_campaign` as `kvfuzz run` does:

- start-up: from the call to the first batch result (processes spawned, for Ray also
  `ray.init` and the node probe, and the first batch's imports);
- examples/s once started: the examples of the results after the first, over the time after it;
- examples per CPU second once started: the same examples over the CPU time every process of
  the mode took after the first result (driver, workers, Ray's daemons), which a busy shared
  machine disturbs less than the wall clock;
- the CPU split after the first result: driver, batch workers, Ray's daemons (GCS, raylet,
  agents, log monitor);
- for Ray: `ray.init`, the node probe, and the round trip of an empty task.

The machine may be shared: compare the figures of one run with each other (`--rounds`
alternates the modes).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from kvfuzz.fuzz.campaign import CampaignOptions, run_campaign


class CpuWatch:
    """The CPU seconds of this process and of each of its descendants (sampled every 0.1 s,
    so processes that end are still counted), split into driver, workers and Ray's daemons."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.seen: dict[int, tuple[str, float]] = {}
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while self.running:
            self.sample()
            time.sleep(0.1)

    def sample(self) -> None:
        for p in self.me.children(recursive=True):
            try:
                cmd = " ".join(p.cmdline()) or p.name()
                times = p.cpu_times()
            except psutil.Error:
                continue
            if cmd.startswith("ray::"):  # a Ray worker (IDLE or a task), or an agent
                kind = "daemons" if "Agent" in cmd else "workers"
            else:  # GCS, raylet, log monitor...; or a `--workers` process
                kind = "daemons" if "/ray/" in cmd else "workers"
            self.seen[p.pid] = (kind, times.user + times.system)

    def totals(self) -> dict[str, float]:
        self.sample()
        out = {"driver": sum(self.me.cpu_times()[:2]), "workers": 0.0, "daemons": 0.0}
        for kind, seconds in self.seen.values():
            out[kind] += seconds
        return out

    def stop(self) -> None:
        self.running = False


class Clock:
    """on_progress hook: when the first result came, the examples and the CPU seconds then."""

    def __init__(self, watch: CpuWatch) -> None:
        self.watch = watch
        self.start = time.perf_counter()
        self.first: float | None = None
        self.first_examples = 0
        self.first_cpu: dict[str, float] = {}

    def __call__(self, stats: Any) -> None:
        if self.first is None and stats.examples:
            self.first = time.perf_counter()
            self.first_examples = stats.examples
            self.first_cpu = self.watch.totals()


def campaign(seconds: float, workers: int = 1,
             backend: Callable[[CampaignOptions], Any] | None = None,
             started: float | None = None) -> dict[str, float]:
    watch = CpuWatch()
    with tempfile.TemporaryDirectory() as corpus:
        options = CampaignOptions(seconds=seconds, seed=11, workers=workers,
                                  corpus=Path(corpus))
        clock = Clock(watch)
        if started is not None:
            clock.start = started
        stats = run_campaign(options, clock, backend=None if backend is None else backend(options))
        end = time.perf_counter()
    after = watch.totals()
    watch.stop()
    assert clock.first is not None, "no batch finished"
    cpu = {kind: after[kind] - clock.first_cpu[kind] for kind in after}
    examples = stats.examples - clock.first_examples
    return {"startup_s": clock.first - clock.start,
            "rate": examples / (end - clock.first),
            "per_cpu_s": examples / max(sum(cpu.values()), 1e-9),
            **{f"cpu_{kind}": seconds for kind, seconds in cpu.items()}}


def ray_campaign(seconds: float) -> dict[str, float]:
    import ray

    from kvfuzz.fuzz import ray_backend

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=ray_backend.LOCAL_CPUS, include_dashboard=False,
             logging_level=logging.WARNING)
    t1 = time.perf_counter()
    ray_backend._probe_nodes(None)
    t2 = time.perf_counter()
    noop = ray.remote(num_cpus=1)(lambda: None)
    ray.get([noop.remote() for _ in range(4)])
    start = time.perf_counter()
    for _ in range(50):
        ray.get(noop.remote())
    task_ms = (time.perf_counter() - start) / 50 * 1000
    # The empty tasks' time is not start-up: the campaign's clock starts at t0 plus what
    # ray.init and the probe took.
    figures = campaign(seconds, backend=ray_backend.RayBackend,
                       started=time.perf_counter() - (t2 - t0))
    figures.update(init_s=t1 - t0, probe_s=t2 - t1, task_ms=task_ms)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="budget per campaign")
    parser.add_argument("--rounds", type=int, default=1, help="alternations of the modes")
    args = parser.parse_args()
    logging.getLogger("kvfuzz.kvcache").setLevel(logging.ERROR)
    modes: dict[str, Callable[[], dict[str, float]]] = {
        "1 process": lambda: campaign(args.seconds),
        "--workers 2": lambda: campaign(args.seconds, workers=2),
        "--ray (2 local CPUs)": lambda: ray_campaign(args.seconds),
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, run in modes.items():
            results[name].append(run())

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(f"campaign of {args.seconds:g} s per mode, {args.rounds} round(s), medians; "
          f"{psutil.cpu_count()} CPUs, load average {psutil.getloadavg()[0]:.1f}")
    print(f"{'mode':22} {'start-up s':>10} {'examples/s':>10} {'vs w2':>6} {'ex/CPU-s':>9} "
          f"{'vs w2':>6}   CPU s: driver / workers / Ray daemons")
    base = "--workers 2"
    for name in modes:
        print(f"{name:22} {med(name, 'startup_s'):10.2f} {med(name, 'rate'):10.1f} "
              f"{med(name, 'rate') / med(base, 'rate'):6.2f} {med(name, 'per_cpu_s'):9.1f} "
              f"{med(name, 'per_cpu_s') / med(base, 'per_cpu_s'):6.2f}   "
              f"{med(name, 'cpu_driver'):6.1f} / {med(name, 'cpu_workers'):6.1f} / "
              f"{med(name, 'cpu_daemons'):6.1f}")
    ray_mode = "--ray (2 local CPUs)"
    print(f"\nRay's start-up: ray.init {med(ray_mode, 'init_s'):.2f} s (GCS, raylet, agents, "
          f"worker processes), node probe {med(ray_mode, 'probe_s'):.2f} s (each node imports "
          f"kvfuzz); an empty task's round trip {med(ray_mode, 'task_ms'):.2f} ms")


if __name__ == "__main__":
    main()
