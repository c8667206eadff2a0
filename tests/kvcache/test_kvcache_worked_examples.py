"""docs/spec.md §9 worked examples E1-E9 on the live layer classes: exact block ids and free-queue
orders, with the §8 state invariants (`kvfuzz.harness.spot_check`) checked after every step.

The same examples run as traces in tests/vllm/test_worked_examples.py, where the executor also
checks the transition invariants (I6, I8-I14, I18, I19) and compares every op with the model.
"""

from __future__ import annotations

from kvfuzz.kvcache import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    RequestStatus,
    SlidingWindowSpec,
)
from kvfuzz.kvcache.single_type_kv_cache_manager import SlidingWindowManager
from kvcache_testkit import (
    dump_manager,
    free_ids,
    ids,
    make_manager,
    make_request,
    record_predictions,
    table_ids,
)
from kvfuzz.harness.spot_check import assert_invariants

PROMPT10 = list(range(100, 110))


def _admit(manager, request):
    """Lookup + allocate_slots for a new request, as the driver's waiting loop does."""
    blocks, hit, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - hit, hit, blocks)
    assert new is not None
    request.num_computed_tokens += hit + (request.num_tokens - hit)
    request.status = RequestStatus.RUNNING
    return hit


def test_e1_sharing_and_release_order():
    m = make_manager(10, FullAttentionSpec(block_size=4))
    pool = m.block_pool
    predictions = record_predictions(m)
    assert free_ids(pool) == list(range(1, 10))
    assert_invariants(m)

    a = make_request("A", PROMPT10, 4)
    assert len(a.block_hashes) == 2
    assert _admit(m, a) == 0
    assert table_ids(m, "A") == [[1, 2, 3]]
    assert pool.blocks[1].block_hash_num_tokens == 4
    assert pool.blocks[2].block_hash_num_tokens == 8
    assert pool.blocks[3].block_hash is None
    assert pool.get_num_free_blocks() == 6
    assert_invariants(m)

    b = make_request("B", PROMPT10, 4)
    blocks, hit, _ = m.get_computed_blocks(b)
    assert (ids(blocks.blocks[0]), hit) == ([1, 2], 8)
    assert m.allocate_slots(b, 2, hit, blocks).get_block_ids() == ([4],)
    assert predictions[-1] == 1
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 4)] == [2, 2, 1]
    assert table_ids(m, "B") == [[1, 2, 4]]
    assert pool.get_num_free_blocks() == 5
    assert_invariants(m)

    m.free(a)
    assert free_ids(pool) == [3, 5, 6, 7, 8, 9]
    assert_invariants(m)
    m.free(b)
    assert free_ids(pool) == [4, 3, 5, 6, 7, 8, 9, 2, 1]
    assert_invariants(m)

    c = make_request("C", PROMPT10, 4)
    blocks, hit, _ = m.get_computed_blocks(c)
    assert (ids(blocks.blocks[0]), hit) == ([1, 2], 8)
    assert m.allocate_slots(c, 2, hit, blocks).get_block_ids() == ([4],)
    assert predictions[-1] == 3
    assert table_ids(m, "C") == [[1, 2, 4]]
    assert free_ids(pool) == [3, 5, 6, 7, 8, 9]
    assert_invariants(m)


def test_e2_evictable_hits_count_against_capacity():
    m = make_manager(10, FullAttentionSpec(block_size=4))
    pool = m.block_pool
    a = make_request("A", PROMPT10, 4)
    _admit(m, a)
    assert_invariants(m)
    m.free(a)
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert_invariants(m)
    hog = make_request("D", list(range(500, 528)), 4)
    _admit(m, hog)
    assert table_ids(m, "D") == [[3, 4, 5, 6, 7, 8, 9]]
    assert free_ids(pool) == [2, 1]
    assert_invariants(m)

    c = make_request("C", PROMPT10, 4)
    predictions = record_predictions(m)
    blocks, hit, _ = m.get_computed_blocks(c)
    assert (ids(blocks.blocks[0]), hit) == ([1, 2], 8)
    before = dump_manager(m)
    assert m.allocate_slots(c, 2, hit, blocks) is None
    assert predictions == [3]
    assert dump_manager(m) == before
    assert [pool.blocks[i].ref_cnt for i in (1, 2)] == [0, 0]
    assert_invariants(m)


