"""Fixed drafts on vLLM's AsyncScheduler (target `vllm-async-scheduler`, docs/vllm.md "Fixed
drafts under async scheduling"): a `SpeculativeConfig` makes vLLM schedule placeholder
drafts for every decoding request and pad one-token admissions to them; kvfuzz's driver on
kvcache and the model play the same rule, three-way, and the bugs planted on that path are
caught.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvfuzz.core.config import Config
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.harness.vllm_scheduler_target import (
    VllmSchedulerSide,
    _publishes_after_output,
    settled_blocks_rule,
    unsupported_reason,
)
from kvfuzz.harness.vllm_target import ALIGN_COUNT_NEGATIVE, VllmSide, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

CONFIG = BUILTIN["fixed_drafts"][1]
ASYNC_THREE_WAY = ("kvcache", "vllm-async-scheduler")
publishing = pytest.mark.skipif(
    not _publishes_after_output(True, False),
    reason="this vLLM's update_from_output caches nothing after an output (0.32): fixed "
           "drafts are left out")


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


@publishing
def test_placeholder_drafts_padding_and_rollback_agree_three_way():
    """vLLM's AsyncScheduler schedules 1 + 2 tokens per decode, pads a one-token admission
    (a full hit) to them, and rolls the rejected drafts back: as kvfuzz's driver does."""
    ex = Execution(CONFIG, "scheduler", ASYNC_THREE_WAY)
    ex.apply(_add("a", list(range(9)), max_tokens=9))
    ex.apply({"op": "step"})
    assert ex.apply({"op": "step", "accept": 1})["scheduled"] == [["a", 3, 0]]
    scheduler = ex.targets[1].side.vllm_scheduler
    a = scheduler.requests["a"]
    assert type(scheduler).__name__ == "AsyncScheduler" and scheduler.num_spec_tokens == 2
    assert (a.num_computed_tokens, a.num_tokens, a.spec_token_ids) == (11, 12, [-1, -1])
    ex.apply(_add("b", list(range(9)), max_tokens=3))
    out = ex.apply({"op": "step", "accept": 0})
    assert out["scheduled"] == [["a", 3, 0], ["b", 3, 8]]
    assert (a.num_computed_tokens, a.num_tokens) == (12, 13)  # both drafts rejected
    assert ex.apply({"op": "step"})["finished"] == ["b"]


@publishing
def test_an_eagle_config_with_fixed_drafts_runs_three_way():
    ex = Execution(CONFIG.replace(use_eagle=True, num_blocks=20), "scheduler", ASYNC_THREE_WAY)
    ex.apply(_add("a", list(range(10)), max_tokens=6))
    ex.apply(_add("b", list(range(10)), max_tokens=6))
    for accept in (None, 1, 0, 2, None):
        ex.apply({"op": "step", "accept": accept})
    assert ex.state.requests["a"].status == "FINISHED_LENGTH_CAPPED"


def test_the_synchronous_scheduler_leaves_fixed_drafts_out():
    assert "num_speculative_tokens" in unsupported_reason(CONFIG, async_scheduling=False)
    publishes = _publishes_after_output(True, False)
    assert (unsupported_reason(CONFIG, async_scheduling=True) is None) == publishes


@publishing
def test_a_fixed_drafts_campaign_exits_0(tmp_path, capsys):
    assert kvfuzz(["run", "--target", "vllm-async-scheduler", "--level", "scheduler",
                   "--config", "fixed_drafts", "--examples", "40",
                   "--corpus", str(tmp_path)]) == 0, capsys.readouterr().out


@publishing
def test_a_draft_on_a_fixed_drafts_config_is_a_usage_error(tmp_path, capsys):
    trace = Trace(CONFIG, "scheduler", [_add("r", list(range(8))), {"op": "step", "draft": 2}],
                  {})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace.to_dict()))
    assert kvfuzz(["replay", str(path), "--target", "vllm-async-scheduler"]) == 2
    assert "draft 2" in capsys.readouterr().err


@publishing
@pytest.mark.parametrize("plant, check", [
    ("drafts-not-published", "DIFF-state"),
    ("padding-unverified", "DIFF"),
])
def test_a_bug_planted_on_the_draft_path_is_caught(plant, check, tmp_path, capsys):
    code = kvfuzz(["run", "--target", f"vllm-scheduler-bug:{plant}", "--level", "scheduler",
                   "--config", "fixed_drafts", "--examples", "60", "--corpus", str(tmp_path)])
    assert code == 1, capsys.readouterr().out
    assert [p.name for p in tmp_path.glob(f"{check}-*fixed_drafts-*.json")]


# ----- drafts on Mamba "align" configs: vLLM's negative count tolerated (docs/findings/028) -----

