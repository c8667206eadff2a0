"""A failing synchronous KV load on a config with several KV cache groups on vLLM's own
Scheduler (docs/findings/031, docs/spec.md §13.3 step 5): vLLM raises `RuntimeError` on a
block-level report there and passes over a request-level one for a running request, so the
request runs on over blocks its load did not fill. kvfuzz's driver and the model roll it back
on every group; target `vllm-scheduler` does not drive the shape (031 tolerated), while
`vllm-scheduler-strict` and `--no-tolerate 031` do and report it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Counterexample, Execution, run_trace
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.tolerance import Tolerance
from kvfuzz.harness.vllm_api import VllmUnsupported
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

TRACE = Path(__file__).resolve().parents[2] / "docs" / "findings" / (
    "031-sync-failure-several-groups.json")

SHARED = [
    {"op": "add_request", "request_id": "a", "prompt": list(range(20)), "max_tokens": 2},
    {"op": "add_request", "request_id": "b", "prompt": list(range(20)) + [7], "max_tokens": 2},
    {"op": "load_remote", "request_id": "a", "num_external_tokens": 16, "sync": True,
     "num_loaded_tokens": 6},
    {"op": "step"}, {"op": "step"}, {"op": "step"},
]
"""On `gpt_oss_connector` (full + sliding window, block size 4): a's load fills 6 of its 16
tokens; b, admitted in the same step, hits a's blocks, the unfilled ones among them."""

UNTOLERATED = get_target("vllm-scheduler").spec(Tolerance(remove=("031",)))
"""vLLM's Scheduler reporting 031 and tolerating the rest (on 0.32 the strict target fails
these traces on finding 007 first, the null block's ref count)."""


def _config(policy: str):
    base = BUILTIN["gpt_oss_connector"][1]
    return base.replace(scheduler=dataclasses.replace(base.scheduler,
                                                      kv_load_failure_policy=policy))


def _trace(policy: str) -> Trace:
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                            "config": _config(policy).to_dict(), "ops": SHARED})


def test_the_finding_fails_on_vllm_and_passes_on_kvcache(capsys):
    """Under "fail" kvfuzz's driver and the model fail r1 in the step that admits it; vLLM's
    Scheduler (the connector reports r1 in `failed_recving`) passes over it and r1 runs on."""
    assert kvfuzz(["replay", str(TRACE)]) == 1
    out = capsys.readouterr().out
    assert "DIFF-result] step 2 on vllm-scheduler" in out and "'finished': ['r1']" in out
    assert kvfuzz(["replay", str(TRACE), "--target", "kvcache"]) == 0


def test_the_tolerant_target_does_not_drive_the_shape():
    ex = Execution(_config("fail"), "scheduler", ("vllm-scheduler",))
    ex.apply(SHARED[0])
    with pytest.raises(VllmUnsupported, match="docs/findings/031"):
        ex.apply(SHARED[2])


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_vllm_passes_over_a_request_level_report(policy):
    """vLLM's `_handle_failed_recving` takes only a request waiting for remote KV (0.34.0
    `scheduler.py:3839-3852`): a and b sample and finish as if the load were whole. kvfuzz's
    driver rolls a back (under "recompute" its window then reaches nulls nothing loaded, so it
    is preempted; under "fail" both fail) and agrees with the model."""
    assert run_trace(_trace(policy), ("kvcache",)).passed
    ex = Execution(_config(policy), "scheduler", (UNTOLERATED,), model=False)
    outs = [ex.apply(op) for op in SHARED]
    assert outs[3] == {"scheduled": [["a", 4, 0], ["b", 1, 20]], "preempted": [],
                       "finished": [], "copies": []}
    assert {rid: v.status for rid, v in ex.state.requests.items()} == {
        "a": "FINISHED_LENGTH_CAPPED", "b": "FINISHED_LENGTH_CAPPED"}
    found = run_trace(_trace(policy), ("kvcache", UNTOLERATED)).finding
    assert found is not None and (found.check, found.step) == ("DIFF-result", 3), found


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_vllm_raises_on_a_block_level_report(policy):
    """The same loads reported by block ids (each group's unfilled blocks): vLLM's
    `_handle_invalid_blocks` raises `RuntimeError` on more than one group (0.34.0
    `scheduler.py:3863-3872`) after `schedule()` took the blocks: a finding (I10), not a crash
    of kvfuzz's."""
    ex = Execution(_config(policy), "scheduler", (UNTOLERATED,), model=False)
    for op in SHARED[:3]:
        ex.apply(op)
    ex.targets[0].side.scheduler._block_failures = True
    with pytest.raises(Counterexample, match=r"\[I10\] step 3 on vllm-scheduler: .*Runtime"):
        ex.apply(SHARED[3])


def test_a_campaign_without_the_tolerance_finds_031(tmp_path, capsys):
    """Default campaigns on `gpt_oss_connector` go past 031 (the connector campaign of
    test_vllm_scheduler.py exits 0); with `--no-tolerate 031` the generator draws failing
    synchronous loads there and the first finding is one."""
    code = kvfuzz(["run", "--target", "vllm-scheduler", "--no-tolerate", "031", "--level",
                   "scheduler", "--examples", "60", "--config", "gpt_oss_connector",
                   "--max-findings", "1", "--corpus", str(tmp_path)])
    capsys.readouterr()
    assert code == 1
    (found,) = tmp_path.glob("*.json")
    ops = json.loads(found.read_text())["ops"]
    assert any(op["op"] == "load_remote" and op.get("num_loaded_tokens") is not None
               for op in ops), ops
