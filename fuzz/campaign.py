"""A fuzzing campaign: generate traces until time or examples run out, keep every finding.

The Hypothesis engine runs the state machines of `kvfuzz.fuzz.machines` in batches, one
(level, config) pair after another, each batch seeded from the campaign seed, so a seed,
target and options give the same examples and the same findings. With an example database
(`CampaignOptions.database`) each batch first replays the failing examples saved there by earlier
campaigns with the same options, then generates its seeded ones. Hypothesis's own shrinking
is off: a failing trace is shrunk by `kvfuzz.fuzz.shrink` (fast, and the same for every engine) and
saved atomically in the corpus folder under a name that says the check it breaks.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings

from kvfuzz.core.configs import BUILTIN, builtin_config
from kvfuzz.harness.executor import Counterexample, Execution
from kvfuzz.harness.targets import get_target
from kvfuzz.core.trace import save_finding
from kvfuzz.fuzz.coverage import behaviour_features
from kvfuzz.fuzz.database import open_database
from kvfuzz.fuzz.plugins import import_plugins
from kvfuzz.fuzz.shrink import shrink_trace

LEVELS = ("api", "scheduler")
BATCH_EXAMPLES = 10


@dataclass
class CampaignOptions:
    target: str = "kvcache"
    seconds: float | None = 60.0
    examples: int | None = None
    seed: int = 0
    workers: int = 1
    configs: tuple[str, ...] = tuple(BUILTIN)
    plugins: tuple[str, ...] = ()
    corpus: Path = Path("kvfuzz-corpus")
    model: bool = True
    levels: tuple[str, ...] = LEVELS
    steps: int = 40
    engine: str = "hypothesis"
    shrink_seconds: float = 30.0
    max_findings: int | None = None
    """Stop once this many distinct findings are saved (None: run the whole budget)."""
    data: str | None = None
    """Add the data checks D1, D2 on this `DEVICE[:DTYPE]` (None: the invariants only)."""
    database: tuple[str, ...] = ()
    """Hypothesis' example database, as specs of `kvfuzz.fuzz.database` (directories, Redis
    URLs): failing examples are saved there and replayed first by later campaigns with the same
    options, on any machine sharing it (empty: no database)."""


@dataclass
class FindingRecord:
    check: str
    message: str
    config: str
    level: str
    file: str
    ops: int
    found_after_s: float
    shrink_s: float


@dataclass
class PairStats:
    """Examples and operations of one (level, config) pair."""

    examples: int = 0
    operations: int = 0


@dataclass
class Stats:
    """Progress of one worker (or the sum over workers)."""

    examples: int = 0
    operations: int = 0
    checks: int = 0
    features: set[tuple[Any, ...]] = field(default_factory=set)
    findings: list[FindingRecord] = field(default_factory=list)
    elapsed: float = 0.0
    edges: int = 0
    """libFuzzer's edge coverage (`cov:`) of the atheris engine, the largest over workers."""
    pairs: dict[tuple[str, str], PairStats] = field(default_factory=dict)
    """The examples and operations of each (level, config) pair, in the order first run."""
    interrupted: bool = False
    """The campaign was ended by Ctrl-C or SIGTERM before its budget was spent."""

    def pair(self, level: str, config: str) -> PairStats:
        return self.pairs.setdefault((level, config), PairStats())

    def merge(self, other: Stats) -> None:
        self.examples += other.examples
        self.operations += other.operations
        self.checks += other.checks
        self.features |= other.features
        self.findings.extend(other.findings)
        self.elapsed = max(self.elapsed, other.elapsed)
        self.edges = max(self.edges, other.edges)
        for (level, config), counts in other.pairs.items():
            mine = self.pair(level, config)
            mine.examples += counts.examples
            mine.operations += counts.operations
        self.interrupted = self.interrupted or other.interrupted

    def by_config(self) -> list[dict[str, Any]]:
        """One row per (level, config) pair run: examples, operations, findings."""
        return [
            {"level": level, "config": config, **asdict(counts),
             "findings": sum(f.level == level and f.config == config for f in self.findings)}
            for (level, config), counts in self.pairs.items()
        ]

    def summary(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "operations": self.operations,
            "invariant_checks": self.checks,
            "coverage": len(self.features),
            "edges": self.edges,
            "seconds": round(self.elapsed, 2),
            "interrupted": self.interrupted,
            "by_config": self.by_config(),
            "findings": [asdict(f) for f in self.findings],
        }


