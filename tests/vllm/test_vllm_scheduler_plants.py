"""Whether a bug planted in vLLM's Scheduler can apply on the installed release
(`harness.vllm_scheduler_plants.cannot_apply`): probed by building the plant's side on its
configs, so bench/bench_vllm_scheduler.py says why instead of timing a hunt that cannot find it.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

import pytest

from kvfuzz.harness.vllm_scheduler_plants import PLANTS, cannot_apply
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]


def test_a_plant_on_configs_the_scheduler_cannot_take_says_why(monkeypatch):
    """`watermark` reserves blocks, which vLLM's Scheduler is never driven with: a plant whose
    only config it is cannot apply, and the reason names the config and the knob; with
    `full` beside it, the plant applies."""
    what, patch, _ = PLANTS["preempt-keeps-blocks"]
    monkeypatch.setitem(PLANTS, "preempt-keeps-blocks", (what, patch, ("watermark",)))
    assert "watermark: " in cannot_apply("preempt-keeps-blocks")
    assert "reserved_blocks" in cannot_apply("preempt-keeps-blocks")
    monkeypatch.setitem(PLANTS, "preempt-keeps-blocks", (what, patch, ("watermark", "full")))
    assert cannot_apply("preempt-keeps-blocks") is None


def test_a_plant_reading_a_method_the_scheduler_lacks_says_why(monkeypatch):
    """`hit-not-adopted` wraps `Scheduler._get_local_prefix_cache_hit`: on a Scheduler without
    it the plant cannot apply, and the reason names the method."""
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.delattr(Scheduler, "_get_local_prefix_cache_hit")
    assert cannot_apply("hit-not-adopted") == (
        "full: vLLM's Scheduler has no _get_local_prefix_cache_hit")


def test_a_plant_on_a_config_no_built_in_is_applies():
    """`sync-failure-window-nulls-skipped` runs on `mistral_connector_fail`, a config of
    `PLANT_CONFIGS` (a campaign runs it as a config file): the probe builds it from there
    rather than asking for a built-in of that name."""
    assert PLANTS["sync-failure-window-nulls-skipped"][2] == ("mistral_connector_fail",)
    assert cannot_apply("sync-failure-window-nulls-skipped") is None


def test_the_cross_budget_plant_cannot_apply_where_cross_runs_unbound(monkeypatch):
    """`cross-encoder-unbudgeted` shows only against a binding encoder budget; where vLLM's
    waiting loop stops at a blocked request (0.32) a campaign runs `cross` with its budget
    dropped (not compared there), so the plant cannot apply, saying why. `encoder-input-skipped`
    on the same config needs no budget and still applies."""
    from kvfuzz.harness import vllm_scheduler_target as target

    rules = target.loop_rules()
    if rules["blocked_waiting"] == "skip":
        assert cannot_apply("cross-encoder-unbudgeted") is None
    monkeypatch.setattr(target, "loop_rules", lambda: {**rules, "blocked_waiting": "stop"})
    why = cannot_apply("cross-encoder-unbudgeted")
    assert why is not None and why.startswith(
        "cross: a campaign runs it with its encoder budget dropped on this vLLM"), why
    assert "waiting loop stops at a request whose encoder input it cannot take" in why
    assert cannot_apply("encoder-input-skipped") is None
