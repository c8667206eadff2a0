"""API level: misuse returns {"error": "ValueError"} and changes nothing; invalid ops raise
InvalidTrace; pool and manager behaviours (docs/traces.md, docs/spec.md §3, §4, §6)."""

from __future__ import annotations

import pytest
from rm_support import Runner, config, full, swa

from kvfuzz.core.config import GroupConfig
from kvfuzz.core.errors import InvalidTrace

ERROR = {"error": "ValueError"}


def running(num_blocks: int = 16, prompt_len: int = 10) -> Runner:
    """A full-attention (bs 4) model where request A holds cdiv(prompt_len, 4) blocks."""
    m = Runner(config(num_blocks, full(4)), "api")
    m.add("A", list(range(prompt_len)))
    m.admit("A", prompt_len)
    return m


def assert_misuse(m: Runner, op: str, **fields) -> None:
    before = m.snap
    assert m.run(op, **fields) == ERROR
    assert m.snap == before


# ----- API misuse (docs/traces.md, checks 1-6) -----


def test_misuse_1_zero_tokens_without_hit():
    m = running()
    m.add("B", [50, 51])
    assert_misuse(m, "allocate_slots", request_id="B", num_new_tokens=0)
    assert [p.compared() for p in m.probes] == [("B", "error", None)]
    m.run("get_computed_blocks", request_id="B")  # miss: hit 0
    assert_misuse(m, "allocate_slots", request_id="B", num_new_tokens=0, use_lookup=True)


def test_zero_new_tokens_with_a_hit_is_allowed():
    m = running()
    m.add("B", list(range(9)))
    assert m.run("get_computed_blocks", request_id="B")["num_computed_tokens"] == 8
    assert m.run("allocate_slots", request_id="B", num_new_tokens=0, use_lookup=True) == {
        "block_ids": [[]]
    }
    assert m.snap.requests["B"].tables == ((1, 2),)
    assert m.snap.requests["B"].num_computed_tokens == 8


@pytest.mark.parametrize(
    "field", ["num_new_tokens", "num_lookahead_tokens", "reserved_blocks", "num_encoder_tokens"]
)
def test_misuse_2_negative_counts(field):
    m = running()
    m.add("B", [50, 51, 52])
    fields = {"num_new_tokens": 2, field: -1}
    assert_misuse(m, "allocate_slots", request_id="B", **fields)


def test_misuse_3_running_request_with_hits():
    m = running()
    m.run("append_tokens", request_id="A", tokens=[7] * 12)
    assert m.run("get_computed_blocks", request_id="A")["block_ids"] == [[1, 2]]
    assert_misuse(m, "allocate_slots", request_id="A", num_new_tokens=1, use_lookup=True)


def test_running_request_with_an_empty_lookup_allocates():
    m = running()
    m.run("append_tokens", request_id="A", tokens=[7])
    m.run("get_computed_blocks", request_id="A")  # 11 tokens, [0..9, 7]: hit 8, non-empty
    m.run("append_tokens", request_id="A", tokens=[7])
    m.add("S", [1], cache_salt="x")
    assert m.run("get_computed_blocks", request_id="S")["block_ids"] == [[]]
    assert m.run("allocate_slots", request_id="A", num_new_tokens=2) == {"block_ids": [[]]}


def test_free_untracked_is_a_no_op_that_finishes_the_request():
    """Not misuse (docs/findings/004): vLLM's scheduler frees requests aborted while waiting."""
    m = running()
    m.add("B", [1, 2])
    before = m.snap
    assert m.run("free", request_id="B") is None
    after = m.snap
    assert after.requests["B"].status == "FINISHED_STOPPED"
    assert (after.ref_cnt, after.free_queue, after.cache) == (before.ref_cnt, before.free_queue,
                                                              before.cache)


