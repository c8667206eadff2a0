"""The loop rules vLLM releases differ on (`scheduler.self_preemption`,
`scheduler.blocked_waiting`, docs/spec.md §7) as engine rules of target `vllm-scheduler`: probed
from the installed Scheduler's source (0.32: `break` twice; 0.33+: `continue` and
`skip_request`), set on the configs a campaign runs, and followed three-way by vLLM's Scheduler,
kvfuzz's driver and the model (tests/kvcache/test_kvcache_loop_rules.py runs both values of each
on the driver and the model).

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.vllm_scheduler_target import loop_rules, unsupported_reason
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

THREE_WAY = ("kvcache", "vllm-scheduler")
OTHER = {"self_preemption": {"continue": "stop", "stop": "continue"},
         "blocked_waiting": {"skip": "stop", "stop": "skip"}}
"""Each rule's other value."""


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


def _engine(name: str, **changes: Any) -> Any:
    config = BUILTIN[name][1]
    config = config.replace(scheduler=dataclasses.replace(config.scheduler, **changes))
    return get_target("vllm-scheduler").engine_config(config)


def test_the_rules_are_probed_and_set_on_every_config_a_campaign_runs():
    rules = loop_rules()
    assert rules["self_preemption"] in ("continue", "stop")
    assert rules["blocked_waiting"] in ("skip", "stop")
    for name in ("priority", "tenants", "full"):
        for target in ("vllm-scheduler", "vllm-async-scheduler",
                       "vllm-scheduler-bug:preempt-keeps-blocks"):
            adapted = get_target(target).engine_config(BUILTIN[name][1]).scheduler
            assert (adapted.self_preemption, adapted.blocked_waiting) == tuple(rules.values())


def test_a_request_that_preempted_itself_under_priority_three_way():
    """`low` runs first, `high` after it; in step 4 both need a block and none is free: `low`
    preempts itself. vLLM's Scheduler, kvfuzz's driver and the model then go on to `high`
    (0.33+) or end the running loop (0.32), as the release's rule says."""
    ex = Execution(_engine("priority").replace(num_blocks=7), "scheduler", THREE_WAY)
    ex.apply(_add("low", list(range(14)), priority=2, max_tokens=8))
    ex.apply({"op": "step"})
    ex.apply(_add("high", list(range(50, 57)), priority=0, max_tokens=8))
    fourth = [ex.apply({"op": "step", "sample": i}) for i in range(3)][-1]
    assert fourth["preempted"] == ["low"]
    goes_on = loop_rules()["self_preemption"] == "continue"
    assert fourth["scheduled"] == ([["high", 1, 0]] if goes_on else [])


def test_a_waiting_request_its_encoder_cannot_take_three_way():
    """b's input at its first token does not fit the encoder cache a's input fills: vLLM's
    Scheduler, kvfuzz's driver and the model pass b over and admit c (0.33+) or end the
    waiting loop at b (0.32), as the release's rule says."""
    config = _engine("tenants", token_budget=8, encoder_budget=None, encoder_cache_size=3)
    ex = Execution(config, "scheduler", THREE_WAY)
    ex.apply(_add("a", list(range(12)), mm_inputs=[[1, 6, 3]], max_tokens=2))
    ex.apply({"op": "step"})
    ex.apply(_add("b", list(range(50, 60)), mm_inputs=[[0, 0, 2]], max_tokens=2))
    ex.apply(_add("c", list(range(70, 73)), max_tokens=2))
    skips = loop_rules()["blocked_waiting"] == "skip"
    assert ex.apply({"op": "step"})["scheduled"] == (
        [["a", 4, 0], ["c", 3, 0]] if skips else [["a", 4, 0]])


@pytest.mark.parametrize("name, field", [("priority", "self_preemption"),
                                         ("tenants", "blocked_waiting")])
def test_a_config_file_naming_the_other_rule_is_refused_with_the_reason(name, field, tmp_path,
                                                                       capsys):
    """Where the rule can decide a step, a trace whose config names the rule this vLLM does
    not follow is a usage error (exit 2) naming the field; where it cannot (fcfs, no encoder
    bound), the config runs."""
    config = _engine(name)
    other = OTHER[field][getattr(config.scheduler, field)]
    config = config.replace(scheduler=dataclasses.replace(config.scheduler, **{field: other}))
    assert f"scheduler.{field} {other!r}" in unsupported_reason(config)
    full = _engine("full")
    assert unsupported_reason(full.replace(scheduler=dataclasses.replace(
        full.scheduler, **{field: other}))) is None
    path = tmp_path / "t.json"
    path.write_text(json.dumps(Trace(config, "scheduler", [_add("r", [1, 2])], {}).to_dict()))
    assert kvfuzz(["replay", str(path), "--target", "vllm-scheduler"]) == 2
    assert f"scheduler.{field}" in capsys.readouterr().err
