"""vLLM's own v1 Scheduler (target `vllm-scheduler`) against kvfuzz's driver on kvcache and the
reference model, through the one executor (docs/vllm.md, "vLLM's own scheduler").

Three-way: each scheduler-level op runs on kvcache (kvfuzz's driver), on vLLM's Scheduler and
on the model; every step's result (scheduled tokens per request, hits, preempted, finished),
every snapshot (block tables, computed tokens, queues) and every registered check are compared
and run on each. Bugs planted in vLLM's Scheduler (`vllm-scheduler-bug:NAME`) are caught by a
campaign; the scheduler-level findings replay on it.

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
from kvfuzz.fuzz.campaign import selected_checks
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.fuzz.machines import machine_for
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.tolerance import Tolerance
from kvfuzz.harness.vllm_api import VllmUnsupported, load_vllm
from kvfuzz.harness.vllm_scheduler_target import (
    _publishes_after_output,
    _stop_keeps_drafts_computed,
    _trim_stopped_drafts,
    loop_rules,
    unsupported_reason,
)
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

FINDINGS = Path(__file__).resolve().parents[2] / "docs" / "findings"
engine = get_target("vllm-scheduler").engine_config
"""A config under the loop rules this vLLM's Scheduler follows (0.32: `stop`), as a campaign
runs it."""
THREE_WAY = ("kvcache", "vllm-scheduler")
CONFIGS = ("full", "hybrid", "partial_hits", "priority", "qwen3_5_align", "qwen3_5_checkpoint",
           "qwen3_next_eagle", "sliding_window", "mamba", "eagle")
"""Shapes whose scheduling differs: prefix hits, windows, copy-on-write, the priority policy,
Mamba state (mode "none" and "align" chunking, prefill checkpoints), EAGLE and spec-decode
drafts."""


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


def test_vllm_scheduler_preempts_admits_hits_and_finishes_as_the_driver_does():
    """Pool pressure on a 10-block pool: every kind of step outcome, three-way."""
    ex = Execution(BUILTIN["full"][1].replace(num_blocks=10), "scheduler", THREE_WAY)
    for i in range(4):
        ex.apply(_add(f"r{i}", list(range(100, 110)) if i % 2 else list(range(12)),
                      max_tokens=3))
    outcomes = [ex.apply({"op": "step", "sample": i}) for i in range(12)]
    assert any(out["preempted"] for out in outcomes)
    assert any(hit for out in outcomes for _, _, hit in out["scheduled"])
    assert any(out["finished"] for out in outcomes)
    assert type(ex.targets[1].side.vllm_scheduler).__name__ == "Scheduler"


def test_priority_preemption_and_aborts_on_vllm_scheduler():
    """The pool runs out while the more important request decodes: vLLM's Scheduler preempts
    the less important one (admitted later or not); aborting a running and a waiting request
    frees what they hold."""
    ex = Execution(engine(BUILTIN["priority"][1].replace(num_blocks=7)), "scheduler", THREE_WAY)
    ex.apply(_add("low", list(range(15)), priority=2, max_tokens=8))
    ex.apply(_add("high", list(range(50, 58)), priority=0, max_tokens=8))
    outcomes = [ex.apply({"op": "step", "sample": i}) for i in range(3)]
    assert ["low"] in [out["preempted"] for out in outcomes]
    ex.apply(_add("other", list(range(30, 40)), priority=1))
    ex.apply({"op": "abort", "request_id": "high"})
    ex.apply({"op": "finish", "request_id": "low"})
    assert ex.state.requests["high"].status == "FINISHED_ABORTED"
    assert ex.apply({"op": "step"})["scheduled"] == [["other", 10, 0]]


def test_spec_decode_drafts_are_verified_and_rolled_back_as_the_driver_does():
    """Drafts proposed after a step (`update_draft_token_ids`), scheduled with the request
    (`scheduled_spec_decode_tokens`), some accepted (sampled tokens = kept drafts + 1), the
    rest rolled back by `update_from_output`; a stop among the kept ones: three-way."""
    ex = Execution(BUILTIN["eagle"][1], "scheduler", THREE_WAY)
    ex.apply(_add("a", list(range(6)), max_tokens=9))
    ex.apply(_add("b", list(range(50, 59)), max_tokens=3))
    ex.apply({"op": "step", "draft": 3})
    out = ex.apply({"op": "step", "accept": 1, "draft": 4, "sample": 5})
    assert out["scheduled"] == [["a", 4, 0], ["b", 4, 0]] and out["finished"] == ["b"]
    scheduler = ex.targets[1].side.vllm_scheduler
    a = scheduler.requests["a"]
    assert (a.num_computed_tokens, a.num_tokens, len(a.spec_token_ids)) == (8, 9, 4)
    ex.apply({"op": "step", "accept": 0, "draft": 2})
    assert (a.num_computed_tokens, a.num_tokens) == (9, 10)  # 4 rejected: 13 - 4
    for op in ({"op": "step", "draft": 4}, {"op": "step", "accept": 2}):
        ex.apply(op)
    assert ex.state.requests["a"].status == "FINISHED_LENGTH_CAPPED"


@pytest.mark.parametrize("target", ["vllm-scheduler", "vllm-async-scheduler"])
def test_lora_embeds_and_salts_campaign_exits_0(target, tmp_path, capsys):
    """Config `tenants`: LoRA adapters, prompt embeddings, multimodal inputs and cache salts
    through vLLM's Scheduler."""
    code = kvfuzz(["run", "--target", target, "--level", "scheduler", "--examples", "40",
                   "--config", "tenants", "--corpus", str(tmp_path / "corpus")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "left out" not in out and "findings           0" in out


def test_multimodal_inputs_run_three_way_with_an_encoder_budget_that_never_binds():
    """A request's multimodal inputs reach vLLM's Scheduler as `mm_features`; it schedules
    their encoder inputs beside the tokens (the encoder cache then holds them) against an
    encoder budget and cache no trace fills, so its chunks are kvfuzz's driver's: a chunk
    that overlaps an input is not cut, and a request whose input differs hits only the
    blocks before it."""
    config = BUILTIN["tenants"][1]
    config = config.replace(scheduler=dataclasses.replace(
        config.scheduler, token_budget=8, encoder_budget=None, encoder_cache_size=None))
    ex = Execution(config, "scheduler", THREE_WAY)
    prompt = list(range(16))
    ex.apply(_add("a", prompt, mm_inputs=[[1, 4, 8]], max_tokens=1))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 8, 0]]  # [0, 8) overlaps [4, 12)
    scheduler = ex.targets[1].side.vllm_scheduler
    assert scheduler.encoder_cache_manager.cached.keys() == {"mm-1"}
    ex.apply({"op": "step"})
    ex.apply(_add("same", prompt, mm_inputs=[[1, 4, 8]], max_tokens=1))
    ex.apply(_add("other", prompt, mm_inputs=[[2, 4, 8]], max_tokens=1))
    hits = {rid: hit for rid, _, hit in ex.apply({"op": "step"})["scheduled"]}
    block = config.scheduler_block_size
    assert hits["same"] > hits["other"] and hits["other"] <= 4 // block * block
    for i in range(4):
        ex.apply({"op": "step", "sample": i})