def test_misuse_5_cache_blocks():
    m = running()
    m.add("B", [1, 2])
    assert_misuse(m, "cache_blocks", request_id="B")
    assert_misuse(m, "cache_blocks", request_id="A", num_computed_tokens=-1)
    assert_misuse(m, "cache_blocks", request_id="A", num_computed_tokens=13)  # 3 blocks · 4
    assert m.run("cache_blocks", request_id="A", num_computed_tokens=12) is None


def test_misuse_6_evict_out_of_range():
    m = running()
    assert_misuse(m, "evict_blocks", block_ids=[-1])
    assert_misuse(m, "evict_blocks", block_ids=[1, 16])
    assert m.run("evict_blocks", block_ids=[0, 15]) is None


# ----- validity (InvalidTrace) -----


@pytest.mark.parametrize(
    "fields",
    [
        {"request_id": "A", "prompt": [1]},  # added before
        {"request_id": "Z", "prompt": []},
        {"request_id": "Z", "prompt": [1] * 128},  # M - 1 = 127 at most
        {"request_id": "Z", "prompt": [1, -1]},
        {"request_id": "Z", "prompt": [1], "max_tokens": 0},
        {"request_id": "Z", "prompt": [1], "num_encoder_tokens": -1},
    ],
)
def test_invalid_add_request(fields):
    m = running()
    with pytest.raises(InvalidTrace):
        m.run("add_request", **fields)


def test_longest_prompt_is_valid():
    m = running()
    m.add("Z", [1] * 127)


def test_invalid_ops_on_unknown_or_finished_requests():
    m = running()
    for op, extra in [
        ("get_computed_blocks", {}),
        ("allocate_slots", {"num_new_tokens": 1}),
        ("free", {}),
        ("append_tokens", {"tokens": [1]}),
        ("cache_blocks", {}),
    ]:
        with pytest.raises(InvalidTrace):
            m.run(op, request_id="nobody", **extra)
    m.run("free", request_id="A")
    with pytest.raises(InvalidTrace):
        m.run("free", request_id="A")
    with pytest.raises(InvalidTrace):
        m.run("get_computed_blocks", request_id="A")


def test_invalid_allocation_sizes_and_lookups():
    m = running()
    m.add("B", list(range(10)))
    with pytest.raises(InvalidTrace):
        m.run("allocate_slots", request_id="B", num_new_tokens=1, use_lookup=True)
    with pytest.raises(InvalidTrace):
        m.run("allocate_slots", request_id="B", num_new_tokens=11)
    m.run("get_computed_blocks", request_id="B")  # hit 8
    with pytest.raises(InvalidTrace):
        m.run("allocate_slots", request_id="B", num_new_tokens=3, use_lookup=True)


def test_lookup_dies_at_the_next_other_op():
    m = running()
    m.add("B", list(range(10)))
    m.run("get_computed_blocks", request_id="B")
    m.add("C", [1])  # add_request keeps it alive
    m.run("get_computed_blocks", request_id="C")  # so does another lookup
    assert m.run("allocate_slots", request_id="B", num_new_tokens=2, use_lookup=True) == {
        "block_ids": [[4]]
    }
    m.add("D", list(range(10)))
    m.run("get_computed_blocks", request_id="D")
    m.run("take_new_block_ids")
    with pytest.raises(InvalidTrace):
        m.run("allocate_slots", request_id="D", num_new_tokens=2, use_lookup=True)


def test_invalid_append():
    m = running()
    with pytest.raises(InvalidTrace):
        m.run("append_tokens", request_id="A", tokens=[])
    with pytest.raises(InvalidTrace):
        m.run("append_tokens", request_id="A", tokens=[-3])
    with pytest.raises(InvalidTrace):
        m.run("append_tokens", request_id="A", tokens=[1] * 119)  # 10 + 119 > 128
    m.run("append_tokens", request_id="A", tokens=[1] * 118)


