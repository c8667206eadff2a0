"""MTP hash lookahead on vLLM's AsyncScheduler (target `vllm-async-scheduler`, docs/vllm.md
"vLLM's own scheduler"): vLLM's `update_from_output` caches a request's settled tokens after
each output of a request with output placeholders, every request that samples under async
scheduling (0.33+), which caches the hash block the sampled token completes. kvfuzz's driver
and the model do the same under `scheduler.async_scheduling` (the target's engine config sets
it where this vLLM publishes), so the MTP configs run three-way.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.vllm_api import load_vllm
from kvfuzz.harness.vllm_scheduler_target import publishing_rule, unsupported_reason
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

MTP = ("deepseek_v3_mtp", "deepseek_v3_mtp3", "qwen3_next_mtp")  # the hash lookahead's
engine = get_target("vllm-async-scheduler").engine_config
hashing_ahead = pytest.mark.skipif(not (vllm_available() and load_vllm().has("hash_lookahead")),
                                   reason="this vLLM does not hash ahead (0.32)")


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


@hashing_ahead
@pytest.mark.parametrize("name", MTP)
def test_the_mtp_configs_run_on_the_async_scheduler_under_its_publishing_rule(name):
    """The engine config publishes after each output exactly where this vLLM's AsyncScheduler
    does, and nothing is left out; run under the other rule, the config is refused."""
    config = engine(BUILTIN[name][1])
    assert config.scheduler.async_scheduling == publishing_rule(True)
    assert unsupported_reason(config, async_scheduling=True) is None
    other = config.replace(scheduler=dataclasses.replace(
        config.scheduler, async_scheduling=not config.scheduler.async_scheduling,
        settled_blocks="next_step"))
    assert "publishing states" in (unsupported_reason(other, async_scheduling=True) or "")


@hashing_ahead
def test_the_block_a_sampled_token_completes_is_published_three_way_on_the_async_scheduler():
    """deepseek_v3_mtp (bs 4, hashes covering the next token): a 4-token prompt sampled once
    completes block 0's lookahead; vLLM's AsyncScheduler caches it before the request
    finishes, and so do kvfuzz's driver and the model; a request sharing the prompt then
    runs three-way too."""
    config = engine(BUILTIN["deepseek_v3_mtp"][1])
    ex = Execution(config, "scheduler", ("kvcache", "vllm-async-scheduler"))
    assert type(ex.targets[1].side.vllm_scheduler).__name__ == "AsyncScheduler"
    ex.apply(_add("r0", [3, 2, 0, 1], max_tokens=1))
    assert ex.apply({"op": "step"})["finished"] == ["r0"]
    assert {tuple(tokens) for _, _, tokens in ex.state.cache} == (
        {(3, 2, 0, 1)} if publishing_rule(True) else set())
    ops = [_add("r1", [3, 2, 0, 1, 2, 3], max_tokens=2), {"op": "step"}, {"op": "step"}]
    for op in ops:
        ex.apply(op)


@hashing_ahead
def test_a_short_mtp_trace_replays_three_way_on_the_async_scheduler():
    """deepseek_v3_mtp3 (hashes covering the next 3 tokens): two requests sharing a prefix,
    decoded over several outputs, agree step by step on vLLM's AsyncScheduler, kvfuzz's
    driver on kvcache and the model; the plant that skips the publishing does not."""
    base = BUILTIN["deepseek_v3_mtp3"][1]
    config = engine(base.replace(scheduler=dataclasses.replace(base.scheduler,
                                                               token_budget=16)))
    ops = [_add("a", [1, 2, 3, 0, 1, 2], max_tokens=4), {"op": "step"}, {"op": "step"},
           {"op": "step"}, {"op": "step"},
           _add("b", [1, 2, 3, 0, 1, 2, 0, 3, 2], max_tokens=2), {"op": "step"},
           {"op": "step"}]
    trace = Trace(config, "scheduler", ops, {})
    result = run_trace(trace, ("kvcache", "vllm-async-scheduler"))
    assert result.passed, result.finding
    if publishing_rule(True):
        planted = run_trace(trace, ("bug:async-output-unpublished",)).finding
        assert planted is not None and planted.check.startswith("DIFF"), planted


def test_a_campaign_on_the_mtp_configs_exits_0_on_the_async_scheduler(tmp_path, capsys):
    """Every MTP config on `vllm-async-scheduler` exits 0 where this vLLM hashes ahead; a
    release without it refuses them (exit 2)."""
    code = kvfuzz(["run", "--target", "vllm-async-scheduler", "--level", "scheduler",
                   "--config", *MTP, "--examples", "40", "--corpus", str(tmp_path)])
    out, err = capsys.readouterr()
    if load_vllm().has("hash_lookahead"):
        assert code == 0, out + err
        assert "findings           0" in out and "left out" not in out + err
    else:
        assert code == 2, out + err
