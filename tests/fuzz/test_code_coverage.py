"""The target's own code coverage (fuzz/code_coverage.py): both recorders, the weights it
feeds (uncapped, the first batch of each pair kept), determinism, and the reports."""

import json
import sys
import textwrap
from pathlib import Path

import pytest

from kvfuzz.fuzz.campaign import RARE, Campaign, CampaignOptions, code_weight, pair_weight
from kvfuzz.fuzz.cli import main
from kvfuzz.fuzz.code_coverage import (KVCACHE_PACKAGES, VLLM_PACKAGES, CodeRecorder,
                                       count_lines, package_roots, rarity, target_packages)
from kvfuzz.fuzz.schedule import FIRST_BATCH, Schedule

HAS_MONITORING = hasattr(sys, "monitoring")


@pytest.fixture
def library(tmp_path, monkeypatch):
    """A package `covlib` under tmp_path, imported: `step(n)` branches on n."""
    root = tmp_path / "covlib"
    root.mkdir()
    (root / "__init__.py").write_text(textwrap.dedent("""\
        def step(n):
            if n > 2:
                return "big"
            return "small"
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module("covlib")
    yield module
    sys.modules.pop("covlib", None)


class Side:
    """A side whose ops call into the library."""

    def __init__(self, library):
        self.library = library

    def apply(self, op):
        return self.library.step(op)


def record(recorder, library, ops, examples=3):
    """One batch of `examples` examples, each a side applying `ops`; the sites recorded."""
    recorder.batch(examples)
    for _ in range(examples):
        side = Side(library)
        recorder.watch(side)
        for op in ops:
            side.apply(op)
    return recorder.take()


def test_the_fallback_records_lines_and_branches_of_the_roots_only(library):
    roots = package_roots(("covlib",))
    recorder = CodeRecorder(roots, monitoring=False)
    small = record(recorder, library, [1])
    assert {s for s in small if len(s) == 2} == {("covlib/__init__.py", 2),
                                                 ("covlib/__init__.py", 4)}
    both = record(recorder, library, [1, 5])
    assert ("covlib/__init__.py", 3) in both and count_lines(both) == (3, 1)
    assert ("covlib/__init__.py", "step", 2, 4) in both  # the branch around `return "big"`
    assert sys.gettrace() is None
    assert record(CodeRecorder(package_roots(("json",)), monitoring=False), library, [5]) == set()


def test_the_fallback_records_the_last_example_of_each_batch(library):
    recorder = CodeRecorder(package_roots(("covlib",)), monitoring=False)
    recorder.batch(2)
    first, last = Side(library), Side(library)
    recorder.watch(first)
    first.apply(5)  # not recorded: not the batch's last example
    recorder.watch(last)
    last.apply(1)
    assert ("covlib/__init__.py", 3) not in recorder.take()
    recorder.batch(1)  # a pair's first batch: its one example is recorded
    side = Side(library)
    recorder.watch(side)
    side.apply(5)
    assert ("covlib/__init__.py", 3) in recorder.take()


def test_the_fallback_leaves_another_tracer_alone(library):
    def other(frame, event, arg):
        return None

    recorder = CodeRecorder(package_roots(("covlib",)), monitoring=False)
    sys.settrace(other)
    try:
        assert record(recorder, library, [5]) == set()
        assert sys.gettrace() is other
    finally:
        sys.settrace(None)


@pytest.mark.skipif(not HAS_MONITORING, reason="sys.monitoring needs Python 3.12+; the "
                    "settrace fallback is tested above")
def test_sys_monitoring_records_every_example_of_the_batch(library):
    recorder = CodeRecorder(package_roots(("covlib",)), monitoring=True)
    sites = record(recorder, library, [1, 5])
    assert {s for s in sites if len(s) == 2} == {("covlib/__init__.py", n) for n in (2, 3, 4)}
    assert count_lines(sites)[1] >= 1  # a branch taken
    again = record(recorder, library, [1])  # re-armed for the next batch
    assert {s for s in again if len(s) == 2} == {("covlib/__init__.py", 2),
                                                 ("covlib/__init__.py", 4)}


def test_each_target_measures_its_own_source():
    assert target_packages("kvcache") == KVCACHE_PACKAGES
    assert target_packages("bug:free-forgets-decrement") == KVCACHE_PACKAGES
    assert target_packages("vllm-strict") == VLLM_PACKAGES
    assert target_packages("vllm-scheduler-bug:x") == VLLM_PACKAGES

    class Mine:
        code_packages = ("mylib.core",)

    assert target_packages("mine", Mine) == ("mylib.core",)
    assert package_roots(("no_such_package_here",)) == ()
    assert [r.name for r in package_roots(KVCACHE_PACKAGES)] == ["kvcache"]


def test_code_weights_are_uncapped_and_off_without_weighting():
    on, off = CampaignOptions(), CampaignOptions(code_coverage=False)
    pair = ("api", "full")
    assert pair_weight(on, pair, 0, 0) == 1.0
    assert pair_weight(on, pair, 0, 1023) == 1 + code_weight(1023) == 11.0
    assert pair_weight(on, pair, 10, 4095) > pair_weight(on, pair, 10, 1023) > 1.2
    assert pair_weight(on, pair, 0, 0, rare=40.0) == 41.0
    assert pair_weight(off, pair, 0, 1023, rare=40.0) == 1.0
    assert pair_weight(CampaignOptions(weighting=False), pair, 10, 1023, rare=40.0) == 1.0


def test_rarity_shares_each_site_few_configs_reached_among_them():
    reached = {("api", "a"): {("f", 1), ("f", 2), ("f", 3)}, ("scheduler", "a"): {("f", 3)},
               ("api", "b"): {("f", 1), ("f", 4)}, ("api", "c"): {("f", 1), ("f", 2)},
               ("api", "d"): {("f", 1)}}
    # f:1 is reached by four configs, f:2 by two, f:3 and f:4 by one each.
    assert rarity(reached, 2) == {("api", "a"): 1.5, ("scheduler", "a"): 1.0, ("api", "b"): 1.0,
                                  ("api", "c"): 0.5, ("api", "d"): 0.0}
    assert rarity(reached, 4)[("api", "d")] == 0.25 and RARE >= 2


def test_a_heavy_pair_never_shrinks_another_pairs_first_batch():
    pairs = [("api", str(i)) for i in range(10)]
    schedule = Schedule(pairs, seed=0, examples=30)
    schedule.weights[pairs[0]] = 1000.0
    assert all(schedule.quota(p) >= FIRST_BATCH for p in pairs)
    assert sum(schedule.quota(p) for p in pairs) == 30 and schedule.quota(pairs[0]) == 12


def campaign(tmp_path, name, **options):
    opts = CampaignOptions(seconds=None, examples=120, seed=3, configs=("full", "hybrid"),
                           corpus=tmp_path / name, lag=1, **options)
    camp = Campaign(opts)
    traces = []
    camp.runner.on_execution = lambda execution: traces.append(execution.trace.to_json())
    stats = camp.run()
    return stats, traces


def test_code_coverage_moves_the_budget_and_a_seed_still_gives_the_same_examples(tmp_path):
    stats, traces = campaign(tmp_path, "a")
    again, traces_again = campaign(tmp_path, "b")
    plain, _ = campaign(tmp_path, "c", code_coverage=False)
    assert traces == traces_again and stats.code == again.code
    assert [f.trace for f in stats.findings] == [f.trace for f in again.findings]
    lines, branches = count_lines(stats.code_total)
    assert lines > 200 and branches > 50
    assert all(site[0].startswith("kvcache/") for site in stats.code_total)
    assert not plain.code_total
    spread = {pair: counts.examples for pair, counts in stats.pairs.items()}
    assert spread != {pair: counts.examples for pair, counts in plain.pairs.items()}
    assert min(spread.values()) >= FIRST_BATCH


def test_the_summary_and_the_json_report_the_code_per_pair(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["run", "--config", "full", "--level", "api", "--examples", "30",
                 "--corpus", str(tmp_path / "c"), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["code_lines"] > 100 and data["code_branches"] > 10
    assert data["by_config"][0]["code_lines"] == data["code_lines"]
    assert (f"target code        {data['code_lines']} lines, {data['code_branches']} branches"
            in out)
    assert "code lines" in out and data["options"]["code_coverage"] is True
    assert main(["run", "--config", "full", "--level", "api", "--examples", "30",
                 "--no-code-coverage", "--corpus", str(tmp_path / "c"),
                 "--json", str(report)]) == 0
    out = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["code_lines"] == 0 and "target code" not in out and "code lines" not in out


def test_a_path_outside_the_roots_is_none(tmp_path):
    recorder = CodeRecorder((tmp_path / "lib",))
    assert recorder.relative(str(tmp_path / "lib" / "a.py")) == "lib/a.py"
    assert recorder.relative(str(Path(sys.executable))) is None


def test_no_batch_after_the_first_round_is_chosen_before_the_round_is_in():
    from kvfuzz.fuzz.schedule import BatchResult

    pairs = [("api", str(i)) for i in range(3)]
    schedule = Schedule(pairs, seed=0, examples=30)
    first = [schedule.next_batch() for _ in pairs]
    for batch in first[:2]:
        schedule.record(BatchResult(batch, examples=batch.examples))
        assert not schedule.ready()
    schedule.record(BatchResult(first[2], examples=first[2].examples))
    schedule.reweigh({pairs[0]: 22.0})
    assert schedule.ready()
    assert [schedule.quota(p) for p in pairs] == [FIRST_BATCH + 22, FIRST_BATCH + 1,
                                                  FIRST_BATCH + 1]


def test_the_first_round_weighs_code_few_configs_reach(tmp_path):
    """events_partial runs kvcache's event code, which full and tenants do not: after the first
    round it gets most of the rest; with code coverage off the three share it evenly."""
    options = dict(seconds=None, examples=66, seed=3, configs=("full", "tenants",
                   "events_partial"), levels=("api",))
    camp = Campaign(CampaignOptions(corpus=tmp_path / "a", **options))
    stats = camp.run()
    rare = {pair[1]: weight for pair, weight in camp.rare.items()}
    spread = {pair[1]: counts.examples for pair, counts in stats.pairs.items()}
    assert rare["events_partial"] > 2 * max(rare["full"], rare["tenants"])
    assert spread["events_partial"] > 2 * max(spread["full"], spread["tenants"])
    plain = Campaign(CampaignOptions(corpus=tmp_path / "b", code_coverage=False,
                                     **options)).run()
    assert {counts.examples for counts in plain.pairs.values()} == {22}


def test_only_a_pairs_first_batch_runs_the_simplest_example(tmp_path):
    """Hypothesis draws its simplest example first in every batch: later batches reject it, so
    no example of a campaign repeats another."""
    camp = Campaign(CampaignOptions(seconds=None, examples=22, seed=0, configs=("full",),
                                    levels=("api",), corpus=tmp_path))
    traces: list[str] = []
    camp.runner.on_execution = traces.append
    camp.run()
    ops = [json.dumps(execution.trace.ops) for execution in traces]
    assert len(ops) == 22 and len(set(ops)) == 22