def test_ops_of_the_other_level_are_invalid():
    m = running()
    with pytest.raises(InvalidTrace):
        m.model.apply({"op": "step", "sample": 0})


# ----- pool and manager behaviour -----


def test_preempt_resets_request_and_watermark_applies_again():
    m = Runner(config(10, full(4), watermark=0.5), "api")  # 5 watermark blocks
    m.add("A", list(range(8)))
    assert m.run("allocate_slots", request_id="A", num_new_tokens=8, has_scheduled_reqs=False)
    m.run("free", request_id="A", preempt=True)
    view = m.snap.requests["A"]
    assert (view.status, view.num_computed_tokens, view.tables) == ("PREEMPTED", 0, (None,))
    assert m.snap.free_queue == (3, 4, 5, 6, 7, 8, 9, 2, 1)
    m.add("B", list(range(100, 120)))  # 5 blocks: 5 + 5 > 9 free
    assert m.admit("B", 20) is None
    assert m.run("allocate_slots", request_id="B", num_new_tokens=20, has_scheduled_reqs=False)
    m.run("free", request_id="B")
    assert m.snap.free_queue == (8, 9, 2, 1, 7, 6, 5, 4, 3)  # B's full blocks: cached, tail
    assert m.admit("A", 4) == {"block_ids": [[8]]}  # hit 4: 1 new + 1 evictable = 2 ≤ 9 - 5
    assert m.probes[0].prediction == 2


def test_eviction_on_pop_and_duplicate_entries():
    m = Runner(config(6, full(2)), "api")
    m.add("A", [1, 2, 3])
    m.run("allocate_slots", request_id="A", num_new_tokens=3)  # blocks 1, 2; caches 1
    m.add("B", [1, 2, 3])
    m.run("allocate_slots", request_id="B", num_new_tokens=3)  # no lookup: duplicate of 1
    s = m.snap
    assert s.cache == {(0, None, (1, 2)): (1, 3)}
    m.run("free", request_id="A")
    m.add("C", [1, 2, 9])
    assert m.run("get_computed_blocks", request_id="C")["block_ids"] == [[1]]  # earliest
    m.add("D", [7, 7, 7, 7, 7, 7])
    # Queue: 2 (uncached, head), 5 (never used), 1 (cached, tail): D takes 2, 5, then 1.
    assert m.snap.free_queue == (2, 5, 1)
    m.run("allocate_slots", request_id="D", num_new_tokens=6)
    s = m.snap
    assert s.requests["D"].tables == ((2, 5, 1),)
    assert s.cache[(0, None, (1, 2))] == (3,) and s.block_keys[1] == (0, None, (7,) * 6)


def test_evict_blocks_keeps_queue_and_refs():
    m = running()
    m.run("free", request_id="A")
    before = m.snap
    m.run("evict_blocks", block_ids=[1])
    s = m.snap
    assert s.free_queue == before.free_queue and s.ref_cnt == before.ref_cnt
    assert s.block_keys[1] is None and (0, None, (0, 1, 2, 3)) not in s.cache
    assert s.block_keys[2] is not None


def test_lookahead_reserved_and_gate():
    m = Runner(config(6, full(4)), "api")  # 5 free
    m.add("A", list(range(8)))
    before = m.snap
    assert m.run("allocate_slots", request_id="A", num_new_tokens=8, reserved_blocks=4) is None
    assert [p.compared() for p in m.probes] == [("A", "capacity", 2)]
    assert m.snap == before
    assert m.run(
        "allocate_slots", request_id="A", num_new_tokens=4, num_lookahead_tokens=8
    ) == {"block_ids": [[1, 2, 3]]}
    m.add("B", list(range(20, 40)))  # 5 blocks needed in full, 2 free
    assert (
        m.run("allocate_slots", request_id="B", num_new_tokens=4, full_sequence_must_fit=True)
        is None
    )
    assert [p.compared() for p in m.probes] == [("B", "gate", None)]
    assert m.run("allocate_slots", request_id="B", num_new_tokens=4) == {"block_ids": [[4]]}


