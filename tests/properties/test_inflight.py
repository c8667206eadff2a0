"""Steps in flight (docs/spec.md §7.1): kvcache and the model agree, each plant is caught by its
check with the model off too, and a completion with nothing in flight is an invalid trace."""

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace

# `a` is read by the first step, aborted while it is in flight; `b` finishes in that step.
OPS = [
    {"op": "add_request", "request_id": "a", "prompt": list(range(1, 18)), "max_tokens": 2},
    {"op": "add_request", "request_id": "b", "prompt": list(range(1, 10)), "max_tokens": 1},
    {"op": "step", "in_flight": True},
    {"op": "abort", "request_id": "a"},
    {"op": "complete_step"},
    {"op": "step"},
]
CAUGHT = {
    "inflight-freed-at-once": ("IF1", True),
    "inflight-fence-one-late": ("IF2", True),
    "inflight-drain-whole-list": ("DIFF-state", False),
}


def _trace(ops: list) -> Trace:
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                            "config": BUILTIN["deferred"][1].to_dict(), "ops": ops})


def test_kvcache_agrees_with_the_model():
    result = run_trace(_trace(OPS), ["kvcache"])
    assert result.passed, result.finding


def test_blocks_wait_for_the_step_then_are_released():
    from kvfuzz.harness.executor import Execution

    execution = Execution(BUILTIN["deferred"][1], "scheduler", ("kvcache",))
    for op in OPS[:4]:
        execution.apply(op)
    state = execution.state
    (step, reads, _), = state.in_flight
    held = {b for run in state.deferred_frees for b in run}
    assert held and held <= set(reads) and not held & set(state.free_queue)
    released = execution.apply(OPS[4])
    assert set(released) == held
    assert not execution.state.in_flight and not execution.state.deferred_frees


@pytest.mark.parametrize("plant", sorted(CAUGHT))
def test_plant_is_caught(plant):
    check, alone = CAUGHT[plant]
    assert run_trace(_trace(OPS), [f"bug:{plant}"]).finding.check == check
    if alone:  # the check itself, without the model to compare with
        finding = run_trace(_trace(OPS), [f"bug:{plant}"], model=False).finding
        assert finding is not None and finding.check == check


def test_complete_step_with_nothing_in_flight_is_invalid():
    result = run_trace(_trace(OPS[:2] + [{"op": "complete_step"}]), ["kvcache"])
    assert result.invalid is not None and "no step is in flight" in str(result.invalid)