def test_e3_sliding_window_hit_and_adoption():
    m = make_manager(12, SlidingWindowSpec(block_size=4, sliding_window=8))
    pool = m.block_pool
    tokens = list(range(16))
    p = make_request("P", tokens, 4)
    _admit(m, p)
    assert table_ids(m, "P") == [[1, 2, 3, 4]]
    assert_invariants(m)
    m.free(p)
    assert free_ids(pool) == [5, 6, 7, 8, 9, 10, 11, 4, 3, 2, 1]
    assert_invariants(m)

    q = make_request("Q", tokens, 4)
    blocks, hit, _ = m.get_computed_blocks(q)
    assert (ids(blocks.blocks[0]), hit) == ([0, 2, 3], 12)
    predictions = record_predictions(m)
    assert m.allocate_slots(q, 4, hit, blocks).get_block_ids() == ([5],)
    # R = 4, S = 1, L = 3 -> one new block; both adopted hits were free (E = 2).
    assert predictions == [3]
    assert table_ids(m, "Q") == [[0, 2, 3, 5]]
    assert [pool.blocks[i].ref_cnt for i in (2, 3, 5)] == [1, 1, 1]
    # Block 5 now duplicates P's block 4 under the same key.
    key = pool.blocks[4].block_hash
    assert pool.blocks[5].block_hash == key
    assert list(pool.cached_block_hash_to_block._dup_ids[key]) == [4, 5]
    assert free_ids(pool) == [6, 7, 8, 9, 10, 11, 4, 1]
    assert_invariants(m)


def test_e4_chunked_local_null_prefix_hit():
    m = make_manager(10, ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8))
    probes = []
    original = m.block_pool.get_cached_block_at
    m.block_pool.get_cached_block_at = lambda *a: probes.append(a) or original(*a)
    r = make_request("R", list(range(17)), 4)
    blocks, hit, _ = m.get_computed_blocks(r)
    assert (ids(blocks.blocks[0]), hit) == ([0, 0, 0, 0], 16)
    assert probes == []
    predictions = record_predictions(m)
    assert m.allocate_slots(r, 1, hit, blocks).get_block_ids() == ([1],)
    assert predictions == [1]
    assert table_ids(m, "R") == [[0, 0, 0, 0, 1]]
    assert_invariants(m)


def test_e5_watermark_applies_to_admission_only():
    m = make_manager(100, FullAttentionSpec(block_size=4), watermark=0.05)
    assert m.watermark_blocks == 5
    hog = make_request("H", list(range(368)), 4)
    _admit(m, hog)
    assert m.block_pool.get_num_free_blocks() == 7
    assert_invariants(m)

    w = make_request("W", list(range(1000, 1012)), 4)
    assert m.allocate_slots(w, 12, has_scheduled_reqs=True) is None
    w.status = RequestStatus.RUNNING
    assert len(m.allocate_slots(w, 12, has_scheduled_reqs=True).blocks[0]) == 3
    assert m.block_pool.get_num_free_blocks() == 4
    assert_invariants(m)


def _hybrid_e6():
    return make_manager(
        64,
        FullAttentionSpec(block_size=32),
        SlidingWindowSpec(block_size=16, sliding_window=16),
    )


def test_e6_hybrid_reconciliation(monkeypatch):
    m = _hybrid_e6()
    coordinator = m.coordinator
    assert (coordinator.scheduler_block_size, coordinator.hash_block_size) == (32, 16)
    assert coordinator._cache_hit_alignment_tokens == 32
    tokens = list(range(112))
    p = make_request("P", tokens, 16)
    _admit(m, p)
    fa_blocks, swa_blocks = table_ids(m, "P")
    assert fa_blocks == [1, 2, 3, 4] and swa_blocks == [5, 6, 7, 8, 9, 10, 11]
    # Cached up to the aligned 96 tokens; the window group only at odd positions (mask).
    assert [m.block_pool.blocks[b].block_hash_num_tokens for b in fa_blocks] == [32, 64, 96, None]
    assert [m.block_pool.blocks[b].block_hash_num_tokens for b in swa_blocks] == [
        None, 32, None, 64, None, 96, None
    ]
    assert_invariants(m)

    q = make_request("Q", tokens, 16)
    blocks, hit, boundary = m.get_computed_blocks(q)
    assert hit == 96 and boundary == 0
    assert ids(blocks.blocks[0]) == [1, 2, 3]
    assert ids(blocks.blocks[1]) == [0, 0, 0, 0, 0, 10]

    m.evict_blocks({10})
    assert_invariants(m)
    searches = []
    original = SlidingWindowManager.find_longest_cache_hit.__func__

    def counting(cls, block_hashes, max_length, *args):
        searches.append(max_length)
        return original(cls, block_hashes, max_length, *args)

    monkeypatch.setattr(SlidingWindowManager, "find_longest_cache_hit", classmethod(counting))
    hit_blocks, hit, uncached = coordinator.find_longest_cache_hit(q.block_hashes, 111)
    monkeypatch.undo()
    assert searches == [96]
    assert hit == 64 and uncached == 32
    assert ids(hit_blocks[0]) == [1, 2]
    assert ids(hit_blocks[1]) == [0, 0, 0, 8]
    blocks, hit, boundary = m.get_computed_blocks(q)
    assert (hit, boundary) == (64, 96)
    assert_invariants(m)


