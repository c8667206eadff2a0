"""Layer 3 (docs/spec.md §4): skipped tokens, the predictor, adoption, window frees, the caching
mask, and each kind's find_longest_cache_hit.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfuzz.kvcache import (
    BlockPool,
    ChunkedLocalAttentionManager,
    ChunkedLocalAttentionSpec,
    CircularBufferManager,
    CircularBufferSpec,
    CrossAttentionManager,
    CrossAttentionSpec,
    FullAttentionManager,
    FullAttentionSpec,
    MambaManager,
    MambaSpec,
    SlidingWindowManager,
    SlidingWindowSpec,
)
from kvfuzz.kvcache.single_type_kv_cache_manager import get_manager_for_kv_cache_spec
from kvcache_testkit import dump_pool, free_ids, ids, make_request

SWA = SlidingWindowSpec(block_size=4, sliding_window=8)
CHUNK = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8)
FULL = FullAttentionSpec(block_size=4)


def _manager(cls, spec, pool=None, **kwargs):
    pool = pool or BlockPool(16, True, 4)
    return cls(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
               scheduler_block_size=spec.block_size, **kwargs)


def _cache_positions(pool, tokens, positions, block_size=4, group_id=0, hbs=4):
    """Register fresh blocks at the given table positions of `tokens`' chain."""
    request = make_request("writer", tokens, hbs)
    n = max(positions) + 1
    table = [pool.null_block] * n
    for i in positions:
        table[i] = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks(request, table, 0, n, block_size, group_id)
    return request, table


# ----- skipped tokens and admission caps -----


def test_skipped_tokens_per_kind():
    pool = BlockPool(4, True, 4)
    swa = _manager(SlidingWindowManager, SlidingWindowSpec(block_size=4, sliding_window=4), pool)
    assert [swa.get_num_skipped_tokens(n) for n in (0, 3, 4, 7)] == [0, 0, 1, 4]
    extra = _manager(SlidingWindowManager, SlidingWindowSpec(
        block_size=4, sliding_window=4, extra_retained_tokens=2), pool)
    assert extra.get_num_skipped_tokens(7) == 2
    chunk = _manager(ChunkedLocalAttentionManager, CHUNK, pool)
    assert [chunk.get_num_skipped_tokens(n) for n in (13, 8, 7)] == [8, 8, 0]
    assert _manager(FullAttentionManager, FULL, pool).get_num_skipped_tokens(100) == 0
    assert _manager(CrossAttentionManager, CrossAttentionSpec(block_size=4),
                    pool).get_num_skipped_tokens(100) == 0


