"""A fuzzing campaign: generate traces until time or examples run out, keep every finding.

The campaign is a stream of (level, config, seed) batches from `kvfuzz.fuzz.schedule.Schedule`,
which shares the budget out so that every pair is reached first; after that round, a pair
weighs 1 + its share of the target's code that few configs reached in the round (`RARE`: lines
and branches of the target's own source, `kvfuzz.fuzz.code_coverage`), plus log2(1 + the sites
its latest batch reached first), plus up to 20 % when its behaviour coverage still grew
(`weighting`), and the configs named by `--focus` three times as much. A backend runs each batch with a `BatchRunner` (in this process for
`--workers 1`, in worker processes for `--workers K`, see `kvfuzz.fuzz.workers`); `Campaign`
takes the results in batch order, so the same seed and options give the same examples and
findings whatever the number of workers. An example is `kvfuzz.fuzz.generator.run_example` on
bytes seeded by one Hypothesis draw: the rules build valid ops straight from the bytes (with
swarm testing, see there), so the campaign runs at the executor's pace (docs/engines.md,
"Where a campaign's time goes"). With an example database (`CampaignOptions.database`) each
batch first replays the failing examples saved there by earlier campaigns with the same
options. Hypothesis's own shrinking is off: a failure is deduplicated, saved raw, shrunk by
`kvfuzz.fuzz.shrink` and saved again, once, by the driver (`kvfuzz.fuzz.findings`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, assume, given, settings, strategies as st

from kvfuzz.core.config import Config
from kvfuzz.core.configs import BUILTIN, builtin_config
from kvfuzz.core.errors import KvfuzzError
from kvfuzz.core.signals import SIGNALLED
from kvfuzz.harness.build import ToleratedBuild
from kvfuzz.harness.executor import Counterexample, Execution
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.tolerance import Tolerance
from kvfuzz.fuzz.config_space import (GENERATED, TRIES, NoConfig, cross_features,
                                      generated_config)
from kvfuzz.fuzz.code_coverage import (CodeRecorder, Site, count_lines, package_roots, rarity,
                                       target_packages)
from kvfuzz.fuzz.coverage import StateProbe, behaviour_features
from kvfuzz.fuzz.database import open_database, quiet, warn
from kvfuzz.fuzz.findings import FindingRecord, Findings, by_check
from kvfuzz.fuzz.generator import FOCUS_OPS, focus_features, run_example
from kvfuzz.fuzz.plugins import import_plugins
from kvfuzz.fuzz.schedule import (FEW_EXAMPLES, LAG, Backend, Batch, BatchResult, Failure,
                                  InProcess, Pair, Schedule)

LEVELS = ("api", "scheduler")
BYTES_PER_STEP = 24
"""Decisions a rule takes at most, about (an example ends early if its bytes run out)."""
FOCUS_WEIGHT = 3
"""How much more a focused pair weighs than the others."""
GROWTH_GAIN = 0.2
"""The most a pair whose coverage grows weighs more than one whose coverage stopped: a pair
(and a bug only it shows) then gets at least 1/1.2 of its even share. Weights of 1 + the new
features (up to 30 times the share) delayed the pairs that grew little: watermark-ignored took
twice the ops over every config (docs/engines.md)."""
CODE_GAIN = "1 + log2(1 + new sites)"
"""How a pair's weight grows with the target's code (lines and branches) its latest batch after
the first round reached first (`code_weight`): without a cap, so a pair still reaching new code
gets several times its share, on a log scale. The first round earns none of it: its sites are
new to whichever pair the order puts first (the code every pair runs, to the first), so the
round is weighed as a whole (`RARE`)."""
RARE = 4
"""The first round's sites that at most this many configs reached weigh their pairs (1/n each
for a site n configs reached, `kvfuzz.fuzz.code_coverage.rarity`), without a cap: code that
few configs run gets their examples. On vLLM 0.34.0 the events, connector, retention and
checkpoint-replay configs lead (300 examples over 110 pairs gave each 2-8 before, and mutants
only those configs reach survived, docs/mutation.md)."""
GROWTH_FULL = 10
"""New features in a batch that earn the whole gain (fewer: a proportional part)."""
POLL_S = 0.1
"""How long the driver waits for a batch result before it looks for a stop again (SIGTERM)."""
PROBE_S = 2.0
"""How often the driver pings a shared example database (`Campaign._probe_database`)."""


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
    """Swarm testing: after a pair's first batch, each example may leave out a random subset
    of the optional rules and knobs."""
    weighting: bool = True
    """After one batch of every pair, pairs whose behaviour coverage still grows get more."""
    generated: bool = False
    """Add a pair `generated` per level whose every batch runs a config drawn from the batch's
    seed over the knob space (`kvfuzz.fuzz.config_space`), one the target can build."""
    code_coverage: bool = True
    """Record the target's own code coverage per batch (summary, JSON) and, with weighting,
    weigh pairs by the code they newly reach (`kvfuzz.fuzz.code_coverage`)."""
    focus: tuple[str, ...] = ()
    """Config and op names to favour (`check_focus`)."""
    lag: int = LAG
    """Batches between a result and the batch its weight first applies to: at most this many
    run at once, and the same lag gives the same batches whatever runs them."""
    engine: str = "hypothesis"
    shrink_seconds: float = 30.0
    max_findings: int | None = None
    """Stop once this many distinct findings are saved (None: run the whole budget)."""
    count_raised: bool = True
    """Whether a finding on which the target raised counts toward `max_findings`; False goes
    on past them to the first finding of a check on results, state, events or hashes (`kvfuzz
    mutate`, which tells a kill by the target's exception alone from one a check made)."""
    data: str | None = None
    """Add the data checks D1, D2 on this `DEVICE[:DTYPE]` (None: the invariants only)."""
    config_files: tuple[Config, ...] = ()
    """Users' configs (`--config-file`), run as given (not varied), by their names in
    `configs`."""
    deadline: float | None = None
    """When a `seconds` budget ends, in `time.time()`'s clock (set by `run_campaign`): a batch
    stops there, at its next op or check, in any process."""
    tolerance: Tolerance = field(default_factory=Tolerance)
    """Known deviations tolerated beyond the target's own, or reported after all
    (`--tolerate`, `--no-tolerate`)."""
    database: tuple[str, ...] = ()
    """Hypothesis' example database, as specs of `kvfuzz.fuzz.database` (directories, Redis
    URLs): failing examples are saved there and replayed first by later campaigns with the same
    options, on any machine sharing it (empty: no database)."""


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
    tolerated: dict[str, int] = field(default_factory=dict)
    """Per known deviation (`id name`), the examples in which the target tolerated it."""
    code: dict[Pair, set[Site]] = field(default_factory=dict)
    """Per pair, the target's code sites (lines, branches) its batches ran."""
    code_total: set[Site] = field(default_factory=set)
    """Every pair's code sites together."""
    generated: dict[str, list[str]] = field(default_factory=dict)
    """Per generated config run (by name), the cross-feature combinations it has."""

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
        count_into(self.tolerated, other.tolerated)
        for pair, sites in other.code.items():
            self.code.setdefault(pair, set()).update(sites)
        self.code_total |= other.code_total
        self.generated.update(other.generated)

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
        count_into(self.tolerated, result.tolerated)
        if result.code:
            self.code.setdefault(result.batch.pair, set()).update(result.code)
            self.code_total |= result.code
        if result.generated is not None:
            name, features = result.generated
            self.generated[name] = list(features)

    def pairs_done(self) -> int:
        return sum(1 for counts in self.pairs.values() if counts.examples)

    def unreached(self) -> list[Pair]:
        """The pairs of the campaign that ran no example."""
        return [pair for pair, counts in self.pairs.items() if not counts.examples]

    def few(self) -> list[Pair]:
        """The pairs that ran some examples, fewer than `FEW_EXAMPLES`."""
        return [pair for pair, c in self.pairs.items() if 0 < c.examples < FEW_EXAMPLES]

    def by_config(self) -> list[dict[str, Any]]:
        """One row per (level, config) pair: examples, operations, findings, the lines and
        branches of the target's code it ran."""
        return [
            {"level": level, "config": config, **asdict(counts),
             "findings": sum(f.level == level and f.config == config for f in self.findings),
             **dict(zip(("code_lines", "code_branches"),
                        count_lines(self.code.get((level, config), set()))))}
            for (level, config), counts in self.pairs.items()
        ]

    def summary(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "operations": self.operations,
            "invariant_checks": self.checks,
            "coverage": len(self.features),
            **dict(zip(("code_lines", "code_branches"), count_lines(self.code_total))),
            "edges": self.edges,
            "seconds": round(self.elapsed, 2),
            "interrupted": self.interrupted,
            "pairs": len(self.pairs),
            "pairs_reached": self.pairs_done(),
            "unreached": ["/".join(p) for p in self.unreached()],
            f"under_{FEW_EXAMPLES}_examples": ["/".join(p) for p in self.few()],
            "by_config": self.by_config(),
            "by_check": by_check(self.findings),
            "tolerated": dict(sorted(self.tolerated.items())),
            "generated_configs": self.generated,
            "findings": [asdict(f) for f in self.findings],
        }


def count_into(counts: dict[str, int], more: dict[str, int]) -> None:
    for key, n in more.items():
        counts[key] = counts.get(key, 0) + n


class Stop(Exception):
    """Ends a campaign early, keeping its findings (a batch came back interrupted)."""


STOP_REQUESTED = threading.Event()
"""Set by the signal handlers: the campaign stops at its next stop point (`stop_point`)."""


def interrupt(signum: int, frame: Any) -> None:
    """Signal handler of `kvfuzz run` (SIGINT, SIGTERM). The first signal only sets
    STOP_REQUESTED: the driver's loop, a batch run in this process (before each example) and a
    shrink (before each replay) then raise KeyboardInterrupt from kvfuzz's own code. A
    KeyboardInterrupt raised by the handler itself could land anywhere: in a queue's read, a
    `finally`, or a string `exec` (a dataclass being made), after which CPython ends a
    `python -m kvfuzz` by SIGINT at exit although the campaign caught the interrupt and kept its
    findings. A second signal, for a run that comes to no stop point, raises at once."""
    SIGNALLED.set()
    if STOP_REQUESTED.is_set():
        raise KeyboardInterrupt
    STOP_REQUESTED.set()


def stop_point() -> None:
    """Raise KeyboardInterrupt if a stop was asked for (`interrupt`)."""
    if STOP_REQUESTED.is_set():
        raise KeyboardInterrupt


class OutOfTime(BaseException):
    """The campaign's time budget ended during an example (a BaseException, so that Hypothesis
    lets it through as it does an interrupt, rather than replaying it as a failure)."""


def selected_checks(data: str | None) -> list[Any] | None:
    """Every registered invariant, plus the data checks on `data` (`DEVICE[:DTYPE]`); None
    (every registered invariant, the executor's default) when `data` is None."""
    if data is None:
        return None
    from kvfuzz.properties import REGISTRY
    from kvfuzz.properties.data import data_checks_for

    return list(REGISTRY) + data_checks_for(data)


def campaign_pairs(options: CampaignOptions) -> list[Pair]:
    """The (level, config) pairs of a campaign, in its order (the generated pairs last)."""
    names = options.configs + ((GENERATED,) if options.generated else ())
    return [(level, name) for name in names for level in options.levels]


class FocusError(KvfuzzError):
    """A `--focus` name is neither a campaign config nor an op."""


def check_focus(names: tuple[str, ...], configs: tuple[str, ...]) -> None:
    """Every focus name is one of the campaign's configs or an op of docs/traces.md."""
    for name in names:
        if name not in configs and name not in FOCUS_OPS:
            raise FocusError(f"--focus {name!r} is neither a config of this campaign "
                             f"({', '.join(configs)}) nor an op ({', '.join(FOCUS_OPS)})")


def pair_weight(options: CampaignOptions, pair: Pair, growth: int, code_growth: int = 0,
                rare: float = 0.0) -> float:
    """A pair's weight in the schedule: 1, plus (with weighting) `rare`, its share of the
    target code few configs reached in the first round (`RARE`), `code_weight` of the sites its
    latest batch reached first and up to GROWTH_GAIN for its new behaviour features, times
    FOCUS_WEIGHT for a focused config."""
    gain = 0.0
    if options.weighting:
        gain = GROWTH_GAIN * min(growth, GROWTH_FULL) / GROWTH_FULL
        if options.code_coverage:
            gain += rare + code_weight(code_growth)
    return (1 + gain) * (FOCUS_WEIGHT if pair[1] in options.focus else 1)


def code_weight(new_sites: int) -> float:
    """The weight a batch earns its pair by the target's code sites it reached first
    (CODE_GAIN, less the 1 every pair has)."""
    return math.log2(1 + new_sites)


def failure_of(exc: Counterexample) -> Failure:
    """A counterexample as plain data, to hand back from any process."""
    f = exc.finding
    return Failure(f.check, f.message, tuple(f.signature), f.trace.to_json(), f.target_raised)


def account(result: BatchResult, executions: list[Execution],
            reached: Collection[tuple[Any, ...]] = ()) -> None:
    """Add the operations, checks, features and tolerated deviations of the executions run
    (and the state behaviours `reached` by their ops) to `result`."""
    result.features.update(reached)
    for execution in executions:
        result.operations += execution.ops_checked
        result.checks += execution.checks_run
        result.features |= behaviour_features(execution)
        for tracked in execution.targets:
            labels = getattr(tracked.side, "tolerated_labels", None)
            count_into(result.tolerated, dict.fromkeys(labels() if labels else (), 1))


class BatchRunner:
    """Runs batches of one campaign in one process (each backend's worker makes one): the
    checks, the example database and the focused rules are set up once."""

    def __init__(self, options: CampaignOptions,
                 warn: Callable[[str], None] = quiet) -> None:
        """`warn` is told when a shared example database is lost: the driver's runner warns,
        a worker's stays quiet and says so in each result (`BatchResult.database_lost`)."""
        self.options = options
        checks = selected_checks(options.data)
        self.checks = None if checks is None else tuple(checks)
        self.database = open_database(options.database, warn=warn)
        check_focus(options.focus, options.configs)
        self.focus_rules = focus_features(n for n in options.focus if n in FOCUS_OPS)
        self.target = get_target(options.target).spec(options.tolerance)
        self.engine_config = get_target(options.target).engine_config
        """What the target's engine fixes of a built-in or generated config (a user's config
        file keeps what it says)."""
        self._tolerated_builds: dict[str, int] = {}
        self.on_execution: Callable[[Execution], None] | None = None
        """Also called with each execution (a benchmark keeps their traces)."""
        self._executions: list[Execution] = []
        self.probe = StateProbe()
        self.generated: Config | None = None
        """The config of the running batch of a generated pair."""
        self.code: CodeRecorder | None = None
        if options.code_coverage and options.engine == "hypothesis":  # atheris: libFuzzer's
            info = get_target(options.target)
            self.code = CodeRecorder(package_roots(target_packages(info.name, info.locate())))

    def example(self, level: str, name: str, data: bytes, swarm: bool = True) -> None:
        """Run one example of pair (level, name) from its bytes (both engines call this);
        `swarm=False` keeps every feature even with swarm testing on."""
        stop_point()
        opts = self.options
        try:
            config = self.generated if name == GENERATED else campaign_config(opts, name)
            users = name in {c.name for c in opts.config_files}
            run_example(
                data, config if users else self.engine_config(config), level, steps=opts.steps,
                targets=(self.target,), model=opts.model, checks=self.checks,
                allow_misuse=not opts.target.startswith("vllm"), swarm=opts.swarm and swarm,
                focus=self.focus_rules, on_execution=self._executed,
                vary=not users and name != GENERATED,
                on_op=self.probe.observe,
                stop=self._stop,
            )
        except ToleratedBuild as exc:  # a varied config the target documents it cannot build
            count_into(self._tolerated_builds, {exc.deviation: 1})

    def _stop(self) -> None:
        """An execution's stop point: a stop asked for, or the time budget spent."""
        stop_point()
        deadline = self.options.deadline
        if deadline is not None and time.time() >= deadline:
            raise OutOfTime

    def _executed(self, execution: Execution) -> None:
        if self.code is not None:
            for tracked in execution.targets:
                self.code.watch(tracked.side)
        self._executions.append(execution)
        if self.on_execution is not None:
            self.on_execution(execution)

    def buildable_config(self, seed: int) -> Config:
        """The generated config of `seed` the target can build: the first of the seeds drawn
        from `seed` whose config it builds (vLLM refuses some combinations at startup, and
        its Scheduler takes no `reserved_blocks`, say: a usage error for a named config)."""
        info = get_target(self.options.target)
        rng = random.Random(seed)
        for _ in range(TRIES):
            config = generated_config(seed)
            with contextlib.suppress(KvfuzzError):
                if info.cannot_build(config) is None:
                    return config
            seed = rng.getrandbits(64)
        raise NoConfig(f"target {info.name} built none of {TRIES} generated configs")

    def take_executions(self) -> list[Execution]:
        """The executions run since the last call."""
        done, self._executions = self._executions, []
        return done

    def take_tolerated_builds(self) -> dict[str, int]:
        """Examples since the last call whose config the target tolerates not building."""
        done, self._tolerated_builds = self._tolerated_builds, {}
        return done

    def database_key(self, level: str, name: str, swarm: bool) -> bytes:
        """What keys a pair's examples in the database: they replay only under the same target,
        level, config, model, data checks, steps, swarm (as the batch runs it), focused ops and
        plugins."""
        opts = self.options
        key = repr((opts.target, level, name, opts.model, opts.data, opts.steps,
                    opts.swarm and swarm, sorted(self.focus_rules), opts.plugins)
                   + ((opts.tolerance,) if opts.tolerance else ()))
        return f"Campaign_{level}_{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}".encode()

    @property
    def example_bytes(self) -> int:
        """Bytes per Hypothesis example: enough decisions for `steps` rules."""
        return BYTES_PER_STEP * self.options.steps + 64

    def hypothesis_batch(self, batch: Batch) -> None:
        """The batch's examples (after the database's saved failures for the pair).
        Hypothesis draws 8 bytes per example, which seed the example's decision bytes (its own
        draws cost more than the ops they would decide, and a campaign shrinks traces, not
        choices); 8 zero bytes, Hypothesis' simplest draw (the first of every batch), stand for
        all-zero decisions, the simplest example, in a pair's first batch only: a later batch
        rejects that draw (Hypothesis draws another in its place) rather than run the simplest
        example again."""
        size = self.example_bytes

        @settings(max_examples=batch.examples, deadline=None, database=self.database,
                  phases=[Phase.reuse, Phase.generate], suppress_health_check=list(HealthCheck),
                  report_multiple_bugs=False)
        @given(st.binary(min_size=8, max_size=8))
        def run(example_seed: bytes) -> None:
            assume(batch.first or any(example_seed))
            data = random.Random(example_seed).randbytes(size) if any(example_seed) else bytes(size)
            self.example(batch.level, batch.config, data, swarm=not batch.first)

        run._hypothesis_internal_use_seed = batch.seed  # type: ignore[attr-defined]
        run.hypothesis.inner_test._hypothesis_internal_add_digest = (  # type: ignore[attr-defined]
            self.database_key(batch.level, batch.config, not batch.first))
        run()

    def __call__(self, batch: Batch) -> BatchResult:
        """Run one batch: its examples, stopping at the first counterexample (returned raw)."""
        logging.getLogger("kvfuzz.kvcache").setLevel(logging.ERROR)
        result = BatchResult(batch)
        start = time.monotonic()
        if self.code is not None:
            self.code.batch(batch.examples)
        if batch.config == GENERATED:
            self.generated = self.buildable_config(batch.seed)
            result.generated = (self.generated.name, sorted(cross_features(self.generated)))
        try:
            self.hypothesis_batch(batch)
            result.examples = batch.examples
        except Counterexample as exc:
            result.failure = failure_of(exc)
            result.examples = batch.examples
        except KeyboardInterrupt:
            result.interrupted = True
        except OutOfTime:  # the examples run so far count, the one cut short included
            result.examples = len(self._executions)
        except Exception:
            # An interrupt during Hypothesis's replay of a failure surfaces as its Flaky error.
            if not STOP_REQUESTED.is_set():
                raise
            result.interrupted = True
        finally:
            if self.code is not None:
                result.code = self.code.take()
        account(result, self.take_executions(), self.probe.take())
        count_into(result.tolerated, self.take_tolerated_builds())
        result.interrupted = result.interrupted or STOP_REQUESTED.is_set()
        result.seconds = time.monotonic() - start
        result.database_lost = getattr(self.database, "lost", None)
        return result


def campaign_findings(options: CampaignOptions) -> Findings:
    """The findings of a campaign into its corpus, each saved with its target, seed, data
    checks and plugins."""
    info = get_target(options.target)
    meta: dict[str, Any] = {"target": info.name, "seed": options.seed}
    if options.data is not None:
        meta["data"] = options.data
    if options.plugins:
        meta["plugins"] = list(options.plugins)
    meta.update(options.tolerance.meta())
    return Findings(options.corpus, meta, [info.spec(options.tolerance)], model=options.model,
                    checks=selected_checks(options.data), shrink_seconds=options.shrink_seconds,
                    stop=STOP_REQUESTED.is_set)


class Campaign:
    """The driver: batches from the schedule to a backend, results back into the stats and
    the findings, in batch order."""

    def __init__(self, options: CampaignOptions,
                 report: Callable[[Stats], None] | None = None) -> None:
        self.options = options
        self.report = report
        self.stats = Stats()
        self.schedule = Schedule(campaign_pairs(options), options.seed, options.examples,
                                 options.lag)
        for pair in self.schedule.pairs:
            self.stats.pair(*pair)
            self.schedule.weights[pair] = pair_weight(options, pair, 0)
        self.findings = campaign_findings(options)
        self.first_round: dict[Pair, set[Site]] = {}
        """The target code sites each pair's first batch ran."""
        self.rare: dict[Pair, float] = {}
        """Per pair, its share of the first round's code few configs reached (`RARE`)."""
        self.database_warned = False
        self.runner = BatchRunner(options, warn=self._warn_database)
        self._waiting: dict[int, BatchResult] = {}
        self._next = 0
        self._start = 0.0
        self._probed = 0.0

    def run(self, backend: Backend | None = None) -> Stats:
        """Run the campaign on `backend` (default: this process) until its budget is spent."""
        if backend is None:
            backend = InProcess(self.runner)
        # The driver's shrinks replay refused ops too: kvcache's warnings about them are noise.
        logging.getLogger("kvfuzz.kvcache").setLevel(logging.ERROR)
        self._start = time.monotonic()
        in_flight = 0
        try:
            while True:
                while (in_flight < backend.capacity and not self._done()
                       and self.schedule.ready()):
                    batch = self.schedule.next_batch(self._seconds_left(), backend.capacity)
                    if batch is None:
                        break
                    backend.submit(batch)
                    in_flight += 1
                if not in_flight:
                    break
                results = backend.results(timeout=POLL_S)
                in_flight -= len(results)
                self._take(results)
                self._probe_database(PROBE_S)
                if self.stats.interrupted:
                    raise Stop()
                stop_point()
        except (KeyboardInterrupt, Stop):
            self.stats.interrupted = True
            self.findings.shrink_seconds = 0.0  # save what is still coming, raw: stop soon
            self._take_all(backend.close(cancel=True))
        except BaseException:  # a check, adapter or plugin fault (exit 3): no worker outlives it
            backend.close(cancel=True)
            raise
        else:
            self._take_all(backend.close(cancel=False))
        self._probe_database(0.0)
        self.stats.interrupted = self.stats.interrupted or STOP_REQUESTED.is_set()
        self.stats.elapsed = time.monotonic() - self._start
        return self.stats

    def _seconds_left(self) -> float | None:
        if self.options.seconds is None:
            return None
        return max(0.0, self.options.seconds - (time.monotonic() - self._start))

    def _counted(self) -> int:
        """The findings `max_findings` counts (`count_raised`)."""
        records = self.findings.records.values()
        return sum(1 for r in records if self.options.count_raised or not r.target_raised)

    def _done(self) -> bool:
        opts = self.options
        if STOP_REQUESTED.is_set() or self.stats.interrupted:
            return True
        if opts.max_findings is not None and self._counted() >= opts.max_findings:
            return True
        left = self._seconds_left()
        return left is not None and left <= 0

    def _take(self, results: list[BatchResult]) -> None:
        """Take results in batch order (a later batch waits for the earlier ones). All wait
        first, so an interrupt while one is counted (its shrink) leaves the others to
        `_take_all`."""
        for result in results:
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

    def _warn_database(self, message: str) -> None:
        """A lost shared database is said once per campaign, whichever process lost it."""
        if not self.database_warned:
            self.database_warned = True
            warn(message)

    def _probe_database(self, every: float) -> None:
        """Ping the shared example database, at most once per `every` s: the driver's own
        check, so a loss is said even when the workers that met it were stopped before
        their results came back."""
        probe = getattr(self.runner.database, "probe", None)
        if probe is not None and time.monotonic() - self._probed >= every:
            probe()
            self._probed = time.monotonic()

    def _count(self, result: BatchResult) -> None:
        if result.database_lost:
            self._warn_database(result.database_lost)
        pair = result.batch.pair
        if result.batch.first:  # weighed with the whole round, once it is in
            self.schedule.record(result)
            self.first_round[pair] = result.code
        else:
            growth = len(result.features - self.stats.features)
            code_growth = len(result.code - self.stats.code_total)
            self.schedule.record(result, pair_weight(self.options, pair, growth, code_growth,
                                                     self.rare.get(pair, 0.0)))
        self.stats.add(result)
        if result.batch.first and len(self.first_round) == len(self.schedule.pairs):
            self.rare = rarity(self.first_round, RARE)
            self.schedule.reweigh({p: pair_weight(self.options, p, 0, 0, self.rare[p])
                                   for p in self.schedule.pairs})
        self.stats.elapsed = time.monotonic() - self._start
        if result.failure is not None:
            try:
                self.findings.offer(result.failure, *result.batch.pair, self.stats.elapsed)
            finally:
                self.stats.findings = self.findings.all()
        if self.report is not None:
            self.report(self.stats)


def campaign_config(options: CampaignOptions, name: str) -> Config:
    """The config named `name`: one of the user's config files, else a built-in one (for
    GENERATED, the generated config of seed 0, which stands for them)."""
    if name == GENERATED:
        return generated_config(0)
    for config in options.config_files:
        if config.name == name:
            return config
    return builtin_config(name)


def run_campaign(options: CampaignOptions, on_progress: Callable[[Stats], None],
                 backend: Backend | None = None) -> Stats:
    """Run a campaign on `backend` (default: `--workers` local processes, or this process);
    call on_progress with the running totals."""
    for name in options.configs:
        campaign_config(options, name)
    STOP_REQUESTED.clear()
    if options.seconds is not None:
        options = dataclasses.replace(options, deadline=time.time() + options.seconds)
    import_plugins(options.plugins)
    campaign = Campaign(options, report=on_progress)
    if backend is None and options.workers > 1:
        from kvfuzz.fuzz.workers import LocalWorkers

        backend = LocalWorkers(options, options.workers)
    return campaign.run(backend)
