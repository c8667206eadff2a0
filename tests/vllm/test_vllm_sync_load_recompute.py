"""A failing synchronous KV load under the "recompute" policy on vLLM's own Scheduler
(docs/spec.md §13.3, docs/findings/029): vLLM keeps the failed blocks keyed while their
requests rewrite them, kvfuzz's driver and the model evict them; target `vllm-scheduler`
tolerates that one difference (029), `vllm-scheduler-strict` and `--no-tolerate 029` report
it, and the plant `recomputed-sync-load-sampled` is caught by a campaign. On a lone sliding
window under "fail" the three agree too, and `sync-failure-window-nulls-skipped` is caught."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.tolerance import Tolerance
from kvfuzz.harness.vllm_api import load_vllm
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

TRACE = Path(__file__).resolve().parents[2] / "docs" / "findings" / (
    "029-recompute-failed-blocks-keyed.json")


def test_the_finding_fails_strict_and_passes_tolerated():
    """r6's load fills 12 of its 15 tokens: block 4 (tokens 12..15) is reported; vLLM keeps
    its key while r6 computes it again."""
    trace = Trace.load(TRACE)
    found = run_trace(trace, ("vllm-scheduler-strict",)).finding
    assert found is not None and (found.check, found.step) == ("DIFF-state", 2), found
    assert "block_keys[block 4]" in found.message
    strict = get_target("vllm-scheduler").spec(Tolerance.of_meta(trace.meta))
    assert run_trace(trace, (strict,)).finding is not None
    assert kvfuzz(["replay", str(TRACE)]) == 1
    ex = Execution(trace.config, "scheduler", ("kvcache", "vllm-scheduler"))
    for op in trace.ops:
        ex.apply(op)
    [side] = [t.side for t in ex.targets if t.name == "vllm-scheduler"]
    assert side.tolerated_labels() == ["029 recompute-failed-blocks-keyed"]


def test_a_failing_synchronous_load_shared_by_a_second_request_agrees_under_recompute():
    """tests/kvcache's trace (b hits the blocks a's load did not fill, in the same step), run
    to the end three-way with every check on: vLLM's Scheduler, 029 tolerated, kvfuzz's driver
    and the model."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvcache"))
    from test_kvcache_connector import SYNC_FAILURE, sync_failure_config

    trace = Trace(sync_failure_config("recompute"), "scheduler",
                  SYNC_FAILURE + [{"op": "step"}] * 4, {})
    assert run_trace(trace, ("kvcache", "vllm-scheduler")).passed
    assert not run_trace(trace, ("vllm-scheduler-strict",)).passed


def test_a_campaign_catches_a_recomputed_sync_load_that_takes_its_output(tmp_path, capsys):
    code = kvfuzz(["run", "--target", "vllm-scheduler-bug:recomputed-sync-load-sampled",
                   "--level", "scheduler", "--config", "connector", "--examples", "60",
                   "--corpus", str(tmp_path)])
    assert code == 1, capsys.readouterr().out
    assert list(tmp_path.glob("DIFF-state-connector-*.json"))


# ----- a lone sliding-window group under "fail" -----

WINDOW_FAILURE = [
    {"op": "add_request", "request_id": "r0", "prompt": [2, 0, 2, 1, 0, 2, 1, 1, 1, 0, 3, 0],
     "max_tokens": 1},
    {"op": "load_remote", "request_id": "r0", "num_external_tokens": 12, "sync": True,
     "num_loaded_tokens": 9},
    {"op": "step"}]
"""11 of r0's 12 tokens load (the last is computed), 9 validly: its window table is one null
block then blocks for tokens 4..11; the output reports the block holding tokens 8..11, so r0
fails at 8 computed tokens (the null block counts)."""


def test_a_failing_synchronous_load_on_a_lone_window_agrees_three_way_under_fail():
    from kvfuzz.harness.vllm_scheduler_plants import PLANT_CONFIGS

    config = PLANT_CONFIGS["mistral_connector_fail"].replace(num_blocks=3)
    trace = Trace(config, "scheduler", WINDOW_FAILURE, {})
    steps: list = []
    # where vLLM counts the null block's references (finding 007), the failed request's
    # window nulls reach the free queue: that target tolerates it, as `vllm` does
    target = ("vllm-scheduler" if load_vllm().has("null_ref_counted")
              else "vllm-scheduler-strict")
    assert run_trace(trace, ("kvcache", target),
                     on_step=lambda i, op, out: steps.append(out)).passed
    assert steps[-1]["finished"] == ["r0"]
    finding = run_trace(trace, ("vllm-scheduler-bug:sync-failure-window-nulls-skipped",)).finding
    assert finding is not None and finding.check == "DIFF-state", finding


def test_async_scheduler_keeps_a_recomputed_requests_placeholder():
    """vLLM issue #45138 (open PRs #45146, #49252): r4's load of its first token fails, the
    step that admitted it sampled (its last token); AsyncScheduler rolls it back to 0 but keeps
    the output placeholder it counted, so its next step schedules 3 tokens of a 2-token prompt.
    The synchronous Scheduler agrees with kvfuzz's driver and the model; campaigns draw such
    failures only where the target offers them."""
    from kvfuzz.core.configs import BUILTIN

    trace = Trace(BUILTIN["connector"][1].replace(num_blocks=2), "scheduler", [
        {"op": "add_request", "request_id": "r4", "prompt": [1, 1], "max_tokens": 1},
        {"op": "load_remote", "request_id": "r4", "num_external_tokens": 2, "sync": True,
         "num_loaded_tokens": 0},
        {"op": "step"}, {"op": "step"}], {})
    assert run_trace(trace, ("kvcache", "vllm-scheduler")).passed
    finding = run_trace(trace, ("vllm-async-scheduler",)).finding
    assert finding is not None and (finding.check, finding.step) == ("DIFF-result", 3), finding
    assert "['r4', 3, 0]" in finding.message
    offers = {name: Execution(trace.config, "scheduler", (name,)).offers(
        "recomputed_sync_failures") for name in ("vllm-scheduler", "vllm-async-scheduler")}
    assert offers == {"vllm-scheduler": True, "vllm-async-scheduler": False}


def test_under_fail_vllm_keeps_a_failed_sharers_blocks_keyed():
    """tests/kvcache's `FAIL_SHARER` under "fail": vLLM evicts r2's table only, so r3's second
    block, computed on r2's invalid block, keeps its key and r6 hits it once r5 has keyed the
    first block again (DIFF on `vllm-scheduler-strict`); `vllm-scheduler` tolerates 029."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvcache"))
    from test_kvcache_connector import FAIL_SHARER, fail_sharer_config

    trace = Trace(fail_sharer_config(), "scheduler", FAIL_SHARER, {})
    found = run_trace(trace, ("vllm-scheduler-strict",)).finding
    assert found is not None and found.check == "DIFF-state" and found.step == 3, found
    assert run_trace(trace, ("kvcache", "vllm-scheduler")).passed
