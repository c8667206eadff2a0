"""Campaign throughput on one process, `--workers 2` and `--ray` on a local 2-CPU Ray, with the
start-up cost of each and where Ray's overhead goes; everything measured in one run.

Each mode runs the same campaign (kvcache, every built-in config, both levels, model and every
check on, the same seed) for `--seconds`, through `run_campaign` as `kvfuzz run` does:

- start-up: from the call to the first batch result (processes spawned, Ray started and its
  nodes probed, the first batch's imports);
- examples/s once started: the examples of the results after the first, over the time after it;
- for Ray: the start-up split into `ray.init`, the node probe and the first batch; the
  round trip of an empty task; the CPU seconds Ray's own processes (GCS, raylet, agents) took
  during the campaign, against the batches' CPU seconds.

The machine may be shared: compare the figures of one run with each other (`--rounds`
alternates the modes).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfuzz.fuzz.campaign import CampaignOptions, run_campaign


class Clock:
    """on_progress hook: when the first result came, and the examples counted then."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.first_examples = 0

    def __call__(self, stats: Any) -> None:
        if self.first is None and stats.examples:
            self.first = time.perf_counter()
            self.first_examples = stats.examples


def campaign(seconds: float, workers: int = 1,
             backend: Callable[[CampaignOptions], Any] | None = None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as corpus:
        options = CampaignOptions(seconds=seconds, seed=11, workers=workers,
                                  corpus=Path(corpus))
        clock = Clock()
        made = None if backend is None else backend(options)
        stats = run_campaign(options, clock, backend=made) if made else run_campaign(options,
                                                                                      clock)
        end = time.perf_counter()
    assert clock.first is not None, "no batch finished"
    return {"startup_s": clock.first - clock.start,
            "rate": (stats.examples - clock.first_examples) / (end - clock.first),
            "examples": stats.examples}


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
    ray.get([noop.remote() for _ in range(4)])  # workers up
    start = time.perf_counter()
    for _ in range(50):
        ray.get(noop.remote())
    task_ms = (time.perf_counter() - start) / 50 * 1000

    before = dict(_last_cpu)
    figures = campaign(seconds, backend=lambda options: ray_backend.RayBackend(options))
    # RayBackend.close shut Ray down: its processes' CPU times were last read by the watcher.
    figures.update(init_s=t1 - t0, probe_s=t2 - t1, task_ms=task_ms,
                   daemons_cpu_s=_last_cpu.get("daemons", 0.0) - before.get("daemons", 0.0),
                   workers_cpu_s=_last_cpu.get("workers", 0.0) - before.get("workers", 0.0))
    figures["startup_s"] += t2 - t0
    return figures


_last_cpu: dict[str, float] = {}


def _watch_ray_cpu() -> None:
    """Keep the CPU seconds of Ray's daemons and workers up to date until Ray shuts down
    (their processes are gone afterwards)."""
    import threading

    import psutil

    def loop() -> None:
        me = psutil.Process()
        while True:
            daemons = workers = 0.0
            for p in me.children(recursive=True):
                try:
                    times = p.cpu_times()
                    used = times.user + times.system
                    if "ray::" in " ".join(p.cmdline() or []):
                        workers += used
                    else:
                        daemons += used
                except psutil.Error:
                    continue
            if daemons or workers:
                _last_cpu["daemons"] = max(_last_cpu.get("daemons", 0.0), daemons)
                _last_cpu["workers"] = max(_last_cpu.get("workers", 0.0), workers)
            time.sleep(0.2)

    threading.Thread(target=loop, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="budget per campaign")
    parser.add_argument("--rounds", type=int, default=1, help="alternations of the modes")
    args = parser.parse_args()
    logging.getLogger("kvfuzz.kvcache").setLevel(logging.ERROR)
    _watch_ray_cpu()
    modes: dict[str, Callable[[], dict[str, float]]] = {
        "1 process": lambda: campaign(args.seconds),
        "--workers 2": lambda: campaign(args.seconds, workers=2),
        "--ray (2 local CPUs)": lambda: ray_campaign(args.seconds),
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, run in modes.items():
            results[name].append(run())
    print(f"campaign of {args.seconds:g} s per mode, {args.rounds} round(s), medians")
    print(f"{'mode':22} {'start-up s':>10} {'examples/s':>10} {'vs --workers 2':>15}")
    base = statistics.median(r["rate"] for r in results["--workers 2"])
    for name, rows in results.items():
        rate = statistics.median(r["rate"] for r in rows)
        startup = statistics.median(r["startup_s"] for r in rows)
        print(f"{name:22} {startup:10.2f} {rate:10.1f} {rate / base:15.2f}")
    ray_rows = results["--ray (2 local CPUs)"]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in ray_rows)

    print("\nRay's overhead")
    print(f"  ray.init (GCS, raylet, workers)      {med('init_s'):7.2f} s")
    print(f"  node probe (import kvfuzz per node)  {med('probe_s'):7.2f} s")
    print(f"  empty task round trip                {med('task_ms'):7.2f} ms")
    print(f"  CPU of Ray's daemons in the campaign {med('daemons_cpu_s'):7.2f} s "
          f"(batches: {med('workers_cpu_s'):.2f} s)")


if __name__ == "__main__":
    main()
