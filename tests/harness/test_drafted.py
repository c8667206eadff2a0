"""A drafter's count per request (`step {drafted}`, docs/traces.md): a request named proposes
fewer drafts than the step's `draft`, or, with fixed drafts, fills fewer of its placeholders,
whose unfilled rest its next step rejects. Played by kvfuzz's driver on kvcache and by the
reference model, compared at every op; no vLLM needed."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import BUILTIN, builtin_config
from kvfuzz.core.errors import TraceFormatError
from kvfuzz.core.trace import Trace, normalize_op
from kvfuzz.fuzz.generator import run_example
from kvfuzz.harness.executor import Execution, run_trace

FIXED = BUILTIN["fixed_drafts"][1]
EAGLE = BUILTIN["eagle"][1]


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


def _computed(ex: Execution, rid: str) -> tuple[int, int]:
    view = ex.state.requests[rid]
    return view.num_computed_tokens, view.num_tokens


@pytest.mark.parametrize("filled, after", [(2, (9, 10)), (1, (8, 9)), (0, (7, 8))])
def test_unfilled_placeholders_are_rejected_by_the_next_step(filled, after):
    """Two placeholders per step: the drafter fills `filled` of a's; the next step schedules
    both and keeps only the filled ones (accept null keeps all it may)."""
    ex = Execution(FIXED, "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(6)), max_tokens=9))
    ex.apply({"op": "step", "drafted": {"a": filled}})
    assert _computed(ex, "a") == (6, 7) and ex.state.requests["a"].num_drafts == 2
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 3, 0]]
    assert _computed(ex, "a") == after


def test_requests_of_one_step_keep_their_own_counts():
    ex = Execution(FIXED, "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(6)), max_tokens=9))
    ex.apply(_add("b", list(range(10, 16)), max_tokens=9))
    ex.apply({"op": "step", "drafted": {"b": 0, "zz": 1}})  # an unknown id is ignored
    ex.apply({"op": "step"})
    assert (_computed(ex, "a"), _computed(ex, "b")) == ((9, 10), (7, 8))


def test_a_drafter_proposes_the_count_named():
    """`draft` 3 for every request, but `a` proposes only 1: its next step schedules 2."""
    ex = Execution(EAGLE, "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(6)), max_tokens=9))
    ex.apply(_add("b", list(range(10, 16)), max_tokens=9))
    ex.apply({"op": "step", "draft": 3, "drafted": {"a": 1}})
    assert (ex.state.requests["a"].num_drafts, ex.state.requests["b"].num_drafts) == (1, 3)
    out = ex.apply({"op": "step"})
    assert out["scheduled"] == [["a", 2, 0], ["b", 4, 0]]
    assert (_computed(ex, "a"), _computed(ex, "b")) == ((8, 9), (10, 11))


def test_a_count_that_is_not_an_int_is_a_format_error():
    with pytest.raises(TraceFormatError, match="drafted"):
        normalize_op({"op": "step", "drafted": {"a": "1"}}, "scheduler")
    with pytest.raises(TraceFormatError, match="drafted"):
        normalize_op({"op": "step", "drafted": [1]}, "scheduler")


def test_a_negative_count_is_invalid():
    ex = Execution(FIXED, "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(6))))
    with pytest.raises(Exception, match="drafted"):
        ex.apply({"op": "step", "drafted": {"a": -1}})


@pytest.mark.parametrize("config", ["fixed_drafts", "eagle"])
def test_the_generators_draw_counts_on_configs_with_drafts(config):
    drafted = []
    for seed in range(12):
        ex = run_example(random.Random(seed).randbytes(2048), builtin_config(config),
                         "scheduler", steps=40, targets=("kvcache",))
        if ex is not None:
            drafted += [op["drafted"] for op in ex.trace.ops
                        if op["op"] == "step" and op["drafted"]]
    assert drafted and any(0 in counts.values() for counts in drafted)


def test_a_vllm_test_export_takes_a_drafters_count_with_the_steps_draft(tmp_path, capsys):
    """The test's drafter proposes a named request only the first `drafted` of its drafts
    (finding 035's test); a count without the step's `draft` is refused (exit 2)."""
    from kvfuzz.core.trace import Trace
    from kvfuzz.fuzz.cli import main as kvfuzz

    for step, code in (({"op": "step", "draft": 2, "drafted": {"a": 1}}, 0),
                       ({"op": "step", "drafted": {"a": 1}}, 2)):
        trace = Trace(EAGLE, "scheduler", [_add("a", list(range(6))), {"op": "step"}, step],
                      {"check": "DIFF-state"})
        path, out = tmp_path / "t.json", tmp_path / f"t{code}.py"
        trace.save(path)
        assert kvfuzz(["export", str(path), "--vllm-test", str(out)]) == code
        assert out.exists() is (code == 0)
    assert "drafted" in capsys.readouterr().err
    text = (tmp_path / "t0.py").read_text(encoding="utf-8")
    assert "step(scheduler, draft=2, drafted={'a': 1})" in text
    assert "proposals = [p[:(drafted or {}).get(request.request_id, draft)]" in text


def test_a_step_drafts_no_more_than_the_state_groups_keep_blocks_for():
    """vLLM sizes a state group's speculative blocks to the drafter's most drafts: a step
    proposing more is invalid, and the generators draw no more (a 4-token-block align config
    with 2 speculative blocks once failed S1 on 4 drafts, on kvcache and the model alike)."""
    group = GroupConfig("mamba", 4, mamba_cache_mode="align", num_speculative_blocks=2)
    config = Config(num_blocks=15, groups=(GroupConfig("full", 4), group, group),
                    max_model_len=64, use_eagle=True, name="small_align_eagle")
    assert config.max_drafts == 2 and BUILTIN["eagle"][1].max_drafts is None
    ops = [{"op": "add_request", "request_id": "a", "prompt": [3, 3, 1], "max_tokens": 4},
           {"op": "step"}]
    assert run_trace(Trace(config, "scheduler", ops + [{"op": "step", "draft": 2}])).passed
    result = run_trace(Trace(config, "scheduler", ops + [{"op": "step", "draft": 3}]))
    assert "draft 3" in str(result.invalid) and "2 speculative blocks" in str(result.invalid)
    drafts = []
    for seed in range(30):
        ex = run_example(random.Random(seed).randbytes(2048), config, "scheduler", steps=40,
                         targets=("kvcache",))
        if ex is not None:
            most = ex.trace.config.max_drafts  # the generators vary s (docs/spec.md §11.2)
            drafts += [(op["draft"], most) for op in ex.trace.ops if op["op"] == "step"]
    assert all(draft <= most for draft, most in drafts)
    assert any(draft == most for draft, most in drafts if most < 4)


def test_a_state_group_without_speculative_blocks_drafts_none():
    """A Mamba group keeping no speculative blocks bounds drafts at 0 (vLLM sizes them to the
    drafter's most drafts): `--generated-configs` drew such configs with EAGLE and drafted,
    and S1 failed once the drafts were rejected (the state after the last kept token had no
    block); such a step is invalid, and the generators draw none."""
    group = GroupConfig("mamba", 1, mamba_cache_mode="align")
    config = Config(num_blocks=3, groups=(group,), max_model_len=64, use_eagle=True,
                    name="align_no_draft_blocks")
    assert config.max_drafts == 0
    ops = [{"op": "add_request", "request_id": "r", "prompt": [0], "max_tokens": 3},
           {"op": "step", "draft": 1}, {"op": "step", "accept": 0}]
    result = run_trace(Trace(config, "scheduler", ops))
    assert "draft 1" in str(result.invalid) and "0 speculative blocks" in str(result.invalid)
    for seed in range(10):
        ex = run_example(random.Random(seed).randbytes(2048), config, "scheduler", steps=40,
                         targets=("kvcache",), vary=False)
        assert ex is None or all(op.get("draft", 0) == 0 for op in ex.trace.ops)
