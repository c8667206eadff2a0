"""KV connector support (docs/spec.md §13): external tokens in allocate_slots, the lookup and
view helpers vLLM's connector scheduler calls, and the driver's simulated load life cycle."""

from __future__ import annotations

import pytest

from kvfuzz.kvcache import FullAttentionSpec, RequestStatus, SlidingWindowSpec
from kvfuzz.kvcache.kv_cache_interface import (
    CircularBufferSpec,
    CrossAttentionSpec,
    MambaSpec,
    RSWASpec,
)
from kvfuzz.kvcache.scheduler import Scheduler

from kvcache_testkit import make_manager, make_request, table_ids

BS = 4


def _manager(num_blocks: int = 12, *specs):
    specs = specs or (FullAttentionSpec(block_size=BS),)
    return make_manager(num_blocks, *specs, max_model_len=64)


def free(m) -> int:
    return m.block_pool.get_num_free_blocks()


def test_external_tokens_take_blocks_after_the_hit_and_delay_caches_nothing():
    m = _manager()
    a = make_request("A", list(range(13)), BS)
    assert m.allocate_slots(a, 13) is not None
    a.num_computed_tokens = 13
    b = make_request("B", list(range(13)) + [50, 51, 52], BS)
    hits, hit, _ = m.get_computed_blocks(b)
    assert hit == 12
    before = free(m)
    new = m.allocate_slots(b, 0, hit, hits, num_external_computed_tokens=3,
                           delay_cache_blocks=True)
    # The 3 external tokens (12..14) take one block; none of it is returned as new or cached.
    assert new is not None and new.get_block_ids() == ([],)
    assert free(m) == before - 1
    assert table_ids(m, "B")[0][:3] == table_ids(m, "A")[0][:3]
    assert m.estimate_cached_tokens(b) == 12
    m.cache_blocks(b, 15)
    assert m.estimate_cached_tokens(b) == 12  # block 3 (tokens 12..15) is not full yet


def test_sliding_window_leaves_external_blocks_outside_the_window_null():
    m = _manager(20, FullAttentionSpec(block_size=BS), SlidingWindowSpec(block_size=BS,
                                                                          sliding_window=4))
    a = make_request("A", list(range(17)), BS)
    assert m.allocate_slots(a, 1, num_external_computed_tokens=16) is not None
    full, window = table_ids(m, "A")
    assert len(full) == 5 and 0 not in full
    assert window[:3] == [0, 0, 0] and 0 not in window[3:]


def _predicted_and_taken(m, request, *args, **kwargs) -> tuple[int, int]:
    """allocate_slots' layer-1 prediction and the blocks it took."""
    predicted = m.coordinator.get_num_blocks_to_allocate(
        request.request_id, args[0] + args[1] + kwargs.get("num_external_computed_tokens", 0),
        args[2].blocks, 0, args[1] + kwargs.get("num_external_computed_tokens", 0), args[1],
        args[0] + args[1] + kwargs.get("num_external_computed_tokens", 0),
    )
    before = free(m)
    assert m.allocate_slots(request, *args, **kwargs) is not None
    return predicted, before - free(m)


def test_mamba_align_external_tokens_pass_the_hit_state_and_take_one_state_block():
    m = _manager(20, FullAttentionSpec(block_size=BS),
                 MambaSpec(block_size=BS, mamba_cache_mode="align"))
    a = make_request("A", list(range(9)), BS)
    assert m.allocate_slots(a, 8) is not None  # the state at 8 is cached
    m.free(a)  # its blocks, and the cached state at 8, are free eviction candidates
    m.new_step_starts()
    b = make_request("B", list(range(9)) + list(range(50, 57)), BS)
    hits, hit, _ = m.get_computed_blocks(b)
    assert hit == 8 and hits.get_block_ids()[1][0] == 0  # [null, state at 8]
    state_at_8 = hits.blocks[1][1]
    predicted, taken = _predicted_and_taken(m, b, 0, hit, hits, num_external_computed_tokens=4,
                                            delay_cache_blocks=True)
    # full: 2 hits touched + 1 external block; mamba: nulls up to the external state block.
    assert predicted == taken == 4
    full, mamba = table_ids(m, "B")
    assert mamba[:2] == [0, 0] and 0 not in mamba[2:] and len(mamba) == 3
    assert state_at_8.ref_cnt == 0  # passed by the external tokens: not adopted


