"""A fuzzing campaign: generate traces until time or examples run out, keep every finding.

The campaign is a stream of (level, config, seed) batches from `kvfuzz.fuzz.schedule.Schedule`,
which shares the budget out so that every pair is reached. A backend runs each batch with
`run_batch` (here for `--workers 1`, in worker processes for `--workers K`, see
`kvfuzz.fuzz.workers`); `Campaign` takes the results in batch order, so the same seed and
options give the same examples and findings whatever the number of workers. A batch runs a
state machine of `kvfuzz.fuzz.machines` with Hypothesis seeded from the batch seed. With an
example database (`CampaignOptions.database`) each batch first replays the failing examples
saved there by earlier campaigns with the same options. Hypothesis's own shrinking is off: a
failure is deduplicated, saved raw, shrunk by `kvfuzz.fuzz.shrink` and saved again, once, by
the driver (`kvfuzz.fuzz.findings`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from kvfuzz.core.configs import BUILTIN, builtin_config
from kvfuzz.harness.executor import Counterexample, Execution
from kvfuzz.harness.targets import get_target
from kvfuzz.fuzz.coverage import behaviour_features
from kvfuzz.fuzz.findings import FindingRecord, Findings, by_check
from kvfuzz.fuzz.plugins import import_plugins
from kvfuzz.fuzz.schedule import (FEW_EXAMPLES, Backend, Batch, BatchResult, Failure, InProcess,
                                  Pair, Schedule)

LEVELS = ("api", "scheduler")


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
    database: Path | None = None
    """Hypothesis' example database directory: failing examples are saved there and replayed
    first by later campaigns with the same options (None: no database)."""


@dataclass
class PairStats:
    """Examples and operations of one (level, config) pair."""

    examples: int = 0
    operations: int = 0


@dataclass
class Stats:
    """Progress of a campaign (or of one atheris worker, or their sum)."""

    examples: int = 0
    operations: int = 0
    checks: int = 0
    features: set[tuple[Any, ...]] = field(default_factory=set)
    findings: list[FindingRecord] = field(default_factory=list)
    elapsed: float = 0.0
    edges: int = 0
    """libFuzzer's edge coverage (`cov:`) of the atheris engine, the largest over workers."""
    pairs: dict[Pair, PairStats] = field(default_factory=dict)
    """The examples and operations of each (level, config) pair, in the campaign's order."""
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

    def add(self, result: BatchResult) -> None:
        """Count a batch's examples, operations, checks and features."""
        pair = self.pair(*result.batch.pair)
        pair.examples += result.examples
        pair.operations += result.operations
        self.examples += result.examples
        self.operations += result.operations
        self.checks += result.checks
        self.features |= result.features
        self.interrupted = self.interrupted or result.interrupted

    def pairs_done(self) -> int:
        return sum(1 for counts in self.pairs.values() if counts.examples)

    def unreached(self) -> list[Pair]:
        """The pairs of the campaign that ran no example."""
        return [pair for pair, counts in self.pairs.items() if not counts.examples]

    def few(self) -> list[Pair]:
        """The pairs that ran some examples, fewer than `FEW_EXAMPLES`."""
        return [pair for pair, c in self.pairs.items() if 0 < c.examples < FEW_EXAMPLES]

    def by_config(self) -> list[dict[str, Any]]:
        """One row per (level, config) pair: examples, operations, findings."""
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
            "pairs": len(self.pairs),
            "pairs_reached": self.pairs_done(),
            "unreached": ["/".join(p) for p in self.unreached()],
            f"under_{FEW_EXAMPLES}_examples": ["/".join(p) for p in self.few()],
            "by_config": self.by_config(),
            "by_check": by_check(self.findings),
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


def campaign_pairs(options: CampaignOptions) -> list[Pair]:
    """The (level, config) pairs of a campaign, in its order."""
    return [(level, name) for name in options.configs for level in options.levels]


def machine_name(options: CampaignOptions, level: str, name: str) -> str:
    """A state machine's class name, which keys its examples in the database: they replay only
    under the same target, level, config, model, data checks, steps and plugins."""
    opts = options
    key = repr((opts.target, level, name, opts.model, opts.data, opts.steps, opts.plugins))
    return f"Campaign_{level}_{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def campaign_machine(options: CampaignOptions, level: str, name: str,
                     on_execution: Callable[[Execution], None]) -> type:
    """A state machine generating `level` traces on config `name`, each execution handed to
    `on_execution` when it ends."""
    from kvfuzz.fuzz.machines import machine_for

    machine = machine_for(
        level,
        targets=(options.target,),
        model=options.model,
        config_names=(name,),
        allow_misuse=options.target != "vllm",
        checks=_checks(options.data),
        name=machine_name(options, level, name),
    )
    machine.on_execution = on_execution
    return machine


@functools.lru_cache(maxsize=8)
def _checks(data: str | None) -> tuple[Any, ...] | None:
    checks = selected_checks(data)
    return None if checks is None else tuple(checks)


@functools.lru_cache(maxsize=8)
def _database(path: Path | None) -> DirectoryBasedExampleDatabase | None:
    return None if path is None else DirectoryBasedExampleDatabase(path)


def failure_of(exc: Counterexample) -> Failure:
    """A counterexample as plain data, to hand back from any process."""
    f = exc.finding
    return Failure(f.check, f.message, tuple(f.signature), f.trace.to_json())


def account(result: BatchResult, executions: list[Execution]) -> None:
    """Add the operations, checks and features of the executions run to `result`."""
    for execution in executions:
        result.operations += execution.ops_checked
        result.checks += execution.checks_run
        result.features |= behaviour_features(execution)


