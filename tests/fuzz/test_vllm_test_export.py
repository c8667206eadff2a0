"""`kvfuzz export FILE --vllm-test OUT.py`: plain vLLM tests from manager- and scheduler-level
traces.

Whether a generated test fails on vLLM and passes on kvcache is checked where vLLM is installed
(tests/vllm/test_finding_vllm_tests.py); here: the checked-in tests are what the exporter writes
today, they import only vllm, torch and pytest (and inspect), and what cannot be expressed is
refused with exit 2 and nothing written.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main
from kvfuzz.fuzz.finding_tests import FINDING_TESTS, FINDINGS_DIR, vllm_test_path
from kvfuzz.fuzz.vllm_test_export import render_vllm_test


@pytest.mark.parametrize("number", sorted(FINDING_TESTS))
def test_checked_in_vllm_test_is_what_the_exporter_writes(number):
    source = FINDINGS_DIR / FINDING_TESTS[number]
    text = render_vllm_test(Trace.load(source), source.relative_to(FINDINGS_DIR.parent.parent))
    assert vllm_test_path(number).read_text(encoding="utf-8") == text, (
        f"regenerate: kvfuzz export {source} --vllm-test {vllm_test_path(number)}")


@pytest.mark.parametrize("number", sorted(FINDING_TESTS))
def test_vllm_test_imports_only_vllm_torch_and_pytest(number):
    tree = ast.parse(vllm_test_path(number).read_text(encoding="utf-8"))
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module}
    assert roots <= {"vllm", "torch", "pytest", "inspect", "json"}, roots


def test_a_refused_call_becomes_pytest_raises_and_the_bookkeeping_is_written_out():
    text = vllm_test_path("003").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert body.count("schedule(") == 2  # a and b were admitted
    assert body.rstrip().endswith(
        "with pytest.raises(ValueError):  # the spec refuses it and changes nothing\n"
        "        manager.allocate_slots(b, 0, num_new_computed_tokens=b_hit, "
        "new_computed_blocks=b_hit_blocks)")


def test_cli_writes_the_test(tmp_path, capsys):
    out = tmp_path / "test_002.py"
    source = FINDINGS_DIR / FINDING_TESTS["002"]
    assert main(["export", str(source), "--vllm-test", str(out)]) == 0
    assert "pytest.raises(ValueError)" in out.read_text(encoding="utf-8")
    assert str(out) in capsys.readouterr().out


@pytest.mark.parametrize("trace_file, says", [
    ("016-short-load-window-unloaded.json", "max_in_flight_tokens other than the token budget"),
    ("025-stopped-drafts-stay-computed.json", "partial_hits"),
])
def test_what_a_vllm_test_cannot_express_is_exit_2_and_nothing_written(tmp_path, capsys,
                                                                         trace_file, says):
    out = tmp_path / "t.py"
    assert main(["export", str(FINDINGS_DIR / trace_file), "--vllm-test", str(out)]) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()


def test_pytest_and_vllm_test_are_one_or_the_other(tmp_path):
    source = str(FINDINGS_DIR / FINDING_TESTS["002"])
    assert main(["export", source]) == 2
    assert main(["export", source, "--pytest", str(tmp_path / "a.py"),
                 "--vllm-test", str(tmp_path / "b.py")]) == 2


def test_an_unexported_op_is_refused(tmp_path):
    trace = json.loads((FINDINGS_DIR / FINDING_TESTS["002"]).read_text(encoding="utf-8"))
    trace["ops"].insert(1, {"op": "reset_prefix_cache"})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace), encoding="utf-8")
    assert main(["export", str(path), "--vllm-test", str(tmp_path / "t.py")]) == 2


def test_ev2_expects_the_removals_kvcache_announces(tmp_path):
    """Without b's copy, evicting block 1 removes the key for good: one BlockRemoved is right."""
    trace = json.loads((FINDINGS_DIR / FINDING_TESTS["011"]).read_text(encoding="utf-8"))
    trace["ops"] = [op for op in trace["ops"] if op.get("request_id") != "b"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace), encoding="utf-8")
    text = render_vllm_test(Trace.load(path), path)
    assert "assert len(removed) == 1, (" in text
    full = vllm_test_path("011").read_text(encoding="utf-8")
    assert "assert len(removed) == 0, (" in full


