"""KV events and `reset_prefix_cache` through vLLM's own Scheduler (docs/vllm.md, "KV events
through vLLM's Scheduler"), three-way with kvfuzz's driver on kvcache and the model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

TARGETS = ("vllm-scheduler", "vllm-async-scheduler")


def _add(ex: Execution, n: int) -> None:
    for i in range(n):
        ex.apply({"op": "add_request", "request_id": f"r{i}", "prompt": list(range(i, i + 9)),
                  "max_tokens": 3})


@pytest.mark.parametrize("target", TARGETS)
def test_the_checks_read_the_batches_the_scheduler_publishes(target):
    """Every event the side reads after a step came in a batch vLLM's `update_from_output`
    published; the replay of them all agrees with kvcache's and the model's cache (EV1)."""
    ex = Execution(BUILTIN["events"][1], "scheduler", ("kvcache", target))
    side = ex.targets[1].side
    publisher = side.vllm_scheduler.kv_event_publisher
    published: list[int] = []
    publish = publisher.publish
    publisher.publish = lambda batch: (published.append(len(batch.events)), publish(batch))
    _add(ex, 3)
    for sample in range(8):
        ex.apply({"op": "step", "sample": sample})
        assert side.manager.take_events() == []  # nothing left for a later batch
    assert sum(published) >= 3
    ex.apply({"op": "take_events"})


@pytest.mark.parametrize("target", TARGETS)
def test_reset_prefix_cache_preempts_and_clears_three_way(target):
    """vLLM's `Scheduler.reset_prefix_cache`: False while requests run; with
    `reset_running_requests` they are preempted (waiting in their running order) and the
    cache cleared; its AllBlocksCleared is read at the reset."""
    ex = Execution(BUILTIN["events"][1], "scheduler", ("kvcache", target))
    _add(ex, 3)
    ex.apply({"op": "step", "sample": 1})
    running = ex.state.running
    assert running and ex.apply({"op": "reset_prefix_cache"}) is False
    assert ex.apply({"op": "reset_prefix_cache", "reset_running_requests": True}) is True
    assert not ex.state.cache and not ex.targets[1].side._event_replay.cached
    assert ex.state.waiting[:len(running)] == running
    for sample in range(6):
        ex.apply({"op": "step", "sample": sample})
    ex.apply({"op": "take_events"})


@pytest.mark.parametrize("target", TARGETS)
def test_a_campaign_on_the_event_configs_exits_0(target, tmp_path, capsys):
    code = kvfuzz(["run", "--target", target, "--level", "scheduler", "--examples", "60",
                   "--config", "events", "events_partial", "events_tenants",
                   "--corpus", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "left out" not in out


@pytest.mark.parametrize("plant, check", [
    ("removals-unpublished", "EV4"),  # the batches leave out every BlockRemoved
    ("reset-keeps-running", "DIFF-result"),  # the reset preempts nothing and fails
])
def test_a_bug_planted_in_the_schedulers_events_or_reset_is_caught(plant, check, tmp_path,
                                                                     capsys):
    code = kvfuzz(["run", "--target", f"vllm-scheduler-bug:{plant}", "--level", "scheduler",
                   "--config", "events", "--examples", "60", "--corpus", str(tmp_path)])
    assert code == 1, capsys.readouterr().out
    assert list(tmp_path.glob(f"{check}-events-*.json"))


def test_an_exported_reset_asserts_what_vllms_scheduler_returns(tmp_path):
    """`kvfuzz export --vllm-test` plays a reset as `Scheduler.reset_prefix_cache` and asserts
    its result: the test passes on vLLM, and fails where the reset preempts nothing."""
    ops = [{"op": "add_request", "request_id": f"r{i}", "prompt": [0, 1, 2, 3, 4, 5, 6 + i],
            "max_tokens": 3} for i in range(2)]
    ops += [{"op": "step", "sample": 1}, {"op": "reset_prefix_cache"},
            {"op": "reset_prefix_cache", "reset_running_requests": True},
            {"op": "step", "sample": 2}]
    trace = Trace(BUILTIN["events"][1], "scheduler", ops, {"check": "DIFF-state"})
    (tmp_path / "t.json").write_text(trace.to_json(), encoding="utf-8")
    out = tmp_path / "test_reset.py"
    assert kvfuzz(["export", str(tmp_path / "t.json"), "--vllm-test", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    asked = "assert scheduler.reset_prefix_cache(reset_running_requests=True) is True"
    assert "reset_running_requests=False) is False" in text and asked in text
    planted = tmp_path / "test_reset_planted.py"
    planted.write_text(text.replace(asked, asked.replace("=True)", "=False)")), encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                          out.name, planted.name], capture_output=True, text=True, cwd=tmp_path)
    assert "PASSED test_reset.py::" in run.stdout, run.stdout[-2000:]
    assert "FAILED test_reset_planted.py::" in run.stdout, run.stdout[-2000:]