def test_mamba_none_external_tokens_keep_only_the_last_state():
    m = make_manager(20, MambaSpec(block_size=BS), max_model_len=64, enable_caching=False)
    a = make_request("A", list(range(13)), BS)
    assert m.allocate_slots(a, 1, num_external_computed_tokens=12) is not None
    assert table_ids(m, "A")[0][:2] == [0, 0] and 0 not in table_ids(m, "A")[0][2:]


@pytest.mark.parametrize("spec, expected", [
    (CircularBufferSpec(block_size=BS), 1),  # the load claims the ring, and only once
    (CrossAttentionSpec(block_size=BS), 0),  # encoder KV is never loaded
])
def test_external_tokens_on_scratch_groups(spec, expected):
    m = make_manager(20, FullAttentionSpec(block_size=BS), spec, max_model_len=64,
                     enable_caching=not isinstance(spec, CrossAttentionSpec))
    a = make_request("A", list(range(9)), BS)
    assert m.allocate_slots(a, 0, num_external_computed_tokens=8,
                            delay_cache_blocks=True) is not None
    assert len(table_ids(m, "A")[0]) == 2 and len(m.coordinator.get_blocks("A")[1]) == expected
    assert m.allocate_slots(a, 1) is not None
    assert len(m.coordinator.get_blocks("A")[1]) == expected


def test_rswa_takes_external_tokens_as_full_attention():
    m = _manager(20, RSWASpec(block_size=BS, rswa_window=4))
    a = make_request("A", list(range(13)), BS)
    assert m.allocate_slots(a, 1, num_external_computed_tokens=12) is not None
    assert len(table_ids(m, "A")[0]) == 4 and 0 not in table_ids(m, "A")[0]


@pytest.mark.parametrize("external", [-1, -5])
def test_negative_external_tokens_raise_and_change_nothing(external):
    m = _manager()
    a = make_request("A", list(range(9)), BS)
    with pytest.raises(ValueError, match=f"num_external_computed_tokens={external}"):
        m.allocate_slots(a, 4, num_external_computed_tokens=external)
    assert free(m) == 11 and not m.coordinator.tracks("A")


def test_connector_lookup_and_truncation():
    m = _manager()
    a = make_request("A", list(range(13)), BS)
    m.allocate_slots(a, 13)
    b = make_request("B", list(range(13)), BS)
    blocks, hit, boundary, diverged = m.get_computed_blocks_for_connector(b)
    assert (hit, boundary, diverged) == (12, 0, False)
    assert m.truncate_computed_blocks(blocks, 8).get_block_ids() == (blocks.get_block_ids()[0][:2],)
    assert m.truncate_computed_blocks(blocks, 0) is m.empty_kv_cache_blocks  # a cut before all
    assert blocks.get_block_ids()[0] == table_ids(m, "A")[0][:3]  # untouched
    with pytest.raises(ValueError, match="6 tokens is not a cut"):
        m.truncate_computed_blocks(blocks, 6)
    with pytest.raises(ValueError, match="16 tokens is not a cut"):
        m.truncate_computed_blocks(blocks, 16)


def _driver(num_blocks: int = 12):
    m = _manager(num_blocks)
    return m, Scheduler(m, max_model_len=64, token_budget=32, max_running=4)


def test_a_whole_load_is_cached_and_the_request_recomputes_its_last_token():
    m, s = _driver()
    r = make_request("R", list(range(8)), BS)
    s.add_request(r)
    assert s.start_load("R", 100) == (0, 8, False)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and s.loads == ("R",)
    assert m.estimate_cached_tokens(r) == 0  # delayed: nothing cached while loading
    assert s.finish_load("R") == 7
    assert r.status == RequestStatus.WAITING and m.estimate_cached_tokens(r) == 8
    out = s.step(lambda request: 1)
    assert out.scheduled == [("R", 1, 0)]


def test_a_short_load_keeps_the_blocks_before_its_first_unfilled_one_and_a_failed_one_frees():
    m, s = _driver()
    short, failed = make_request("S", list(range(12)), BS), make_request("F", [9] * 8, BS)
    s.add_request(short)
    s.add_request(failed)
    s.start_load("S", 12)
    s.start_load("F", 8)
    # 5 tokens landed: block 1 (tokens 4..7) is not filled, so the request keeps 4.
    assert s.finish_load("S", 5) == 4 and m.estimate_cached_tokens(short) == 4
    assert len(table_ids(m, "S")[0]) == 3  # its blocks stay; 4.. are computed again in them
    assert s.finish_load("F", 0) == 0 and table_ids(m, "F") == [[]]