def test_an_encoder_decoder_config_runs_three_way():
    """`cross`: vLLM's Scheduler made encoder-decoder (as its own tests make one) schedules each
    request's encoder input (its `num_encoder_tokens` at offset 0) with its first chunk and
    allocates the cross-attention blocks then; a preempted request's are freed and allocated
    again at its readmission; a request without encoder tokens gets none: three-way (the
    encoder budget unbound here: tests/vllm/test_vllm_scheduler_encoder.py binds it)."""
    cross = BUILTIN["cross"][1]
    ex = Execution(cross.replace(num_blocks=12, scheduler=dataclasses.replace(
        cross.scheduler, encoder_budget=None)), "scheduler", THREE_WAY)
    ex.apply(_add("a", list(range(6)), num_encoder_tokens=10, max_tokens=3))
    ex.apply(_add("b", list(range(20, 60)), num_encoder_tokens=7, max_tokens=3))
    ex.apply(_add("c", list(range(9)), max_tokens=2))
    scheduler = ex.targets[1].side.vllm_scheduler
    assert scheduler.is_encoder_decoder
    outcomes = [ex.apply({"op": "step", "sample": i}) for i in range(8)]
    assert outcomes[0]["scheduled"] == [["a", 6, 0]]
    cross = scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    assert ["b"] in [out["preempted"] for out in outcomes]
    assert len(cross.req_to_blocks["b"]) == 2  # cdiv(7, 4), after its readmission
    ex.apply({"op": "abort", "request_id": "b"})
    ex.apply({"op": "step"})
    assert not cross.req_to_blocks.get("c")


def test_an_encoder_budget_and_cache_that_bind_cut_chunks_as_the_driver_does():
    """`tenants`' encoder budget (3 embeddings a step) and encoder cache (4) reach vLLM's
    Scheduler (`max_num_encoder_input_tokens`, `EncoderCacheManager`), three-way: a's input 0
    (2) leaves 1 of the budget, so a's chunk stops before its input 1 (3) and b's before its
    own; after the step the entry of a's input 0 turns evictable; the next step evicts it for
    input 1, which b then hits (docs/spec.md §7.2)."""
    config = BUILTIN["tenants"][1]
    config = config.replace(scheduler=dataclasses.replace(config.scheduler, token_budget=16))
    ex = Execution(engine(config), "scheduler", THREE_WAY)
    ex.apply(_add("a", list(range(12)), mm_inputs=[[0, 2, 2], [1, 6, 3]], max_tokens=2))
    ex.apply(_add("b", list(range(20, 32)), mm_inputs=[[1, 1, 3]], max_tokens=2))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 6, 0], ["b", 1, 0]]
    cache = ex.targets[1].side.vllm_scheduler.encoder_cache_manager
    assert list(cache.freeable) == ["mm-0"] and cache.num_free_slots == 2
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 6, 0], ["b", 10, 0]]
    assert cache.cached.keys() == {"mm-1"} and list(cache.freeable) == ["mm-1"]
    for i in range(3):
        ex.apply({"op": "step", "sample": i})


def test_drafts_on_the_async_scheduler_are_a_usage_error(tmp_path, capsys):
    trace = Trace(BUILTIN["eagle"][1], "scheduler",
                  [_add("r", list(range(8))), {"op": "step", "draft": 2}], {})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace.to_dict()))
    assert kvfuzz(["replay", str(path), "--target", "vllm-async-scheduler"]) == 2
    assert "draft" in capsys.readouterr().err


def test_finding_025_shows_on_vllm_scheduler_where_documented():
    """A stop among accepted drafts: vLLM 0.32 leaves the dropped drafts computed; the strict
    target fails at the last step where the deviation applies, `vllm-scheduler` passes."""
    path = FINDINGS / "025-stopped-drafts-stay-computed.json"
    doc = path.with_suffix(".md").read_text()
    assert f"kvfuzz replay docs/findings/{path.name}" in doc
    trace = Trace.load(path)
    sides: list[Any] = []

    def tolerant(config: Any, level: str) -> Any:
        sides.append(get_target("vllm-scheduler").build(config, level))
        return sides[-1]

    assert run_trace(trace, ("kvcache", tolerant)).passed
    strict = run_trace(trace, ("vllm-scheduler-strict",)).finding
    if not _stop_keeps_drafts_computed():
        assert strict is None and "stopped-drafts-stay-computed" not in sides[0].tolerated
        return
    assert (strict.check, strict.step) == (trace.meta["check"], len(trace.ops) - 1)
    assert sides[0].tolerated["stopped-drafts-stay-computed"] == {"r4"}


def test_finding_025_is_tolerated_only_for_a_request_that_sampled():
    """025's shape needs a sampled token: a request ended while a KV load covering its whole
    prompt is in flight keeps every token computed on every release, and is left as it is."""
    config = BUILTIN["connector"][1]
    ex = Execution(config, "scheduler", ("kvcache",))
    ex.apply(_add("r", list(range(11)), max_tokens=2))
    ex.apply({"op": "load_remote", "request_id": "r", "num_external_tokens": 11})
    ex.apply({"op": "abort", "request_id": "r"})
    view = ex.state.requests["r"]
    assert (view.status, view.num_computed_tokens, view.num_tokens) == ("FINISHED_ABORTED", 11, 11)
    assert _trim_stopped_drafts(ex.state, config) == (ex.state, [])
    trimmed, rids = _trim_stopped_drafts(ex.state, config, sampled={"r"})
    assert (trimmed.requests["r"].num_computed_tokens, rids) == (10, ["r"])


