"""A fuzzing campaign: generate traces until time or examples run out, keep every finding.

The Hypothesis engine runs batches of examples of one (level, config) pair: every pair in
turn first, then pairs drawn with more weight where behaviour coverage still grew in their
latest batch, and on configs named by `--focus`. Each batch is seeded from the campaign seed,
so a seed, target and options give the same examples and the same findings. An example is
`kvfuzz.fuzz.generator.run_example` on bytes seeded by one Hypothesis draw: the rules build
valid ops straight from the bytes (with swarm testing, see there), so the campaign runs at
the executor's pace (docs/engines.md, "Where a campaign's time goes"). With an example database
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
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from kvfuzz.core.configs import BUILTIN, builtin_config
from kvfuzz.harness.executor import Counterexample, Execution
from kvfuzz.harness.targets import get_target
from kvfuzz.core.trace import save_finding
from kvfuzz.fuzz.coverage import behaviour_features
from kvfuzz.core.errors import KvfuzzError
from kvfuzz.fuzz.database import open_database
from kvfuzz.fuzz.generator import FOCUS_OPS, focus_features, run_example
from kvfuzz.fuzz.plugins import import_plugins
from kvfuzz.fuzz.shrink import shrink_trace

LEVELS = ("api", "scheduler")
BATCH_EXAMPLES = 10
BYTES_PER_STEP = 24
"""Decisions a rule takes at most, about (an example ends early if its bytes run out)."""


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
    swarm: bool = True
    """Swarm testing: each example leaves out a random subset of the optional rules and knobs."""
    weighting: bool = True
    """After one batch of every pair, pairs whose behaviour coverage still grows get more."""
    focus: tuple[str, ...] = ()
    """Config and op names to favour (`check_focus`)."""
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


class FocusError(KvfuzzError):
    """A `--focus` name is neither a campaign config nor an op."""


def check_focus(names: tuple[str, ...], configs: tuple[str, ...]) -> None:
    """Every focus name is one of the campaign's configs or an op of docs/traces.md."""
    for name in names:
        if name not in configs and name not in FOCUS_OPS:
            raise FocusError(f"--focus {name!r} is neither a config of this campaign "
                             f"({', '.join(configs)}) nor an op ({', '.join(FOCUS_OPS)})")


FOCUS_WEIGHT = 3
"""How much more a focused pair weighs than the others."""


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
        check_focus(options.focus, options.configs)
        self.focus_rules = focus_features(n for n in options.focus if n in FOCUS_OPS)
        self.growth: dict[tuple[str, str], int] = {}
        """New behaviour features of each pair's latest batch (the weighting's signal)."""

    def batch_seed(self, index: int) -> int:
        material = f"{self.options.seed}:{self.worker}:{index}".encode()
        return int.from_bytes(hashlib.sha256(material).digest()[:8], "big")

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """The (level, config) pairs the campaign rotates through."""
        return [(level, name) for name in self.options.configs for level in self.options.levels]

    def example(self, level: str, name: str, data: bytes) -> None:
        """Run one example of pair (level, name) from its bytes (both engines call this)."""
        opts = self.options
        run_example(
            data, builtin_config(name), level, steps=opts.steps, targets=(opts.target,),
            model=opts.model, checks=None if self.checks is None else tuple(self.checks),
            allow_misuse=opts.target != "vllm", swarm=opts.swarm, focus=self.focus_rules,
            on_execution=self._executions.append,
        )

    def database_key(self, level: str, name: str) -> bytes:
        """What keys a pair's examples in the database: they replay only under the same target,
        level, config, model, data checks, steps, swarm, focused ops and plugins."""
        opts = self.options
        key = repr((opts.target, level, name, opts.model, opts.data, opts.steps, opts.swarm,
                    sorted(self.focus_rules), opts.plugins))
        return f"Campaign_{level}_{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}".encode()

    def hypothesis_batch(self, level: str, name: str, count: int, seed: int) -> None:
        """`count` examples of one pair (after the database's saved failures for the pair).
        Hypothesis draws 8 bytes per example, which seed the example's decision bytes (its own
        draws cost more than the ops they would decide, and a campaign shrinks traces, not
        choices); 8 zero bytes, Hypothesis' simplest draw, stand for all-zero decisions, the
        simplest example."""
        size = self.example_bytes

        @settings(max_examples=count, deadline=None, database=self.database,
                  phases=[Phase.reuse, Phase.generate], suppress_health_check=list(HealthCheck),
                  report_multiple_bugs=False)
        @given(st.binary(min_size=8, max_size=8))
        def batch(example_seed: bytes) -> None:
            data = random.Random(example_seed).randbytes(size) if any(example_seed) else bytes(size)
            self.example(level, name, data)

        batch._hypothesis_internal_use_seed = seed  # type: ignore[attr-defined]
        batch.hypothesis.inner_test._hypothesis_internal_add_digest = (  # type: ignore[attr-defined]
            self.database_key(level, name))
        batch()

    @property
    def example_bytes(self) -> int:
        """Bytes per Hypothesis example: enough decisions for `steps` rules."""
        return BYTES_PER_STEP * self.options.steps + 64

    def run(self) -> Stats:
        logging.getLogger("kvfuzz.kvcache").setLevel(logging.ERROR)
        opts = self.options
        start = time.monotonic()
        pairs = self.pairs
        index = 0
        level, name = pairs[0]
        try:
            while not self._done(start):
                level, name = self.next_pair(index)
                count = self._batch_size()
                try:
                    self.hypothesis_batch(level, name, count, self.batch_seed(index))
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

    def next_pair(self, index: int) -> tuple[str, str]:
        """The pair of batch `index`: every pair in turn for the first round (and always,
        without weighting); then drawn, seeded by the batch, with weight 1 + the new features
        of the pair's latest batch, times FOCUS_WEIGHT for a focused config."""
        pairs = self.pairs
        if index < len(pairs) or not (self.options.weighting or self.options.focus):
            return pairs[index % len(pairs)]
        focus = set(self.options.focus)
        weights = [(1 + (self.growth.get(p, 0) if self.options.weighting else 0))
                   * (FOCUS_WEIGHT if p[1] in focus else 1) for p in pairs]
        return random.Random(self.batch_seed(index)).choices(pairs, weights)[0]

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
        known = len(self.stats.features)
        for execution in self._executions:
            self.stats.operations += execution.ops_checked
            pair.operations += execution.ops_checked
            self.stats.checks += execution.checks_run
            self.stats.features |= behaviour_features(execution)
        self._executions.clear()
        self.growth[(level, name)] = len(self.stats.features) - known

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