def test_a_short_load_with_several_groups_fails_the_whole_request():
    m = _manager(24, FullAttentionSpec(block_size=BS), SlidingWindowSpec(block_size=BS,
                                                                          sliding_window=4))
    s = Scheduler(m, max_model_len=64, token_budget=32, max_running=4)
    a = make_request("A", list(range(9)), BS)
    s.add_request(a)
    s.start_load("A", 8)
    assert s.finish_load("A") == 8  # whole: 0..7 cached, 8 is computed
    s.step(lambda request: 1)
    r = make_request("R", list(range(20)), BS)
    s.add_request(r)
    assert s.start_load("R", 20) == (8, 12, False)
    before = free(m)
    # vLLM takes no block-level failure with several groups: the request starts again from 0.
    assert s.finish_load("R", 11) == 0 and table_ids(m, "R") == [[], []]
    assert free(m) > before and r.status == RequestStatus.WAITING


def test_a_short_load_on_one_window_group_keeps_only_a_prefix_whose_window_was_loaded():
    m = _manager(24, SlidingWindowSpec(block_size=BS, sliding_window=4))
    s = Scheduler(m, max_model_len=64, token_budget=32, max_running=4)
    for rid, tokens in (("A", 20), ("B", 20), ("C", 22)):
        s.add_request(make_request(rid, [ord(rid)] * tokens, BS))
        s.start_load(rid, tokens)
    assert table_ids(m, "A")[0][:4] == [0, 0, 0, 0]  # 16 + window 4: blocks 0..3 are nulls
    # 17 tokens landed: the first unfilled block is 4 (16..19), its window (13..15) is a null.
    assert s.finish_load("A", 17) == 0 and table_ids(m, "A") == [[]]
    # 3 landed: every real block is unfilled; starting at the first (16) reads nulls too.
    assert s.finish_load("B", 3) == 0
    # 22 loaded into nulls 0..3 and blocks 4, 5; 21 landed: block 5 is unfilled, and the
    # window of 20 (17..19) is in block 4.
    assert table_ids(m, "C")[0][:5].count(0) == 4
    assert s.finish_load("C", 21) == 20
    # The three wait in load start order (docs/spec.md §13.2), C holding its 20 tokens.
    assert [r.request_id for r in s.waiting] == ["A", "B", "C"]
    assert m.estimate_cached_tokens(s.waiting[2]) == 20


def test_under_the_fail_policy_a_short_load_fails_its_request_and_frees_its_blocks():
    """vLLM's "fail" kv_load_failure_policy (docs/spec.md §13.2): a short or failed load
    finishes the request FINISHED_ERROR, frees every block (the local hit too), caches
    nothing; its computed tokens stop at the first unfilled block. A whole load lands."""
    m = _manager()
    s = Scheduler(m, max_model_len=64, token_budget=32, max_running=4, fail_short_loads=True)
    a = make_request("A", list(range(9)), BS)
    s.add_request(a)
    s.start_load("A", 8)
    assert s.finish_load("A") == 8 and a.status == RequestStatus.WAITING
    s.step(lambda request: 1)
    before = free(m)
    for rid, loaded in (("S", 5), ("F", 0)):
        r = make_request(rid, list(range(16)), BS)
        s.add_request(r)
        assert s.start_load(rid, 16) == (8, 8, False)
        assert s.finish_load(rid, loaded) == 0
        assert r.status == RequestStatus.FINISHED_ERROR and table_ids(m, rid) == [[]]
        assert r.num_computed_tokens == (12 if loaded else 8)
        probe = make_request(f"P{rid}", list(range(16)), BS)
        assert m.get_computed_blocks(probe)[1] == 8 and free(m) == before
        assert rid not in {q.request_id for q in s.waiting}


