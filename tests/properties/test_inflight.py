"""Steps in flight (docs/spec.md §7.1): kvcache and the model agree, each plant is caught by its
check with the model off too, and a completion with nothing in flight is an invalid trace."""

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace, normalize_op
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


# A generated config (campaign seed 2): r6's full-attention block 1 is keyed at a 24-token
# partial entry; steps 4 and 5 are left in flight reading it, step 4 completes (its token
# arrives), and step 6 (in flight too, beside step 5) fills the block, promoting the entry to
# its 32-token key.
PROMOTED = {"num_blocks": 6, "groups": [{"kind": "full", "block_size": 32},
                                        {"kind": "mamba", "block_size": 16,
                                         "mamba_cache_mode": "align"}],
            "max_model_len": 64, "hash_block_size": 8}
PROMOTED_OPS = [{"op": "add_request", "request_id": "r6", "prompt": [0] * 29, "max_tokens": 8},
                {"op": "step"}, {"op": "step"}, {"op": "step"},
                {"op": "step", "in_flight": True}, {"op": "step", "in_flight": True},
                {"op": "complete_step"}, {"op": "step", "in_flight": True}]


def _promoted_trace() -> Trace:
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                            "config": PROMOTED, "ops": PROMOTED_OPS})


def test_a_partial_entry_promoted_under_a_step_in_flight_is_no_re_key():
    result = run_trace(_promoted_trace(), ["kvcache"])
    assert result.passed, result.finding


def test_if1_still_flags_a_key_that_is_not_a_promotion():
    """The same step with block 1's new key over other tokens, of another identity (a salt),
    or dropped is a re-key."""
    import dataclasses

    from kvfuzz.core.sides import Observations
    from kvfuzz.harness.executor import Execution
    from kvfuzz.properties import REGISTRY, CheckContext

    trace = _promoted_trace()
    execution = Execution(trace.config, "scheduler", ("kvcache",))
    for op in PROMOTED_OPS[:-1]:
        execution.apply(op)
    before = execution.state
    execution.apply(PROMOTED_OPS[-1])
    after = execution.state
    old, new = before.block_keys[1], after.block_keys[1]
    assert old != new and new[2][:len(old[2])] == old[2]  # the promotion the trace plays
    check = REGISTRY.get("IF1")
    ctx = CheckContext(trace.config, "scheduler", 0, {"op": "step"}, None, Observations(),
                       execution.requests, {})
    assert check.fn(before, after, ctx) is None
    for planted in ((new[0], new[1], (7,) + new[2][1:]), (new[0], "salt", new[2]), None):
        keys = list(after.block_keys)
        keys[1] = planted
        bad = dataclasses.replace(after, block_keys=tuple(keys), _derived={})
        assert "re-keyed" in check.fn(before, bad, ctx)


# Mamba "align" with block 32: step 1 (in flight) keys state block 2 at 8 tokens; step 2 (in
# flight too) goes on writing block 2, so its key moves to the copy 2 -> 4 the step makes.
MOVED = {"num_blocks": 5, "groups": [{"kind": "mamba", "block_size": 8,
                                      "mamba_cache_mode": "align"},
                                     {"kind": "mamba", "block_size": 32,
                                      "mamba_cache_mode": "align"}],
         "max_model_len": 64}
MOVED_OPS = [{"op": "add_request", "request_id": "r0", "prompt": [1, 2, 1, 2, 2, 1, 3, 1, 3],
              "max_tokens": 1},
             {"op": "step", "in_flight": True}, {"op": "step", "in_flight": True}]


def test_a_key_moved_to_the_steps_copy_under_a_step_in_flight_is_no_re_key():
    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                             "config": MOVED, "ops": MOVED_OPS})
    result = run_trace(trace, ["kvcache"])
    assert result.passed, result.finding


