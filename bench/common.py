"""What the executor benchmarks share: traces generated once, replayed and timed."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings

from kvfuzz.fuzz.campaign import Campaign, CampaignOptions
from kvfuzz.harness.executor import run_trace
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.machines import machine_for

SEED = 12345


def generated_traces(level: str, config_name: str, examples: int, steps: int,
                     **machine_options: Any) -> list[Trace]:
    """The non-empty traces `examples` seeded runs of the state machine generate."""
    collected: list[Trace] = []
    machine = machine_for(level, config_names=(config_name,), **machine_options)
    machine.on_execution = lambda e: collected.append(e.trace)
    machine._hypothesis_internal_use_seed = SEED
    machine.TestCase.settings = settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    machine.TestCase("runTest").runTest()
    return [t for t in collected if t.ops]


def ops_per_second(traces: list[Trace], repeats: int, **run_options: Any) -> float:
    """Median over `repeats` replays on kvcache of the ops replayed per second."""
    ops = sum(len(t.ops) for t in traces)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for trace in traces:
            result = run_trace(trace, ["kvcache"], **run_options)
            assert result.passed, result.finding and result.finding.report()
        rates.append(ops / (time.perf_counter() - start))
    return statistics.median(rates)


def first_counterexample(**options: Any) -> tuple[float | None, int | None, str]:
    """A campaign of `options` stopped at its first finding, in a corpus thrown away: seconds to
    that finding, its shrunk length and its check, or (None, None, "-") within the budget."""
    with tempfile.TemporaryDirectory() as corpus:
        stats = Campaign(CampaignOptions(corpus=Path(corpus), max_findings=1, **options)).run()
    if not stats.findings:
        return None, None, "-"
    first = stats.findings[0]
    return first.found_after_s, first.ops, first.check