def test_an_aborted_load_holds_its_blocks_until_the_load_ends():
    m, s = _driver()
    r = make_request("R", list(range(8)), BS)
    s.add_request(r)
    s.start_load("R", 8)
    s.finish_request("R", RequestStatus.FINISHED_ABORTED)
    assert free(m) == 9 and s.loads == ("R",)
    s.finish_load("R")
    assert free(m) == 11 and s.loads == ()


def test_finish_load_without_a_load_raises_and_changes_nothing():
    m, s = _driver()
    r = make_request("R", list(range(8)), BS)
    s.add_request(r)
    with pytest.raises(ValueError, match=r"finish_load\('R'\): no KV load in flight"):
        s.finish_load("R")
    with pytest.raises(ValueError, match="num_external_tokens=-2"):
        s.start_load("R", -2)
    with pytest.raises(ValueError, match="unknown request 'X'"):
        s.start_load("X", 2)
    assert r.status == RequestStatus.WAITING and free(m) == 11


def _hybrid_after_two_chunks():
    """Full attention + Mamba align (bs 8): A computed 16 tokens in two chunks, so both groups
    cached the prefixes of 8 and 16 tokens."""
    m = make_manager(20, FullAttentionSpec(block_size=8),
                     MambaSpec(block_size=8, mamba_cache_mode="align"), max_model_len=64)
    a = make_request("A", list(range(17)), 8)
    for _ in range(2):
        assert m.allocate_slots(a, 8) is not None
        a.num_computed_tokens += 8
        m.new_step_starts()
    return m, table_ids(m, "A")


def test_connector_lookup_reports_a_state_hit_shorter_than_full_attention():
    m, (full, mamba) = _hybrid_after_two_chunks()
    m.evict_blocks([mamba[1]])  # the state at 16 is gone, full attention's block 1 is not
    b = make_request("B", list(range(17)), 8)
    blocks, hit, boundary, diverged = m.get_computed_blocks_for_connector(b)
    assert (hit, boundary, diverged) == (16, 0, True)
    assert blocks.get_block_ids()[0] == full[:2] and len(blocks.blocks[1]) == 1
    assert m.get_computed_blocks(b)[1] == 8  # the boundary every group agrees on
    # The load brings the state at 16: the shorter state hit is passed, not adopted.
    before = free(m)
    assert m.allocate_slots(b, 0, hit, blocks, num_external_computed_tokens=1,
                            delay_cache_blocks=True) is not None
    # one block per group for token 16: the state group passes its hit at 8 (nulls)
    assert before - free(m) == 2 and table_ids(m, "B")[1][:2] == [0, 0]


def test_connector_lookup_falls_back_when_full_attention_is_the_shorter_hit():
    m, (full, mamba) = _hybrid_after_two_chunks()
    m.evict_blocks([full[1]])
    b = make_request("B", list(range(17)), 8)
    blocks, hit, boundary, diverged = m.get_computed_blocks_for_connector(b)
    assert (hit, diverged) == (8, False)
    assert (blocks.get_block_ids(), hit, boundary) == (
        m.get_computed_blocks(b)[0].get_block_ids(), *m.get_computed_blocks(b)[1:])


def test_with_state_groups_a_load_leaves_the_last_token_and_a_short_one_fails_whole():
    m = make_manager(30, FullAttentionSpec(block_size=8),
                     MambaSpec(block_size=8, mamba_cache_mode="align"), max_model_len=64)
    s = Scheduler(m, max_model_len=64, token_budget=32, max_running=4, state_groups=True)
    s.add_request(make_request("W", list(range(17)), 8))
    s.add_request(make_request("S", list(range(8)) + [99] * 9, 8))
    assert s.start_load("W", 100) == (0, 16, False)  # NIXL's backoff: token 16 is computed
    assert s.finish_load("W") == 16 and m.coordinator.tracks("W")
    s.finish_request("W", RequestStatus.FINISHED_ABORTED)
    free_before = free(m)
    # Full attention hits 8 tokens, the state group nothing (W cached only the state at 16):
    # the connector lookup keeps the deeper hit and says so; the load brings the state.
    assert s.start_load("S", 100) == (8, 8, True)
    assert s.finish_load("S", 3) == 0 and not m.coordinator.tracks("S")  # short: all lost
    assert free(m) == free_before