@pytest.mark.parametrize("target", ["vllm-scheduler", "vllm-async-scheduler"])
def test_a_clean_campaign_exits_0(target, tmp_path, capsys):
    code = kvfuzz(["run", "--target", target, "--level", "scheduler", "--examples", "40",
                   "--config", "full", "hybrid", "qwen3_5_align", "eagle", "--corpus",
                   str(tmp_path / "corpus")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "findings           0" in out


def test_a_config_the_scheduler_cannot_take_is_left_out_with_its_reason():
    with pytest.raises(VllmUnsupported, match="reserved_blocks"):
        get_target("vllm-scheduler").cannot_build(BUILTIN["watermark"][1])
    assert get_target("vllm-scheduler").cannot_build(BUILTIN["full"][1]) is None
    assert get_target("vllm-scheduler").cannot_build(BUILTIN["connector"][1]) is None


def test_an_op_the_target_does_not_drive_is_a_usage_error(tmp_path, capsys):
    trace = Trace(BUILTIN["deferred"][1], "scheduler",
                  [_add("r", list(range(8))), {"op": "step", "in_flight": True}], {})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace.to_dict()))
    assert kvfuzz(["replay", str(path), "--target", "vllm-scheduler"]) == 2
    assert "in_flight" in capsys.readouterr().err


# ----- KV connectors: kvfuzz's connector on vLLM's Scheduler (harness/vllm_connector.py) -----

def test_kv_loads_whole_short_failed_and_aborted_on_vllm_scheduler():
    """Every way a load ends, three-way, on one full-attention group (block-level failures)
    and on a hybrid (the request reported failed): vLLM's Scheduler starts the loads through
    kvfuzz's connector and takes their ends as a worker reports them."""
    for name in ("connector", "gpt_oss_connector"):
        ex = Execution(BUILTIN[name][1], "scheduler", THREE_WAY)
        for rid, base in (("whole", 0), ("short", 20), ("failed", 40), ("aborted", 60)):
            ex.apply(_add(rid, list(range(base, base + 11)), max_tokens=2))
            assert ex.apply({"op": "load_remote", "request_id": rid,
                             "num_external_tokens": 11})["external"] == 11
        assert ex.state.requests["short"].status == "WAITING_FOR_REMOTE_KVS"
        ex.apply({"op": "abort", "request_id": "aborted"})
        ended = [ex.apply({"op": "finish_load", "request_id": rid, "num_loaded_tokens": n})
                 for rid, n in (("whole", None), ("short", 6), ("failed", 0), ("aborted", None))]
        assert ended == ([10, 4, 0, 0] if name == "connector" else [10, 0, 0, 0])
        for i in range(6):
            ex.apply({"op": "step", "sample": i})
        assert all(ex.state.requests[rid].status.startswith("FINISHED")
                   for rid in ("whole", "short", "failed", "aborted"))
        scheduler = ex.targets[1].side.vllm_scheduler
        assert type(scheduler.connector).__name__ == "TraceConnector"
        assert scheduler.recompute_kv_load_failures


def test_the_fail_policy_fails_a_short_load_three_way():
    """vLLM's other `kv_load_failure_policy` (`scheduler.kv_load_failure_policy = "fail"`,
    set on vLLM through KVTransferConfig): a short load fails the request (FINISHED_ERROR) and
    frees its blocks; a whole one lands as under "recompute". kvfuzz's driver, the model and
    vLLM's Scheduler agree."""
    for name in ("connector", "gpt_oss_connector"):
        config = BUILTIN[name][1]
        config = config.replace(scheduler=dataclasses.replace(
            config.scheduler, kv_load_failure_policy="fail"))
        ex = Execution(config, "scheduler", THREE_WAY)
        for rid, base in (("whole", 0), ("short", 20)):
            ex.apply(_add(rid, list(range(base, base + 11)), max_tokens=2))
            ex.apply({"op": "load_remote", "request_id": rid, "num_external_tokens": 11})
        assert ex.apply({"op": "finish_load", "request_id": "whole"}) == 10
        assert ex.apply({"op": "finish_load", "request_id": "short",
                         "num_loaded_tokens": 6}) == 0
        scheduler = ex.targets[1].side.vllm_scheduler
        assert not scheduler.recompute_kv_load_failures
        assert ex.state.requests["short"].status == "FINISHED_ERROR"
        assert ex.state.requests["whole"].status == "WAITING"
        held = {b.block_id for g in scheduler.kv_cache_manager.get_blocks("whole").blocks
                for b in g if not b.is_null}
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        assert free == config.num_blocks - 1 - len(held)  # "short" holds nothing
        for i in range(4):
            ex.apply({"op": "step", "sample": i})
        assert ex.state.requests["whole"].status.startswith("FINISHED")


@pytest.mark.parametrize("policy, first", [("fcfs", "later"), ("priority", "low")])
def test_landed_loads_wait_ahead_of_the_rest_in_load_start_order_three_way(policy, first):
    """vLLM 0.34's `kv_holding_waiting` (sched/scheduler.py:229-234, drained first at
    :1101): requests a load started for wait ahead of the others, in load start order (under
    priority, in priority order), even ahead of a more important request; kvfuzz's driver and
    the model agree (docs/spec.md §13.2), so `landed-load-order` is no deviation any more."""
    base = BUILTIN["connector"][1]
    config = base.replace(scheduler=dataclasses.replace(base.scheduler, policy=policy,
                                                        token_budget=4))
    ex = Execution(engine(config), "scheduler", ("vllm-scheduler-strict",))
    ex.apply(_add("low", list(range(8)), priority=2, max_tokens=2))
    ex.apply(_add("later", list(range(20, 28)), priority=2, max_tokens=2))
    ex.apply({"op": "load_remote", "request_id": "later", "num_external_tokens": 4})
    ex.apply({"op": "load_remote", "request_id": "low", "num_external_tokens": 4})
    ex.apply(_add("high", list(range(40, 48)), priority=0, max_tokens=2))
    ex.apply({"op": "finish_load", "request_id": "later"})
    ex.apply({"op": "finish_load", "request_id": "low"})
    assert ex.state.waiting == (first, ({"low", "later"} - {first}).pop(), "high")
    assert ex.apply({"op": "step"})["scheduled"] == [[first, 4, 0]]


@pytest.mark.parametrize("gate, started", [(False, True), (True, False)])
def test_a_load_passes_the_full_sequence_gate_three_way(gate, started):
    """vLLM 0.34 passes `full_sequence_must_fit` to an async load's allocation too
    (sched/scheduler.py:1511): with 7 blocks free, a 40-token prompt (10 blocks) starts no
    8-token load under the gate; without it the load starts. Driver and model agree."""
    base = BUILTIN["connector"][1]
    ex = Execution(base.replace(scheduler=dataclasses.replace(
        base.scheduler, full_sequence_must_fit=gate)), "scheduler", ("vllm-scheduler-strict",))
    ex.apply(_add("r0", list(range(32)), max_tokens=4))
    ex.apply({"op": "step"})
    ex.apply(_add("r1", list(range(100, 140)), max_tokens=1))
    out = ex.apply({"op": "load_remote", "request_id": "r1", "num_external_tokens": 8})
    assert (out is not None) == started, out


