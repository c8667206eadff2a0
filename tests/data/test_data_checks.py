"""The data checks (properties.data): they catch content bugs the structural invariants miss,
and kvcache passes them on generated traces, on every device/dtype of conftest.py."""

import pytest
from hypothesis import Phase, settings

from data_traces import A8, FULL, PLANTS, add, alloc, trace
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.core.sides import ForwardPass, Observations
from kvfuzz.kvcache.paged_kv import PagedKVCache
from kvfuzz.properties import REGISTRY, CheckContext
from kvfuzz.properties.data import DATA_CHECKS, data_checks, reads_match_tokens
from kvfuzz.fuzz.machines import machine_for

# What the data layer adds, by plant (first failing check; None: nothing fails):
#
#   plant                     level      structural (model off)  with the model
#   hit-swaps-block           api        I13                     I13
#   hit-swaps-block           scheduler  -                       DIFF-state
#   cow-skipped               both       -                       DIFF-result
#   cow-redirect-late         both       -                       -
#   copy-one-step-late        scheduler  -                       DIFF-result
#   cache-ahead-of-schedule   both       - (I11 once r0 writes)  DIFF-state
#   no-eviction-on-pop        both       -                       DIFF-state
#   salt-ignored              both       H2                      H2
#   load-rollback-into-window scheduler  -                       DIFF-result
#   failed-load-report-rounds-up scheduler -                    DIFF-state
#   sync-failure-resumes-over-window scheduler -                DIFF-result
#
# The structural invariants alone miss every plant but hit-swaps-block at the API level and
# salt-ignored; cow-redirect-late (the worker writes through a stale table) is missed even with
# the model in lockstep. D1 catches all of them. test_structural_outcome_is_as_documented keeps
# this table honest.

_PLANT_IDS = [f"{p.mutant}-{p.level}" for p in PLANTS]


def _first_check(result) -> str | None:
    assert result.invalid is None, result.invalid
    return result.finding.check if result.finding else None


@pytest.mark.parametrize("plant", PLANTS, ids=_PLANT_IDS)
def test_data_check_catches_plant(plant, device_dtype):
    result = run_trace(plant.trace, [f"bug:{plant.mutant}"], model=False,
                       checks=data_checks(*device_dtype))
    assert _first_check(result) == "D1", plant.trace.to_json()
    assert plant.message in result.finding.message


@pytest.mark.parametrize("plant", PLANTS, ids=_PLANT_IDS)
def test_plant_trace_passes_on_kvcache(plant, device_dtype):
    checks = list(REGISTRY) + data_checks(*device_dtype)
    assert _first_check(run_trace(plant.trace, ["kvcache"], checks=checks)) is None


@pytest.mark.parametrize("plant", PLANTS, ids=_PLANT_IDS)
def test_structural_outcome_is_as_documented(plant):
    target = [f"bug:{plant.mutant}"]
    assert _first_check(run_trace(plant.trace, target, model=False)) == plant.structural
    assert _first_check(run_trace(plant.trace, target)) == plant.with_model


def test_data_checks_are_separate_from_the_registry():
    assert [c.name for c in DATA_CHECKS] == ["D1", "D2"]
    assert not {"D1", "D2"} & {c.name for c in REGISTRY}
    assert [c.name for c in data_checks(names=["D2"])] == ["D2"]


def test_d2_alone_catches_paged_attention_that_drops_a_position(monkeypatch, device_dtype):
    original = PagedKVCache.attention
    monkeypatch.setattr(PagedKVCache, "attention",
                        lambda self, q, table, start, end, scale=None:
                        original(self, q, table, start + 1 if end - start > 1 else start, end))
    ops = [add("r0", A8), *alloc("r0", 3)]
    checks = data_checks(*device_dtype)
    result = run_trace(trace("api", FULL, ops), ["kvcache"], model=False, checks=checks)
    assert _first_check(result) == "D2"
    assert "r0 group 0: paged attention over positions 0..2 differs" in result.finding.message


def _context(execution: Execution, forward: list[ForwardPass]) -> CheckContext:
    return CheckContext(execution.config, execution.level, 99, {"op": "allocate_slots"}, {},
                        Observations(forward=forward), execution.requests, {})


@pytest.mark.parametrize("tables, message", [
    (((0, 3),), "r0 writes position 0 of group 0 through the null block"),
    (((3,),), "r0 writes positions 0..5 of group 0, but its table has only 1 blocks of 4"),
])
def test_d1_reports_writes_the_mirror_cannot_take(tables, message):
    execution = Execution(trace("api", FULL, []).config, "api", ["kvcache"], model=False,
                          checks=[])
    for op in [add("r0", A8), *alloc("r0", 6)]:
        execution.apply(op)
    state = execution.targets[0].snapshot
    ctx = _context(execution, [ForwardPass("r0", 0, 6, tables)])
    assert reads_match_tokens(state, state, ctx) == message


# Generated traces: kvcache with the model, every invariant and both data checks. The priority
# policy and Tier-B partial hits are left out at the scheduler level: there the data checks find
# the two real hazards of test_data_hazards.py.
_CLEAN_SCHEDULER_CONFIGS = ("full", "no_cache", "sliding_window", "chunked_local", "hybrid",
                            "hybrid3", "cross", "watermark", "eagle")