def test_a_request_whose_hits_are_bounded_reads_no_external_kv():
    """A hit limit (prompt logprobs) or no cache reads: the connector's hits are not bounded,
    so the driver and the model load nothing for it (vLLM 0.34 `skip_reading_external_kv`)."""
    from kvfuzz.core.configs import BUILTIN
    from kvfuzz.harness.executor import Execution

    ex = Execution(BUILTIN["connector"][1], "scheduler", ("kvcache",))
    for rid, field in (("limited", {"prefix_cache_hit_limit": 4}),
                       ("skipping", {"skip_reading_prefix_cache": True}), ("free", {})):
        ex.apply({"op": "add_request", "request_id": rid, "prompt": list(range(9)), **field})
    loads = [ex.apply({"op": "load_remote", "request_id": rid, "num_external_tokens": 9})
             for rid in ("limited", "skipping", "free")]
    assert loads[:2] == [None, None] and loads[2]["external"] == 9


def test_a_synchronous_load_is_taken_at_admission_with_the_chunk_after_it():
    """`load_remote {sync: true}` (docs/spec.md §13.3): the offer stands until the request's
    next admission, whose lookup loads the tokens (counted computed at once, no waiting for
    remote KV) and schedules the rest in the same step; the step's hit is the local one."""
    m, s = _driver()
    a = make_request("A", list(range(8)), BS)
    s.add_request(a)
    s.step(lambda request: 1)
    r = make_request("R", list(range(8)) + list(range(50, 59)), BS)
    s.add_request(r)
    assert s.start_load("R", 100, sync=True) is True
    assert s.start_load("R", 3) is None and s.start_load("R", 3, sync=True) is None
    assert r.status == RequestStatus.WAITING and not s.loads and not m.coordinator.tracks("R")
    out = s.step(lambda request: 1)
    # Hit 8, then the connector loads tokens 8..15 and leaves the last one to compute.
    assert ("R", 1, 8) in out.scheduled and s.sync_loaded == {"R": 8}
    assert r.num_computed_tokens == 17 and r.status == RequestStatus.RUNNING
    assert s.start_load("R", 3, sync=True) is None  # no longer waiting


def test_a_synchronous_load_waits_for_room_and_is_offered_again():
    """An admission the pool refuses keeps the offer: the next one loads it."""
    m, s = _driver(4)
    s.add_request(make_request("big", list(range(9)), BS))
    s.step(lambda request: 1)
    s.add_request(make_request("R", list(range(20, 32)), BS))
    assert s.start_load("R", 8, sync=True) is True
    assert [rid for rid, _, _ in s.step(lambda request: 1).scheduled] == ["big"]
    s.finish_request("big", RequestStatus.FINISHED_ABORTED)
    assert s.step(lambda request: 1).scheduled == [("R", 4, 0)]
    assert s.sync_loaded == {"R": 8}


def test_synchronous_loads_agree_with_the_model_on_a_state_hybrid():
    """kvcache's driver and the model, one op at a time, on finding 017's shape
    (`nemotron_h_connector`, 9 blocks): kvcache counts the two state blocks each align group
    takes, so the admission is refused from 8 free blocks and nothing is scheduled."""
    from kvfuzz.core.configs import BUILTIN
    from kvfuzz.harness.executor import Execution

    for num_blocks, scheduled in ((9, []), (40, [["a", 8, 0]])):
        ex = Execution(BUILTIN["nemotron_h_connector"][1].replace(num_blocks=num_blocks),
                       "scheduler", ("kvcache",))
        ex.apply({"op": "add_request", "request_id": "a", "prompt": list(range(17))})
        assert ex.apply({"op": "load_remote", "request_id": "a", "num_external_tokens": 8,
                         "sync": True}) is True
        assert ex.apply({"op": "step"})["scheduled"] == scheduled