def test_admission_caps_follow_the_pool_sizing_formulas():
    spec = SlidingWindowSpec(block_size=4, sliding_window=8, extra_retained_tokens=1)
    assert spec.max_admission_blocks_per_request(10, 1000) == -(-(8 - 1 + 1 + 10) // 4) + 1
    assert spec.max_admission_blocks_per_request(10, 12) == 3 + 1
    assert CHUNK.max_admission_blocks_per_request(10, 1000) == 5
    assert CHUNK.max_admission_blocks_per_request(10, 9) == 3
    pool = BlockPool(8, True, 4)
    swa = get_manager_for_kv_cache_spec(SWA, 4, 1000, block_pool=pool, enable_caching=True,
                                        kv_cache_group_id=0, scheduler_block_size=4)
    assert swa.max_admission_blocks_per_request == 4
    full = get_manager_for_kv_cache_spec(FULL, 4, 1000, block_pool=pool, enable_caching=True,
                                         kv_cache_group_id=0, scheduler_block_size=4)
    assert full.max_admission_blocks_per_request is None
    # The cap is consulted only when asked for (the full-sequence gate).
    assert swa.get_num_blocks_to_allocate("r", 100, [], 0, 0, 100) == 25
    assert swa.get_num_blocks_to_allocate("r", 100, [], 0, 0, 100, apply_admission_cap=True) == 4
    assert full.get_num_blocks_to_allocate("r", 100, [], 0, 0, 100, apply_admission_cap=True) == 25


# ----- predictor and adoption -----


def test_predictor_counts_new_skipped_and_evictable_blocks():
    pool = BlockPool(16, True, 4)
    request, table = _cache_positions(pool, list(range(16)), [1, 2])
    pool.free_blocks(table[1:])
    swa = _manager(SlidingWindowManager, SWA, pool)
    hits = [pool.null_block, table[1], table[2]]
    before = dump_pool(pool)
    assert swa.get_num_blocks_to_allocate("q", 16, hits, 12, 12, 16) == 1 + 2
    assert dump_pool(pool) == before
    assert swa.req_to_blocks == {} and swa.num_cached_block == {}
    pool.touch([table[1]])
    assert swa.get_num_blocks_to_allocate("q", 16, hits, 12, 12, 16) == 1 + 1


def test_skipped_hits_are_neither_adopted_nor_counted():
    pool = BlockPool(16, True, 4)
    _, table = _cache_positions(pool, list(range(24)), [0, 1, 2, 3, 4])
    pool.free_blocks(reversed(table))
    swa = _manager(SlidingWindowManager, SWA, pool)
    # skipped(20) = 13 -> three whole blocks drop out: only two hits are touched.
    assert swa.get_num_blocks_to_allocate("q", 24, table, 20, 20, 24) == 1 + 2
    swa.add_local_computed_blocks("q", table, 20)
    assert ids(swa.req_to_blocks["q"]) == [0, 0, 0, table[3].block_id, table[4].block_id]
    assert [b.ref_cnt for b in table] == [0, 0, 0, 1, 1]
    assert swa.num_cached_block["q"] == 5


def test_fast_path_for_tracked_requests_and_rejected_drafts():
    full = _manager(FullAttentionManager, FULL)
    full.add_local_computed_blocks("r", [], 0)
    full.allocate_new_blocks("r", 12, 12)
    assert full.get_num_blocks_to_allocate("r", 13, [], 12, 12, 13) == 1
    assert full.get_num_blocks_to_allocate("r", 5, [], 5, 5, 5) == 0
    assert full.allocate_new_blocks("r", 5, 5) == []


def test_partial_hit_reserves_and_takes_a_cow_block():
    pool = BlockPool(16, True, 2)
    full = FullAttentionManager(FULL, block_pool=pool, enable_caching=True,
                                kv_cache_group_id=0, scheduler_block_size=4)
    writer = make_request("w", list(range(7)), 2)
    src = pool.get_new_blocks(2)
    pool.cache_full_blocks(writer, src, 0, 1, 4, 0)
    pool.cache_partial_block(writer, src[1], 6, 0, 4)
    hits = src
    assert full.get_num_blocks_to_allocate("q", 8, hits, 6, 6, 8) == 0 + 1
    full.add_local_computed_blocks("q", hits, 6)
    assert full._partial_hit_reqs == {"q": (1, src[1])} and full.num_cached_block["q"] == 1
    new = full.allocate_new_blocks("q", 8, 8)
    cow = new[0]
    assert ids(new) == [3] and ids(full.req_to_blocks["q"]) == [1, 3]
    assert full._pending_cow_copies == [(src[1], cow)] and full.new_block_ids == [3]
    assert (src[1].ref_cnt, cow.ref_cnt) == (2, 2)
    assert full.take_pending_cow_copies() == [(src[1], cow)] and full._pending_cow_copies == []
    assert full.take_new_block_ids() == [3] and full.new_block_ids == []


def test_new_block_ids_recorded_only_when_asked():
    quiet = _manager(FullAttentionManager, FULL)
    quiet.allocate_new_blocks("r", 8, 8)
    assert quiet.new_block_ids == [] and not quiet.records_new_block_ids
    loud = _manager(FullAttentionManager, FULL, needs_kv_cache_zeroing=True)
    loud.allocate_new_blocks("r", 8, 8)
    assert loud.new_block_ids == [1, 2] and loud.records_new_block_ids


def test_zeroing_records_attention_blocks_only_and_context_parallelism_is_refused():
    """vLLM's rule: a ring's and a state group's blocks are never zeroed."""
    ring = CircularBufferSpec(block_size=4)
    state = MambaSpec(block_size=8)
    for cls, spec in ((CircularBufferManager, ring), (MambaManager, state)):
        manager = cls(spec, block_pool=BlockPool(16, False, 4), enable_caching=False,
                      kv_cache_group_id=0, scheduler_block_size=8, needs_kv_cache_zeroing=True)
        manager.allocate_new_blocks("r", 8, 8)
        assert manager.new_block_ids == [] and not manager.records_new_block_ids, cls
    for sizes in (dict(dcp_world_size=2), dict(pcp_world_size=2)):
        with pytest.raises(ValueError, match="context parallelism"):
            _manager(FullAttentionManager, FULL, **sizes)


# ----- frees -----


def test_free_releases_tail_first_without_leading_nulls():
    pool = BlockPool(8, True, 4)
    swa = _manager(SlidingWindowManager, SWA, pool)
    swa.allocate_new_blocks("r", 16, 16)
    swa.req_to_blocks["r"][0] = pool.null_block
    pool.free_blocks([pool.blocks[1]])
    assert ids(swa.pop_blocks_for_free("r")) == [2, 3, 4]
    swa.allocate_new_blocks("s", 8, 8)
    assert ids(swa.req_to_blocks["s"]) == [1, 5]
    swa.free("s")
    assert swa.req_to_blocks == {} and free_ids(pool)[:2] == [5, 1]
    assert swa.pop_blocks_for_free("never") == []


def test_remove_skipped_blocks_nulls_and_frees_newest_first():
    pool = BlockPool(10, True, 4)
    swa = _manager(SlidingWindowManager, SWA, pool)
    swa.remove_skipped_blocks("absent", 100)
    assert swa.req_to_blocks == {}
    swa.allocate_new_blocks("r", 24, 24)
    swa.remove_skipped_blocks("r", 16)  # skipped(16) = 9 -> blocks 0 and 1
    assert ids(swa.req_to_blocks["r"]) == [0, 0, 3, 4, 5, 6]
    assert free_ids(pool)[:2] == [2, 1]
    swa.remove_skipped_blocks("r", 16)
    assert free_ids(pool)[:2] == [2, 1]
    swa.remove_skipped_blocks("r", 100)
    assert ids(swa.req_to_blocks["r"]) == [0] * 6
    assert free_ids(pool)[:4] == [6, 5, 4, 3]
    full = _manager(FullAttentionManager, FULL, pool)
    full.allocate_new_blocks("f", 8, 8)
    full.remove_skipped_blocks("f", 8)
    assert ids(full.req_to_blocks["f"]) == [6, 5]


# ----- caching -----


def test_cache_blocks_stops_at_hashed_tokens():
    pool = BlockPool(10, True, 4)
    full = _manager(FullAttentionManager, FULL, pool)
    request = make_request("r", list(range(10)), 4)
    full.allocate_new_blocks("r", 12, 12)
    full.cache_blocks(request, 12)
    assert full.num_cached_block["r"] == 2
    assert [b.block_hash_num_tokens for b in full.req_to_blocks["r"]] == [4, 8, None]


def test_sliding_window_sparse_mask_in_hybrid_alignment():
    pool = BlockPool(8, True, 4)
    swa = _manager(SlidingWindowManager, SlidingWindowSpec(block_size=4, sliding_window=4), pool)
    request = make_request("r", list(range(28)), 4)
    assert swa._reachable_mask(0, 6, request) is None
    swa.cache_hit_alignment_tokens = 12  # need 1, per 3
    assert swa._reachable_mask(0, 6, request) == [False, False, True, False, False, True]
    assert swa._reachable_mask(4, 6, request) == [False, True]
    swa.use_eagle = True  # need 2, shifted right by one
    assert swa._reachable_mask(0, 7, request) == [False, False, True, True, False, True, True]
    swa.cache_hit_alignment_tokens = 6
    assert swa._reachable_mask(0, 4, request) is None


def test_cross_attention_never_caches_or_looks_up():
    pool = BlockPool(8, False, 4)
    cross = CrossAttentionManager(CrossAttentionSpec(block_size=4), block_pool=pool,
                                  enable_caching=False, kv_cache_group_id=0,
                                  scheduler_block_size=4)
    with pytest.raises(ValueError):
        cross.cache_blocks(make_request("r", [1, 2, 3, 4], 4), 4)
    with pytest.raises(NotImplementedError):
        CrossAttentionManager.find_longest_cache_hit([], 4, [0], pool, cross.kv_cache_spec,
                                                     False, 4)


# ----- find_longest_cache_hit per kind (§4.9) -----


def test_full_attention_stops_at_first_miss_and_caps_at_max_length():
    pool = BlockPool(16, True, 4)
    request, table = _cache_positions(pool, list(range(16)), [0, 1, 3])
    hashes = request.block_hashes
    blocks, hit = FullAttentionManager.find_longest_cache_hit(hashes, 16, [0], pool, FULL,
                                                              False, 4)
    assert (ids(blocks[0]), hit) == ([1, 2], 8)
    blocks, hit = FullAttentionManager.find_longest_cache_hit(hashes, 7, [0], pool, FULL,
                                                              False, 4)
    assert (ids(blocks[0]), hit) == ([1], 4)
    blocks, hit = FullAttentionManager.find_longest_cache_hit(hashes, 16, [0], pool, FULL,
                                                              True, 4)
    assert (ids(blocks[0]), hit) == ([1], 4)
    blocks, hit = FullAttentionManager.find_longest_cache_hit(hashes, 16, [0], pool, FULL,
                                                              False, 8)
    assert (ids(blocks[0]), hit) == ([1, 2], 8)


def test_full_attention_joint_lookup_needs_every_group():
    pool = BlockPool(16, True, 4)
    request, table = _cache_positions(pool, list(range(8)), [0, 1], group_id=0)
    _cache_positions(pool, list(range(8)), [0], group_id=1)
    blocks, hit = FullAttentionManager.find_longest_cache_hit(
        request.block_hashes, 8, [0, 1], pool, FULL, False, 4)
    assert hit == 4 and [ids(b) for b in blocks] == [[1], [3]]


def test_full_attention_fine_grained_phase_two():
    pool = BlockPool(16, True, 2)
    spec = FullAttentionSpec(block_size=8)
    writer = make_request("w", list(range(15)), 2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(writer, blocks, 0, 1, 8, 0)
    pool.cache_partial_block(writer, blocks[1], 12, 0, 8)
    reader = make_request("r", list(range(15)), 2)
    hit_blocks, hit = FullAttentionManager.find_longest_cache_hit(
        reader.block_hashes, 14, [0], pool, spec, False, 2)
    assert (ids(hit_blocks[0]), hit) == ([1, 2], 12)
    hit_blocks, hit = FullAttentionManager.find_longest_cache_hit(
        reader.block_hashes, 11, [0], pool, spec, False, 2)
    assert (ids(hit_blocks[0]), hit) == ([1], 8)
    hit_blocks, hit = FullAttentionManager.find_longest_cache_hit(
        reader.block_hashes, 14, [0], pool, spec, True, 2)
    assert (ids(hit_blocks[0]), hit) == ([1, 2], 10)
    hit_blocks, hit = FullAttentionManager.find_longest_cache_hit(
        reader.block_hashes, 14, [0], pool, spec, False, 8)
    assert (ids(hit_blocks[0]), hit) == ([1], 8)


def test_sliding_window_example_from_the_spec():
    pool = BlockPool(16, True, 4)
    request, table = _cache_positions(pool, list(range(16)), [1, 2])
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(
        request.block_hashes, 15, [0], pool, SWA, False, 4)
    assert (ids(blocks[0]), hit) == ([0, table[1].block_id, table[2].block_id], 12)


def test_sliding_window_prefers_the_rightmost_run_and_accepts_a_short_head_run():
    pool = BlockPool(16, True, 4)
    request, table = _cache_positions(pool, list(range(32)), [0, 3, 5, 6])
    hashes = request.block_hashes
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(hashes, 31, [0], pool, SWA,
                                                              False, 4)
    assert hit == 28 and ids(blocks[0])[5:] == ids(table[5:7]) and ids(blocks[0])[:5] == [0] * 5
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(hashes, 20, [0], pool, SWA,
                                                              False, 4)
    assert (ids(blocks[0]), hit) == ([table[0].block_id], 4)
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(hashes, 31, [0], pool, SWA,
                                                              True, 4)
    assert (ids(blocks[0]), hit) == ([], 0)


def test_sliding_window_alignment_filters_the_run_end():
    pool = BlockPool(16, True, 4)
    spec = SlidingWindowSpec(block_size=4, sliding_window=4)  # need 1
    request, table = _cache_positions(pool, list(range(32)), [1, 4])
    hashes = request.block_hashes
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(hashes, 31, [0], pool, spec,
                                                              False, 8)
    assert (ids(blocks[0]), hit) == ([0, table[1].block_id], 8)
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(hashes, 31, [0], pool, spec,
                                                              False, 4)
    assert hit == 20 and ids(blocks[0]) == [0, 0, 0, 0, table[4].block_id]


def test_sliding_window_eagle_needs_one_more_block_then_drops_it():
    pool = BlockPool(16, True, 4)
    request, table = _cache_positions(pool, list(range(24)), [1, 2, 3])
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(
        request.block_hashes, 16, [0], pool, SWA, True, 4)
    assert (ids(blocks[0]), hit) == ([0, table[1].block_id, table[2].block_id], 12)


def _scan_right_to_left(hashes, max_length, group_ids, pool, block_size, window, eagle, align):
    """vLLM 0.33.0's sliding-window search, block by block from the right (docs/spec.md §4.9.2)."""
    need = -(-(window - 1) // block_size) + (1 if eagle else 0)
    num = min(max_length // block_size, len(hashes))
    found = [[pool.null_block] * num for _ in group_ids]
    run = 0
    for i in range(num - 1, -1, -1):
        cached = pool.get_cached_block_at(hashes, block_size, i, group_ids)
        if cached is None:
            run = 0
            continue
        if run == 0 and block_size != align and (i if eagle else i + 1) * block_size % align:
            continue
        for blocks, block in zip(found, cached):
            blocks[i] = block
        run += 1
        if run >= need:
            return _eagle_trim([b[: i + run] for b in found], block_size, align, eagle)
    aligned = [b[:run] for b in found]
    return _eagle_trim(_align_trim(aligned, block_size, align), block_size, align, eagle)


def _align_trim(found, block_size, align):
    per = align // math.gcd(align, block_size)
    keep = len(found[0]) - len(found[0]) % per
    return [b[:keep] for b in found]


def _eagle_trim(found, block_size, align, eagle):
    if eagle and found[0]:
        found = _align_trim([b[:-1] for b in found], block_size, align)
    return found


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    align_factor=st.sampled_from([(1, 1), (2, 1), (3, 1), (4, 1), (1, 2), (1, 4)]),
    window=st.integers(1, 12),
    eagle=st.booleans(),
    num_groups=st.integers(1, 2),
    cached=st.lists(st.tuples(st.booleans(), st.booleans()), max_size=14),
    extra_length=st.integers(-3, 3),
)
def test_sliding_window_search_equals_the_block_by_block_scan(
    block_size, align_factor, window, eagle, num_groups, cached, extra_length
):
    """The window-skipping search returns exactly the blocks of the right-to-left scan, for
    every pattern of cached positions (per group), alignment, window, EAGLE and length.
    """
    multiple, divisor = align_factor
    if block_size % divisor:
        return
    align = block_size * multiple // divisor
    pool = BlockPool(64, True, block_size)
    group_ids = list(range(num_groups))
    request = make_request("writer", list(range(len(cached) * block_size)), block_size)
    for group_id in group_ids:
        mask = [pattern[group_id] for pattern in cached]
        if any(mask):
            table = [pool.get_new_blocks(1)[0] if on else pool.null_block for on in mask]
            pool.cache_full_blocks(request, table, 0, len(table), block_size, group_id)
    spec = SlidingWindowSpec(block_size=block_size, sliding_window=window)
    max_length = max(0, len(cached) * block_size + extra_length)
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(
        request.block_hashes, max_length, group_ids, pool, spec, eagle, align)
    expected = _scan_right_to_left(request.block_hashes, max_length, group_ids, pool,
                                   block_size, window, eagle, align)
    assert [ids(b) for b in blocks] == [ids(b) for b in expected]
    assert hit == len(expected[0]) * block_size


def test_chunked_local_examples_from_the_spec():
    pool = BlockPool(16, True, 4)
    request, table = _cache_positions(pool, list(range(17)), [2])
    hashes = request.block_hashes
    blocks, hit = ChunkedLocalAttentionManager.find_longest_cache_hit(hashes, 15, [0], pool,
                                                                      CHUNK, False, 4)
    assert (ids(blocks[0]), hit) == ([0, 0, table[2].block_id], 12)
    miss = make_request("m", list(range(50, 67)), 4)
    blocks, hit = ChunkedLocalAttentionManager.find_longest_cache_hit(
        miss.block_hashes, 15, [0], pool, CHUNK, False, 4)
    assert (ids(blocks[0]), hit) == ([0, 0], 8)
    blocks, hit = ChunkedLocalAttentionManager.find_longest_cache_hit(
        miss.block_hashes, 16, [0], pool, CHUNK, False, 4)
    assert (ids(blocks[0]), hit) == ([0, 0, 0, 0], 16)
    blocks, hit = ChunkedLocalAttentionManager.find_longest_cache_hit(
        miss.block_hashes, 0, [0], pool, CHUNK, False, 4)
    assert (ids(blocks[0]), hit) == ([], 0)