def test_ev3_asserts_each_stored_event_carries_block_size_token_ids_per_hash():
    """026: vLLM's BlockStored spans null blocks it names no hash for; the test reads every
    stored event the calls sent."""
    text = vllm_test_path("026").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert "enable_kv_cache_events=True" in text
    assert "for event in manager.take_events():" in body
    assert "assert tokens == hashes * event.block_size, (" in body


def test_ev4_asserts_the_last_calls_stored_keys_are_held_and_requests_carry_the_mode():
    """027: the lookup of a request in kv_cache_report_mode "full" announces a key no block
    holds; the test drains the earlier calls' events and reads the lookup's."""
    text = vllm_test_path("027").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert ("SamplingParams(max_tokens=max_tokens, "
            "extra_args={\"kv_cache_report_mode\": 'full'})") in text
    assert 'not hasattr(BlockPool, "emit_cached_block_events")' in text
    drained = body.index("manager.take_events()  # the events of the calls before the last")
    assert drained < body.index("lookup(manager, b)") < body.index("assert stored <= held, (")


def test_a_trace_kvcache_fails_is_refused(tmp_path, monkeypatch, capsys):
    """The expected outcomes come from kvcache and the model; where they are the ones failing,
    a planted bug here, there is nothing to expect of vLLM."""
    from kvfuzz.fuzz import vllm_test_export
    from kvfuzz.harness.executor import Execution

    class PlantedBug(Execution):
        def __init__(self, config, level, targets, **kwargs):
            super().__init__(config, level, ["bug:free-forgets-decrement"], **kwargs)

    monkeypatch.setattr(vllm_test_export, "Execution", PlantedBug)
    trace = {"format": "kvfuzz-trace", "version": 1, "level": "api",
             "config": {"num_blocks": 4, "groups": [{"kind": "full", "block_size": 4}],
                        "max_model_len": 64},
             "ops": [{"op": "add_request", "request_id": "r0", "prompt": [1, 1, 0, 0, 1]},
                     {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 5},
                     {"op": "free", "request_id": "r0"}]}
    path, out = tmp_path / "t.json", tmp_path / "t.py"
    path.write_text(json.dumps(trace), encoding="utf-8")
    assert main(["export", str(path), "--vllm-test", str(out)]) == 2
    assert "fails on kvcache or the reference model" in capsys.readouterr().err
    assert not out.exists()


def _scheduler_trace(tmp_path: Path, check: str, step: dict) -> Path:
    trace = json.loads((FINDINGS_DIR / FINDING_TESTS["023"]).read_text(encoding="utf-8"))
    trace["meta"]["check"] = check
    trace["ops"][1] = step
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace), encoding="utf-8")
    return path