@pytest.mark.parametrize("policy, first", [("fcfs", "later"), ("priority", "low")])
def test_requests_a_load_started_for_wait_ahead_of_the_rest(policy, first):
    """docs/spec.md §13.2 (vLLM 0.34's `kv_holding_waiting`): landed loads wait ahead of the
    other waiting requests, a more important one included, in load start order (priority:
    in priority order), not in the order the loads ended; kvcache and the model agree."""
    import dataclasses

    from kvfuzz.core.configs import BUILTIN
    from kvfuzz.harness.executor import Execution

    base = BUILTIN["connector"][1]
    ex = Execution(base.replace(scheduler=dataclasses.replace(
        base.scheduler, policy=policy, token_budget=4)), "scheduler", ("kvcache",))
    for rid, start in (("low", 0), ("later", 20)):
        ex.apply({"op": "add_request", "request_id": rid, "prompt": list(range(start, start + 8)),
                  "priority": 2, "max_tokens": 2})
    for rid in ("later", "low"):
        ex.apply({"op": "load_remote", "request_id": rid, "num_external_tokens": 4})
    ex.apply({"op": "add_request", "request_id": "high", "prompt": list(range(40, 48)),
              "priority": 0, "max_tokens": 2})
    for rid in ("later", "low"):
        ex.apply({"op": "finish_load", "request_id": rid})
    assert ex.state.waiting == (first, ({"low", "later"} - {first}).pop(), "high")
    assert ex.apply({"op": "step"})["scheduled"] == [[first, 4, 0]]


def test_a_load_passes_the_full_sequence_gate():
    """docs/spec.md §13.2: a load's allocation takes the full-sequence gate, as admission
    does: 10 blocks of prompt do not start a load with 7 free (kvcache and the model)."""
    import dataclasses

    from kvfuzz.core.configs import BUILTIN
    from kvfuzz.harness.executor import Execution

    base = BUILTIN["connector"][1]
    ex = Execution(base.replace(scheduler=dataclasses.replace(
        base.scheduler, full_sequence_must_fit=True)), "scheduler", ("kvcache",))
    ex.apply({"op": "add_request", "request_id": "r0", "prompt": list(range(32)),
              "max_tokens": 4})
    ex.apply({"op": "step"})
    ex.apply({"op": "add_request", "request_id": "r1", "prompt": list(range(100, 140)),
              "max_tokens": 1})
    assert ex.apply({"op": "load_remote", "request_id": "r1", "num_external_tokens": 8}) is None


SYNC_FAILURE = [
    {"op": "add_request", "request_id": "a", "prompt": list(range(20)), "max_tokens": 2},
    {"op": "add_request", "request_id": "b", "prompt": list(range(20)) + [7], "max_tokens": 2},
    {"op": "load_remote", "request_id": "a", "num_external_tokens": 16, "sync": True,
     "num_loaded_tokens": 6},
    {"op": "step"},
]
"""a's synchronous load fills 6 of its 16 tokens; b, admitted in the same step, hits a's
blocks (cached at a's admission), the ones the load did not fill among them."""


def sync_failure_config(policy: str):
    import dataclasses

    from kvfuzz.core.configs import BUILTIN

    base = BUILTIN["connector"][1]
    return base.replace(scheduler=dataclasses.replace(base.scheduler,
                                                      kv_load_failure_policy=policy))


@pytest.mark.parametrize("policy, finished, after", [
    ("recompute", [], {"a": (4, "RUNNING"), "b": (20, "RUNNING")}),
    ("fail", ["a", "b"], {"a": (4, "FINISHED_ERROR"), "b": (20, "FINISHED_ERROR")})])
def test_a_failing_synchronous_load_is_reported_by_the_step_that_admits_it(policy, finished,
                                                                            after):
    """docs/spec.md §13.3: the step's output reports blocks 2-4 (tokens 4..15) not filled. a's
    computed tokens drop to 4, the start of the first; b holds them too, already marked by a:
    it keeps its hit (20) and takes no output. a's blocks from the first reported one on lose
    their keys under either policy (vLLM only under "fail": docs/findings/029); under "fail"
    both fail. kvcache's driver and the model agree."""
    from kvfuzz.harness.executor import Execution

    ex = Execution(sync_failure_config(policy), "scheduler", ("kvcache",))
    for op in SYNC_FAILURE[:-1]:
        ex.apply(op)
    out = ex.apply(SYNC_FAILURE[-1])
    assert out["scheduled"] == [["a", 4, 0], ["b", 1, 20]] and out["finished"] == finished
    views = ex.state.requests
    assert {rid: (v.num_computed_tokens, v.status) for rid, v in views.items()} == after
    keyed = {b for blocks in ex.state.cache.values() for b in blocks}
    assert keyed.isdisjoint({2, 3, 4, 5})