def run_batch(options: CampaignOptions, batch: Batch) -> BatchResult:
    """Run one batch, in whatever process a backend chose: its examples with Hypothesis,
    seeded from the batch seed, stopping at the first counterexample (returned raw)."""
    logging.getLogger("kvfuzz.kvcache").setLevel(logging.ERROR)
    result = BatchResult(batch)
    start = time.monotonic()
    executions: list[Execution] = []
    machine = campaign_machine(options, batch.level, batch.config, executions.append)
    machine._hypothesis_internal_use_seed = batch.seed
    test = machine.TestCase
    test.settings = settings(
        max_examples=batch.examples,
        stateful_step_count=options.steps,
        deadline=None,
        database=_database(options.database),
        phases=[Phase.reuse, Phase.generate],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    try:
        test("runTest").runTest()
        result.examples = batch.examples
    except Counterexample as exc:
        result.failure = failure_of(exc)
        result.examples = batch.examples
    except (KeyboardInterrupt, Stop):
        result.interrupted = True
    except Exception:
        # An interrupt during Hypothesis's replay of a failure surfaces as its Flaky error.
        if not STOP_REQUESTED.is_set():
            raise
        result.interrupted = True
    account(result, executions)
    result.interrupted = result.interrupted or STOP_REQUESTED.is_set()
    result.seconds = time.monotonic() - start
    return result


def campaign_findings(options: CampaignOptions) -> Findings:
    """The findings of a campaign into its corpus, each saved with its target, seed, data
    checks and plugins."""
    meta: dict[str, Any] = {"target": get_target(options.target).name, "seed": options.seed}
    if options.data is not None:
        meta["data"] = options.data
    if options.plugins:
        meta["plugins"] = list(options.plugins)
    return Findings(options.corpus, meta, [meta["target"]], model=options.model,
                    checks=selected_checks(options.data), shrink_seconds=options.shrink_seconds)


class Campaign:
    """The driver: batches from the schedule to a backend, results back into the stats and
    the findings, in batch order."""

    def __init__(self, options: CampaignOptions,
                 report: Callable[[Stats], None] | None = None) -> None:
        self.options = options
        self.report = report
        self.stats = Stats()
        self.schedule = Schedule(campaign_pairs(options), options.seed, options.examples)
        for level, name in self.schedule.pairs:
            self.stats.pair(level, name)
        self.findings = campaign_findings(options)
        self._waiting: dict[int, BatchResult] = {}
        self._next = 0
        self._start = 0.0

    def run(self, backend: Backend | None = None) -> Stats:
        """Run the campaign on `backend` (default: this process) until its budget is spent."""
        if backend is None:
            backend = InProcess(functools.partial(run_batch, self.options))
        self._start = time.monotonic()
        in_flight = 0
        try:
            while True:
                while in_flight < backend.capacity and not self._done():
                    batch = self.schedule.next_batch(self._seconds_left(), backend.capacity)
                    if batch is None:
                        break
                    backend.submit(batch)
                    in_flight += 1
                if not in_flight:
                    break
                for result in backend.results(timeout=0.5):
                    in_flight -= 1
                    self._take(result)
                if self.stats.interrupted:
                    raise Stop()
        except (KeyboardInterrupt, Stop):
            self.stats.interrupted = True
            self.findings.shrink_seconds = 0.0  # save what is still coming, raw: stop soon
            self._take_all(backend.close(cancel=True))
        else:
            self._take_all(backend.close(cancel=False))
        self.stats.interrupted = self.stats.interrupted or STOP_REQUESTED.is_set()
        self.stats.elapsed = time.monotonic() - self._start
        return self.stats

    def _seconds_left(self) -> float | None:
        if self.options.seconds is None:
            return None
        return max(0.0, self.options.seconds - (time.monotonic() - self._start))

    def _done(self) -> bool:
        opts = self.options
        if STOP_REQUESTED.is_set() or self.stats.interrupted:
            return True
        if opts.max_findings is not None and len(self.findings.records) >= opts.max_findings:
            return True
        left = self._seconds_left()
        return left is not None and left <= 0

    def _take(self, result: BatchResult) -> None:
        """Take results in batch order (a later batch waits for the earlier ones)."""
        self._waiting[result.batch.index] = result
        while self._next in self._waiting:
            self._count(self._waiting.pop(self._next))
            self._next += 1

    def _take_all(self, results: list[BatchResult]) -> None:
        """The last results: in batch order, whatever went missing."""
        for result in results:
            self._waiting[result.batch.index] = result
        for index in sorted(self._waiting):
            self._count(self._waiting.pop(index))

    def _count(self, result: BatchResult) -> None:
        self.schedule.record(result)
        self.stats.add(result)
        self.stats.elapsed = time.monotonic() - self._start
        if result.failure is not None:
            try:
                self.findings.offer(result.failure, *result.batch.pair, self.stats.elapsed)
            finally:
                self.stats.findings = self.findings.all()
        if self.report is not None:
            self.report(self.stats)


def run_campaign(options: CampaignOptions, on_progress: Callable[[Stats], None],
                 backend: Backend | None = None) -> Stats:
    """Run a campaign on `backend` (default: `--workers` local processes, or this process);
    call on_progress with the running totals."""
    for name in options.configs:
        builtin_config(name)
    STOP_REQUESTED.clear()
    import_plugins(options.plugins)
    campaign = Campaign(options, report=on_progress)
    if backend is None and options.workers > 1:
        from kvfuzz.fuzz.workers import LocalWorkers

        backend = LocalWorkers(options, options.workers)
    return campaign.run(backend)
