"""Preconditions vLLM asserts: kvcache refuses the call, changing nothing, with a
PreconditionError (a ValueError and an AssertionError); and what a Mamba group may leave short."""

from __future__ import annotations

import pytest

from kvfuzz.kvcache import BlockPool, FreeKVCacheBlockQueue, FullAttentionSpec, KVCacheBlock
from kvfuzz.kvcache import MambaSpec
from kvfuzz.kvcache.errors import PreconditionError
from kvcache_testkit import make_manager, make_request


def test_a_precondition_error_is_both_kinds():
    assert issubclass(PreconditionError, ValueError)
    assert issubclass(PreconditionError, AssertionError)


def _hybrid_hit():
    """Full attention (bs 2) + Mamba align (bs 4): a 7-token prompt computed to 6, then a
    lookup of its 8-token extension hits 6 tokens: 3 full blocks, 2 state columns."""
    manager = make_manager(24, FullAttentionSpec(block_size=2),
                           MambaSpec(block_size=4, mamba_cache_mode="align"), hash_block_size=2)
    producer = make_request("p", [0, 0, 1, 1, 2, 2, 3], 2)
    hits, num_hit, _ = manager.get_computed_blocks(producer)
    assert manager.allocate_slots(producer, 6, num_hit, hits) is not None
    manager.free(producer)
    manager.new_step_starts()
    hits, num_hit, _ = manager.get_computed_blocks(make_request("c", [0, 0, 1, 1, 2, 2, 3, 3], 2))
    assert num_hit == 6 and [len(g) for g in hits.blocks] == [3, 2]
    return manager, hits


def test_truncation_may_leave_the_state_group_short_only():
    manager, hits = _hybrid_hit()
    short_state = manager.create_kv_cache_blocks((list(hits.blocks[0]), []))
    assert [len(g) for g in manager.truncate_computed_blocks(short_state, 4).blocks] == [2, 0]
    short_full = manager.create_kv_cache_blocks((list(hits.blocks[0][:1]), list(hits.blocks[1])))
    with pytest.raises(PreconditionError, match="4 tokens is not a cut of 1 blocks of 2"):
        manager.truncate_computed_blocks(short_full, 4)
    with pytest.raises(AssertionError, match="6 tokens is not a cut"):  # not a state block end
        manager.truncate_computed_blocks(hits, 6)
    assert [len(g) for g in hits.blocks] == [3, 2]  # the lookup result itself is untouched


def test_a_partial_key_must_end_on_the_hash_grid():
    pool = BlockPool(2, True, 2)
    block = pool.get_new_blocks(1)[0]
    request = make_request("r", [0, 0, 1, 1], 2)
    for num_tokens in (3, 0, 6):  # off the grid, empty, past the request's hashes
        with pytest.raises(PreconditionError, match=f"num_tokens {num_tokens} is not"):
            pool.cache_partial_block(request, block, num_tokens, 0, 4)
    with pytest.raises(AssertionError, match="block_size 3 is not a multiple"):
        pool.cache_partial_block(request, block, 2, 0, 3)
    assert block.block_hash is None and not pool.cached_block_hashes_by_block


def test_append_n_to_a_queue_whose_tail_lost_its_link_changes_nothing():
    queue = FreeKVCacheBlockQueue([])
    queue.fake_free_list_tail.prev_free_block = None
    block = KVCacheBlock(block_id=0)
    with pytest.raises(AssertionError, match="tail sentinel"):
        queue.append_n([block])
    assert queue.num_free_blocks == 0
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert block.prev_free_block is None and block.next_free_block is None