def test_a_connector_campaign_on_vllm_scheduler_exits_0(tmp_path, capsys):
    code = kvfuzz(["run", "--target", "vllm-scheduler", "--level", "scheduler", "--examples",
                   "30", "--config", "connector", "gpt_oss_connector", "nemotron_h_connector",
                   "mistral_connector",
                   "--corpus", str(tmp_path / "corpus")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "findings           0" in out


def test_the_strict_target_shows_the_load_reservation_the_other_tolerates():
    """vLLM reserves the blocks an in-flight load's prefill still needs when it admits another
    load (DEVIATIONS["load-reservation"]); kvfuzz's driver does not."""
    trace = Trace(BUILTIN["connector"][1].replace(num_blocks=5), "scheduler", [
        _add("r4", [2, 3, 0, 1, 2], max_tokens=1),
        {"op": "load_remote", "request_id": "r4", "num_external_tokens": 2},
        _add("r7", [2, 3, 0, 1, 2, 3, 2, 2, 1], max_tokens=1),
        {"op": "load_remote", "request_id": "r7", "num_external_tokens": 11}], {})
    strict = run_trace(trace, ("vllm-scheduler-strict",)).finding
    assert strict is not None and (strict.check, strict.step) == ("DIFF-result", 3)
    assert run_trace(trace, ("vllm-scheduler",)).passed


def test_finding_016_is_reached_by_vllm_scheduler(capsys):
    """A short load on a lone sliding-window group: vLLM's Scheduler keeps the prefix up to
    the first invalid block, and the next chunk reads the window through the null block.
    `vllm-scheduler` tolerates it (its connector reports such a load failed, as the driver
    rolls it back)."""
    path = FINDINGS / "016-short-load-window-unloaded.json"
    trace = Trace.load(path)
    checks = _checks_of(trace)
    found = run_trace(trace, ("vllm-scheduler-strict",), model=False, checks=checks).finding
    assert found is not None and (found.check, found.step) == ("D1", 3), found
    assert run_trace(trace, ("kvcache",), model=False, checks=checks).passed
    assert kvfuzz(["replay", str(path), "--target", "vllm-scheduler-strict",
                   "--no-model"]) == 1
    assert kvfuzz(["replay", str(path), "--target", "vllm-scheduler"]) == 0  # tolerated


# ----- steps in flight: AsyncScheduler with a KV-consumer connector defers frees -----

ASYNC_THREE_WAY = ("kvcache", "vllm-async-scheduler")


def test_steps_in_flight_on_vllm_async_scheduler_three_way():
    """Two prefill chunks left in flight, an abort while they are: vLLM's AsyncScheduler
    holds the outputs and defers the free, kvfuzz's driver defers it; the in-flight steps,
    their reads, the deferred frees and what `complete_step` releases agree three-way (018
    tolerated: the free is drained group after group)."""
    ex = Execution(BUILTIN["deferred_connector"][1], "scheduler", ASYNC_THREE_WAY)
    ex.apply(_add("a", list(range(20)), max_tokens=2))
    ex.apply(_add("b", list(range(40, 62)), max_tokens=2))
    ex.apply({"op": "step"})
    ex.apply({"op": "step", "in_flight": True})
    ex.apply({"op": "step", "in_flight": True})
    assert len(ex.state.in_flight) == 2
    ex.apply({"op": "abort", "request_id": "a"})
    assert ex.state.deferred_frees
    assert ex.apply({"op": "complete_step"}) == []
    released = ex.apply({"op": "complete_step"})
    assert released and not ex.state.in_flight and not ex.state.deferred_frees
    for i in range(8):
        ex.apply({"op": "step", "sample": i})
    assert ex.targets[1].side.scheduler.reordered == ["a"]


def test_steps_in_flight_that_sample_agree_three_way_on_vllm_async_scheduler():
    """vLLM appends a step's tokens when its output is taken (output placeholders), and so
    does kvfuzz's driver: r's and q's prompts complete in a step left in flight, and the next
    step in flight schedules the position of r's token still to come (4 computed of 3
    tokens), not q, whose pending token ends it; each `complete_step` appends the tokens,
    caches what is settled and finishes a request at max_tokens, three-way."""
    ex = Execution(BUILTIN["deferred_connector"][1], "scheduler", ASYNC_THREE_WAY)
    ex.apply(_add("r", list(range(3)), max_tokens=2))
    ex.apply(_add("q", [40], max_tokens=1))
    assert ex.apply({"op": "step", "in_flight": True})["scheduled"] == [["r", 3, 0],
                                                                        ["q", 1, 0]]
    assert ex.apply({"op": "step", "in_flight": True})["scheduled"] == [["r", 1, 0]]
    views = ex.state.requests
    assert (views["r"].num_computed_tokens, views["r"].num_tokens) == (4, 3)
    ex.apply({"op": "complete_step"})
    views = ex.state.requests
    assert views["q"].status == "FINISHED_LENGTH_CAPPED" and views["r"].num_tokens == 4
    ex.apply({"op": "complete_step"})
    assert ex.state.requests["r"].status == "FINISHED_LENGTH_CAPPED"
    assert not ex.state.in_flight and not ex.state.deferred_frees

def test_steps_in_flight_on_the_synchronous_scheduler_under_pipeline_parallelism():
    """On a config with deferred frees and a consumer connector vLLM's synchronous Scheduler
    is built with two pipeline stages, so it defers frees behind steps in flight: the three
    agree on prefill chunks in flight and an abort while they are, and a step in flight that
    samples under `scheduler.in_flight_sampling = "placeholders"` (the default) is refused
    (exit 2): that Scheduler follows "wait"."""
    from kvfuzz.core.errors import InvalidTrace

    ex = Execution(BUILTIN["deferred_connector"][1], "scheduler", ("kvcache", "vllm-scheduler"))
    vllm_side = ex.targets[1].side
    assert vllm_side.vllm_scheduler.defer_block_free
    assert not vllm_side.offers("in_flight_sampling") and vllm_side.offers("in_flight")
    ex.apply(_add("a", list(range(20)), max_tokens=2))
    ex.apply({"op": "step", "in_flight": True})
    ex.apply({"op": "abort", "request_id": "a"})
    assert ex.state.deferred_frees
    assert ex.apply({"op": "complete_step"})
    assert not ex.state.in_flight and not ex.state.deferred_frees
    ex.apply(_add("r", list(range(3))))
    with pytest.raises(InvalidTrace, match=r"samples \['r'\] under scheduler.in_flight_"
                       r"sampling 'placeholders'; vLLM's Scheduler follows 'wait'"):
        ex.apply({"op": "step", "in_flight": True})


def _waits(config: Any) -> Any:
    return config.replace(scheduler=dataclasses.replace(config.scheduler,
                                                        in_flight_sampling="wait"))


def test_steps_in_flight_that_sample_agree_three_way_on_the_synchronous_scheduler():
    """Under the pipeline's rule (`in_flight_sampling = "wait"`) a request whose sampling step
    is in flight gets no tokens until its output is taken, as vLLM's Scheduler gives it
    `num_tokens_with_spec − num_computed_tokens = 0` (`scheduler.py:855-859`, `:907-925` in
    0.34.0): r's and q's prompts complete in a step left in flight; the next step in flight
    schedules neither (nothing launched); the output appends their tokens (q ends at
    max_tokens) and r's next step schedules its new token, three-way."""
    ex = Execution(_waits(BUILTIN["deferred_connector"][1]), "scheduler", THREE_WAY)
    assert ex.targets[1].side.offers("in_flight_sampling")
    ex.apply(_add("r", list(range(3)), max_tokens=2))
    ex.apply(_add("q", [40], max_tokens=1))
    assert ex.apply({"op": "step", "in_flight": True})["scheduled"] == [["r", 3, 0],
                                                                        ["q", 1, 0]]
    assert ex.apply({"op": "step", "in_flight": True})["scheduled"] == []
    assert len(ex.state.in_flight) == 1
    assert (ex.state.requests["r"].num_computed_tokens, ex.state.requests["r"].num_tokens) == (
        3, 3)
    ex.apply({"op": "complete_step"})
    views = ex.state.requests
    assert views["q"].status == "FINISHED_LENGTH_CAPPED" and views["r"].num_tokens == 4
    assert ex.apply({"op": "step", "in_flight": True})["scheduled"] == [["r", 1, 0]]
    ex.apply({"op": "complete_step"})
    assert ex.state.requests["r"].status == "FINISHED_LENGTH_CAPPED"
    assert not ex.state.in_flight and not ex.state.deferred_frees


def test_the_async_scheduler_refuses_the_pipelines_rule():
    """AsyncScheduler always counts output placeholders: a step in flight that samples under
    "wait" is a usage error naming the value, and it offers no such step to the generators."""
    from kvfuzz.core.errors import InvalidTrace

    ex = Execution(_waits(BUILTIN["deferred_connector"][1]), "scheduler", ASYNC_THREE_WAY)
    assert not ex.targets[1].side.offers("in_flight_sampling")
    ex.apply(_add("r", list(range(3))))
    with pytest.raises(InvalidTrace, match="in_flight_sampling 'wait'; vLLM's AsyncScheduler "
                                           "follows 'placeholders'"):
        ex.apply({"op": "step", "in_flight": True})


@pytest.mark.parametrize("target, rule", [
    ("vllm-scheduler", "wait"), ("vllm-scheduler-strict", "wait"),
    ("vllm-scheduler-bug:in-flight-sample-rescheduled", "wait"),
    ("vllm-async-scheduler", "placeholders"), ("vllm-scheduler-bug:free-not-deferred",
                                               "placeholders")])
def test_a_campaign_runs_a_config_under_its_schedulers_rule(target, rule):
    """The target sets `in_flight_sampling` of a config whose steps stay in flight to the rule
    its Scheduler follows; a config without deferred frees is left as it is."""
    info = get_target(target)
    for config in (BUILTIN["deferred_connector"][1], _waits(BUILTIN["deferred_connector"][1])):
        assert info.engine_config(config).scheduler.in_flight_sampling == rule
    full = BUILTIN["full"][1]
    assert info.engine_config(full) == full.replace(  # the loop rules of this vLLM only
        scheduler=dataclasses.replace(full.scheduler, **loop_rules()))
    assert get_target("kvcache").engine_config(BUILTIN["deferred"][1]) is BUILTIN["deferred"][1]


def test_a_campaign_draws_steps_in_flight_that_sample_on_the_synchronous_scheduler(tmp_path):
    """A campaign on `deferred_connector` runs under "wait" and draws steps in flight whose
    requests sample (the plant that schedules them anyway is caught below); unmutated it
    finds nothing."""
    code = kvfuzz(["run", "--target", "vllm-scheduler", "--level", "scheduler",
                   "--config", "deferred_connector", "--examples", "60", "--seed", "3",
                   "--corpus", str(tmp_path)])
    assert code == 0


def test_a_campaign_leaves_steps_in_flight_on_vllm_async_scheduler(tmp_path, capsys):
    code = kvfuzz(["run", "--target", "vllm-async-scheduler", "--level", "scheduler",
                   "--config", "deferred_connector", "--examples", "120", "--seed", "2",
                   "--corpus", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "018 deferred-drain-group-order" in out


def test_finding_018_trace_replays_on_vllm_async_scheduler():
    """018's trace: a request aborted while its prefill chunk is in flight. vLLM's
    AsyncScheduler (KV-consumer connector) defers the free and drains it in reverse over the
    whole list, window group first: DIFF-state on the free queue at `complete_step` (the trace
    records `no_tolerate: 018`); tolerated, the side drains group after group and it passes."""
    _replays_as_recorded("018-deferred-drain-group-order", "vllm-async-scheduler",
                         ("DIFF-state", 3), "free_queue")
    # The synchronous Scheduler with two pipeline stages drains the same way.
    path = FINDINGS / "018-deferred-drain-group-order.json"
    assert kvfuzz(["replay", str(path), "--target", "vllm-scheduler"]) == 1


def _replays_as_recorded(name: str, target: str, where: tuple[str, int], says: str) -> None:
    """A finding trace that records `no_tolerate`: on `target` it fails `where` (check, step)
    with a message naming `says`, and `kvfuzz replay` exits 1; kvcache passes it, and so does
    `target` tolerating its default deviations."""
    path = FINDINGS / f"{name}.json"
    trace = Trace.load(path)
    found = run_trace(trace, (get_target(target).spec(Tolerance.of_meta(trace.meta)),)).finding
    assert found is not None and (found.check, found.step) == where, found
    assert says in found.message
    assert run_trace(trace, ("kvcache",)).passed
    assert kvfuzz(["replay", str(path), "--target", target]) == 1
    assert run_trace(trace, (get_target(target).spec(Tolerance()),)).passed


# ----- MTP at scheduler level: hash and prefill lookahead (0.33+) -----

def test_mtp_runs_on_vllm_scheduler_where_the_release_hashes_ahead(tmp_path, capsys):
    """vLLM's Scheduler takes MTP's lookahead from VllmConfig (num_hash_lookahead_tokens,
    num_prefill_lookahead_tokens): a campaign exits 0 where vLLM hashes ahead, and a release
    without it refuses the config (exit 2)."""
    code = kvfuzz(["run", "--target", "vllm-scheduler", "--level", "scheduler", "--config",
                   "deepseek_v3_mtp", "--examples", "60", "--corpus", str(tmp_path)])
    out, err = capsys.readouterr()
    if load_vllm().has("hash_lookahead"):
        assert code == 0, out
        assert "findings           0" in out
    else:
        assert code == 2 and "num_hash_lookahead_tokens" in err


def test_mtp_runs_where_vllm_and_the_driver_publish_alike():
    """vLLM's Scheduler skips a waiting request the prefill lookahead leaves no tokens (as
    kvfuzz's driver now does), and publishes states after each output under async scheduling
    (0.33+) and on a Mamba hybrid (0.34; `cache_blocks` in `update_from_output`), which with
    hash lookahead caches the hash block the sampled token completes; kvfuzz's driver
    publishes under `scheduler.async_scheduling` and on a Mamba hybrid under
    `scheduler.settled_blocks` "at_output", so a config is refused where the two differ, and
    runs under this release's rule (tests/vllm/test_vllm_scheduler_async_mtp.py)."""
    assert unsupported_reason(engine(BUILTIN["deepseek_v3_mtp"][1])) is None
    assert unsupported_reason(engine(BUILTIN["deepseek_v3_mtp3"][1])) is None
    if load_vllm().has("hash_lookahead"):
        assert "publishing states" in unsupported_reason(BUILTIN["deepseek_v3_mtp"][1], True)
    mamba = unsupported_reason(BUILTIN["qwen3_next_mtp"][1]) or ""
    assert ("publishing states" in mamba) != _publishes_after_output(False, True)
    assert unsupported_reason(engine(BUILTIN["qwen3_next_mtp"][1])) is None


def _mtp_trace(config: str, ops: list[dict[str, Any]]) -> Trace:
    base = BUILTIN[config][1]
    return Trace(base.replace(scheduler=dataclasses.replace(base.scheduler, token_budget=16)),
                 "scheduler", ops, {})


def test_a_request_the_prefill_lookahead_leaves_no_tokens_is_passed_over_three_way():
    """deepseek_v3_mtp3 (prefill lookahead 3), budget 16: r0 takes 15 tokens; the one left
    would end r1's 2-token prompt inside the lookahead, so r1 is passed over (vLLM's
    `skip_request`) and r2 takes it; vLLM's Scheduler, kvfuzz's driver and the model agree."""
    if not load_vllm().has("hash_lookahead"):
        pytest.skip("this vLLM does not hash ahead")
    ops = [_add("r0", [2, 1, 2, 3, 1, 2, 0, 2, 1, 3, 0, 0, 2, 3, 3], max_tokens=1),
           _add("r1", [2, 1], max_tokens=1), _add("r2", [2, 1, 0, 1], max_tokens=1),
           {"op": "step"}, {"op": "step"}]
    steps: list[Any] = []
    result = run_trace(_mtp_trace("deepseek_v3_mtp3", ops), ("vllm-scheduler-strict",),
                       on_step=lambda i, op, out: steps.append(out))
    assert result.passed, result.finding
    assert steps[3]["scheduled"] == [["r0", 15, 0], ["r2", 1, 0]]
    assert ["r1", 2, 0] in steps[4]["scheduled"]


def test_the_block_a_sampled_token_completes_is_published_three_way():
    """qwen3_next_mtp (hash blocks of 2 covering the next 2 tokens, Mamba align): a 3-token
    prompt sampled once completes hash block 0's lookahead; vLLM 0.34's `update_from_output`
    caches it before the request finishes, and so do kvfuzz's driver and the model
    (`settled_blocks` "at_output"); 0.32 and 0.33 cache nothing there ("next_step"), nor do
    the driver and the model under that rule."""
    if not load_vllm().has("hash_lookahead"):
        pytest.skip("this vLLM does not hash ahead")
    config = engine(_mtp_trace("qwen3_next_mtp", []).config)
    ex = Execution(config, "scheduler", ("kvcache", "vllm-scheduler-strict"))
    ex.apply(_add("r5", [3, 2, 0], max_tokens=1))
    assert ex.apply({"op": "step"})["finished"] == ["r5"]
    published = _publishes_after_output(False, True)
    assert {tuple(tokens) for _, _, tokens in ex.state.cache} == ({(3, 2)} if published
                                                                 else set())


# ----- the state machines, three-way, over the shapes above -----

for _name in CONFIGS:
    # Under this vLLM's loop rules: a config they change runs as given (not varied).
    _adapted = engine(BUILTIN[_name][1])
    _machine = machine_for("scheduler", targets=THREE_WAY, allow_misuse=False,
                           **({"config_names": (_name,)} if _adapted is BUILTIN[_name][1]
                              else {"configs": (_adapted,)}),
                           name=f"VllmSchedulerMachine_{_name}")
    globals()[f"Test{_machine.__name__}"] = _machine.TestCase


# ----- bugs planted in vLLM's Scheduler, each caught by a campaign -----

@pytest.mark.parametrize("plant, config, check", [
    ("preempt-keeps-blocks", "full", "I16"),
    ("finish-keeps-blocks", "full", "I16"),
    ("hit-not-adopted", "full", "DIFF-result"),
    ("mamba-split-unaligned", "mamba_align", "DIFF-result"),
    ("rejection-keeps-computed", "eagle", "DIFF-state"),
    ("failed-load-kept", "connector", "DIFF-result"),
    ("free-not-deferred", "deferred_connector", "IF1"),
    ("in-flight-sample-rescheduled", "deferred_connector", "DIFF-result"),
    ("failed-load-recomputed", "nemotron_h_connector", "DIFF-state"),
    ("encoder-never-fits", "tenants", "DIFF-result"),
    ("encoder-input-skipped", "cross", "DIFF-probe"),
    ("one-new-block-unsent", "full", "W1"),
])
def test_a_bug_planted_in_vllm_scheduler_is_caught(plant, config, check, tmp_path, capsys):
    code = kvfuzz(["run", "--target", f"vllm-scheduler-bug:{plant}", "--level", "scheduler",
                   "--config", config, "--examples", "60", "--corpus", str(tmp_path)])
    assert code == 1, capsys.readouterr().out
    assert [p.name for p in tmp_path.glob(f"{check}-{config}-*.json")]


def test_the_plant_that_gives_each_request_the_whole_encoder_budget_is_caught():
    """`encoder-budget-per-request` needs two requests' new inputs in one step over the budget,
    which a campaign meets later (docs/vllm.md, the plants' table): this trace has them. a's
    inputs spend 2 of the 3; b's input 1 (3) then fits only the plant's whole budget."""
    config = BUILTIN["tenants"][1]
    config = config.replace(scheduler=dataclasses.replace(
        config.scheduler, token_budget=16, encoder_cache_size=None))
    trace = Trace(level="scheduler", config=engine(config), ops=[
        _add("a", list(range(12)), mm_inputs=[[0, 2, 2], [1, 6, 3]], max_tokens=2),
        _add("b", list(range(20, 32)), mm_inputs=[[1, 1, 3]], max_tokens=2), {"op": "step"}])
    assert run_trace(trace, ("vllm-scheduler",)).passed
    finding = run_trace(trace, ("vllm-scheduler-bug:encoder-budget-per-request",)).finding
    assert finding is not None and finding.check == "DIFF-result", finding


def test_an_encoder_entry_of_a_request_preempted_after_it_was_scheduled_is_hit_uncomputed():
    """docs/findings/hazards.md, "An encoder output no step computed": under priority, a's third
    input (identifier 2) is allocated in the encoder cache when a is scheduled in step 3, then
    b's shortage preempts a; the step's encoder inputs drop a's, the entry stays cached. In
    step 4, c names identifier 2: a hit, so no step ever encodes it. Three-way (kvfuzz's driver
    and the model keep vLLM's rule, so no comparison sees it)."""
    from kvfuzz.core.config import SchedulerConfig

    config = BUILTIN["tenants"][1].replace(num_blocks=8, scheduler=SchedulerConfig(
        policy="priority", token_budget=16, encoder_budget=3))
    ex = Execution(engine(config), "scheduler", THREE_WAY)
    scheduler = ex.targets[1].side.vllm_scheduler
    encoded: list[dict[str, list[int]]] = []
    schedule = scheduler.schedule

    def recording_schedule() -> Any:
        output = schedule()
        encoded.append(dict(output.scheduled_encoder_inputs))
        return output

    scheduler.schedule = recording_schedule
    ex.apply(_add("a", list(range(24)), priority=1, max_tokens=4,
                  mm_inputs=[[0, 8, 2], [1, 12, 3], [2, 18, 3]]))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 12, 0]]  # cut before input 1
    ex.apply(_add("b", [50, 51, 52, 53], priority=0, max_tokens=8))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 6, 0], ["b", 4, 0]]
    assert ex.apply({"op": "step"}) == {"scheduled": [["b", 1, 0]], "preempted": ["a"],
                                        "finished": [], "copies": []}
    assert "mm-2" in scheduler.encoder_cache_manager.cached  # allocated, never computed
    ex.apply(_add("c", [60, 61, 62, 63, 64], priority=0, max_tokens=1, mm_inputs=[[2, 0, 3]]))
    assert ex.apply({"op": "step"})["scheduled"] == [["b", 1, 0], ["c", 5, 0]]
    assert encoded == [{"a": [0]}, {"a": [1]}, {}, {}]  # identifier 2: never encoded


