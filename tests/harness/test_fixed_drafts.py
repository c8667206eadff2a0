"""Fixed drafts (`scheduler.num_speculative_tokens`, docs/traces.md "Fixed drafts"): vLLM's
async scheduling with a SpeculativeConfig, played by kvfuzz's driver on kvcache and by the
reference model. Each sampling request gets the placeholder drafts, a one-token admission is
padded to them, and each output publishes the request's settled tokens; the two agree
step by step (the executor compares every result and snapshot)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvfuzz.core.config import Config, ConfigError, SchedulerConfig
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.shrink import _config_variants
from kvfuzz.harness.executor import Execution, run_trace

CONFIG = BUILTIN["fixed_drafts"][1]


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


def _computed(ex: Execution, rid: str) -> tuple[int, int]:
    view = ex.state.requests[rid]
    return view.num_computed_tokens, view.num_tokens


def test_every_sampling_request_schedules_its_placeholder_drafts():
    """A decode step schedules 1 + 2 tokens; `accept` keeps some and rolls the rest back."""
    ex = Execution(CONFIG, "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(6)), max_tokens=9))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 6, 0]]
    assert _computed(ex, "a") == (6, 7)
    assert ex.apply({"op": "step", "accept": 1})["scheduled"] == [["a", 3, 0]]
    assert _computed(ex, "a") == (8, 9)  # one draft kept, one rejected, one sampled
    assert ex.apply({"op": "step", "accept": 0})["scheduled"] == [["a", 3, 0]]
    assert _computed(ex, "a") == (9, 10)
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 3, 0]]
    assert _computed(ex, "a") == (12, 13)


def test_a_one_token_admission_is_padded_and_its_kept_drafts_published():
    """A full hit leaves one token: the admission is scheduled with the drafts (3 tokens), and
    the block its kept drafts fill is cached by the output, before any later step."""
    ex = Execution(CONFIG, "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(9)), max_tokens=9))
    ex.apply({"op": "step"})
    ex.apply(_add("b", list(range(9)), max_tokens=3))
    out = ex.apply({"op": "step"})
    assert out["scheduled"] == [["a", 3, 0], ["b", 3, 8]]
    assert _computed(ex, "b") == (11, 12)
    cached = {tuple(tokens) for _, _, tokens in ex.state.cache}
    assert tuple(ex.state.requests["b"].tokens[:12]) in cached


def test_no_padding_in_a_step_with_a_running_prefill_chunk():
    """No padding while a running request's prefill chunk is scheduled in the step; the next
    admission, after it, is padded."""
    ex = Execution(CONFIG.replace(num_blocks=24, scheduler=SchedulerConfig(
        num_speculative_tokens=2, token_budget=16)), "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(9)), max_tokens=9))
    ex.apply({"op": "step"})
    ex.apply(_add("long", list(range(100, 120))))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 3, 0], ["long", 13, 0]]
    ex.apply(_add("b", list(range(9)), max_tokens=3))
    out = ex.apply({"op": "step"})  # long's last chunk: b is not padded
    assert out["scheduled"] == [["a", 3, 0], ["long", 7, 0], ["b", 1, 8]]
    ex.apply(_add("c", list(range(9)), max_tokens=3))
    assert ["c", 3, 8] in ex.apply({"op": "step"})["scheduled"]


def test_steps_in_flight_place_the_drafts_at_launch():
    """A step left in flight gives its sampling request the drafts at once: the next step
    schedules them with the pending token, and both agree when the outputs arrive."""
    config = CONFIG.replace(deferred_frees=True)
    ex = Execution(config, "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(6)), max_tokens=9))
    ex.apply({"op": "step"})
    ex.apply({"op": "step", "in_flight": True})
    assert ex.apply({"op": "step", "in_flight": True, "accept": 1})["scheduled"] == [["a", 3, 0]]
    ex.apply({"op": "complete_step"})
    ex.apply({"op": "complete_step"})
    assert not ex.state.in_flight


def test_a_draft_on_a_fixed_drafts_config_is_invalid():
    trace = Trace(CONFIG, "scheduler", [_add("a", list(range(6))), {"op": "step", "draft": 1}],
                  {})
    result = run_trace(trace, ("kvcache",))
    assert result.invalid is not None and "draft 1" in str(result.invalid)


@pytest.mark.parametrize("change, says", [
    ({"kv_connector": True}, "kv_connector"),
    ({"scheduler": {"num_speculative_tokens": -1}}, "num_speculative_tokens"),
])
def test_fixed_drafts_are_validated(change, says):
    data = {**CONFIG.to_dict(), **change}
    if "scheduler" in change:
        data["scheduler"] = {**CONFIG.to_dict()["scheduler"], **change["scheduler"]}
    with pytest.raises(ConfigError, match=says):
        Config.from_dict(data)


def test_a_shrink_keeps_at_least_one_fixed_draft():
    trace = Trace(CONFIG, "scheduler", [_add("a", [1])], {})
    drafts = [t.config.scheduler.num_speculative_tokens for t in _config_variants(trace)]
    assert 1 in drafts and 0 not in drafts
    one = Trace(CONFIG.replace(scheduler=dataclasses.replace(CONFIG.scheduler,
                                                             num_speculative_tokens=1)),
                "scheduler", [_add("a", [1])], {})
    assert 0 not in [t.config.scheduler.num_speculative_tokens for t in _config_variants(one)]


# ----- drafts on configs with Mamba "align" groups (docs/traces.md) -----

MAMBA = BUILTIN["qwen3_next_eagle"][1].replace(groups=tuple(
    dataclasses.replace(g, num_speculative_blocks=4) if g.kind == "mamba" else g
    for g in BUILTIN["qwen3_next_eagle"][1].groups))
"""With 4 speculative blocks per state group: a step drafts at most that many
(`Config.max_drafts`)."""
DRAFTED_MAMBA = [_add("r4", [1, 3, 1, 0], max_tokens=3), {"op": "step", "accept": 0},
                 {"op": "step", "accept": 1, "draft": 4}, {"op": "step", "accept": 0},
                 {"op": "step"}]
"""Rejected drafts on a Mamba "align" hybrid: the request resumes from a speculative state."""


def test_s2_does_not_judge_a_resume_from_drafts():
    result = run_trace(Trace(MAMBA, "scheduler", DRAFTED_MAMBA, {}), ("kvcache",))
    assert result.finding is None and result.invalid is None


def test_drafts_on_a_mamba_config_only_without_the_data_checks():
    from kvfuzz.fuzz.generator import SchedulerRules
    from kvfuzz.properties import REGISTRY
    from kvfuzz.properties.data import data_checks_for

    pytest.importorskip("torch")
    plain = SchedulerRules(Execution(MAMBA, "scheduler", ("kvcache",)), choices=None)
    data = SchedulerRules(Execution(MAMBA, "scheduler", ("kvcache",),
                                    checks=list(REGISTRY) + data_checks_for("cpu")),
                          choices=None)
    assert plain.feasible("step_spec") and not data.feasible("step_spec")