@pytest.mark.parametrize("level, configs", [("api", None), ("scheduler", _CLEAN_SCHEDULER_CONFIGS)])
def test_kvcache_passes_the_data_checks_on_generated_traces(level, configs, device_dtype):
    machine = machine_for(level, config_names=configs,
                          checks=tuple(REGISTRY) + tuple(data_checks(*device_dtype)))
    case = machine.TestCase
    case.settings = settings(case.settings, max_examples=min(case.settings.max_examples, 40))
    case("runTest").runTest()


def test_machines_with_data_checks_find_a_plant_the_invariants_miss(device_dtype):
    """Random scheduler traces, model off, invariants plus data checks: D1 finds the swap."""
    checks = tuple(REGISTRY) + tuple(data_checks(*device_dtype))
    machine = machine_for("scheduler", targets=("bug:hit-swaps-block",), model=False,
                          config_names=("full",), checks=checks)
    case = machine.TestCase
    case.settings = settings(case.settings, max_examples=200, database=None,
                             phases=[Phase.generate], report_multiple_bugs=False)
    with pytest.raises(Exception) as caught:
        case("runTest").runTest()
    assert "[D1]" in str(caught.value)


# A state group (Mamba "align"): a pass writes only the state after its last token, into the
# block the nulls before it leave, and resumes from the state before its first token.
_ALIGN = {"name": "mamba_align", "num_blocks": 16, "max_model_len": 64,
          "groups": [{"kind": "mamba", "block_size": 4, "mamba_cache_mode": "align"}]}
_STATE_HIT = [add("r0", A8 + [3, 3, 3]), *alloc("r0", 8), {"op": "free", "request_id": "r0"},
              {"op": "new_step_starts"}, add("r1", A8 + [3, 3, 3]), *alloc("r1", 3, lookup=True)]


_RING = {"name": "ring", "num_blocks": 5, "max_model_len": 64,
         "groups": [{"kind": "full", "block_size": 4},
                    {"kind": "circular_buffer", "block_size": 8}]}


def test_d1_leaves_a_circular_buffer_out(device_dtype):
    """A 9-token chunk runs through a ring of one 8-slot block: the worker's scratch, reused
    modulo its size, which D1 does not read as a paged history (the full group it does)."""
    checks = list(REGISTRY) + data_checks(*device_dtype)
    ops = [add("r0", [0] * 12), *alloc("r0", 9, lookup=True)]
    assert _first_check(run_trace(trace("api", _RING, ops), ["kvcache"], checks=checks)) is None


def test_d1_reads_an_rswa_group_around_its_released_gap(device_dtype):
    """R-SWA (bs 2, window 2) after a 4-token prompt and 5 decoded tokens: the block of
    positions 4..5 lies between the prompt and the window and is released; D1 reads the prompt
    and the window only."""
    config = {"name": "rswa", "num_blocks": 24, "max_model_len": 32,
              "groups": [{"kind": "rswa", "block_size": 2, "rswa_window": 2}]}
    ops = [add("r0", [0, 0, 1, 1]), *alloc("r0", 4),
           {"op": "append_tokens", "request_id": "r0", "tokens": [0, 1, 2]}, *alloc("r0", 3),
           {"op": "append_tokens", "request_id": "r0", "tokens": [3, 1]}, *alloc("r0", 1),
           *alloc("r0", 1)]
    checks = list(REGISTRY) + data_checks(*device_dtype)
    assert _first_check(run_trace(trace("api", config, ops), ["kvcache"], checks=checks)) is None


_CHECKPOINTED = {"name": "checkpointed", "num_blocks": 20, "max_model_len": 64,
                 "hash_block_size": 2,
                 "groups": [{"kind": "full", "block_size": 8},
                            {"kind": "mamba", "block_size": 8, "mamba_cache_mode": "align",
                             "num_prefill_checkpoint_blocks": 1,
                             "prefill_checkpoint_alignment": 2}]}


def test_d1_follows_the_state_written_at_a_prefill_checkpoint(device_dtype):
    """docs/spec.md §11.6's example: A's 13-token prompt in one pass exports the state after 12
    tokens into block 3 (its column 0), keyed at 12; B (A's prompt and 3 more) hits 12 and
    resumes from block 3, which D1 must see holding A's state after 12."""
    prompt = [5, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    ops = [add("a", prompt), *alloc("a", 13), {"op": "new_step_starts"},
           add("b", prompt + [7, 9, 3]), *alloc("b", 4, lookup=True)]
    checks = list(REGISTRY) + data_checks(*device_dtype)
    result = run_trace(trace("api", _CHECKPOINTED, ops), ["kvcache"], checks=checks)
    assert _first_check(result) is None
    assert result.ops_run == len(ops)


def test_d1_passes_align_state_groups_on_kvcache(device_dtype):
    checks = list(REGISTRY) + data_checks(*device_dtype)
    assert _first_check(run_trace(trace("api", _ALIGN, _STATE_HIT), ["kvcache"],
                                  checks=checks)) is None


def test_d1_catches_a_pass_resuming_from_the_wrong_state(device_dtype):
    result = run_trace(trace("api", _ALIGN, _STATE_HIT), ["bug:state-hit-misplaced"],
                       model=False, checks=data_checks(*device_dtype))
    assert _first_check(result) == "D1"
    assert "r1 resumes from position 7 of group 0 through the null block" in result.finding.message
