"""The executor: validity, lockstep comparison, reports, determinism of replays."""

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.errors import InvalidTrace
from kvfuzz.harness.executor import Counterexample, Execution, run_trace
from kvfuzz.harness.targets import UnknownTarget, get_target
from kvfuzz.core.trace import Trace

FULL = Config(10, (GroupConfig("full", 4),), max_model_len=32)
P = list(range(10))


def _e1_ops():
    return [
        {"op": "add_request", "request_id": "A", "prompt": P},
        {"op": "get_computed_blocks", "request_id": "A"},
        {"op": "allocate_slots", "request_id": "A", "num_new_tokens": 10, "use_lookup": True},
        {"op": "add_request", "request_id": "B", "prompt": P},
        {"op": "get_computed_blocks", "request_id": "B"},
        {"op": "allocate_slots", "request_id": "B", "num_new_tokens": 2, "use_lookup": True},
        {"op": "free", "request_id": "A"},
        {"op": "free", "request_id": "B"},
    ]


def test_e1_in_lockstep_with_the_model():
    execution = Execution(FULL, "api", ["kvcache"])
    results = [execution.apply(op) for op in _e1_ops()]
    assert results[4] == {"block_ids": [[1, 2]], "num_computed_tokens": 8}
    assert results[5] == {"block_ids": [[4]]}
    assert execution.state.free_queue == (4, 3, 5, 6, 7, 8, 9, 2, 1)
    assert execution.checks_run > 100


@pytest.mark.parametrize(
    "op, needle",
    [
        ({"op": "free", "request_id": "ghost"}, "'ghost'"),
        ({"op": "allocate_slots", "request_id": "A", "num_new_tokens": 11}, "11"),
        ({"op": "allocate_slots", "request_id": "A", "num_new_tokens": 1, "use_lookup": True},
         "lookup"),
        ({"op": "add_request", "request_id": "A", "prompt": [1]}, "'A'"),
        ({"op": "add_request", "request_id": "Z", "prompt": list(range(40))}, "40"),
    ],
)
def test_invalid_ops_stop_with_the_step_and_change_nothing(op, needle):
    execution = Execution(FULL, "api", ["kvcache"])
    execution.apply(_e1_ops()[0])
    before = execution.targets[0].side.snapshot()
    with pytest.raises(InvalidTrace) as err:
        execution.apply(op)
    assert needle in str(err.value) and f"step 1 ({op['op']})" in str(err.value)
    assert execution.targets[0].side.snapshot() == before
    assert len(execution.trace.ops) == 1


def test_misuse_is_an_error_result_equal_on_both_sides():
    execution = Execution(FULL, "api", ["kvcache"])
    execution.apply(_e1_ops()[0])
    assert execution.apply({"op": "evict_blocks", "block_ids": [10]}) == {"error": "ValueError"}
    assert execution.apply({"op": "cache_blocks", "request_id": "A",
                            "num_computed_tokens": 4}) == {"error": "ValueError"}


def test_a_finding_reports_step_check_states_and_trace():
    trace = Trace(FULL, "api", _e1_ops())
    result = run_trace(trace, ["bug:free-forgets-decrement"])
    finding = result.finding
    assert finding is not None and finding.check == "P2" and finding.step == 6
    report = finding.report()
    assert "step 6" in report and "P2" in report and "ref_cnt" in report
    assert len(finding.trace.ops) == 7 and finding.trace.meta["check"] == "P2"
    assert "trace up to step 6, api level, config {" in report
    assert '    0: {"op": "add_request", "request_id": "A"' in report
    assert '    6: {"op": "free", "request_id": "A"}' in report and "    7:" not in report
    assert "trace up to" not in finding.report(with_trace=False)
    assert run_trace(finding.trace, ["bug:free-forgets-decrement"]).finding.check == "P2"


def test_differential_finding_shows_both_states_side_by_side():
    result = run_trace(Trace(FULL, "api", _e1_ops()), ["bug:free-forward-order"], checks=())
    assert result.finding.check == "DIFF-state"
    assert "model after step" in result.finding.details and "|" in result.finding.details


def test_invariant_finding_shows_the_model_state_beside_the_target_state():
    finding = run_trace(Trace(FULL, "api", _e1_ops()), ["bug:free-forward-order"]).finding
    assert finding.check == "I7" and finding.step == 7
    assert "bug:free-forward-order after step 7" in finding.details
    assert "model after step 7" in finding.details and "|" in finding.details


def test_side_by_side_shows_a_differing_long_line_in_full():
    """A 40-block queue overflows the left column: both queues still appear in full."""
    config = Config(40, (GroupConfig("full", 4),), max_model_len=32)
    queues = []
    for target in ("kvcache", "bug:free-forward-order"):
        execution = Execution(config, "api", [target], model=False, checks=())
        for op in _e1_ops():
            execution.apply(op)
        queues.append(execution.targets[0].snapshot.free_queue)
    assert queues[0] != queues[1]
    finding = run_trace(Trace(config, "api", _e1_ops()), ["bug:free-forward-order"]).finding
    report = finding.report()
    for queue in queues:
        assert f"free (39): {list(queue)}" in report


def test_two_targets_and_no_model():
    result = run_trace(Trace(FULL, "api", _e1_ops()), ["kvcache", "bug:free-forward-order"],
                       model=False, checks=())
    assert result.finding.check == "DIFF-state" and result.finding.target == "bug:free-forward-order"


def test_unknown_target_names_it_and_lists_the_known_ones():
    with pytest.raises(UnknownTarget, match="'nope'.*kvcache"):
        get_target("nope")


def test_counterexample_carries_the_finding():
    execution = Execution(FULL, "api", ["bug:free-forgets-decrement"])
    for op in _e1_ops()[:6]:
        execution.apply(op)
    with pytest.raises(Counterexample) as err:
        execution.apply(_e1_ops()[6])
    assert err.value.finding.check == "P2"