def test_gate_uses_the_window_admission_cap():
    # cap = cdiv(min(w - 1 + x + F, M), bs) + 1 = cdiv(15, 4) + 1 = 5 blocks.
    cfg = config(6, swa(4, 8), max_in_flight_tokens=8)
    m = Runner(cfg, "api")
    m.add("A", list(range(100)))
    assert m.run(
        "allocate_slots", request_id="A", num_new_tokens=8, full_sequence_must_fit=True
    ) == {"block_ids": [[1, 2]]}
    m2 = Runner(config(5, swa(4, 8), max_in_flight_tokens=8), "api")  # 4 free < 5
    m2.add("A", list(range(100)))
    assert (
        m2.run("allocate_slots", request_id="A", num_new_tokens=8, full_sequence_must_fit=True)
        is None
    )
    assert m2.probes[0].outcome == "gate"


def test_sliding_window_frees_out_of_window_blocks_even_on_none():
    m = Runner(config(8, swa(4, 4)), "api")  # 7 free
    m.add("A", list(range(24)))
    m.run("allocate_slots", request_id="A", num_new_tokens=16)  # blocks 1-4, all cached
    m.add("B", list(range(50, 58)))
    m.run("allocate_slots", request_id="B", num_new_tokens=8)  # blocks 5, 6 -> 1 free
    # skipped(16) = 13 -> 3 blocks fall out: 3, 2, 1 freed (cached: tail, highest first).
    before_free = m.snap.free_queue
    assert before_free == (7,)
    assert m.run("allocate_slots", request_id="A", num_new_tokens=8, reserved_blocks=3) is None
    s = m.snap
    assert s.requests["A"].tables == ((0, 0, 0, 4),)
    assert s.free_queue == (7, 3, 2, 1)
    assert m.probes[0].compared() == ("A", "capacity", 2)
    assert m.run("allocate_slots", request_id="A", num_new_tokens=8) == {"block_ids": [[7, 3]]}
    assert m.snap.requests["A"].tables == ((0, 0, 0, 4, 7, 3),)


def test_uncached_frees_go_to_the_head_as_one_run():
    m = Runner(config(10, full(4), enable_caching=False), "api")
    m.add("A", list(range(10)))
    m.run("allocate_slots", request_id="A", num_new_tokens=10)
    m.run("free", request_id="A")
    assert m.snap.free_queue == (3, 2, 1, 4, 5, 6, 7, 8, 9)
    assert m.snap.cache == {}


def test_cross_attention_allocated_once_from_encoder_tokens():
    m = Runner(config(10, full(4), GroupConfig("cross", 4), enable_caching=False), "api")
    m.add("A", [1, 2, 3], num_encoder_tokens=6)
    assert m.run(
        "allocate_slots", request_id="A", num_new_tokens=3, num_encoder_tokens=6
    ) == {"block_ids": [[1], [2, 3]]}
    m.run("append_tokens", request_id="A", tokens=[4, 5])
    assert m.run("allocate_slots", request_id="A", num_new_tokens=2) == {"block_ids": [[4], []]}
    view = m.snap.requests["A"]
    assert view.tables == ((1, 4), (2, 3)) and view.num_cached_blocks == (None, None)


def test_prompt_tail_partial_entry_without_partial_hits():
    """§4.6 step 5 registers the prompt tail even with partial hits off (bs 32 != hbs 16);
    after promotion the interior boundary stays reachable as an extra key."""
    m = Runner(config(40, full(32), swa(16, 16)), "api")
    prompt = list(range(90))
    m.add("P", prompt)
    m.run("allocate_slots", request_id="P", num_new_tokens=90)  # cacheable 64: tail 80 > 64
    assert m.snap.extra_keys == {} and m.snap.block_key_tokens[3] is None
    m.run("append_tokens", request_id="P", tokens=[0] * 6)
    m.run("allocate_slots", request_id="P", num_new_tokens=6)  # cacheable 96
    s = m.snap
    assert s.block_key_tokens[3] == 96
    assert s.extra_keys == {3: frozenset({(0, None, tuple(prompt[:80]))})}
    assert s.cache[(0, None, tuple(prompt[:80]))] == (3,)