# ----- scheduler-level findings, replayed on vLLM's own Scheduler -----

@pytest.mark.parametrize("name", ["020-checkpoint-chunk-keys-start-state",
                                  "021-junction-chunk-keys-start-state",
                                  "hazard-preempted-after-scheduled",
                                  "hazard-same-step-copy",
                                  "hazard-copy-of-a-copy"])
def test_finding_is_reached_by_vllm_scheduler(name):
    """vLLM's own Scheduler issues the chunks and copies of these findings from valid requests:
    the trace fails on `vllm-scheduler-strict` at the step and check it fails on `vllm-strict`
    (kvfuzz's driver on vLLM's manager; on 0.32 finding 007 comes first on both), under the
    loop rules of this vLLM's Scheduler (0.32's `break` for the priority hazard)."""
    trace = Trace.load(FINDINGS / f"{name}.json")
    trace.config = engine(trace.config)
    ours = run_trace(trace, ("vllm-scheduler-strict",), checks=_checks_of(trace)).finding
    driver = run_trace(trace, ("vllm-strict",), checks=_checks_of(trace)).finding
    assert ours is not None and driver is not None
    assert (ours.check, ours.step) == (driver.check, driver.step), ours.headline()
    if name[0].isdigit():  # a known deviation: `vllm-scheduler` tolerates it as `vllm` does
        assert run_trace(trace, ("vllm-scheduler",)).passed


