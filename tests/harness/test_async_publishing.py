"""Publishing after each output under async scheduling (`scheduler.async_scheduling`,
docs/spec.md §7): vLLM's AsyncScheduler counts every request that samples as holding output
placeholders, and `update_from_output` caches such a request's settled tokens after its output
(0.33+). Under MTP hash lookahead that caches the hash block the sampled token completes, even
when the request finishes at once. kvfuzz's driver on kvcache and the reference model do the
same; the plant `bug:async-output-unpublished` takes it away from the driver and the model
catches it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.harness.manager_side import publishes_after_output


def _config(name: str, async_scheduling: bool) -> Any:
    base = BUILTIN[name][1]
    return base.replace(scheduler=dataclasses.replace(base.scheduler,
                                                      async_scheduling=async_scheduling))


def _trace(async_scheduling: bool) -> Trace:
    """deepseek_v3_mtp (bs 4, hashes covering the next token): a 4-token prompt sampled once
    completes block 0's lookahead, and the request finishes."""
    ops = [{"op": "add_request", "request_id": "r0", "prompt": [3, 2, 0, 1], "max_tokens": 1},
           {"op": "step"}]
    return Trace(_config("deepseek_v3_mtp", async_scheduling), "scheduler", ops, {})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_output_under_async_scheduling_caches_the_block_its_sample_completes(
        async_scheduling):
    """Only under async scheduling is block 0 cached after r0's output; kvcache's driver and
    the model agree either way."""
    trace = _trace(async_scheduling)
    ex = Execution(trace.config, "scheduler", ("kvcache",))
    for op in trace.ops:
        ex.apply(op)
    assert {tuple(tokens) for _, _, tokens in ex.state.cache} == (
        {(3, 2, 0, 1)} if async_scheduling else set())


def test_async_scheduling_publishes_only_with_caching():
    config = _config("deepseek_v3_mtp", True)
    assert publishes_after_output(config)
    assert not publishes_after_output(config.replace(enable_caching=False))
    assert not publishes_after_output(_config("deepseek_v3_mtp", False))
    assert publishes_after_output(_config("qwen3_next_mtp", False))  # settled_blocks at_output


def test_the_plant_that_skips_publishing_under_async_scheduling_is_caught():
    """`bug:async-output-unpublished` leaves block 0 uncached; the model reports it. Without
    async scheduling the plant changes nothing (the same trace passes on it)."""
    found = run_trace(_trace(True), ["bug:async-output-unpublished"]).finding
    assert found is not None and found.check.startswith("DIFF"), found
    assert run_trace(_trace(True), ["kvcache"]).passed
    assert run_trace(_trace(False), ["bug:async-output-unpublished"]).passed


def test_a_campaign_finds_the_plant_and_its_shrunk_trace_replays(tmp_path):
    """A short seeded campaign on deepseek_v3_mtp under async scheduling (a user's config, as
    `--config-file` gives it) finds the plant through the one executor; the saved trace
    replays to the same check and passes on kvcache."""
    from kvfuzz.fuzz.campaign import Campaign, CampaignOptions

    config = dataclasses.replace(_config("deepseek_v3_mtp", True), name="mtp_async")
    stats = Campaign(CampaignOptions(
        target="bug:async-output-unpublished", seconds=None, examples=300, seed=1,
        configs=("mtp_async",), config_files=(config,), corpus=tmp_path, levels=("scheduler",),
        shrink_seconds=20, max_findings=1)).run()
    assert stats.findings, f"survived {stats.examples} examples"
    trace = Trace.load(stats.findings[0].file)
    replayed = run_trace(trace, ["bug:async-output-unpublished"]).finding
    assert replayed is not None and replayed.check == stats.findings[0].check
    assert run_trace(trace, ["kvcache"]).passed
