"""`--workers K`: a `kvfuzz.fuzz.schedule.Backend` of K local processes that die with their parent.

Each worker takes batches from a task queue, runs them with its
`kvfuzz.fuzz.campaign.BatchRunner` and puts the `BatchResult`s on a result queue; the parent (the campaign driver) deduplicates,
shrinks and saves the findings. A worker ignores SIGINT (Ctrl-C reaches the whole process
group: the parent decides) and ends its batch early on SIGTERM, at its next example,
handing back what it ran. It
exits when its parent does, even by SIGKILL: Linux's PR_SET_DEATHSIG, and a watchdog thread
that checks the parent's pid, for other systems and for a parent that died before the worker
had set it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

from kvfuzz.core.errors import KvfuzzError
from kvfuzz.fuzz.exits import ErrorReport
from kvfuzz.fuzz.schedule import Batch, BatchResult

PR_SET_DEATHSIG = 1
WATCHDOG_S = 0.5


class WorkerDied(KvfuzzError):
    """Every worker process is gone while batches were still due."""


def die_with_parent(parent: int, watchdog: bool = True) -> None:
    """End this process when `parent` ends (SIGKILL from the kernel on Linux, and a watchdog
    thread's `os._exit`). Without `watchdog` it can run between fork and exec (the atheris
    engine's workers), where no thread may start."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_DEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
    if not watchdog:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCHDOG_S)
        os._exit(1)

    threading.Thread(target=watch, name="kvfuzz-parent-watchdog", daemon=True).start()


def _serve(options: Any, tasks: Any, results: Any, parent: int) -> None:
    """A worker's life: batches in, results out, until the None sentinel or SIGTERM."""
    die_with_parent(parent)
    from kvfuzz.fuzz.campaign import STOP_REQUESTED, BatchRunner
    from kvfuzz.fuzz.plugins import import_plugins

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM asks the batch to stop at its next example (the runner's stop point); raising
    # from the handler could land in a queue's read and cut a message in two.
    signal.signal(signal.SIGTERM, lambda signum, frame: STOP_REQUESTED.set())
    try:
        import_plugins(options.plugins)
        runner = BatchRunner(options)
        while not STOP_REQUESTED.is_set():
            batch = tasks.get()
            if batch is None:
                break
            results.put(runner(batch))
    except Exception as exc:  # noqa: BLE001 - the parent exits 2 or 3 with it (fuzz/exits.py)
        results.put(ErrorReport.of(exc))
    finally:  # a SIGTERM now would interrupt the queues' flushing at exit
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The results reach the parent; then the worker ends without freeing its objects one by
    # one (a million-block pool's took seconds, which a SIGTERM to the campaign waited for).
    results.close()
    results.join_thread()
    os._exit(0)


class LocalWorkers:
    """K worker processes (spawned: no state shared by accident) running batches."""

    def __init__(self, options: Any, count: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.capacity = count
        self.tasks = ctx.Queue()
        self.done = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(options, self.tasks, self.done,
                                                      os.getpid()), daemon=True)
                      for _ in range(count)]
        for proc in self.procs:
            proc.start()
        self.submitted: dict[int, Batch] = {}
        self.closing = False

    def submit(self, batch: Batch) -> None:
        self.submitted[batch.index] = batch
        self.tasks.put(batch)

    def results(self, timeout: float) -> list[BatchResult]:
        out: list[BatchResult] = []
        try:
            out.append(self.done.get(timeout=timeout))
            while True:
                out.append(self.done.get_nowait())
        except queue.Empty:
            pass
        for result in out:
            if isinstance(result, ErrorReport):
                result.raise_here()
            self.submitted.pop(result.batch.index, None)
        dead = [p for p in self.procs if not p.is_alive()]
        if not out and self.submitted and dead and not self.closing:
            codes = ", ".join(str(p.exitcode) for p in dead)
            raise WorkerDied(f"{len(dead)} worker process(es) ended (exit codes {codes}) with "
                             f"{len(self.submitted)} batches still due")
        return out

    def close(self, cancel: bool, grace: float = 10.0) -> list[BatchResult]:
        self.closing = True
        if cancel:
            for proc in self.procs:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGTERM)
        for _ in self.procs:
            self.tasks.put(None)
        out: list[BatchResult] = []
        deadline = time.monotonic() + grace
        while self.submitted and time.monotonic() < deadline:
            got = self.results(timeout=0.2) if any(p.is_alive() for p in self.procs) else []
            out.extend(got)
            if not got and not any(p.is_alive() for p in self.procs):
                out.extend(self._drain())
                break
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        return out

    def _drain(self) -> list[BatchResult]:
        out: list[BatchResult] = []
        try:
            while True:
                out.append(self.done.get(timeout=0.2))
        except queue.Empty:
            return out