class Stop(Exception):
    """Raised from a signal handler to end a campaign early, keeping its findings."""


STOP_REQUESTED = threading.Event()
"""Set by the signal handlers beside the exception they raise: should a library swallow that
exception, the campaign still ends at its next batch."""


def interrupt(signum: int, frame: Any) -> None:
    """Signal handler of `kvfuzz run` (SIGINT, SIGTERM): end the campaign like Ctrl-C."""
    STOP_REQUESTED.set()
    raise KeyboardInterrupt


def selected_checks(data: str | None) -> list[Any] | None:
    """Every registered invariant, plus the data checks on `data` (`DEVICE[:DTYPE]`); None
    (every registered invariant, the executor's default) when `data` is None."""
    if data is None:
        return None
    from kvfuzz.properties import REGISTRY
    from kvfuzz.properties.data import data_checks_for

    return list(REGISTRY) + data_checks_for(data)


class Campaign:
    """One worker's campaign (the CLI runs K of them in processes with disjoint seeds)."""

    def __init__(self, options: CampaignOptions, worker: int = 0,
                 report: Callable[[Stats], None] | None = None) -> None:
        self.options = options
        self.worker = worker
        self.report = report
        self.stats = Stats()
        self._seen: set[tuple[str, str, str]] = set()
        self._executions: list[Execution] = []
        self.checks = selected_checks(options.data)
        self.database = open_database(options.database)

    def batch_seed(self, index: int) -> int:
        material = f"{self.options.seed}:{self.worker}:{index}".encode()
        return int.from_bytes(hashlib.sha256(material).digest()[:8], "big")

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """The (level, config) pairs the campaign rotates through."""
        return [(level, name) for name in self.options.configs for level in self.options.levels]

    def machine(self, level: str, name: str) -> type:
        """A state machine generating `level` traces on config `name`, counted by this campaign."""
        from kvfuzz.fuzz.machines import machine_for

        opts = self.options
        machine = machine_for(
            level,
            targets=(opts.target,),
            model=opts.model,
            config_names=(name,),
            allow_misuse=opts.target != "vllm",
            checks=None if self.checks is None else tuple(self.checks),
            name=self.machine_name(level, name),
        )
        machine.on_execution = self._executions.append
        return machine

    def machine_name(self, level: str, name: str) -> str:
        """The machine's class name, which keys its examples in the database: they replay only
        under the same target, level, config, model, data checks, steps and plugins."""
        opts = self.options
        key = repr((opts.target, level, name, opts.model, opts.data, opts.steps, opts.plugins))
        return f"Campaign_{level}_{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"

    def run(self) -> Stats:
        logging.getLogger("kvfuzz.kvcache").setLevel(logging.ERROR)
        opts = self.options
        start = time.monotonic()
        pairs = self.pairs
        index = 0
        level, name = pairs[0]
        try:
            while not self._done(start):
                level, name = pairs[index % len(pairs)]
                machine = self.machine(level, name)
                machine._hypothesis_internal_use_seed = self.batch_seed(index)
                count = self._batch_size()
                test = machine.TestCase
                test.settings = settings(
                    max_examples=count,
                    stateful_step_count=opts.steps,
                    deadline=None,
                    database=self.database,
                    phases=[Phase.reuse, Phase.generate],
                    suppress_health_check=list(HealthCheck),
                    report_multiple_bugs=False,
                )
                try:
                    test("runTest").runTest()
                except Counterexample as exc:
                    self._record(exc, level, name, start)
                except Exception:
                    # An interrupt during Hypothesis's replay of a failure surfaces as its
                    # Flaky error: the campaign ends as interrupted, keeping what it found.
                    if not STOP_REQUESTED.is_set():
                        raise
                self._account(level, name, count)
                self.stats.elapsed = time.monotonic() - start
                if self.report is not None:
                    self.report(self.stats)
                index += 1
        except (KeyboardInterrupt, Stop):
            self.stats.interrupted = True
            self._account(level, name)
            self.stats.elapsed = time.monotonic() - start
        # A library that swallowed the interrupt's exception leaves only the flag.
        self.stats.interrupted = self.stats.interrupted or STOP_REQUESTED.is_set()
        return self.stats

    def _batch_size(self) -> int:
        if self.options.examples is None:
            return BATCH_EXAMPLES
        return max(0, min(BATCH_EXAMPLES, self.options.examples - self.stats.examples))

    def _done(self, start: float) -> bool:
        opts = self.options
        if STOP_REQUESTED.is_set():
            return True
        if opts.max_findings is not None and len(self.stats.findings) >= opts.max_findings:
            return True
        if opts.examples is not None and self.stats.examples >= opts.examples:
            return True
        return opts.seconds is not None and time.monotonic() - start >= opts.seconds

    def _account(self, level: str, name: str, examples: int = 0) -> None:
        """Add the finished examples and the executions run since the last call to the totals
        and to the (level, config) pair they ran on."""
        pair = self.stats.pair(level, name)
        self.stats.examples += examples
        pair.examples += examples
        for execution in self._executions:
            self.stats.operations += execution.ops_checked
            pair.operations += execution.ops_checked
            self.stats.checks += execution.checks_run
            self.stats.features |= behaviour_features(execution)
        self._executions.clear()

    def _record(self, exc: Counterexample, level: str, name: str, start: float) -> None:
        finding = exc.finding
        key = (finding.check, level, name)
        if key in self._seen:
            return
        self._seen.add(key)
        found_after = time.monotonic() - start
        t = time.monotonic()
        target = get_target(self.options.target).name
        shrunk = shrink_trace(
            finding.trace, [target], model=self.options.model, checks=self.checks,
            seconds=self.options.shrink_seconds,
        )
        trace = shrunk.trace
        trace.meta.update({"check": finding.check, "target": target, "config": name,
                           "seed": self.options.seed, "level": level})
        if self.options.data is not None:
            trace.meta["data"] = self.options.data
        if self.options.plugins:
            trace.meta["plugins"] = list(self.options.plugins)
        path = save_finding(trace, self.options.corpus)
        self.stats.findings.append(
            FindingRecord(
                check=finding.check,
                message=shrunk.finding.message,
                config=name,
                level=level,
                file=str(path),
                ops=len(trace.ops),
                found_after_s=round(found_after, 3),
                shrink_s=round(time.monotonic() - t, 3),
            )
        )