def test_if1_flags_a_key_dropped_without_a_copy_that_holds_it():
    """The same step without its copy (or with the copy unkeyed) re-keys block 2."""
    import dataclasses

    from kvfuzz.core.sides import Observations
    from kvfuzz.harness.executor import Execution
    from kvfuzz.properties import REGISTRY, CheckContext

    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                             "config": MOVED, "ops": MOVED_OPS})
    execution = Execution(trace.config, "scheduler", ("kvcache",))
    for op in MOVED_OPS[:-1]:
        execution.apply(op)
    before = execution.state
    result = execution.apply(MOVED_OPS[-1])
    after = execution.state
    assert result["copies"] == [[2, 4]] and after.block_keys[4] == before.block_keys[2]
    check = REGISTRY.get("IF1")

    def ctx(result):
        return CheckContext(trace.config, "scheduler", 0, {"op": "step"}, result,
                            Observations(), execution.requests, {})

    assert check.fn(before, after, ctx(result)) is None
    assert "re-keyed" in check.fn(before, after, ctx({**result, "copies": []}))
    keys = list(after.block_keys)
    keys[4] = None
    unkeyed = dataclasses.replace(after, block_keys=tuple(keys), _derived={})
    assert "re-keyed" in check.fn(before, unkeyed, ctx(result))


def test_a_promotion_whose_key_gains_extra_keys_is_no_re_key():
    """PROMOTED with prompt embeddings: the promoted key's identity carries one more hash
    block's extra keys than the partial entry's."""
    ops = [dict(PROMOTED_OPS[0], prompt_embeds=[0] * 29)] + PROMOTED_OPS[1:]
    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                             "config": PROMOTED, "ops": ops})
    result = run_trace(trace, ["kvcache"])
    assert result.passed, result.finding


def test_a_pass_over_a_token_still_to_come_is_seen_when_the_token_arrives():
    """r's one-token prompt samples in step 1, left in flight; step 2 (in flight) computes the
    position of that token, not known yet: its forward pass is held, and seen, as an earlier
    batch, by the `complete_step` that delivers the token (D1 and S2 read the tokens a pass
    computed; without this D1 failed on `deferred` with the data checks, found at once)."""
    from kvfuzz.harness.executor import Execution

    side = Execution(BUILTIN["deferred"][1], "scheduler", ("kvcache",)).targets[0].side

    def passes(op: dict) -> list[tuple[int, int, bool]]:
        side.apply(normalize_op(op, "scheduler"))
        return [(p.start, p.end, p.earlier) for p in side.observations().forward]

    passes({"op": "add_request", "request_id": "r", "prompt": [2], "max_tokens": 4})
    assert passes({"op": "step", "in_flight": True}) == [(0, 1, False)]
    assert passes({"op": "step", "in_flight": True}) == [] and len(side.unsampled_passes) == 1
    assert passes({"op": "complete_step"}) == [(1, 2, True)] and not side.unsampled_passes


@pytest.mark.parametrize("rule, second", [("placeholders", [["r", 1, 0]]), ("wait", [])])
def test_a_request_whose_sampling_step_is_in_flight_follows_the_configs_rule(rule, second):
    """`scheduler.in_flight_sampling` (docs/spec.md §7.1): with placeholders the next step in
    flight schedules the position of r's token still to come; under "wait" (vLLM's Scheduler
    under pipeline parallelism) r gets nothing until the output is in. kvcache's driver and
    the model agree."""
    import dataclasses

    from kvfuzz.harness.executor import Execution

    config = BUILTIN["deferred"][1]
    config = config.replace(scheduler=dataclasses.replace(config.scheduler,
                                                          in_flight_sampling=rule))
    execution = Execution(config, "scheduler", ("kvcache",))
    execution.apply({"op": "add_request", "request_id": "r", "prompt": list(range(1, 9)),
                     "max_tokens": 3})
    assert execution.apply({"op": "step", "in_flight": True})["scheduled"] == [["r", 8, 0]]
    assert execution.apply({"op": "step", "in_flight": True})["scheduled"] == second
    execution.apply({"op": "complete_step"})
    execution.apply({"op": "step"})  # completes the rest, then samples once more
    assert execution.state.requests["r"].num_tokens == (10 if rule == "wait" else 11)