def test_finding_020_harms_a_later_request_on_vllm_scheduler():
    """Two more ops after 020's trace: a request sharing r7's first block resumes from the
    block vLLM's Scheduler keyed, which holds the state after 2 tokens (S2, model off)."""
    trace = Trace.load(FINDINGS / "020-checkpoint-chunk-keys-start-state.json")
    trace.ops += [_add("r8", [2, 0, 1, 2, 1, 3, 3, 1, 0], max_tokens=1), {"op": "step"}]
    harmed = run_trace(trace, ("vllm-scheduler-strict",), model=False)
    assert harmed.finding is not None and harmed.finding.check == "S2", harmed
    assert run_trace(trace, ("vllm-scheduler",), model=False).passed


def _checks_of(trace: Trace) -> Any:
    """The checks the finding was recorded with (the data checks for a hazard)."""
    return selected_checks(trace.meta.get("data"))


def test_the_generated_pair_skips_configs_the_scheduler_cannot_take(tmp_path):
    """A generated config vLLM's Scheduler cannot take (here `reserved_blocks`) is skipped for
    the next seed's, as one vLLM refuses to build: not a usage error that stops the run."""
    from kvfuzz.fuzz.campaign import BatchRunner, CampaignOptions
    from kvfuzz.fuzz.config_space import generated_config

    seed = next(s for s in range(200) if generated_config(s).scheduler.reserved_blocks)
    runner = BatchRunner(CampaignOptions(target="vllm-scheduler", corpus=tmp_path))
    config = runner.buildable_config(seed)
    assert config.scheduler.reserved_blocks == 0
    assert get_target("vllm-scheduler").cannot_build(config) is None


