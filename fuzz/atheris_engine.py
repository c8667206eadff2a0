"""Coverage-guided fuzzing with libFuzzer through atheris (`kvfuzz run --engine atheris`).

Bytes to traces: the first byte of a libFuzzer input picks the (level, config) pair (its value
modulo the number of pairs, in the campaign's rotation order), and the rest are the decisions of
that pair's example, read by the same generator as the Hypothesis engine's
(`kvfuzz.fuzz.generator.run_example`, one byte per decision), so one fuzz target covers every
pair, a mutated byte is a changed decision, libFuzzer mutates towards the pairs that reach new
code, and every op still goes through the one executor with every check.
Coverage is libFuzzer's, over kvcache's instrumented modules (`atheris.instrument_imports`);
the campaign's behaviour features are counted as well, so `coverage` means the same thing for
both engines and `edges` is libFuzzer's `cov:`.

Processes: `atheris.Fuzz` runs once per process and ends it, so each worker is a subprocess
(`python -m kvfuzz.fuzz.atheris_engine RUN_DIR WORKER LIBFUZZER_ARGS... CORPUS_DIR`) with its own
libFuzzer seed; the parent polls the workers' stats files and logs and calls `on_progress`. A
worker dies with the parent, even when the parent is killed (`kvfuzz.fuzz.workers`).

Files: `<corpus>/atheris-inputs/` is libFuzzer's corpus, shared by the workers (libFuzzer reloads
it, so they learn from each other) and kept between runs; it starts with one seed input per
pair. `<corpus>/atheris-logs/worker-K.log` is libFuzzer's output (and any crash artifact of
the harness itself). Findings are the `Counterexample`s the executor raises inside an input:
the worker catches them, so libFuzzer goes on; the first failure of each bug across all workers
(`kvfuzz.fuzz.findings.dedup_key`) is saved, shrunk and saved again in the corpus like the
Hypothesis engine's.
Each worker rewrites its stats file atomically after a finding, on its last input and at
least every POLL_S seconds, so nothing already found is lost when the run is interrupted; SIGINT/SIGTERM make a worker stop after its current input.

Determinism: worker K's libFuzzer `-seed` derives from the campaign seed and K, workers run
with PYTHONHASHSEED=0, and a single worker does not reload the corpus directory (`-reload=0`;
reloads come at timed intervals), so one worker with the same seed, budget in examples
(`-runs`) and starting corpus runs the same inputs in the same order. A time budget, or
several workers sharing the corpus, make the run depend on timing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import math
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris
from kvfuzz.fuzz.campaign import (FOCUS_WEIGHT, STOP_REQUESTED, BatchRunner, CampaignOptions,
                                  Stats, account, campaign_findings, campaign_pairs, count_into,
                                  failure_of, stop_point)
from kvfuzz.fuzz.findings import dedup_key
from kvfuzz.fuzz.schedule import Batch, BatchResult, Failure
from kvfuzz.fuzz.workers import die_with_parent
from kvfuzz.fuzz.plugins import import_plugins
from kvfuzz.core.configs import builtin_config
from kvfuzz.core.errors import HarnessFault, KvfuzzError
from kvfuzz.fuzz.exits import ErrorReport
from kvfuzz.harness.executor import Counterexample

INPUTS_DIR = "atheris-inputs"
LOGS_DIR = "atheris-logs"
INSTRUMENTED = "kvfuzz.kvcache"
MAX_LEN = 4096
"""libFuzzer's input size limit; `-len_control=0` lets inputs use it from the start (short
inputs end a state machine run after a few steps)."""
SEED_LEN = 1024
POLL_S = 0.25
_COV = re.compile(rb"\bcov: (\d+)")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGKILL)
"""How `_stop` may end a worker that has not set up its handler yet, or does not stop."""


FAULT_FILE = "fault.pickle"
"""Where a worker leaves the `ErrorReport` of a check, adapter or plugin that raised."""


class AtherisError(KvfuzzError):
    """A worker stopped abnormally (a harness crash; its log says why)."""


def worker_seed(seed: int, worker: int) -> int:
    """libFuzzer's `-seed` for a worker: distinct per worker, never 0 (0 means random)."""
    digest = hashlib.sha256(f"atheris:{seed}:{worker}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % (2**31 - 1) + 1


def libfuzzer_args(options: CampaignOptions, worker: int, logs: Path) -> list[str]:
    """The flags a worker runs libFuzzer with (budget, seed, sizes, signal handling)."""
    args = [f"-seed={worker_seed(options.seed, worker)}", f"-max_len={MAX_LEN}", "-len_control=0",
            "-handle_int=0", "-handle_term=0", f"-artifact_prefix={logs}/worker-{worker}-"]
    if options.workers == 1:
        args.append("-reload=0")  # nobody else adds inputs; reloading makes order timing-bound
    if options.examples is not None:
        args.append(f"-runs={options.examples}")
    elif options.seconds is not None:
        args.append(f"-max_total_time={max(1, math.ceil(options.seconds))}")
    return args


def seed_inputs(inputs: Path, num_pairs: int) -> None:
    """Give an empty libFuzzer corpus one input per (level, config) pair."""
    inputs.mkdir(parents=True, exist_ok=True)
    if any(inputs.iterdir()):
        return
    for index in range(num_pairs):
        data = bytes([index]) + random.Random(index).randbytes(SEED_LEN)
        (inputs / f"seed-{index:03d}").write_bytes(data)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


# ----- the worker (a subprocess) -----


class AtherisWorker:
    """One libFuzzer process: libFuzzer's inputs, the campaign's accounting and findings."""

    def __init__(self, options: CampaignOptions, worker: int, run_dir: Path) -> None:
        self.options = options
        self.run_dir = run_dir
        self.stats = Stats()
        self.runner = BatchRunner(options)
        self.findings = campaign_findings(options)
        self.stats_file = run_dir / f"worker-{worker}.pickle"
        pairs = campaign_pairs(options)
        for pair in pairs:
            self.stats.pair(*pair)
        focus = set(options.focus)
        self.rotation = pairs + [p for p in pairs if p[1] in focus] * (FOCUS_WEIGHT - 1)
        """The pair of each first-byte value: focused configs take FOCUS_WEIGHT times more."""
        self.start = time.monotonic()
        self.stopping = False
        self.written = 0.0
        """When the stats file was last written."""

    def fuzz(self, argv: list[str]) -> None:
        """Run libFuzzer with `argv`; never returns (libFuzzer ends the process)."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._stop)
        atheris.Setup(argv, self.one_input)
        atheris.Fuzz()

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def one_input(self, data: bytes) -> None:
        level, name = self.rotation[data[0] % len(self.rotation) if data else 0]
        result = BatchResult(Batch(0, level, name, 0, 1), examples=1)
        try:
            self.runner.example(level, name, data[1:])
        except Counterexample as exc:
            self._record(failure_of(exc), level, name)
            self.written = 0.0
        except HarnessFault as exc:  # not a finding: the parent exits 3 with it
            _write_atomic(self.run_dir / FAULT_FILE, pickle.dumps(ErrorReport.of(exc)))
            os._exit(3)
        account(result, self.runner.take_executions(), self.runner.probe.take())
        count_into(result.tolerated, self.runner.take_tolerated_builds())
        self.stats.add(result)
        now = time.monotonic()
        self.stats.elapsed = now - self.start
        # Written after a finding, on the last input of an examples budget, when stopping, and
        # at the parent's polling pace in between (a write per input cost more than the input).
        if (now - self.written >= POLL_S or self.stopping
                or self.stats.examples == self.options.examples):
            _write_atomic(self.stats_file, pickle.dumps(self.stats))
            self.written = now
        if self.stopping:
            os._exit(0)

    def _record(self, failure: Failure, level: str, name: str) -> None:
        """Only the first worker to find a bug (`dedup_key`) saves and shrinks it; it counts its
        own duplicates of it."""
        key = dedup_key(failure.check, failure.signature)
        if key in self.findings.records:
            self.findings.offer(failure, level, name, time.monotonic() - self.start)
            return
        claim = hashlib.sha256(key.encode()).hexdigest()
        try:
            os.close(os.open(self.run_dir / "claims" / claim[:16], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        try:
            self.findings.offer(failure, level, name, time.monotonic() - self.start)
        finally:
            self.stats.findings = self.findings.all()


def _instrument(package: str) -> None:
    """Import `package` (and the modules its `__init__` imports) with atheris's coverage
    instrumentation; it must not have been imported before.
    """
    assert package not in sys.modules, f"{package} was imported before instrumentation"
    with atheris.instrument_imports(include=[package]):
        importlib.import_module(package)


def worker_main(argv: list[str]) -> None:
    """`python -m kvfuzz.fuzz.atheris_engine RUN_DIR WORKER LIBFUZZER_ARGS...`."""
    run_dir, worker = Path(argv[1]), int(argv[2])
    options = pickle.loads((run_dir / "options.pickle").read_bytes())
    _instrument(INSTRUMENTED)
    import_plugins(options.plugins)
    logging.getLogger("kvfuzz.kvcache").setLevel(logging.ERROR)
    AtherisWorker(options, worker, run_dir).fuzz([argv[0], *argv[3:]])


# ----- the parent -----


class _Log:
    """Follows a worker's libFuzzer log for its latest `cov:`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.edges = 0

    def poll(self) -> int:
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        self.offset += len(chunk)
        lines, _, self.partial = (self.partial + chunk).rpartition(b"\n")
        found = _COV.findall(lines)
        if found:
            self.edges = int(found[-1])
        return self.edges

    def tail(self, lines: int = 15) -> str:
        text = self.path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def _collect(run_dir: Path, logs: list[_Log], start: float, options: CampaignOptions) -> Stats:
    total = Stats()
    for pair in campaign_pairs(options):
        total.pair(*pair)
    for worker, log in enumerate(logs):
        path = run_dir / f"worker-{worker}.pickle"
        stats = pickle.loads(path.read_bytes()) if path.exists() else Stats()
        stats.edges = log.poll()
        total.merge(stats)
    total.elapsed = time.monotonic() - start
    return total


def _budget_spent(options: CampaignOptions, stats: Stats, start: float) -> bool:
    """The wall-clock budget (startup included) or the findings limit is reached.

    libFuzzer's own `-max_total_time` only counts from its start.
    """
    if options.max_findings is not None and len(stats.findings) >= options.max_findings:
        return True
    return options.seconds is not None and time.monotonic() - start >= options.seconds


def _stop(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """Ask the workers to stop after their current input; kill those that do not."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_atheris(options: CampaignOptions, on_progress: Callable[[Stats], None]) -> Stats:
    """Run `options.workers` libFuzzer workers; call on_progress with the running totals."""
    for name in options.configs:
        builtin_config(name)
    STOP_REQUESTED.clear()
    inputs = options.corpus / INPUTS_DIR
    logs_dir = options.corpus / LOGS_DIR
    logs_dir.mkdir(parents=True, exist_ok=True)
    seed_inputs(inputs, len(options.configs) * len(options.levels))
    start = time.monotonic()
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory(prefix="kvfuzz-atheris-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "claims").mkdir()
        (run_dir / "options.pickle").write_bytes(pickle.dumps(options))
        logs = [_Log(logs_dir / f"worker-{w}.log") for w in range(options.workers)]
        procs = []
        for worker, log in enumerate(logs):
            with open(log.path, "wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvfuzz.fuzz.atheris_engine", str(run_dir), str(worker),
                     *libfuzzer_args(options, worker, logs_dir), str(inputs)],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True,  # Ctrl-C reaches the parent, which stops them
                    preexec_fn=functools.partial(die_with_parent, os.getpid(), watchdog=False),
                ))
        grace = options.shrink_seconds + 10
        stopped = interrupted = False
        try:
            while any(proc.poll() is None for proc in procs) and not stopped:
                time.sleep(POLL_S)
                stats = _collect(run_dir, logs, start, options)
                on_progress(stats)
                stopped = (_budget_spent(options, stats, start)
                           or (run_dir / FAULT_FILE).exists())
                stop_point()
        except KeyboardInterrupt:
            stopped = interrupted = True
        if stopped:
            _stop(procs, grace)
        stats = _collect(run_dir, logs, start, options)
        stats.interrupted = interrupted
        fault = run_dir / FAULT_FILE
        if fault.exists():
            pickle.loads(fault.read_bytes()).raise_here()
    for worker, (proc, log) in enumerate(zip(procs, logs)):
        if proc.returncode != 0 and not (stopped and -proc.returncode in _STOP_SIGNALS):
            raise AtherisError(f"atheris worker {worker} exited with code {proc.returncode} "
                               f"(log: {log.path}):\n{log.tail()}")
    return stats


if __name__ == "__main__":
    worker_main(sys.argv)