def test_recomputing_a_failed_synchronous_load_rewrites_no_keyed_block():
    """Under "recompute" a recomputes into the blocks its load did not fill and b into the
    block after its hit: kvcache's driver evicted their keys first, so I11 passes; the plant
    `failed-load-blocks-keyed` (vLLM's rule, `scheduler.py:3907-3911` in 0.34.0: evicted
    only under "fail") rewrites them keyed and I11 says so (docs/findings/029)."""
    from kvfuzz.core.trace import Trace
    from kvfuzz.harness.executor import run_trace

    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                             "config": sync_failure_config("recompute").to_dict(),
                             "ops": SYNC_FAILURE + [{"op": "step"}] * 3})
    assert run_trace(trace, ["kvcache"]).passed
    # The model sees the keys at once (DIFF-state, step 3); alone, I11 sees the rewrite.
    finding = run_trace(trace, ["bug:failed-load-blocks-keyed"]).finding
    assert finding is not None and (finding.check, finding.step) == ("DIFF-state", 3)
    finding = run_trace(trace, ["bug:failed-load-blocks-keyed"], model=False).finding
    assert finding is not None and (finding.check, finding.step) == ("I11", 4)


def test_a_request_sharing_a_failed_block_rewrites_its_own_blocks_unkeyed():
    """r3 hits r2's first block, which r2's synchronous load fails on, and computes its second
    block in that step: r2 marks the block (r3 keeps its hit), and r3's second block, which
    it computes again, loses its key too under "recompute" (a campaign's shrunk trace, on a
    6-block pool with a budget of 16)."""
    from kvfuzz.core.trace import Trace
    from kvfuzz.harness.executor import run_trace

    ops = [
        {"op": "add_request", "request_id": "r0", "prompt": [0, 0, 2, 2, 2], "max_tokens": 2},
        {"op": "add_request", "request_id": "r1", "prompt": [2, 3, 0, 3, 0, 3, 2, 0],
         "cache_salt": "b", "max_tokens": 2},
        {"op": "add_request", "request_id": "r2", "prompt": [2, 3, 0, 3], "max_tokens": 1},
        {"op": "step"}, {"op": "step"},
        {"op": "add_request", "request_id": "r3", "prompt": [2, 3, 0, 3, 2, 2, 0, 1],
         "max_tokens": 2},
        {"op": "load_remote", "request_id": "r2", "num_external_tokens": 3, "sync": True,
         "num_loaded_tokens": 1},
        {"op": "step"}, {"op": "step"}]
    import dataclasses

    config = sync_failure_config("recompute")
    config = config.replace(num_blocks=6, scheduler=dataclasses.replace(config.scheduler,
                                                                        token_budget=16))
    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                             "config": config.to_dict(), "ops": ops})
    assert run_trace(trace, ["kvcache"]).passed
    finding = run_trace(trace, ["bug:failed-load-blocks-keyed"], model=False).finding
    assert finding is not None and finding.check == "I11", finding


@pytest.mark.parametrize("config, op, says", [
    ("connector", {"sync": False}, "num_loaded_tokens is for a synchronous load"),
    ("nemotron_h_connector", {"sync": True}, "all full attention, MLA or sliding windows"),
    ("connector", {"sync": True, "num_loaded_tokens": -1}, "must be >= 0 or null, got -1"),
])
def test_a_failing_synchronous_load_where_it_is_not_valid_exits_2(config, op, says):
    from kvfuzz.core.configs import BUILTIN
    from kvfuzz.core.errors import InvalidTrace
    from kvfuzz.harness.executor import Execution

    for model in (True, False):
        ex = Execution(BUILTIN[config][1], "scheduler", ("kvcache",), model=model)
        ex.apply({"op": "add_request", "request_id": "a", "prompt": list(range(9))})
        with pytest.raises(InvalidTrace, match=says):
            ex.apply({"op": "load_remote", "request_id": "a", "num_external_tokens": 4,
                      "num_loaded_tokens": 2, **op})


def test_the_generators_draw_failing_synchronous_loads_under_the_fail_policy():
    import random

    from kvfuzz.fuzz.generator import run_example

    drawn = 0
    for seed in range(30):
        ex = run_example(random.Random(seed).randbytes(2048), sync_failure_config("fail"),
                         "scheduler", steps=40, targets=("kvcache",), vary=False)
        drawn += sum(op["op"] == "load_remote" and op["num_loaded_tokens"] is not None
                     for op in ex.trace.ops)
    assert drawn