def test_e7_salt_isolation():
    m = make_manager(20, FullAttentionSpec(block_size=4))
    a = make_request("A", PROMPT10, 4, cache_salt="a")
    b = make_request("B", PROMPT10, 4, cache_salt="b")
    assert not set(a.block_hashes) & set(b.block_hashes)
    _admit(m, a)
    assert_invariants(m)
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 0 and blocks is m.empty_kv_cache_blocks
    a2 = make_request("A2", PROMPT10, 4, cache_salt="a")
    assert m.get_computed_blocks(a2)[1] == 8


def test_e8_reset_refused_while_held():
    m = make_manager(10, FullAttentionSpec(block_size=4))
    a = make_request("A", PROMPT10, 4)
    _admit(m, a)
    before = dump_manager(m)
    assert m.reset_prefix_cache() is False
    assert dump_manager(m) == before
    assert_invariants(m)
    m.free(a)
    assert_invariants(m)
    queue = free_ids(m.block_pool)
    assert m.reset_prefix_cache() is True
    assert len(m.block_pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    assert free_ids(m.block_pool) == queue
    assert_invariants(m)
    again = make_request("A2", PROMPT10, 4)
    assert m.get_computed_blocks(again)[1] == 0


def test_e9_partial_hit_and_copy_on_write():
    m = make_manager(
        200,
        FullAttentionSpec(block_size=32),
        SlidingWindowSpec(block_size=16, sliding_window=16),
        enable_partial_hash_hits=True,
    )
    pool = m.block_pool
    assert m.coordinator._cache_hit_alignment_tokens == 16
    tokens = list(range(90))
    p = make_request("P", tokens, 16)
    assert len(p.block_hashes) == 5
    _admit(m, p)
    assert table_ids(m, "P") == [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert [pool.blocks[i].block_hash_num_tokens for i in (1, 2, 3)] == [32, 64, 80]
    assert_invariants(m)

    q = make_request("Q", tokens, 16)
    blocks, hit, _ = m.get_computed_blocks(q)
    assert hit == 80
    assert ids(blocks.blocks[0]) == [1, 2, 3]
    assert ids(blocks.blocks[1]) == [0, 0, 0, 0, 8]
    group_predictions = []
    for single in m.coordinator.single_type_managers:
        original = single.get_num_blocks_to_allocate
        single.get_num_blocks_to_allocate = (
            lambda *a, _o=original, **k: group_predictions.append(_o(*a, **k)) or
            group_predictions[-1]
        )
    new = m.allocate_slots(q, 10, hit, blocks)
    assert group_predictions == [1, 1]
    assert new.get_block_ids() == ([10], [11])
    assert table_ids(m, "Q") == [[1, 2, 10], [0, 0, 0, 0, 8, 11]]
    fa = m.coordinator.single_type_managers[0]
    assert pool.blocks[3].ref_cnt == 2 and pool.blocks[10].ref_cnt == 2
    assert [(s.block_id, d.block_id) for s, d in fa._pending_cow_copies] == [(3, 10)]
    assert fa.num_cached_block["Q"] == 2
    assert fa.new_block_ids == [10]
    # As in vLLM, the private copy also receives the prompt-tail partial entry.
    assert pool.blocks[10].block_hash_num_tokens == 80
    assert_invariants(m)

    assert m.take_new_block_ids() == [10]
    copies, retained = m.take_kv_cache_block_copies()
    assert [tuple(c) for c in copies] == [(3, 10)]
    assert ids(retained) == [3, 10]
    assert_invariants(m, retained=retained)
    pool.free_blocks(retained)
    assert pool.blocks[3].ref_cnt == 1 and pool.blocks[10].ref_cnt == 1
    assert_invariants(m)
