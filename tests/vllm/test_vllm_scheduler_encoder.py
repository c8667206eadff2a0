"""A binding encoder budget and cache on vLLM's AsyncScheduler (target `vllm-async-scheduler`):
the release rule it follows (`scheduler.async_scheduling`, docs/spec.md §7.2; docs/vllm.md,
"A binding encoder under async scheduling"), three-way, and the bug planted against it.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.harness.vllm_encoder_budget import encoder_release_rule, releases_past_placeholders
from kvfuzz.harness.vllm_scheduler_target import (
    VllmAsyncSchedulerSide,
    VllmSchedulerSide,
    _passes_over_encoder_blocked,
    unsupported_reason,
)
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not (vllm_available() and _passes_over_encoder_blocked()),
    reason="needs a vLLM whose waiting loop passes a blocked request over (0.33+): these "
           "configs and finding 030's file run under the default rule 'skip' (0.32's `break` on cross: "
           "test_vllm_scheduler_cross_loop_rule.py)")]


def _config(async_scheduling: bool):
    config = BUILTIN["tenants"][1]
    return config.replace(scheduler=dataclasses.replace(
        config.scheduler, encoder_budget=None, encoder_cache_size=3,
        async_scheduling=async_scheduling))


def _add(rid: str, prompt: list[int], mm: list[list[int]], max_tokens: int) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, "mm_inputs": mm,
            "max_tokens": max_tokens}


OPS = [_add("r6", [2, 3, 0, 0], [[1, 1, 3]], 2), {"op": "step"},
       _add("r7", [2, 3, 0, 1, 1, 2, 3, 3, 0], [[0, 4, 2], [1, 6, 3]], 1), {"op": "step"}]
"""r6's input (3 embeddings, the whole cache) ends where its prompt does; its first step
samples. r7's input 0 (2) needs the room r6's entry holds."""


def test_the_engine_rule_is_read_from_vllm_source():
    assert releases_past_placeholders()  # 0.32-0.34 all subtract num_output_placeholders
    assert encoder_release_rule(True) and not encoder_release_rule(False)
    for side, rule in ((VllmAsyncSchedulerSide, True), (VllmSchedulerSide, False)):
        assert side.engine_config(_config(not rule)).scheduler.async_scheduling is rule


def test_async_scheduler_releases_an_input_its_own_sample_covers_one_output_later():
    """AsyncScheduler counts r6's sample as a placeholder when step 1 schedules it, and
    `update_from_output` releases before it resolves it: r6 still references its entry in
    step 2, so r7 stops before its input 0 (4 tokens). kvfuzz's driver and the model under
    `async_scheduling` agree; the synchronous Scheduler lets the entry go after step 1 and r7
    evicts it (6 tokens, up to its input 1, which no longer fits)."""
    ex = Execution(_config(True), "scheduler", ("kvcache", "vllm-async-scheduler"))
    results = [ex.apply(op) for op in OPS]
    assert results[3]["scheduled"] == [["r6", 1, 0], ["r7", 4, 0]]
    cache = ex.targets[1].side.vllm_scheduler.encoder_cache_manager
    assert cache.cached == {"mm-1": set()} and cache.num_free_slots == 0
    ex = Execution(_config(False), "scheduler", ("kvcache", "vllm-scheduler"))
    assert [ex.apply(op) for op in OPS][3]["scheduled"] == [["r6", 1, 0], ["r7", 6, 0]]


def test_a_release_rule_other_than_the_schedulers_is_bad_input(tmp_path, capsys):
    assert "async_scheduling false" in unsupported_reason(_config(False), True)
    assert "async_scheduling true" in unsupported_reason(_config(True), False)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(Trace(_config(False), "scheduler", OPS, {}).to_dict()))
    assert kvfuzz(["replay", str(path), "--target", "vllm-async-scheduler"]) == 2
    assert "async_scheduling" in capsys.readouterr().err


def test_the_plant_that_releases_past_unresolved_placeholders_is_caught():
    """`encoder-released-unsettled`: AsyncScheduler's output lets r6's entry go as the
    synchronous Scheduler's does, so r7 evicts it in step 2 where the driver holds it."""
    trace = Trace(_config(True), "scheduler", OPS, {})
    assert run_trace(trace, ("vllm-async-scheduler",)).passed
    finding = run_trace(trace, ("vllm-scheduler-bug:encoder-released-unsettled",)).finding
    assert finding is not None and finding.check == "DIFF-result", finding