def test_a_bounded_request_asks_vllm_for_prompt_logprobs():
    """The trace's hit bounds reach vLLM's Scheduler as `SamplingParams(prompt_logprobs=)`:
    prompt scoring from row 4 bounds the hit at 4 tokens, plain prompt logprobs skip cache
    reads; vLLM's Request derives both, three-way with the driver and the model."""
    ex = Execution(BUILTIN["full"][1], "scheduler", THREE_WAY)
    ex.apply(_add("a", list(range(12)), max_tokens=1))
    for i in range(3):
        ex.apply({"op": "step", "sample": i})
    bounded = [("limit", {"prefix_cache_hit_limit": 4}),
               ("skip", {"skip_reading_prefix_cache": True})]
    if not get_target("vllm-scheduler").build(BUILTIN["full"][1], "scheduler").offers(
            "prefix_cache_hit_limit"):
        bounded = bounded[1:]  # releases before 0.34 bound no hit by a limit
    for rid, bound in bounded:
        ex.apply(_add(rid, list(range(12)), max_tokens=1, **bound))
    out = ex.apply({"op": "step", "sample": 0})
    hits = {rid: hit for rid, _, hit in out["scheduled"]}
    requests = ex.targets[1].side.scheduler._requests
    for rid, _ in bounded:
        assert requests[rid].sampling_params.prompt_logprobs == 1
        assert hits[rid] == (4 if rid == "limit" else 0)
    if len(bounded) == 2:
        assert requests["limit"].prefix_cache_hit_limit == 4
        assert requests["skip"].prefix_cache_hit_limit == 0