ALIGN_DRAFTS = VllmSchedulerSide.engine_config(BUILTIN["qwen3_next_eagle"][1])
"""With the rule this release's Scheduler follows for when accepted drafts' blocks are
cached (`scheduler.settled_blocks`), as a campaign runs it."""
FINDINGS = Path(__file__).resolve().parents[2] / "docs" / "findings"
NEGATIVE = FINDINGS / "028-align-count-negative.json"


def _engine_trace(path: Path) -> Trace:
    """The trace at `path` under this release's `scheduler.settled_blocks`."""
    trace = Trace.load(path)
    return Trace(VllmSchedulerSide.engine_config(trace.config), trace.level, list(trace.ops),
                 dict(trace.meta))


@pytest.mark.parametrize("target, side", [("vllm", VllmSide),
                                          ("vllm-scheduler", VllmSchedulerSide)])
def test_drafts_run_on_a_mamba_align_config_with_the_negative_count_tolerated(target, side):
    """The generators draw drafts on an align config; the finding's trace (3 state groups
    counting -1 each after rejected drafts) passes with the deviation tolerated, recorded for
    its request, and fails P1 on the strict target."""
    assert Execution(ALIGN_DRAFTS, "scheduler", (target,)).offers("draft")
    trace = _engine_trace(NEGATIVE)
    sides: list[Any] = []

    def build(config: Any, level: str) -> Any:
        sides.append(side(config, level))
        return sides[-1]

    assert run_trace(trace, ["kvcache", build]).passed
    assert sides[0].tolerated[ALIGN_COUNT_NEGATIVE] == {"r3"}
    assert "028 align-count-negative" in sides[0].tolerated_labels()
    result = run_trace(trace, [f"{target}-strict"])
    assert (result.finding.check, result.finding.step) == ("P1", len(trace.ops) - 1)
    assert "predicted -3 blocks but the free count fell by 0" in result.finding.message


def _floored(theirs: int, hits: int = 0) -> tuple[int, set[str]]:
    """What `_floor_align_count` makes of an align group's count `theirs` (with `hits`
    evictable hits among the new computed blocks), and the requests it recorded."""
    single = SimpleNamespace(block_pool=SimpleNamespace(num_gpu_blocks=20),
                             get_num_blocks_to_allocate=lambda *args, **kwargs: theirs,
                             _get_num_evictable_blocks=lambda blocks: hits)
    side = SimpleNamespace(tolerated={ALIGN_COUNT_NEGATIVE: set()})
    VllmSide._floor_align_count(side, single)  # type: ignore[arg-type]
    return single.get_num_blocks_to_allocate("r", 8, [], 0, 0, 8), side.tolerated[
        ALIGN_COUNT_NEGATIVE]


def test_only_a_negative_align_count_is_floored():
    """Exactly the negative `new` reads as 0 (the evicted hits still counted); a count of 0
    or more, and vLLM's "not this step" (the pool + 1), pass as they are, unrecorded."""
    assert _floored(-3) == (0, {"r"})
    assert _floored(1, hits=2) == (2, {"r"})  # new = -1, two hits evicted
    for count, hits in ((0, 0), (2, 0), (2, 2), (21, 0)):
        assert _floored(count, hits) == (count, set())


def test_the_plant_that_gives_back_an_align_surplus_is_caught_on_the_finding_trace():
    """After rejected drafts the plant frees the 3 blocks past the step's need: P1 sees the
    free count rise where the (floored) count says 0. Without drafts no table is long."""
    result = run_trace(_engine_trace(NEGATIVE), ["vllm-scheduler-bug:align-surplus-freed"])
    assert result.finding.check == "P1"
    assert "predicted 0 blocks but the free count fell by -3" in result.finding.message


def test_the_align_surplus_plant_is_caught_by_a_campaign(tmp_path, capsys):
    """On every release, under its `settled_blocks` rule: the generators steer drafts across
    an align block end, then reject them (`kvfuzz.fuzz.align_drafts`; seed 0 finds it
    between examples 12 and 22 on 0.32.0 and 0.33.0)."""
    assert kvfuzz(["run", "--target", "vllm-scheduler-bug:align-surplus-freed", "--level",
                   "scheduler", "--config", "qwen3_next_eagle", "--examples", "40",
                   "--corpus", str(tmp_path)]) == 1, capsys.readouterr().out
    assert [p.name for p in tmp_path.glob("P1-qwen3_next_eagle-*.json")]