def test_a_campaign_binds_the_encoder_under_async_scheduling(tmp_path, capsys):
    """`tenants` runs with its encoder bound on the AsyncScheduler (no longer unbound)."""
    engine = VllmAsyncSchedulerSide.engine_config(BUILTIN["tenants"][1]).scheduler
    assert (engine.encoder_budget, engine.encoder_cache_size, engine.async_scheduling) == (
        3, 4, True)
    code = kvfuzz(["run", "--target", "vllm-async-scheduler", "--level", "scheduler",
                   "--config", "tenants", "--examples", "40", "--corpus", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "left out" not in out and "findings           0" in out


# ----- the encoder budget on an encoder-decoder config (`cross`) -----

CROSS_OPS = [{"op": "add_request", "request_id": rid, "prompt": list(range(10 * i, 10 * i + 6)),
              "num_encoder_tokens": tokens, "max_tokens": 3}
             for i, (rid, tokens) in enumerate((("a", 10), ("b", 5), ("c", 2)))] + [
    {"op": "step"}] * 3
"""`cross` binds the budget (12): a's encoder input (10) leaves 2, so b's (5) waits."""


@pytest.mark.parametrize("target", ["vllm-scheduler", "vllm-async-scheduler"])
def test_an_encoder_decoder_input_waits_for_the_budget_as_the_driver_does(target):
    """vLLM's Scheduler made encoder-decoder schedules each request's encoder input against
    `max_num_encoder_input_tokens` when it starts: b is passed over in step 1 (0 tokens,
    `scheduler.py:2203-2223`) and c admitted behind it, three-way."""
    config = VllmAsyncSchedulerSide.engine_config(BUILTIN["cross"][1]) if "async" in target \
        else BUILTIN["cross"][1]
    ex = Execution(config, "scheduler", ("kvcache", target))
    results = [ex.apply(op) for op in CROSS_OPS]
    assert results[3]["scheduled"] == [["a", 6, 0], ["c", 6, 0]]
    assert results[4]["scheduled"] == [["a", 1, 0], ["c", 1, 0], ["b", 6, 0]]
    assert ex.targets[1].side.vllm_scheduler.max_num_encoder_input_tokens == 12


def test_an_encoder_cache_bound_on_an_encoder_decoder_config_runs():
    cross = BUILTIN["cross"][1]
    bound = cross.replace(scheduler=dataclasses.replace(cross.scheduler, encoder_cache_size=12))
    assert unsupported_reason(bound) is None


# ----- finding 030: an encoder-decoder input's room is given back after every output -----

ROOT = Path(__file__).resolve().parents[2]
FINDING_030 = str(ROOT / "docs" / "findings" / "030-encoder-decoder-slots-credited-twice.json")


def _trace_030() -> Trace:
    return Trace.load(FINDING_030)


def test_vllm_admits_more_encoder_inputs_than_the_cache_holds_strict():
    """a's input (8 of a cache of 12) is credited back after each of its 3 outputs: vLLM's
    count reaches 28, and b and c (9 + 9) are both admitted in one step, three-way only c
    waits."""
    finding = run_trace(_trace_030(), ("vllm-scheduler-strict",)).finding
    assert finding is not None and finding.check == "DIFF-result", finding
    assert "['c', 4, 0]" in finding.message
    assert run_trace(_trace_030(), ("kvcache",)).passed


def test_vllms_free_count_grows_past_the_cache_size_after_each_output():
    ex = Execution(_trace_030().config, "scheduler", ("kvcache", "vllm-scheduler-strict"))
    manager = ex.targets[1].side.vllm_scheduler.encoder_cache_manager
    counts = []
    for op in _trace_030().ops[:4]:
        ex.apply(op)
        counts.append(manager.num_free_slots)
    assert counts == [12, 12, 20, 28] and manager.cache_size == 12


def test_vllm_scheduler_tolerates_030_and_names_the_request_it_let_in():
    ex = Execution(_trace_030().config, "scheduler", ("kvcache", "vllm-scheduler"))
    for op in _trace_030().ops:
        result = ex.apply(op)
    assert result["scheduled"] == [["a", 1, 0], ["b", 4, 0]]
    assert ex.targets[1].side.tolerated["encoder-decoder-slots-credited-twice"] == {"c"}


def test_finding_030_replays_with_no_tolerate(capsys):
    assert kvfuzz(["replay", FINDING_030]) == 1
    assert "DIFF-result" in capsys.readouterr().out


def test_the_tolerance_hides_no_other_slot_count_error():
    """The plant that never gives an encoder-decoder input's room back is caught by the
    tolerating target (the opposite error of 030)."""
    trace = _trace_030()
    assert run_trace(trace, ("vllm-scheduler",)).passed
    finding = run_trace(trace, ("vllm-scheduler-bug:cross-encoder-room-kept",)).finding
    assert finding is not None and finding.check == "DIFF-result", finding


def test_a_campaign_on_a_cross_config_with_an_encoder_cache_bound_exits_0(tmp_path, capsys):
    code = kvfuzz(["run", "--target", "vllm-scheduler", "--config-file",
                   str(ROOT / "docs" / "configs" / "whisper-encoder-cache.json"), "--level",
                   "scheduler", "--examples", "40", "--corpus", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "findings           0" in out and "030 encoder-decoder-slots-credited-twice" in out


def test_the_plant_that_lets_an_encoder_decoder_input_past_the_budget_is_caught():
    trace = Trace(BUILTIN["cross"][1], "scheduler", CROSS_OPS, {})
    assert run_trace(trace, ("vllm-scheduler",)).passed
    finding = run_trace(trace, ("vllm-scheduler-bug:cross-encoder-unbudgeted",)).finding
    assert finding is not None and finding.check == "DIFF-result", finding
