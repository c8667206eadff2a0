"""A scheduler-level vLLM test of a `qwen3_next_junction` finding builds vLLM's Scheduler with
`enable_mamba_shared_prefix_checkpoint`: without it vLLM's split floors the junction, and the
test would assert the other behaviour (seen: the DIFF-state trace below, exported, passes on
vLLM 0.34.0 with the option and fails without it)."""

from __future__ import annotations

from pathlib import Path

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.vllm_scheduler_test_export import render_scheduler_test
from kvfuzz.harness.executor import run_trace

PROMPT = [3, 0, 1, 1, 2, 1, 2, 2, 0, 1]
OPS = [{"op": "add_request", "request_id": "r5", "prompt": PROMPT, "cache_salt": "b",
        "max_tokens": 1},
       {"op": "add_request", "request_id": "r8", "prompt": PROMPT, "cache_salt": "b",
        "max_tokens": 1},
       {"op": "step"}]


def test_the_exported_scheduler_sets_the_option():
    config = BUILTIN["qwen3_next_junction"][1]
    finding = run_trace(Trace(config, "scheduler", OPS), ["bug:junction-state-unkeyed"]).finding
    assert finding is not None and finding.check == "DIFF-state"
    trace = Trace(config, "scheduler", OPS, {"check": finding.check})
    text = render_scheduler_test(trace, Path("t.json"))
    assert ('mamba_cache_mode="align", enable_mamba_shared_prefix_checkpoint=True)'
            in text)