def test_eagle_drop_unitary():
    m = Runner(config(16, full(4), use_eagle=True), "api")
    m.add("A", list(range(13)))
    m.run("allocate_slots", request_id="A", num_new_tokens=13)  # caches 3 blocks
    m.add("B", list(range(13)))
    # 3 blocks match within 12 tokens; the drop gives one back.
    assert m.run("get_computed_blocks", request_id="B") == {
        "block_ids": [[1, 2]],
        "num_computed_tokens": 8,
    }


def test_skip_reading_prefix_cache_still_populates():
    m = running()
    m.add("B", list(range(10)), skip_reading_prefix_cache=True)
    assert m.run("get_computed_blocks", request_id="B") == {
        "block_ids": [[]],
        "num_computed_tokens": 0,
    }
    m.run("allocate_slots", request_id="B", num_new_tokens=10)
    assert m.snap.cache[(0, None, tuple(range(4)))] == (1, 4)


def test_hybrid_eagle_group_caches_one_block_past_the_aligned_boundary():
    """cacheable(n, g) for an EAGLE group: min(n, round_sbs(n) + bs_g) (docs/spec.md §5.5)."""
    prompt = list(range(13))
    plain = Runner(config(16, full(8), swa(4, 8)), "api")
    eagle = Runner(config(16, full(8), swa(4, 8), use_eagle=True), "api")
    for m in (plain, eagle):
        m.add("P", prompt)
        assert m.run("allocate_slots", request_id="P", num_new_tokens=13) == {
            "block_ids": [[1, 2], [3, 4, 5, 6]]
        }
    # Rounded to sbs = 8: FA block 1 and SWA blocks 3, 4; EAGLE adds SWA block 5 (12 tokens),
    # and the FA prompt tail (limit 13 with EAGLE, boundary 12 <= 13) becomes reachable.
    assert plain.snap.block_key_tokens[1:7] == (8, None, 4, 8, None, None)
    assert eagle.snap.block_key_tokens[1:7] == (8, 12, 4, 8, 12, None)
    assert eagle.snap.requests["P"].num_cached_blocks == (1, 3)


def test_hybrid_eagle_verifications_are_void_once_a_plain_search_shortens():
    """docs/spec.md §5.5 / §10.14 with three spec groups, all dropping (A = 8, hbs = 4).

    Round 1 (all drop): FA 32 -> 24; SW1 (need 3) -> 24; SW2 (need 4) -> 16.  Round 2: SW1 is
    verified, searches without a drop and finds only [4, 8] -> 8 (16 was evicted), which
    clears the verified set; SW2 must drop again at 8 -> 0.  Keeping SW2's stale verification
    would answer 8."""
    m = Runner(config(40, full(8), swa(4, 8), swa(4, 13), use_eagle=True), "api")
    tokens = list(range(33))
    m.add("P", tokens)
    assert m.run("allocate_slots", request_id="P", num_new_tokens=33) == {
        "block_ids": [[1, 2, 3, 4, 5], list(range(6, 15)), list(range(15, 24))]
    }
    assert m.snap.requests["P"].num_cached_blocks == (4, 8, 8)
    m.run("evict_blocks", block_ids=[9, 21])  # SW1 prefix 16, SW2 prefix 28
    m.add("Q", tokens)
    assert m.run("get_computed_blocks", request_id="Q") == {
        "block_ids": [[], [], []],
        "num_computed_tokens": 0,
    }
    # Control: without the evictions every group accepts 24.
    m2 = Runner(config(40, full(8), swa(4, 8), swa(4, 13), use_eagle=True), "api")
    m2.add("P", tokens)
    m2.run("allocate_slots", request_id="P", num_new_tokens=33)
    m2.add("Q", tokens)
    assert m2.run("get_computed_blocks", request_id="Q") == {
        "block_ids": [[1, 2, 3], [0, 0, 0, 0, 10, 11], [0, 0, 0, 18, 19, 20]],
        "num_computed_tokens": 24,
    }


