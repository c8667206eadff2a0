"""BlockHashToBlockMap and BlockPool (docs/spec.md §2.4, §3)."""

from __future__ import annotations

import pytest

from kvfuzz.kvcache import BlockHashToBlockMap, BlockPool, KVCacheBlock
from kvfuzz.kvcache.block_pool import ROOT, SEGMENT_LEN, segment_head
from kvfuzz.kvcache.kv_cache_utils import make_block_hash_with_group_id, null_head_len
from kvcache_testkit import dump_pool, free_ids, ids, make_request

HEAD = b"s" * 32
KEY = make_block_hash_with_group_id(b"h" * 32, 0)
OTHER = make_block_hash_with_group_id(b"h" * 32, 1)


# ----- hash map -----


def test_vllms_map_methods_find_a_key_in_any_segment():
    import copy

    fine = [i.to_bytes(32, "big") for i in range(SEGMENT_LEN + 2)]
    blocks = [KVCacheBlock(i) for i in range(len(fine) + 1)]
    m = BlockHashToBlockMap(blocks)
    for i in range(len(fine)):
        m.insert_in(segment_head(fine, i), fine[i], blocks[i])
    late = fine[SEGMENT_LEN + 1]  # in the second segment
    assert m.get_one_block(late) is blocks[SEGMENT_LEN + 1] and m.get_one_block(b"x" * 32) is None
    assert m.contain(late, SEGMENT_LEN + 1) and not m.contain(late, 0)
    m.insert(late, blocks[-1])  # a copy joins the key where it is
    assert m.segment_of(late) is m._segments[fine[SEGMENT_LEN]] and m.contain(late, len(fine))
    assert m.pop(late, 7) is None and m.pop(late, SEGMENT_LEN + 1) is blocks[SEGMENT_LEN + 1]
    assert m._cache[late] == len(fine)
    saved = copy.copy(m._cache)
    assert type(saved) is dict and len(saved) == len(m) == len(fine)
    del m._cache[fine[0]]
    assert m.get_one_block(fine[0]) is None
    m._cache[fine[0]] = 0
    assert m.get_one_block(fine[0]) is blocks[0] and m.segment_of(fine[0]) is m.root


def test_vllms_get_cached_block_takes_the_hash_and_groups():
    pool = _pool(6)
    request, (block,) = _cached(pool, [1, 2, 3, 4], 1)
    (other,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [other], 0, 1, 4, 1)
    block_hash = request.block_hashes[0]
    assert ids(pool.get_cached_block(block_hash, [0, 1])) == ids([block, other])
    assert pool.get_cached_block(block_hash, [0, 2]) is None


def test_map_single_then_duplicates_keep_insertion_order():
    m = BlockHashToBlockMap([])
    b1, b2, b3 = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    segment = m.insert_in(HEAD, KEY, b2)
    assert segment[None] == HEAD and segment[KEY] is b2
    assert m.insert_in(HEAD, KEY, b1) is segment and m.insert_in(HEAD, KEY, b3) is segment
    assert list(segment[KEY]) == [2, 1, 3]
    assert dict(m.items()) == {KEY: {2: b2, 1: b1, 3: b3}}
    assert len(m) == 1


def test_map_pop_specific_block_id():
    m = BlockHashToBlockMap([])
    b1, b2 = KVCacheBlock(1), KVCacheBlock(2)
    segment = m.insert_in(HEAD, KEY, b1)
    m.insert_in(HEAD, KEY, b2)
    assert m.pop_in(segment, KEY, 1) is b1
    assert segment[KEY] == {2: b2}
    assert m.pop_in(segment, KEY, 1) is None
    assert m.pop_in(segment, KEY, 2) is b2
    # The emptied segment is dropped (the root stays).
    assert len(m) == 0 and m._segments == {ROOT: m.root}


def test_map_pop_leaves_a_different_single_block():
    m = BlockHashToBlockMap([])
    b1 = KVCacheBlock(1)
    segment = m.insert_in(HEAD, KEY, b1)
    assert m.pop_in(segment, KEY, 7) is None
    assert segment[KEY] is b1
    assert m.pop_in(segment, OTHER, 1) is None
    assert m.pop_in(segment, KEY, 1) is b1 and len(m) == 0