@pytest.mark.parametrize("name, num_blocks", [("connector", None), ("gpt_oss_connector", None),
                                               ("nemotron_h_connector", 40)])
def test_synchronous_loads_run_three_way(name, num_blocks):
    """`load_remote {sync: true}`: kvfuzz's connector offers the tokens to vLLM's Scheduler as
    a synchronous load (`load_kv_async=False`) at the request's admission; the tokens count
    computed at once and the rest of the prompt is scheduled in the same step, as in kvfuzz's
    driver and the model. A request that hits a cached prefix loads past it."""
    config = BUILTIN[name][1]
    ex = Execution(config.replace(num_blocks=num_blocks or config.num_blocks), "scheduler",
                   THREE_WAY)
    ex.apply(_add("a", list(range(17)), max_tokens=2))
    assert ex.apply({"op": "load_remote", "request_id": "a", "num_external_tokens": 8,
                     "sync": True}) is True
    out = ex.apply({"op": "step"})
    assert out["scheduled"] == [["a", 9 if name != "nemotron_h_connector" else 8, 0]]
    assert ex.state.requests["a"].num_computed_tokens >= 16
    assert "a" not in ex.targets[1].side.scheduler.connector.sync_offers
    for i in range(3):
        ex.apply({"op": "step", "sample": i})
    ex.apply(_add("b", list(range(24)), max_tokens=1))
    ex.apply({"op": "load_remote", "request_id": "b", "num_external_tokens": 30, "sync": True})
    (rid, n, hit), = ex.apply({"op": "step"})["scheduled"]
    assert rid == "b" and n == 1 and hit > 0  # the hit, then the load up to the last token


def test_finding_017_trace_replays_on_vllm_scheduler():
    """017's scheduler-level trace: a synchronous load of 8 tokens of a 17-token prompt on
    `nemotron_h_connector` with 8 free blocks. vLLM's align predictor admits it and
    `get_new_blocks` raises mid-allocation (P4; the trace records `no_tolerate: 017`);
    tolerated, the predictor counts the two state blocks and the admission waits."""
    _replays_as_recorded("017-external-state-block-uncounted-scheduler", "vllm-scheduler",
                         ("P4", 2), "Cannot get 1 free blocks")


@pytest.mark.parametrize("num_blocks, raises", [(9, True), (14, True), (15, False)])
def test_finding_017_is_reached_by_vllm_scheduler_with_a_synchronous_load(num_blocks, raises):
    """Finding 017 end to end: kvfuzz's connector made synchronous (`load_kv_async=False`)
    offers 8 of a 17-token prompt on `nemotron_h_connector`; vLLM's Scheduler admits the
    request with 8 new tokens whenever its align predictor's count fits (from 8 free blocks)
    and the allocation then raises mid-way until 14 are free (the engine dies)."""
    import time

    from kvfuzz.harness.vllm_api import load_vllm
    from kvfuzz.harness.vllm_scheduler_target import build_vllm_scheduler

    v = load_vllm()
    if not v.has("kv_connector"):
        pytest.skip("this vLLM has no KV connector API")
    config = BUILTIN["nemotron_h_connector"][1]
    v["utils"].NONE_HASH = v["sha256"](config.none_hash_seed)
    hasher = v["utils"].get_request_block_hasher(config.resolved_hash_block_size, v["sha256"])
    scheduler = build_vllm_scheduler(config.replace(num_blocks=num_blocks))
    scheduler.connector.get_num_new_matched_tokens = lambda request, computed: (8, False)
    request = v["Request"]("a", list(range(17)), v["SamplingParams"](max_tokens=1), None,
                           arrival_time=time.time(), block_hasher=hasher)
    scheduler.add_request(request)
    if raises:
        with pytest.raises(ValueError, match="Cannot get 1 free blocks from the pool"):
            scheduler.schedule()
    else:
        assert scheduler.schedule().num_scheduled_tokens == {"a": 8}
        assert request.num_computed_tokens == 16
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0


# ----- a synchronous KV load that fails, reported by the step that admits it -----

@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failing_synchronous_load_agrees_three_way(policy):
    """kvfuzz's connector reports the blocks a synchronous load did not fill in the
    `KVConnectorOutput` of the step that admitted it (`invalid_block_ids`); vLLM's Scheduler
    handles them (`_handle_invalid_blocks`, `scheduler.py:3854-3934` in 0.34.0) as kvfuzz's
    driver and the model do, under each policy, while both requests then run to their end
    (under "recompute" vLLM keeps the failed blocks keyed: 029, tolerated)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvcache"))
    from test_kvcache_connector import SYNC_FAILURE, sync_failure_config

    ex = Execution(sync_failure_config(policy), "scheduler", THREE_WAY)
    for op in SYNC_FAILURE:
        ex.apply(op)
    for _ in range(4):
        ex.apply({"op": "step"})
    statuses = {v.status for v in ex.state.requests.values()}
    assert statuses == ({"FINISHED_LENGTH_CAPPED"} if policy == "recompute"
                        else {"FINISHED_ERROR"})
    # Without the rollback (the plant ignores invalid blocks) the step differs at once.
    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                             "config": sync_failure_config(policy).to_dict(),
                             "ops": SYNC_FAILURE})
    finding = run_trace(trace, ("vllm-scheduler-bug:failed-load-kept",), checks=()).finding
    assert finding is not None and finding.step == 3