def _worker(options: CampaignOptions, worker: int, queue: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def stop(signum: int, frame: Any) -> None:
        STOP_REQUESTED.set()
        raise Stop()

    signal.signal(signal.SIGTERM, stop)
    import_plugins(options.plugins)
    campaign = Campaign(options, worker, report=lambda stats: queue.put(("progress", worker,
                                                                         _portable(stats))))
    stats = campaign.run()
    queue.put(("done", worker, _portable(stats)))


def _portable(stats: Stats) -> Stats:
    """A copy to queue: the queue pickles it later, while the campaign goes on."""
    return copy.deepcopy(stats)


def run_campaign(options: CampaignOptions, on_progress: Callable[[Stats], None]) -> Stats:
    """Run `options.workers` workers; call on_progress with the running totals."""
    for name in options.configs:
        builtin_config(name)
    STOP_REQUESTED.clear()
    if options.workers <= 1:
        import_plugins(options.plugins)
        return Campaign(options, 0, report=on_progress).run()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(worker_options, w, queue), daemon=True)
             for w, worker_options in enumerate(_split_examples(options))]
    for p in procs:
        p.start()
    latest: dict[int, Stats] = {}
    done: set[int] = set()
    interrupted = False
    try:
        while len(done) < len(procs):
            try:
                kind, worker, stats = queue.get(timeout=0.5)
            except Exception:  # queue.Empty: check for dead workers
                if all(not p.is_alive() for p in procs):
                    break
                continue
            latest[worker] = stats
            if kind == "done":
                done.add(worker)
            on_progress(_total(latest))
    except KeyboardInterrupt:
        interrupted = True
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while len(done) < len(procs) and time.monotonic() < deadline:
            try:
                kind, worker, stats = queue.get(timeout=0.5)
            except Exception:
                continue
            latest[worker] = stats
            if kind == "done":
                done.add(worker)
    for p in procs:
        p.join(timeout=5)
    total = _total(latest)
    total.interrupted = total.interrupted or interrupted
    return total


def _split_examples(options: CampaignOptions) -> list[CampaignOptions]:
    """Each worker's options: an examples budget is shared out, a time budget is everyone's."""
    if options.examples is None:
        return [options] * options.workers
    share, extra = divmod(options.examples, options.workers)
    return [replace(options, examples=share + (w < extra))
            for w in range(options.workers) if share + (w < extra)]


def _total(latest: dict[int, Stats]) -> Stats:
    total = Stats()
    for stats in latest.values():
        total.merge(stats)
    return total
