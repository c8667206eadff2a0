"""Fixed drafts on vLLM's AsyncScheduler (target `vllm-async-scheduler`, docs/vllm.md "Fixed
drafts under async scheduling"): a `SpeculativeConfig` makes vLLM schedule placeholder
drafts for every decoding request and pad one-token admissions to them; kvfuzz's driver on
kvcache and the model play the same rule, three-way, and the bugs planted on that path are
caught.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution
from kvfuzz.harness.vllm_scheduler_target import _publishes_after_output, unsupported_reason
from kvfuzz.harness.vllm_target import vllm_available

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


@pytest.mark.parametrize("target", ["vllm", "vllm-scheduler"])
def test_drafts_on_a_mamba_align_config_are_left_out_naming_why(target, tmp_path, capsys):
    """vLLM's Mamba "align" count goes negative after rejected drafts (docs/vllm.md, "Drafts
    on configs with Mamba groups"): the generators draw none there, and a trace with some
    exits 2 naming it."""
    config = BUILTIN["qwen3_next_eagle"][1]
    assert not Execution(config, "scheduler", (target,)).offers("draft")
    trace = Trace(config, "scheduler", [_add("r", [1, 3, 1, 0]), {"op": "step", "draft": 2}],
                  {})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace.to_dict()))
    assert kvfuzz(["replay", str(path), "--target", target]) == 2
    assert "Mamba" in capsys.readouterr().err


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
