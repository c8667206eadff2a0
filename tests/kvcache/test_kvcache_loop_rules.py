"""The scheduler's loop rules that vLLM releases differ on (docs/spec.md §7, §7.2):
`scheduler.self_preemption` and `scheduler.blocked_waiting`, followed by kvfuzz's driver
(kvcache/scheduler.py) and the model (reference_model/scheduler.py) in lockstep. Each test runs
both values and fails if either side ignores the config's rule (the other value's outcome, or a
DIFF between the two sides)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvfuzz.core.config import Config
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import ConfigError
from kvfuzz.harness.executor import Execution


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


def _with(name: str, **scheduler: Any) -> Config:
    config = BUILTIN[name][1]
    return config.replace(scheduler=dataclasses.replace(config.scheduler, **scheduler))


@pytest.mark.parametrize("rule, fourth", [
    ("continue", {"scheduled": [["high", 1, 0]], "preempted": ["low"], "finished": [],
                  "copies": []}),
    ("stop", {"scheduled": [], "preempted": ["low"], "finished": [], "copies": []}),
])
def test_a_request_that_preempted_itself_ends_the_running_loop_only_under_stop(rule, fourth):
    """Priority, 6 usable blocks. `low` runs first (admitted alone), `high` after it; in step 4
    both need a new block and none is free: `low`, the least important, preempts itself. Under
    "continue" (vLLM 0.33+) the loop goes on and `high` takes the freed blocks; under "stop"
    (vLLM 0.32's `break`) the step schedules nothing."""
    config = _with("priority", self_preemption=rule).replace(num_blocks=7)
    ex = Execution(config, "scheduler", ("kvcache",))
    ex.apply(_add("low", list(range(14)), priority=2, max_tokens=8))
    ex.apply({"op": "step"})
    ex.apply(_add("high", list(range(50, 57)), priority=0, max_tokens=8))
    outcomes = [ex.apply({"op": "step", "sample": i}) for i in range(3)]
    assert outcomes[-1] == fourth
    assert ex.apply({"op": "step"})["scheduled"] == [["high", 1, 0]]


@pytest.mark.parametrize("rule, second", [("skip", [["a", 4, 0], ["c", 3, 0]]),
                                          ("stop", [["a", 4, 0]])])
def test_a_waiting_request_its_encoder_cannot_take_ends_the_waiting_loop_only_under_stop(
        rule, second):
    """Encoder cache 3, 8 tokens a step. a's input (3 embeddings) fills the cache until a
    computes past it; b's input at its first token does not fit, so b's chunk is cut to no
    token. Under "skip" (vLLM 0.33+) c, behind b, is admitted; under "stop" (vLLM 0.32's
    `break`) the waiting loop ends at b."""
    config = _with("tenants", token_budget=8, encoder_budget=None, encoder_cache_size=3,
                   blocked_waiting=rule)
    ex = Execution(config, "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(12)), mm_inputs=[[1, 6, 3]], max_tokens=2))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 8, 0]]
    ex.apply(_add("b", list(range(50, 60)), mm_inputs=[[0, 0, 2]], max_tokens=2))
    ex.apply(_add("c", list(range(70, 73)), max_tokens=2))
    assert ex.apply({"op": "step"})["scheduled"] == second


@pytest.mark.parametrize("rule, first", [("skip", [["a", 6, 0], ["c", 6, 0]]),
                                         ("stop", [["a", 6, 0]])])
def test_an_encoder_decoder_input_the_budget_cannot_take_ends_the_loop_only_under_stop(
        rule, first):
    """`cross` binds the encoder budget (12): a's encoder input (10) leaves 2, so b's (5)
    cuts b to no token. Under "skip" c's (2), behind b, is admitted; under "stop" (vLLM
    0.32's `break`, which vLLM compares on cross too) the waiting loop ends at b."""
    ex = Execution(_with("cross", blocked_waiting=rule), "scheduler", ("kvcache",))
    for i, (rid, tokens) in enumerate((("a", 10), ("b", 5), ("c", 2))):
        ex.apply(_add(rid, list(range(10 * i, 10 * i + 6)), num_encoder_tokens=tokens,
                      max_tokens=3))
    assert ex.apply({"op": "step"})["scheduled"] == first


@pytest.mark.parametrize("field, value", [("self_preemption", "break"),
                                          ("blocked_waiting", "continue")])
def test_a_bad_loop_rule_is_refused_naming_it(field, value):
    with pytest.raises(ConfigError, match=f"scheduler.{field} must be one of .*'{value}'"):
        Config.from_dict({"num_blocks": 8, "groups": [{"kind": "full", "block_size": 4}],
                          "scheduler": {field: value}})


def test_the_shrinker_keeps_the_loop_rules():
    """The rules are the engine's (a release's), not the trace's to drop: a shrink tries the
    other scheduler fields at their defaults, never these."""
    from kvfuzz.core.trace import Trace
    from kvfuzz.fuzz.shrink import _config_variants

    config = _with("priority", self_preemption="stop", blocked_waiting="stop")
    variants = list(_config_variants(Trace(config, "scheduler", [], {})))
    assert any(v.config.scheduler.policy == "fcfs" for v in variants)
    assert all((v.config.scheduler.self_preemption, v.config.scheduler.blocked_waiting)
               == ("stop", "stop") for v in variants)