def _settled_steps(rule: str) -> list[tuple[list[Any], int]]:
    """a (6 tokens) prefills in chunks of 4 and 2 with a draft for token 7, which the next
    step keeps, completing block 1 at that output; one more step follows. Three-way: what
    each decode scheduled, and the blocks the model holds cached after it."""
    config = Config.from_dict({"num_blocks": 24, "groups": [
        {"kind": "full", "block_size": 4},
        {"kind": "mamba", "block_size": 4, "mamba_cache_mode": "align",
         "num_speculative_blocks": 1}],
        "scheduler": {"num_lookahead_tokens": 1, "settled_blocks": rule}})
    ex = Execution(config, "scheduler", ("kvcache", "vllm-scheduler"))
    ex.apply(_add("a", [1, 2, 3, 1, 2, 3], max_tokens=6))
    ex.apply({"op": "step"})
    return [(ex.apply(op)["scheduled"], len(ex.state.cache))
            for op in ({"op": "step", "draft": 1}, {"op": "step", "accept": 1}, {"op": "step"})]


def test_accepted_drafts_blocks_are_cached_by_the_releases_rule_three_way():
    """vLLM's Scheduler, kvfuzz's driver and the model agree on when the block a kept draft
    completes is cached: at the output (0.34) or at the request's next step (0.32, 0.33)."""
    rule = settled_blocks_rule()
    assert rule == ("at_output" if _publishes_after_output(False, True) else "next_step")
    cached = [4, 4] if rule == "at_output" else [2, 4]
    assert _settled_steps(rule) == [([["a", 2, 0]], 2), ([["a", 2, 0]], cached[0]),
                                    ([["a", 1, 0]], cached[1])]


def test_drafts_on_a_mamba_hybrid_under_the_other_rule_exit_2_naming_it(tmp_path, capsys):
    """A Mamba hybrid whose `settled_blocks` is not this release's rule gets no drafts from
    the generators, and the finding's trace under it exits 2 naming both rules (target
    `vllm`, kvfuzz's driver alone, still runs it)."""
    other = "next_step" if settled_blocks_rule() == "at_output" else "at_output"
    config = ALIGN_DRAFTS.replace(scheduler=dataclasses.replace(ALIGN_DRAFTS.scheduler,
                                                                settled_blocks=other))
    assert not Execution(config, "scheduler", ("vllm-scheduler",)).offers("draft")
    assert Execution(config, "scheduler", ("vllm",)).offers("draft")
    trace = Trace.load(NEGATIVE)
    path = tmp_path / "other-rule.json"
    Trace(config, trace.level, list(trace.ops), dict(trace.meta)).save(path)
    assert kvfuzz(["replay", str(path), "--target", "vllm-scheduler"]) == 2
    assert (f"settled_blocks '{other}', where vLLM's Scheduler follows "
            f"'{settled_blocks_rule()}'") in capsys.readouterr().err


@publishing
def test_a_drafters_count_caps_what_the_next_step_keeps_three_way():
    """The drafter fills 1 of a's 2 placeholders and none of b's: vLLM's AsyncScheduler still
    schedules both (its placeholders do not depend on the drafter), and the worker's -1
    drafts are rejected, so a keeps 1 and b none, as kvfuzz's driver and the model say."""
    ex = Execution(CONFIG, "scheduler", ASYNC_THREE_WAY)
    ex.apply(_add("a", list(range(6)), max_tokens=9))
    ex.apply(_add("b", list(range(10, 16)), max_tokens=9))
    ex.apply({"op": "step", "drafted": {"a": 1, "b": 0}})
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 3, 0], ["b", 3, 0]]
    scheduler = ex.targets[1].side.vllm_scheduler
    assert [(r.num_computed_tokens, r.num_tokens)
            for r in (scheduler.requests["a"], scheduler.requests["b"])] == [(8, 9), (7, 8)]


def test_a_drafters_count_on_the_synchronous_scheduler_three_way():
    """update_draft_token_ids takes proposals of different lengths: a proposes 1, b 3."""
    config = BUILTIN["eagle"][1]
    ex = Execution(config, "scheduler", ("kvcache", "vllm-scheduler"))
    ex.apply(_add("a", list(range(6)), max_tokens=9))
    ex.apply(_add("b", list(range(10, 16)), max_tokens=9))
    ex.apply({"op": "step", "draft": 3, "drafted": {"a": 1}})
    assert ex.apply({"op": "step", "accept": 2})["scheduled"] == [["a", 2, 0], ["b", 4, 0]]


def test_a_bug_only_a_drafters_count_exposes_is_caught(tmp_path, capsys):
    """`drafts-cut-to-first`: every request keeps as many proposals as the batch's first;
    with one count per step (no `drafted`) it never shows. DIFF-state sees it at once: each
    request's draft count is compared (`num_drafts`)."""
    code = kvfuzz(["run", "--target", "vllm-scheduler-bug:drafts-cut-to-first", "--level",
                   "scheduler", "--config", "eagle", "--examples", "60",
                   "--corpus", str(tmp_path)])
    assert code == 1, capsys.readouterr().out
    found = [json.loads(p.read_text()) for p in tmp_path.glob("DIFF-state-*eagle-*.json")]
    assert found and all(any(op.get("drafted") for op in f["ops"]) for f in found)
