"""`reset_prefix_cache` at the scheduler level: kvfuzz's driver and the model, in lockstep."""

from __future__ import annotations

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import InvalidTrace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution


def _started(config_name: str, targets: tuple[str, ...] = ("kvcache",)) -> Execution:
    ex = Execution(BUILTIN[config_name][1], "scheduler", targets)
    for i in range(3):
        ex.apply({"op": "add_request", "request_id": f"r{i}", "prompt": list(range(i, i + 9)),
                  "max_tokens": 3, "priority": i % 2})
    ex.apply({"op": "step", "sample": 1})
    return ex


@pytest.mark.parametrize("config", ["events", "priority", "hybrid"])
def test_a_reset_fails_while_requests_run_and_preempts_them_when_asked(config):
    ex = _started(config)
    running = ex.state.running
    assert running and ex.apply({"op": "reset_prefix_cache"}) is False
    assert ex.apply({"op": "reset_prefix_cache", "reset_running_requests": True}) is True
    assert ex.state.running == () and not ex.state.cache
    assert set(ex.state.waiting) == set(running)  # priority: in priority order
    if config != "priority":
        assert ex.state.waiting[:len(running)] == running  # in their running order
    for sample in range(6):
        ex.apply({"op": "step", "sample": sample})
    if ex.config.kv_events:  # AllBlocksCleared, then the re-prefills: EV1 three ways
        ex.apply({"op": "take_events"})


def test_a_reset_with_a_step_in_flight_is_invalid():
    ex = Execution(BUILTIN["deferred"][1], "scheduler", ("kvcache",))
    ex.apply({"op": "add_request", "request_id": "r", "prompt": list(range(8))})
    ex.apply({"op": "step", "in_flight": True})
    with pytest.raises(InvalidTrace, match="in flight"):
        ex.apply({"op": "reset_prefix_cache", "reset_running_requests": True})


def test_the_driver_ignoring_reset_running_requests_is_caught(tmp_path, capsys):
    code = kvfuzz(["run", "--target", "bug:reset-keeps-running", "--level", "scheduler",
                   "--config", "events", "--examples", "60", "--corpus", str(tmp_path)])
    assert code == 1, capsys.readouterr().out
    assert list(tmp_path.glob("DIFF-*-events-*.json"))


def test_a_reset_that_preempts_in_the_wrong_order_is_caught_by_i7(tmp_path, capsys):
    """I7 reads a preempting reset's releases: the last running request's blocks first."""
    code = kvfuzz(["run", "--target", "bug:reset-preempts-in-order", "--level", "scheduler",
                   "--config", "events", "--examples", "60", "--no-model",
                   "--corpus", str(tmp_path)])
    assert code == 1, capsys.readouterr().out
    assert list(tmp_path.glob("I7-events-*.json"))