def test_hybrid_eagle_drop_applies_once_per_candidate():
    """docs/bugs.md #15: the drop must not be re-applied by already-verified groups.

    Round 1 (all drop): FA 32 -> 24; SW1 (need 2) -> 24; SW2 (need 3; prefix 24 evicted) ->
    16.  Round 2 at 16: SW1 and SW2 are verified and accept 16 without a drop.  Re-dropping
    would make SW1 match one block past 16 (prefix 20, evicted) and end at 8."""
    m = Runner(config(40, full(8), swa(4, 5), swa(4, 9), use_eagle=True), "api")
    tokens = list(range(33))
    m.add("P", tokens)
    m.run("allocate_slots", request_id="P", num_new_tokens=33)
    assert m.snap.requests["P"].tables == (
        (1, 2, 3, 4, 5), tuple(range(6, 15)), tuple(range(15, 24))
    )
    m.run("evict_blocks", block_ids=[10, 20])  # SW1 prefix 20, SW2 prefix 24
    m.add("Q", tokens)
    assert m.run("get_computed_blocks", request_id="Q") == {
        "block_ids": [[1, 2], [0, 0, 0, 9], [0, 0, 17, 18]],
        "num_computed_tokens": 16,
    }


def test_sparse_window_mask_with_eagle_shift():
    """need = cdiv(4, 4) + 1 = 2 < per = 16 / 4 = 4, shift 1: block i is cached iff i >= 1 and
    (i - 1) % 4 >= 2, i.e. i in {3, 4, 7, 8, ...} (docs/spec.md §4.9.2)."""
    m = Runner(config(40, full(16), swa(4, 5), use_eagle=True), "api")
    m.add("P", list(range(33)))
    m.run("allocate_slots", request_id="P", num_new_tokens=33)
    s = m.snap
    swa_table = s.requests["P"].tables[1]
    # cacheable = min(33, 32 + 4) = 33 -> 8 window blocks recorded, keys only at 3, 4, 7.
    assert s.requests["P"].num_cached_blocks == (2, 8)
    keyed = [i for i, b in enumerate(swa_table) if s.block_keys[b] is not None]
    assert keyed == [3, 4, 7]


def test_fine_grained_eagle_margin_is_one_hash_unit():
    """Partial hits + EAGLE, FA groups bs 8 and 16 (hbs = A = 8).  FA8 ends at 32 (prefix 40
    evicted) and drops to 24; FA16 then searches max_len = 24 + hbs = 32 and drops to 24.
    A margin of bs = 16 would reach P's prompt-tail partial entry at 40 and answer 32."""
    m = Runner(config(40, full(8), full(16), partial_hits=True, use_eagle=True), "api")
    tokens = list(range(40))
    m.add("P", tokens)
    m.run("allocate_slots", request_id="P", num_new_tokens=40)
    s = m.snap
    assert s.requests["P"].tables == ((1, 2, 3, 4, 5), (6, 7, 8))
    # Prompt tail with EAGLE: limit = num_prompt_tokens = 40 -> partial entry on block 8.
    assert s.block_key_tokens[6:9] == (16, 32, 40)
    m.run("evict_blocks", block_ids=[5])
    m.add("Q", tokens + [0])
    assert m.run("get_computed_blocks", request_id="Q") == {
        "block_ids": [[1, 2, 3], [6, 7]],
        "num_computed_tokens": 24,
    }
