"""A failing synchronous KV load on a lone sliding-window group under "recompute" on vLLM's own
Scheduler (docs/spec.md §13.3 step 5, docs/findings/016): vLLM resumes the request at the first
block the load did not fill, whose window reads the table's leading null block; kvfuzz's
driver and the model preempt it. `vllm-scheduler` tolerates that by 016 (it preempts the
request after vLLM's `_handle_invalid_blocks`), `vllm-scheduler-strict` fails D1, and the plant
`sync-failure-resumes-over-window` (vLLM's rule on kvcache) fails D1 too."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.vllm_target import vllm_available
from kvfuzz.properties import REGISTRY
from kvfuzz.properties.data import data_checks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

TRACE = Path(__file__).resolve().parents[2] / "docs" / "findings" / (
    "016-sync-load-window-unloaded.json")


def test_vllm_resumes_over_the_window_and_the_tolerated_target_preempts():
    """r (12 tokens, window 8, blocks of 4) loads 11 tokens synchronously, 4 filled: its table
    is the null block then blocks 1, 2, and the output reports both. vLLM rolls r back to 4,
    whose window reads position 0 through the null block; kvfuzz's driver and the model
    preempt r, and `vllm-scheduler` (016 tolerated) does the same, three-way."""
    trace = Trace.load(TRACE)
    checks = list(REGISTRY) + data_checks()
    found = run_trace(trace, ("vllm-scheduler-strict",), model=False, checks=checks).finding
    assert found is not None and (found.check, found.step) == ("D1", 2), found
    assert "through the null block" in found.message
    assert run_trace(trace, ("kvcache", "vllm-scheduler"), checks=checks).passed
    assert kvfuzz(["replay", str(TRACE), "--target", "vllm-scheduler-strict"]) == 1
    assert kvfuzz(["replay", str(TRACE), "--target", "vllm-scheduler"]) == 0
    assert run_trace(trace, ("bug:sync-failure-resumes-over-window",), model=False,
                     checks=checks).finding.check == "D1"
