"""BlockHashToBlockMap and BlockPool (docs/spec.md §2.4, §3)."""

from __future__ import annotations

import copy
import gc

import pytest

from kvfuzz.kvcache import BlockHashToBlockMap, BlockPool, KVCacheBlock
from kvfuzz.kvcache.kv_cache_utils import make_block_hash_with_group_id, null_head_len
from kvcache_testkit import dump_pool, free_ids, ids, make_request

KEY = make_block_hash_with_group_id(b"h" * 32, 0)
OTHER = make_block_hash_with_group_id(b"h" * 32, 1)


# ----- hash map -----


def test_the_map_is_vllms_plain_dicts_of_ids_out_of_the_gc():
    blocks = [KVCacheBlock(i) for i in range(5)]
    m = BlockHashToBlockMap(blocks)
    for block in (blocks[2], blocks[1], blocks[3]):
        m.insert(KEY, block)
    m.insert(OTHER, blocks[4])
    m.insert(OTHER, blocks[4])  # the same block again: nothing changes
    # The earliest inserted id per key; every id of a key several blocks hold, in order.
    assert type(m._cache) is dict and m._cache == {KEY: 2, OTHER: 4}
    assert m._dup_ids == {KEY: {2: None, 1: None, 3: None}}
    assert not gc.is_tracked(m._cache) and len(m) == 2
    assert m.get_one_block(KEY) is blocks[2] and m.get_one_block(b"x" * 36) is None
    assert m.contain(KEY, 1) and not m.contain(KEY, 4) and m.contain(OTHER, 4)
    assert not m.contain(OTHER, 2)


def test_map_pop_leaves_the_earliest_block_left_under_the_key():
    blocks = [KVCacheBlock(i) for i in range(4)]
    m = BlockHashToBlockMap(blocks)
    for i in (1, 2, 3):
        m.insert(KEY, blocks[i])
    assert m.pop(KEY, 7) is None and m.pop(OTHER, 1) is None
    assert m.pop(KEY, 2) is blocks[2] and m._cache[KEY] == 1
    assert m.pop(KEY, 1) is blocks[1]
    # One block left: the key is single again.
    assert m._cache == {KEY: 3} and m._dup_ids == {}
    assert m.pop(KEY, 1) is None and m._cache == {KEY: 3}
    assert m.pop(KEY, 3) is blocks[3] and len(m) == 0 and not gc.is_tracked(m._cache)


def _filled_map(n: int) -> tuple[list[bytes], list[bytes], list[KVCacheBlock], BlockHashToBlockMap]:
    """A map of blocks 0..n-1, block i under fine hash i of group 0."""
    fine = [i.to_bytes(32, "big") for i in range(n)]
    keys = [make_block_hash_with_group_id(h, 0) for h in fine]
    blocks = [KVCacheBlock(i) for i in range(n)]
    m = BlockHashToBlockMap(blocks)
    for key, block in zip(keys, blocks):
        m.insert(key, block)
    return fine, keys, blocks, m


def test_writes_through_the_plain_dict_are_what_lookups_see():
    fine, keys, blocks, m = _filled_map(6)
    saved = copy.copy(m._cache)
    del m._cache[keys[3]]
    assert m.get_one_block(keys[3]) is None
    assert m.get_one_block_run(fine, 0, len(fine), 1, 0) == blocks[:3]
    m._cache[keys[3]] = saved[keys[3]]
    assert m.get_one_block_run(fine, 0, len(fine), 1, 0) == blocks
    m._cache.clear()
    assert m.get_one_block_run(fine, 0, len(fine), 1, 0) == [] and len(m) == 0


def test_same_hash_different_groups_are_different_keys():
    m = BlockHashToBlockMap([KVCacheBlock(i) for i in range(3)])
    m.insert(KEY, m._blocks[1])
    m.insert(OTHER, m._blocks[2])
    assert len(m) == 2 and m._dup_ids == {}
    assert OTHER[-4:] == (1).to_bytes(4, "big") and OTHER[:-4] == b"h" * 32


def test_runs_step_through_the_hashes_and_stop_at_the_first_miss():
    fine, keys, blocks, m = _filled_map(200)
    assert m.get_one_block_run(fine, 0, len(fine), 1, 0) == blocks
    assert m.get_one_block_run(fine, 3, len(fine), 4, 0) == blocks[3::4]
    assert m.get_one_block_run(fine, 0, len(fine), 1, 1) == []
    m.pop(keys[105], 105)
    assert m.get_one_block_run(fine, 0, len(fine), 1, 0) == blocks[:105]
    assert m.get_one_block_run(fine, 101, len(fine), 4, 0) == [blocks[101]]


def test_vllms_maybe_evict_cached_block_drops_the_keys_of_one_copy():
    pool = _pool(6)
    request, (first, second) = _cached(pool, [1, 2, 3, 4, 5, 6, 7, 8], 2)
    (copy_of_first,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [copy_of_first], 0, 1, 4, 0)
    cache = pool.cached_block_hash_to_block
    assert cache._dup_ids == {first.block_hash: {first.block_id: None, copy_of_first.block_id: None}}
    assert pool._maybe_evict_cached_block(first) and first.block_hash is None
    assert cache.get_one_block(copy_of_first.block_hash) is copy_of_first and cache._dup_ids == {}
    assert not pool._maybe_evict_cached_block(first)
    assert pool._maybe_evict_cached_block(second) and len(cache) == 1
    dump_pool(pool)


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
    cache = pool.cached_block_hash_to_block
    assert list(cache._dup_ids[key]) == [1, 2]
    pool.free_blocks([a])
    pool.get_new_blocks(2)
    assert a.block_hash is None and b.block_hash == key
    assert cache._cache == {key: 2} and cache._dup_ids == {}
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
    assert partial not in pool.cached_block_hash_to_block._cache
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
    assert cache_map._cache == {} and cache_map._dup_ids == {} and not gc.is_tracked(cache_map._cache)
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