FAIL_SHARER = [
    {"op": "add_request", "request_id": "r2", "prompt": [2, 3, 0, 3], "max_tokens": 1},
    {"op": "add_request", "request_id": "r3", "prompt": [2, 3, 0, 3, 2, 2, 0, 1],
     "max_tokens": 2},
    {"op": "load_remote", "request_id": "r2", "num_external_tokens": 3, "sync": True,
     "num_loaded_tokens": 1},
    {"op": "step"},
    {"op": "add_request", "request_id": "r5", "prompt": [2, 3, 0, 3, 1], "max_tokens": 1},
    {"op": "step"},
    {"op": "add_request", "request_id": "r6", "prompt": [2, 3, 0, 3, 2, 2, 0, 1, 3],
     "max_tokens": 1},
    {"op": "step"}]
"""Under "fail" (`fail_sharer_config`): r3 hits r2's first block, which r2's synchronous load
fails on, and computes its second block on it; both fail. r5 computes the first block again
(keyed anew); r6 shares r3's prompt."""


def fail_sharer_config():
    import dataclasses

    config = sync_failure_config("fail")
    return config.replace(num_blocks=8, scheduler=dataclasses.replace(config.scheduler,
                                                                      token_budget=16))


def test_a_sharer_failed_with_the_load_leaves_no_block_it_computed_on_invalid_kv_keyed():
    """`FAIL_SHARER`: r6 would hit r3's second block too had it kept its key (vLLM keeps it:
    docs/findings/029); kvfuzz's driver evicted it, r6 hits 4 tokens."""
    from kvfuzz.core.trace import Trace
    from kvfuzz.harness.executor import run_trace

    trace = Trace(fail_sharer_config(), "scheduler", FAIL_SHARER, {})
    steps: list = []
    assert run_trace(trace, ["kvcache"], on_step=lambda i, op, out: steps.append(out)).passed
    assert steps[3]["finished"] == ["r2", "r3"] and steps[-1]["scheduled"] == [["r6", 5, 4]]
    finding = run_trace(trace, ["bug:failed-load-blocks-keyed"]).finding
    assert finding is not None and finding.check == "DIFF-state", finding


@pytest.mark.parametrize("policy, step, after", [
    ("recompute", {"preempted": ["a"], "finished": []},
     {"a": (0, "PREEMPTED"), "b": (20, "RUNNING")}),
    ("fail", {"preempted": [], "finished": ["a", "b"]},
     {"a": (4, "FINISHED_ERROR"), "b": (20, "FINISHED_ERROR")})])
def test_a_failing_synchronous_load_rolls_back_every_group(policy, step, after):
    """docs/spec.md §13.3 on full + sliding window (`gpt_oss_connector`, block size 4 in
    both): a's load fills 6 of 16 tokens; each group reports its blocks from token 4 on, a
    drops to 4 and every group's blocks from there lose their keys (b, which hit them, keeps
    its hit). Under "recompute" the window of 4 tokens reaches a's leading window nulls, so a
    is preempted. kvcache's driver and the model agree; the plant that rolls back the first
    group alone leaves the window's blocks keyed (DIFF-state). vLLM's Scheduler cannot take
    this report: docs/findings/031."""
    import dataclasses

    from kvfuzz.core.configs import BUILTIN
    from kvfuzz.core.trace import Trace
    from kvfuzz.harness.executor import Execution, run_trace

    base = BUILTIN["gpt_oss_connector"][1]
    config = base.replace(scheduler=dataclasses.replace(base.scheduler,
                                                        kv_load_failure_policy=policy))
    ex = Execution(config, "scheduler", ("kvcache",))
    for op in SYNC_FAILURE[:-1]:
        ex.apply(op)
    out = ex.apply(SYNC_FAILURE[-1])
    assert out["scheduled"] == [["a", 4, 0], ["b", 1, 20]]
    assert {k: out[k] for k in step} == step
    views = ex.state.requests
    assert {rid: (v.num_computed_tokens, v.status) for rid, v in views.items()} == after
    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                             "config": config.to_dict(), "ops": SYNC_FAILURE + [{"op": "step"}]})
    assert run_trace(trace, ["kvcache"]).passed
    finding = run_trace(trace, ["bug:sync-failure-first-group-only"]).finding
    assert finding is not None and finding.check == "DIFF-state", finding
