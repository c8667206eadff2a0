"""An encoder cache bound on an encoder-decoder config (`cross`) with steps in flight, on vLLM's
AsyncScheduler (target `vllm-async-scheduler`, harness/vllm_encoder_decoder_flight.py): a
step's encoder inputs hold their room until its output is taken, three-way, and the bug
planted against it.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvfuzz.core.config_file import load_config_file
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.tolerance import Tolerance
from kvfuzz.harness.vllm_scheduler_target import _passes_over_encoder_blocked
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not (vllm_available() and _passes_over_encoder_blocked()),
    reason="needs a vLLM whose waiting loop passes a blocked request over (0.33+): the "
           "config file runs under the default rule 'skip' (0.32's `break` on cross: "
           "test_vllm_scheduler_cross_loop_rule.py)")]

CONFIG_FILE = Path(__file__).resolve().parents[2] / "docs" / "configs" / (
    "whisper-encoder-cache-async.json")

OPS = [{"op": "add_request", "request_id": "r7", "prompt": [2], "max_tokens": 1,
        "num_encoder_tokens": 3},
       {"op": "add_request", "request_id": "r8", "prompt": [0], "max_tokens": 1,
        "num_encoder_tokens": 10},
       {"op": "step", "in_flight": True}, {"op": "step", "in_flight": True}]
"""r7's input (3 of a cache of 12) runs in a step left in flight; r8's (10) needs room r7's
input holds until that step's output is taken (a campaign's shrunk find of the plant)."""


def _trace(async_scheduling: bool = True) -> Trace:
    config = load_config_file(CONFIG_FILE)
    config = config.replace(scheduler=dataclasses.replace(
        config.scheduler, async_scheduling=async_scheduling))
    return Trace(config, "scheduler", OPS, {})


def test_a_step_in_flight_holds_its_encoder_inputs_room_three_way():
    """vLLM's deferral is on for the encoder-decoder AsyncScheduler, and the second step in
    flight leaves r8 waiting on all three sides."""
    trace = _trace()
    ex = Execution(trace.config, "scheduler", ("kvcache", "vllm-async-scheduler"))
    results = [ex.apply(op) for op in OPS]
    assert ex.targets[1].side.vllm_scheduler.defer_block_free
    assert [r["scheduled"] for r in results[2:]] == [[["r7", 1, 0]], []]
    assert run_trace(trace, ("vllm-async-scheduler",)).passed


def test_the_plant_that_gives_the_room_back_at_launch_is_caught():
    finding = run_trace(_trace(), ("vllm-scheduler-bug:cross-encoder-freed-at-launch",)).finding
    assert finding is not None and finding.check == "DIFF-result", finding
    assert "['r8', 1, 0]" in finding.message


def test_steps_in_flight_on_cross_are_bad_input_on_the_synchronous_scheduler(tmp_path, capsys):
    """vLLM keeps an encoder-decoder model's steps in flight only under async scheduling (no
    pipeline stages for Whisper): `vllm-scheduler` refuses the trace, naming the op."""
    path = tmp_path / "t.json"
    _trace(async_scheduling=False).save(path)
    assert kvfuzz(["replay", str(path), "--target", "vllm-scheduler"]) == 2
    err = capsys.readouterr().err
    assert "in_flight" in err and "cross attention with deferred_frees under async" in err


def test_a_campaign_on_the_async_config_file_exits_0(tmp_path, capsys):
    code = kvfuzz(["run", "--target", "vllm-async-scheduler", "--config-file",
                   str(CONFIG_FILE), "--level", "scheduler", "--examples", "40",
                   "--corpus", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "findings           0" in out and "030 encoder-decoder-slots-credited-twice" in out


# ----- finding 030 with vLLM's own sizes (budget = cache) needs a step in flight -----

IN_FLIGHT_030 = CONFIG_FILE.parents[1] / "findings" / (
    "030-encoder-decoder-slots-credited-twice-in-flight.json")


def test_030_changes_a_decision_with_budget_equal_to_cache_only_with_steps_in_flight():
    """a's input (8) is credited after each output (vLLM's count 12, then 20, 28); b's (8)
    starts in a step left in flight, and c's (8) in the next: vLLM admits c, the model keeps
    it waiting (b still holds 8 of 12). The same steps without steps in flight agree: b's
    output gives its room back before c is scheduled."""
    trace = Trace.load(IN_FLIGHT_030)
    s = trace.config.scheduler
    assert s.encoder_budget == s.encoder_cache_size == 12
    strict = (get_target("vllm-async-scheduler").spec(Tolerance.of_meta(trace.meta)),)
    finding = run_trace(trace, strict).finding
    assert finding is not None and finding.check == "DIFF-result", finding
    assert "['c', 4, 0]" in finding.message
    tolerated = Trace(trace.config, "scheduler", trace.ops, {})
    assert run_trace(tolerated, ("vllm-async-scheduler",)).passed
    plain = [{k: v for k, v in op.items() if k != "in_flight"} for op in trace.ops
             if op["op"] != "complete_step"]
    assert run_trace(Trace(trace.config, "scheduler", plain, {}), strict).passed