def test_same_hash_different_groups_are_different_keys():
    m = BlockHashToBlockMap([])
    m.insert_in(HEAD, KEY, KVCacheBlock(1))
    m.insert_in(HEAD, OTHER, KVCacheBlock(2))
    assert len(m) == 2
    assert OTHER[-4:] == (1).to_bytes(4, "big") and OTHER[:-4] == b"h" * 32


def test_map_files_keys_by_segment_and_runs_cross_segments():
    fine = [i.to_bytes(32, "big") for i in range(2 * SEGMENT_LEN + 2)]
    keys = [make_block_hash_with_group_id(h, 0) for h in fine]
    m = BlockHashToBlockMap([])
    blocks = [KVCacheBlock(i) for i in range(len(fine))]
    segments = [m.insert_in(segment_head(fine, i), keys[i], blocks[i]) for i in range(len(fine))]
    # Every request's first segment is the shared root.
    assert [segments[i][None] for i in (0, SEGMENT_LEN - 1, SEGMENT_LEN, len(fine) - 1)] == [
        ROOT, ROOT, fine[SEGMENT_LEN], fine[2 * SEGMENT_LEN]]
    assert len(m._segments) == 3 and len(m) == len(fine)
    assert m.get_one_block_run(fine, 0, len(fine), 1, 0) == blocks
    assert m.get_one_block_run(fine, 3, len(fine), 4, 0) == blocks[3::4]
    assert m.get_one_block_run(fine, 0, len(fine), 1, 1) == []
    # A miss ends the run, in whichever segment it falls.
    m.pop_in(segments[SEGMENT_LEN + 5], keys[SEGMENT_LEN + 5], SEGMENT_LEN + 5)
    assert m.get_one_block_run(fine, 0, len(fine), 1, 0) == blocks[:SEGMENT_LEN + 5]
    for i in (2 * SEGMENT_LEN, 2 * SEGMENT_LEN + 1):
        m.pop_in(segments[i], keys[i], i)
    assert len(m._segments) == 2 and fine[2 * SEGMENT_LEN] not in m._segments


# ----- pool -----


def _pool(n: int = 8, hbs: int = 4) -> BlockPool:
    return BlockPool(n, enable_caching=True, hash_block_size=hbs)


def _cached(pool: BlockPool, tokens: list[int], n_blocks: int, request_id: str = "r"):
    """A request holding n_blocks fresh blocks, all registered under its hashes."""
    request = make_request(request_id, tokens, pool.hash_block_size)
    blocks = pool.get_new_blocks(n_blocks)
    pool.cache_full_blocks(request, blocks, 0, n_blocks, pool.hash_block_size, 0)
    return request, blocks


def test_construction_reserves_the_null_block():
    pool = _pool(5)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    assert BlockPool(1, True, 4).get_usage() == 0.0


def test_get_new_blocks_pops_head_and_sets_ref():
    pool = _pool()
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3] and all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == pytest.approx(3 / 7)
    assert pool.get_new_blocks(0) == []


