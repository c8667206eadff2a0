"""`skip_reading_prefix_cache` at the scheduler level on vLLM's own Scheduler: a request that
asks for prompt logprobs from row 0 (vLLM derives the flag, `sampling_params.py:629-635` in
0.34.0) computes its whole prompt on vLLM's Scheduler, kvfuzz's driver and the model, and the
plant `scoring-reads-cache` (its hit limit taken from `prompt_logprob_start` alone) is caught
by this knob only (docs/vllm.md, "Requests that skip reading the prefix cache")."""

from __future__ import annotations

from typing import Any

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.vllm_api import load_vllm
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]


def _trace(**second: Any) -> Trace:
    """r1 shares r0's first block, cached while both are admitted in one step."""
    return Trace(BUILTIN["full"][1], "scheduler", [
        {"op": "add_request", "request_id": "r0", "prompt": [1, 2, 0, 1], "max_tokens": 1},
        {"op": "add_request", "request_id": "r1",
         "prompt": [1, 2, 0, 1, 0, 3, 0, 2, 3, 0, 2, 2, 0], "max_tokens": 1, **second},
        {"op": "step"}], {})


def test_a_request_skipping_the_cache_agrees_three_way_and_exposes_the_plant():
    skipping = _trace(skip_reading_prefix_cache=True)
    assert run_trace(skipping, ("kvcache", "vllm-scheduler-strict")).passed
    finding = run_trace(skipping, ("vllm-scheduler-bug:scoring-reads-cache",)).finding
    assert finding is not None and finding.check == "DIFF-result", finding
    limits = load_vllm().has("request_hit_limit")
    for other in ({}, {"prefix_cache_hit_limit": 0}, {"prefix_cache_hit_limit": 4}):
        if other and not limits:
            continue  # this release takes no per-request hit limit (0.32, 0.33)
        if other and not run_trace(_trace(**other), ("vllm-scheduler",)).passed:
            continue  # this release bounds no hit (no `prompt_logprob_start`)
        assert run_trace(_trace(**other), ("vllm-scheduler-bug:scoring-reads-cache",)).passed


def test_a_campaign_catches_a_whole_prompt_scoring_that_reads_the_cache(tmp_path, capsys):
    code = kvfuzz(["run", "--target", "vllm-scheduler-bug:scoring-reads-cache", "--level",
                   "scheduler", "--config", "full", "--examples", "60", "--corpus",
                   str(tmp_path)])
    assert code == 1, capsys.readouterr().out
    assert list(tmp_path.glob("DIFF-result-full-*.json"))
