"""A binding encoder budget on an encoder-decoder config (`cross`) under the waiting loop rule
of every release (`scheduler.blocked_waiting`, docs/spec.md §7.2): vLLM's Scheduler, kvfuzz's
driver and the model end the waiting loop at a request whose encoder input the budget cannot
take (0.32: `break`) or pass it over (0.33+), three-way, and the plants against the budget and
the encoder cache are caught on each release.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.vllm_scheduler_plants import cannot_apply
from kvfuzz.harness.vllm_scheduler_target import loop_rules, unsupported_reason
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

TARGETS = ("vllm-scheduler", "vllm-async-scheduler")

OPS = [{"op": "add_request", "request_id": rid, "prompt": list(range(10 * i, 10 * i + 6)),
        "num_encoder_tokens": tokens, "max_tokens": 3}
       for i, (rid, tokens) in enumerate((("a", 10), ("b", 5), ("c", 2)))] + [{"op": "step"}] * 2
"""`cross` binds the budget (12): a's encoder input (10) leaves 2, so b's (5) cannot start in
step 1; c's (2) would fit behind it."""


def _cross(target: str) -> Trace:
    return Trace(get_target(target).engine_config(BUILTIN["cross"][1]), "scheduler", OPS, {})


@pytest.mark.parametrize("target", TARGETS)
def test_the_budget_binds_on_cross_under_the_releases_loop_rule(target):
    trace = _cross(target)
    s = trace.config.scheduler
    assert (s.encoder_budget, s.blocked_waiting) == (12, loop_rules()["blocked_waiting"])
    assert unsupported_reason(trace.config, "async" in target) is None


@pytest.mark.parametrize("target", TARGETS)
def test_a_blocked_encoder_decoder_input_stops_or_is_passed_over_three_way(target):
    """Step 1: b waits; 0.32 ends the loop there (c waits too), 0.33+ admits c. Step 2: the
    budget is fresh and the waiting ones start."""
    ex = Execution(_cross(target).config, "scheduler", ("kvcache", target))
    results = [ex.apply(op) for op in OPS]
    if loop_rules()["blocked_waiting"] == "stop":
        expected = [[["a", 6, 0]], [["a", 1, 0], ["b", 6, 0], ["c", 6, 0]]]
    else:
        expected = [[["a", 6, 0], ["c", 6, 0]], [["a", 1, 0], ["c", 1, 0], ["b", 6, 0]]]
    assert [r["scheduled"] for r in results[3:]] == expected
    assert ex.targets[1].side.vllm_scheduler.max_num_encoder_input_tokens == 12


def test_the_plant_that_ignores_the_budget_is_caught_on_every_release():
    assert cannot_apply("cross-encoder-unbudgeted") is None
    trace = _cross("vllm-scheduler")
    assert run_trace(trace, ("vllm-scheduler",)).passed
    finding = run_trace(trace, ("vllm-scheduler-bug:cross-encoder-unbudgeted",)).finding
    assert finding is not None and finding.check == "DIFF-result", finding
    assert "['b', 6, 0]" in finding.message


FINDING_030 = Path(__file__).resolve().parents[2] / "docs" / "findings" / (
    "030-encoder-decoder-slots-credited-twice.json")


def test_the_plant_that_keeps_the_caches_room_is_caught_on_every_release():
    """Finding 030's steps (an encoder cache bound on cross) under the release's loop rule:
    the tolerating target passes, the plant that never gives the room back is caught."""
    assert cannot_apply("cross-encoder-room-kept") is None
    saved = Trace.load(FINDING_030)
    trace = Trace(get_target("vllm-scheduler").engine_config(saved.config), "scheduler",
                  saved.ops, {})
    assert run_trace(trace, ("vllm-scheduler",)).passed
    finding = run_trace(trace, ("vllm-scheduler-bug:cross-encoder-room-kept",)).finding
    assert finding is not None and finding.check == "DIFF-result", finding


@pytest.mark.parametrize("target", TARGETS)
def test_an_unplanted_campaign_on_cross_exits_0(target, tmp_path, capsys):
    code = kvfuzz(["run", "--target", target, "--config", "cross", "--level", "scheduler",
                   "--examples", "40", "--corpus", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "left out" not in out and "findings           0" in out