@pytest.mark.parametrize("check, step, says", [
    ("P2", {"op": "step"}, "asserts D1 or DIFF-state"),
    ("D1", {"op": "step", "in_flight": True},
     "exported with check DIFF-state and a KV connector"),
    ("DIFF-state", {"op": "step", "in_flight": True},
     "exported with check DIFF-state and a KV connector"),
])
def test_a_scheduler_trace_a_vllm_test_cannot_express_is_exit_2(tmp_path, capsys, check, step,
                                                                 says):
    path = _scheduler_trace(tmp_path, check, step)
    assert main(["export", str(path), "--vllm-test", str(tmp_path / "t.py")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "t.py").exists()


def test_a_scheduler_test_drives_vllms_scheduler_and_asserts_its_check():
    """023 (D1): a forward pass that keeps the KV written, priority policy, lookahead; 022
    (DIFF-state, EAGLE): the manager built with use_eagle, the keyed blocks asserted."""
    text = vllm_test_path("023").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert "policy='priority'" in text and "scheduler.num_lookahead_tokens = 1" in text
    assert body.count("step(scheduler, forward)") == 4
    assert "not the KV of its own prefix" in text
    eagle = vllm_test_path("022").read_text(encoding="utf-8")
    assert '"use_eagle": True' in eagle and "ForwardPass" not in eagle
    assert "assert keyed == [1, 2, 3, 4, 6, 8, 10, 11, 13, 15], (" in eagle


def test_a_scheduler_test_plays_drafts_and_asserts_the_requests_the_diff_names():
    """025 (DIFF-state on requests, drafts): the drafter's proposals go in by
    update_draft_token_ids, the accepted drafts come back with the sampled token, and the
    request's count is asserted, not the keyed blocks; 022 keeps the plain step."""
    text = vllm_test_path("025").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert "scheduler.update_draft_token_ids(DraftTokenIds(req_ids, proposals))" in text
    assert "accepted = list(spec.get(request.request_id, ()))[:accept]" in text
    assert "step(scheduler, draft=3)" in body and "scheduler.add_request(r4)" in body
    assert "assert r4.num_computed_tokens == 2, (" in body and "keyed" not in body
    eagle = vllm_test_path("022").read_text(encoding="utf-8")
    assert "DraftTokenIds" not in eagle and "def step(scheduler: Scheduler, sample" in eagle


def test_an_encoder_decoder_trace_asserts_what_each_step_schedules():
    """030 (DIFF-result on what a step schedules, a cross group): the Scheduler made
    encoder-decoder with the trace's encoder budget and cache, each request's encoder input a
    feature at offset 0, and every step's tokens per request asserted as the model has them."""
    text = vllm_test_path("030").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert "CrossAttentionSpec(block_size=4" in text
    assert "scheduler.is_encoder_decoder = True" in text
    assert "ENCODER_BUDGET = 24\nENCODER_CACHE_SIZE = 12\n" in text
    assert "EncoderDecoderCacheManager(\n        cache_size=ENCODER_CACHE_SIZE)" in text
    assert "num_encoder_tokens=9))" in body and body.count("scheduled = step(scheduler)") == 4
    assert body.rstrip().endswith("the reference model schedules {{'a': 1, 'b': 4}}\")")


@pytest.mark.parametrize("change, says", [
    ({"check": "D1"}, "a cross-attention group is exported with check DIFF-result"),
    ({"dedup_key": "DIFF-result/step/preempted"}, "only where the difference is in what a step"),
])
def test_an_encoder_decoder_trace_a_vllm_test_cannot_express_is_exit_2(tmp_path, capsys, change,
                                                                      says):
    trace = json.loads((FINDINGS_DIR / FINDING_TESTS["030"]).read_text(encoding="utf-8"))
    trace["meta"].update(change)
    path, out = tmp_path / "t.json", tmp_path / "t.py"
    path.write_text(json.dumps(trace), encoding="utf-8")
    assert main(["export", str(path), "--vllm-test", str(out)]) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()


def test_a_connector_trace_writes_its_connector_into_the_test():
    """016 (D1, a KV connector, one window group): a connector class on vLLM's base class in
    the test's own code, the load's start and short end played, the window read."""
    text = vllm_test_path("016").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert "class TraceConnector(KVConnectorBase_V1, SupportsHMA):" in text
    assert "kvfuzz" not in body
    assert 'kv_connector_module_path=__name__' in text
    assert 'kv_load_failure_policy="recompute"' in text
    assert "report.invalid_block_ids = " in text
    assert "ATTENTION_GROUPS = [(0, 4, 8)]" in text
    assert "range(max(start - window + 1, 0) if window else 0, start)" in text
    assert ("load_remote(scheduler, 'r', 12)\n    finish_load(scheduler, forward, 'r', 4)\n"
            "    step(scheduler, forward)") in body


def test_a_trace_with_a_step_in_flight_drives_vllms_async_scheduler():
    """018 (DIFF-state on the free queue, a consumer connector, two groups): AsyncScheduler
    with async scheduling, the step's output held while the request is aborted, the free
    queue's order asserted; no load ops are written."""
    text = vllm_test_path("018").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert "scheduler = AsyncScheduler(" in text and "async_scheduling=True," in text
    assert 'kv_role="kv_consumer"' in text and "def load_remote" not in text
    assert ("step(scheduler, in_flight=in_flight)\n"
            "    scheduler.finish_requests('r4', RequestStatus.FINISHED_ABORTED)\n"
            "    complete(scheduler, in_flight)\n") in body
    assert "get_all_free_blocks()]\n    assert free == [1, 3, 2], (" in body
    assert "keyed" not in body


def test_a_windowed_trace_in_flight_needs_twice_the_budget_in_flight(tmp_path, capsys):
    """AsyncScheduler derives max_in_flight_tokens as two batches' budget; the finding's own
    trace (the manager's default, max_model_len) is refused, naming it."""
    source = FINDINGS_DIR / "018-deferred-drain-group-order.json"
    assert main(["export", str(source), "--vllm-test", str(tmp_path / "t.py")]) == 2
    assert "max_in_flight_tokens other than twice the token budget" in capsys.readouterr().err
    assert not (tmp_path / "t.py").exists()


@pytest.mark.parametrize("change, says", [
    ({"meta": {"check": "DIFF-state"}}, "exported with check D1 on one KV cache group"),
    ({"ops": [{"op": "add_request", "request_id": "q", "prompt": [5, 6]}]},
     "beside other unfinished requests"),
])
def test_a_connector_trace_a_vllm_test_cannot_express_is_exit_2(tmp_path, capsys, change, says):
    trace = json.loads((FINDINGS_DIR / FINDING_TESTS["016"]).read_text(encoding="utf-8"))
    trace["meta"].update(change.get("meta", {}))
    trace["ops"][1:1] = change.get("ops", [])
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace), encoding="utf-8")
    assert main(["export", str(path), "--vllm-test", str(tmp_path / "t.py")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "t.py").exists()


def test_each_finding_shown_passing_with_its_fix_has_one_in_the_checker():
    """tests/vllm/proposed_fixes.py patches exactly the findings PROPOSED_FIXES names."""
    import importlib.util

    from kvfuzz.fuzz.finding_tests import PROPOSED_FIXES

    path = Path(__file__).resolve().parents[1] / "vllm" / "proposed_fixes.py"
    spec = importlib.util.spec_from_file_location("proposed_fixes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert set(module.FIXES) == set(PROPOSED_FIXES)
    assert all(vllm_test_path(n).name.startswith(f"test_{n}_") for n in PROPOSED_FIXES)


def test_a_synchronous_load_is_exported_only_under_diff_state(tmp_path, capsys):
    """`load_remote {sync: true}` under D1 has no exported form (the test's forward pass keeps
    no KV a synchronous load writes): exit 2, nothing written."""
    from kvfuzz.core.configs import BUILTIN
    from kvfuzz.core.trace import Trace

    trace = Trace(BUILTIN["connector"][1], "scheduler", [
        {"op": "add_request", "request_id": "a", "prompt": list(range(9))},
        {"op": "load_remote", "request_id": "a", "num_external_tokens": 4, "sync": True},
        {"op": "step"}], {"check": "D1"})
    path, out = tmp_path / "t.json", tmp_path / "t.py"
    trace.save(path)
    assert main(["export", str(path), "--vllm-test", str(out)]) == 2
    assert "synchronous KV loads is exported with check DIFF-state" in capsys.readouterr().err
    assert not out.exists()


def test_a_failing_synchronous_load_reports_its_unfilled_blocks_and_asserts_the_keys():
    """029 (DIFF-state, a synchronous load filling 12 of 15 tokens): the connector offers it
    at the lookup, the step reports the blocks it did not fill, the model's keys asserted."""
    text = vllm_test_path("029").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert "class SyncLoadConnector(TraceConnector):" in text
    assert 'kv_connector="SyncLoadConnector"' in text
    assert 'kv_load_failure_policy="recompute"' in text
    assert "scheduler.update_from_output(output, load_failures(" in text
    assert "sync_load(scheduler, 'r6', 15, 12)\n    step(scheduler)\n" in body
    assert "assert keyed == [1, 2, 3], (" in body


def test_a_failing_synchronous_load_on_several_groups_names_its_request():
    """031 (DIFF-result in the finished requests, two groups, policy "fail"): the step reports
    the request whose load failed (`failed_recving`, never block ids, which vLLM refuses on
    several groups) and asserts each step's finished requests."""
    text = vllm_test_path("031").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert 'kv_load_failure_policy="fail"' in text
    assert "KVConnectorOutput(failed_recving=failed)" in text
    assert "invalid_block_ids" not in text
    assert "    return sorted(before - set(scheduler.requests))\n" in text
    assert ("sync_load(scheduler, 'r1', 8, 2)\n    finished = step(scheduler)\n"
            "    assert finished == ['r1'], (") in body


def test_partial_hits_are_forced_on_as_the_vllm_target_forces_them():
    """036 (api level, partial hits on two attention groups): vLLM turns partial hits on only
    beside a Mamba "align" group, so the test tells its coordinator they are on, and skips
    where vLLM has no partial hits."""
    text = vllm_test_path("036").read_text(encoding="utf-8")
    body = text[text.index("@pytest.mark.skipif"):]
    assert "from vllm.v1.core import kv_cache_coordinator\n" in text
    assert "reason='this vLLM has no partial (sub-block) prefix hits'" in body
    assert ("def test_partial_hit_reported_as_full(monkeypatch):\n"
            "    # Partial (sub-block) prefix hits:") in body
    assert ("    monkeypatch.setattr(kv_cache_coordinator, \"partial_hash_hits_enabled\",\n"
            "                        lambda *args, **kwargs: True)\n"
            "    manager = make_manager()\n") in body


def test_a_step_that_raised_is_asserted_by_playing_it():
    """035 (I10): the test plays the steps, the drafter filling the trace's `drafted`; a step
    that raises fails it."""
    text = vllm_test_path("035").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert "It asserts that no step raises" in text
    assert body.rstrip().endswith("step(scheduler, draft=4, drafted={'r1': 3})\n    step(scheduler)")


def test_a_synchronous_load_beside_steps_in_flight_is_exit_2(tmp_path, capsys):
    trace = json.loads((FINDINGS_DIR / FINDING_TESTS["029"]).read_text(encoding="utf-8"))
    del trace["ops"][1]["num_loaded_tokens"]  # a load that fills all: the model takes it
    trace["ops"][2:] = [{"op": "step", "in_flight": True}, {"op": "complete_step"}]
    path, out = tmp_path / "t.json", tmp_path / "t.py"
    path.write_text(json.dumps(trace), encoding="utf-8")
    assert main(["export", str(path), "--vllm-test", str(out)]) == 2
    assert "synchronous KV loads beside steps in flight" in capsys.readouterr().err
    assert not out.exists()


def test_a_failing_synchronous_load_under_fail_names_the_policy(tmp_path):
    trace = json.loads((FINDINGS_DIR / FINDING_TESTS["029"]).read_text(encoding="utf-8"))
    trace["config"]["scheduler"] = {"kv_load_failure_policy": "fail"}
    path, out = tmp_path / "t.json", tmp_path / "t.py"
    path.write_text(json.dumps(trace), encoding="utf-8")
    assert main(["export", str(path), "--vllm-test", str(out)]) == 0
    assert 'kv_load_failure_policy="fail"' in out.read_text(encoding="utf-8")


def test_a_negative_count_records_each_groups_count_and_asserts_none_below_0():
    """028 (P1: predicted -3): every group's get_num_blocks_to_allocate recorded from the
    Scheduler's construction on, the drafts played, no negative count asserted."""
    text = vllm_test_path("028").read_text(encoding="utf-8")
    body = text[text.index("def test_"):]
    assert "def record_counts(scheduler: Scheduler) -> list:" in text
    assert body.index("counts = record_counts(scheduler)") < body.index("add_request")
    assert "step(scheduler, draft=3, accept=0)" in body
    assert "negative = [(group, n) for group, n in counts if n < 0]" in body
    assert "assert not negative, (" in body and "keyed" not in body


def test_p1_without_a_negative_prediction_is_exit_2(tmp_path, capsys):
    trace = json.loads((FINDINGS_DIR / FINDING_TESTS["028"]).read_text(encoding="utf-8"))
    trace["meta"]["message"] = ("allocate_slots('r3') predicted 2 blocks but the free count "
                                "fell by 1")
    path, out = tmp_path / "t.json", tmp_path / "t.py"
    path.write_text(json.dumps(trace), encoding="utf-8")
    assert main(["export", str(path), "--vllm-test", str(out)]) == 2
    assert "check P1" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("number, scheduler, op, says", [
    ("029", {"async_scheduling": True}, None, "scheduler.async_scheduling"),
    ("029", {"self_preemption": "stop"}, None, "scheduler.self_preemption"),
    ("029", {"blocked_waiting": "stop"}, None, "scheduler.blocked_waiting"),
    ("018", {"in_flight_sampling": "wait"}, None, "scheduler.in_flight_sampling"),
    ("028", {}, (1, {"op": "step", "accept": 4, "drafted": {"r3": 1}}), "(drafted)"),
    ("029", {}, (0, {"op": "add_request", "request_id": "r6", "prompt": [2, 3, 1, 2],
                     "skip_reading_prefix_cache": True}), "skip_reading_prefix_cache"),
])
def test_a_scheduler_field_a_vllm_test_does_not_set_is_exit_2_naming_it(
        tmp_path, capsys, number, scheduler, op, says):
    """The session's scheduler rules and fields: a generated test would play the release's
    own rule (or none), so each is refused, never written as a wrong test."""
    trace = json.loads((FINDINGS_DIR / FINDING_TESTS[number]).read_text(encoding="utf-8"))
    trace["config"].setdefault("scheduler", {}).update(scheduler)
    if op is not None:
        trace["ops"][op[0]] = op[1]
    path, out = tmp_path / "t.json", tmp_path / "t.py"
    path.write_text(json.dumps(trace), encoding="utf-8")
    assert main(["export", str(path), "--vllm-test", str(out)]) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()
