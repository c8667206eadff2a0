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