def test_get_new_blocks_evicts_cached_free_blocks_on_pop():
    pool = _pool(4)
    _, blocks = _cached(pool, list(range(12)), 3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    evicted = pool.get_new_blocks(2)
    assert ids(evicted) == [3, 2]
    assert all(b.block_hash is None and b.block_hash_num_tokens is None for b in evicted)
    assert len(pool.cached_block_hash_to_block) == 1
    assert pool.blocks[1].block_hash is not None
    # Released again, the evicted blocks count as unhashed: to the head, as one run.
    pool.free_blocks(evicted)
    assert free_ids(pool) == [3, 2, 1]
    dump_pool(pool)


def test_get_new_blocks_evicts_a_duplicate_without_touching_the_other():
    pool = _pool(4)
    request, (a,) = _cached(pool, [1, 2, 3, 4], 1, "a")
    _, (b,) = _cached(pool, [1, 2, 3, 4], 1, "b")
    key = a.block_hash
    assert list(b._segment[key]) == [1, 2]
    pool.free_blocks([a])
    pool.get_new_blocks(2)
    assert a.block_hash is None and b.block_hash == key
    assert list(b._segment[key]) == [2]
    dump_pool(pool)


def test_touch_rescues_free_blocks_and_counts_references():
    pool = _pool(4)
    _, blocks = _cached(pool, list(range(8)), 2)
    pool.free_blocks([blocks[1], blocks[0]])
    pool.touch(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 1] and free_ids(pool) == [3]
    pool.touch([pool.null_block, blocks[0]])
    assert blocks[0].ref_cnt == 2 and pool.null_block.ref_cnt == 0


def test_free_blocks_uncached_to_head_as_one_run_cached_to_tail():
    pool = _pool(8)
    _, cached = _cached(pool, list(range(8)), 2)
    plain = pool.get_new_blocks(2)
    assert free_ids(pool) == [5, 6, 7]
    pool.free_blocks([plain[1], cached[1], plain[0], cached[0]])
    assert free_ids(pool) == [4, 3, 5, 6, 7, 2, 1]


def test_free_blocks_only_queues_at_zero_and_skips_null():
    pool = _pool(4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([pool.null_block, block])
    assert block.ref_cnt == 1 and free_ids(pool) == [2, 3]
    pool.free_blocks([block])
    assert free_ids(pool) == [1, 2, 3]


def test_free_blocks_with_caching_disabled_always_goes_to_head():
    pool = BlockPool(5, enable_caching=False, hash_block_size=4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 4]


def test_cache_full_blocks_sets_keys_and_token_counts():
    pool = _pool(8, hbs=2)
    request = make_request("r", list(range(9)), 2)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 2, 4, 0)
    assert blocks[0].block_hash == make_block_hash_with_group_id(request.block_hashes[1], 0)
    assert blocks[1].block_hash == make_block_hash_with_group_id(request.block_hashes[3], 0)
    assert [b.block_hash_num_tokens for b in blocks] == [4, 8, None]
    before = dump_pool(pool)
    pool.cache_full_blocks(request, blocks, 2, 2, 4, 0)
    assert dump_pool(pool) == before


def test_cache_full_blocks_skips_null_and_masked_blocks():
    pool = _pool(8)
    request = make_request("r", list(range(12)), 4)
    blocks = [pool.null_block, *pool.get_new_blocks(2)]
    pool.cache_full_blocks(request, blocks, 0, 3, 4, 0, block_mask=[True, False, True])
    assert pool.null_block.block_hash is None
    assert blocks[1].block_hash is None
    assert blocks[2].block_hash_num_tokens == 12
    assert len(pool.cached_block_hash_to_block) == 1


@pytest.mark.parametrize(
    ("num_blocks", "num_full", "mask", "message"),
    [
        (2, 3, None, r"blocks \[0, 3\) need 2 blocks and 2 hashes of 4 tokens"),
        (3, 3, None, r"blocks \[0, 3\) need 3 blocks and 2 hashes of 4 tokens"),
        (2, 2, [True], r"block_mask has 1 entries for 2 blocks"),
    ],
)
def test_cache_full_blocks_bad_range_raises_and_changes_nothing(num_blocks, num_full, mask,
                                                                message):
    pool = _pool(8)
    request = make_request("r", list(range(10)), 4)
    blocks = pool.get_new_blocks(num_blocks)
    before = dump_pool(pool)
    with pytest.raises(ValueError, match=rf"cache_full_blocks\('r'\): {message}"):
        pool.cache_full_blocks(request, blocks, 0, num_full, 4, 0, block_mask=mask)
    assert dump_pool(pool) == before


def test_partial_entry_then_promotion_to_full_key():
    pool = _pool(8, hbs=2)
    request = make_request("r", list(range(7)), 2)
    blocks = pool.get_new_blocks(2)
    partial = pool.cache_partial_block(request, blocks[1], 6, 0, 4)
    assert partial == make_block_hash_with_group_id(request.block_hashes[2], 0)
    assert blocks[1].block_hash == partial and blocks[1].block_hash_num_tokens == 6
    assert not pool.is_block_writable(blocks[1]) and pool.is_block_writable(blocks[0])
    assert pool.cache_partial_block(request, pool.null_block, 2, 0, 4) is None
    request.append_output_token_ids([7])
    pool.cache_full_blocks(request, blocks, 0, 2, 4, 0)
    full = make_block_hash_with_group_id(request.block_hashes[3], 0)
    assert blocks[1].block_hash == full and blocks[1].block_hash_num_tokens == 8
    assert partial not in dict(pool.cached_block_hash_to_block.items())
    assert pool.cached_block_hashes_by_block == {}
    dump_pool(pool)


def test_partial_entry_below_the_primary_becomes_an_extra_key():
    pool = _pool(8, hbs=2)
    request = make_request("r", list(range(8)), 2)
    (block,) = pool.get_new_blocks(1)
    high = pool.cache_partial_block(request, block, 6, 0, 8)
    low = pool.cache_partial_block(request, block, 4, 0, 8)
    assert block.block_hash == high and block.block_hash_num_tokens == 6
    assert {b: list(keys) for b, keys in pool.cached_block_hashes_by_block.items()} == {1: [low]}
    assert pool.get_cached_block_at(request.block_hashes, 2, 1, [0]) == [block]
    dump_pool(pool)
    replaced = pool.cache_partial_block(request, block, 2, 0, 8, replace_existing_hashes=True)
    assert block.block_hash == replaced and block.block_hash_num_tokens == 2
    assert pool.cached_block_hashes_by_block == {} and len(pool.cached_block_hash_to_block) == 1
    pool.free_blocks([block])
    pool.get_new_blocks(7)
    assert len(pool.cached_block_hash_to_block) == 0 and block.block_hash is None


def test_evict_blocks_strips_keys_in_place():
    pool = _pool(6)
    _, blocks = _cached(pool, list(range(8)), 2)
    pool.free_blocks([blocks[1]])
    queue = free_ids(pool)
    pool.evict_blocks({1, 2, 5})
    assert all(b.block_hash is None for b in blocks)
    assert blocks[0].ref_cnt == 1 and free_ids(pool) == queue
    assert len(pool.cached_block_hash_to_block) == 0


def test_reset_prefix_cache():
    pool = _pool(6)
    request, blocks = _cached(pool, list(range(8)), 2)
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(reversed(blocks))
    queue = free_ids(pool)
    cache_map = pool.cached_block_hash_to_block
    assert pool.reset_prefix_cache() is True
    # Emptied in place, as vLLM does: whoever holds the map sees it empty.
    assert pool.cached_block_hash_to_block is cache_map and len(cache_map) == 0
    assert not list(cache_map.items())
    assert cache_map.get_one_block_run(request.block_hashes, 0, 2, 1, 0) == []
    assert all(b.block_hash is None for b in pool.blocks) and free_ids(pool) == queue


def test_get_cached_block_needs_every_group():
    pool = _pool(6)
    request, (block,) = _cached(pool, [1, 2, 3, 4], 1)
    (other,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [other], 0, 1, 4, 1)
    assert ids(pool.get_cached_block_at(request.block_hashes, 4, 0, [0, 1])) == [1, 2]
    assert pool.get_cached_block_at(request.block_hashes, 4, 0, [0, 2]) is None


def test_get_rightmost_cached_block_searches_the_groups_it_is_given():
    """A key of group 1 alone is a hit for group 1, though group 0 has none there."""
    pool = _pool(8)
    request = make_request("r", list(range(12)), pool.hash_block_size)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 3, 4, 1)
    hashes = request.block_hashes
    assert pool.get_rightmost_cached_block(hashes, 4, [2, 1, 0], [1]) == (2, [blocks[2]])
    assert pool.get_rightmost_cached_block(hashes, 4, [2, 1, 0], [0]) is None
    assert pool.get_rightmost_cached_block(hashes, 4, [2, 1, 0], [1, 0]) is None


def test_null_head_len_counts_exactly_the_leading_nulls():
    pool = BlockPool(8, True, 4)
    null = pool.null_block
    b7, b1, b4 = pool.blocks[7], pool.blocks[1], pool.blocks[4]
    for table, expected in [
        ([], 0),
        ([b1, b7], 0),
        ([null], 1),
        ([null, null, null], 3),
        ([null, b7, b1, b4], 1),
        ([null, null, b1, b7], 2),
        ([null, null, null, b4, b1], 3),
        # vLLM counts the leading run only: nulls after a held block are not in it.
        ([null, b1, null], 1),
        ([null, b1, null, null, b7], 1),
        ([b1, null, null], 0),
    ]:
        assert null_head_len(table, null) == expected, table
        assert null_head_len(table) == expected, table  # vLLM's signature

