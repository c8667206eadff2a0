"""Blocks cached under a hash of any length (docs/spec.md §2.4): vLLM's xxhash functions give
16 bytes, its SHA-256 ones 32, and a frontend may hand a Request others; a key is the hash and
the group id as 4 big-endian bytes, as in vLLM, so it splits the same way at every length.
"""

from __future__ import annotations

import hashlib

import pytest

from kvfuzz.harness.spot_check import assert_invariants
from kvfuzz.kvcache import FullAttentionSpec, Request, RequestStatus, SlidingWindowSpec
from kvfuzz.kvcache.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvcache_testkit import make_manager

HBS = 4


def _hasher(length: int):
    """A chained hasher whose hashes have `length` bytes (BLAKE2b of parent and tokens)."""
    def hasher(request: Request) -> list[bytes]:
        hashes = request.block_hashes
        new = []
        parent = hashes[-1] if hashes else b"seed"
        for k in range(len(hashes), request.num_tokens // HBS):
            tokens = bytes(str(request.all_token_ids[k * HBS:(k + 1) * HBS]), "ascii")
            parent = hashlib.blake2b(parent + tokens, digest_size=length).digest()
            new.append(parent)
        return new

    return hasher


@pytest.mark.parametrize("length", [8, 16, 28, 32, 36, 64])
def test_blocks_are_cached_and_hit_under_a_hash_of_any_length(length: int) -> None:
    """The old manager refused to cache under any hash but a 32-byte digest."""
    m = make_manager(32, FullAttentionSpec(block_size=HBS),
                     SlidingWindowSpec(block_size=HBS, sliding_window=8))
    first = Request("a", list(range(17)), block_hasher=_hasher(length))
    assert {len(h) for h in first.block_hashes} == {length}
    assert m.allocate_slots(first, 17) is not None
    for block in m.block_pool.blocks:
        key = block.block_hash
        if key is not None:
            assert len(key) == length + 4
            assert get_block_hash(key) in first.block_hashes and get_group_id(key) in (0, 1)
    first.status = RequestStatus.FINISHED_STOPPED
    m.free(first)
    second = Request("b", list(range(17)), block_hasher=_hasher(length))
    assert m.get_computed_blocks(second)[1] == 16
    assert_invariants(m, requests=[second])


def test_keys_of_different_lengths_and_groups_never_collide() -> None:
    """A 36-byte hash in group 0 is a 32-byte hash and a group id in its bytes: vLLM's key form
    keeps their keys apart (a bare hash as group 0's key, kvcache's old form, made them
    equal), so the manager serves neither as the other's hit."""
    short = [bytes([k]) * 32 for k in (1, 2)]
    long = [h + (1).to_bytes(4, "big") for h in short]
    assert make_block_hash_with_group_id(long[0], 0) != make_block_hash_with_group_id(short[0], 1)
    key = make_block_hash_with_group_id(long[0], 0)
    assert (get_block_hash(key), get_group_id(key)) == (long[0], 0)
    m = make_manager(32, FullAttentionSpec(block_size=HBS),
                     SlidingWindowSpec(block_size=HBS, sliding_window=8))
    cached = Request("a", list(range(9)), block_hashes=list(short))
    assert m.allocate_slots(cached, 9) is not None
    assert m.block_pool.get_cached_block(short[0], [1]) is not None
    assert m.block_pool.get_cached_block(long[0], [0]) is None
    other = Request("b", list(range(100, 109)), block_hashes=list(long))
    assert m.get_computed_blocks(other)[1] == 0
