"""FreeKVCacheBlockQueue: every operation, its order and its errors (docs/spec.md §2.2)."""

from __future__ import annotations

import pytest

from kvfuzz.kvcache import FreeKVCacheBlockQueue, KVCacheBlock
from kvcache_testkit import ids


def _queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def _links(queue: FreeKVCacheBlockQueue) -> list[int]:
    """Walk tail to head too, so a broken back link shows up."""
    back = []
    node = queue.fake_free_list_tail.prev_free_block
    while node is not queue.fake_free_list_head:
        back.append(node.block_id)
        node = node.prev_free_block
    return back[::-1]


def test_construction_links_in_order_between_sentinels():
    blocks, q = _queue(4)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3] == _links(q)
    assert q.num_free_blocks == 4
    assert q.fake_free_list_head.block_id == q.fake_free_list_tail.block_id == -1
    assert blocks[0].prev_free_block is q.fake_free_list_head
    assert blocks[3].next_free_block is q.fake_free_list_tail


def test_empty_queue():
    _, q = _queue(0)
    assert q.get_all_free_blocks() == [] and q.num_free_blocks == 0
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    with pytest.raises(ValueError, match="No free blocks"):
        q.popleft()
    assert q.popleft_n(0) == []


def test_popleft_takes_head_and_unlinks():
    blocks, q = _queue(3)
    first = q.popleft()
    assert first is blocks[0]
    assert first.prev_free_block is None and first.next_free_block is None
    assert ids(q.get_all_free_blocks()) == [1, 2] == _links(q)
    assert q.num_free_blocks == 2


def test_popleft_n():
    blocks, q = _queue(5)
    popped = q.popleft_n(3)
    assert ids(popped) == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert ids(q.get_all_free_blocks()) == [3, 4] == _links(q)
    assert q.num_free_blocks == 2
    assert ids(q.popleft_n(2)) == [3, 4]
    assert q.get_all_free_blocks() == [] and _links(q) == []


def test_popleft_n_over_count_raises_and_changes_nothing():
    _, q = _queue(2)
    with pytest.raises(ValueError, match=r"popleft_n\(3\): the queue holds 2 blocks"):
        q.popleft_n(3)
    with pytest.raises(ValueError, match=r"popleft_n\(-1\)"):
        q.popleft_n(-1)
    assert ids(q.get_all_free_blocks()) == [0, 1] and q.num_free_blocks == 2


def test_remove_from_middle_and_ends():
    blocks, q = _queue(5)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q.get_all_free_blocks()) == [1, 3] == _links(q)
    assert q.num_free_blocks == 2
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None


def test_remove_unlinked_block_raises_runtime_error():
    blocks, q = _queue(3)
    q.remove(blocks[1])
    with pytest.raises(RuntimeError, match="block 1"):
        q.remove(blocks[1])
    assert ids(q.get_all_free_blocks()) == [0, 2] and q.num_free_blocks == 2


def test_append_and_append_n_keep_order_at_tail():
    blocks, q = _queue(5)
    taken = q.popleft_n(4)
    q.append(taken[2])
    q.append_n([taken[0], taken[3]])
    q.append_n([])
    assert ids(q.get_all_free_blocks()) == [4, 2, 0, 3] == _links(q)
    assert q.num_free_blocks == 4


def test_prepend_n_keeps_order_at_head():
    blocks, q = _queue(4)
    taken = q.popleft_n(3)
    q.prepend_n([taken[1], taken[2]])
    q.prepend_n([])
    assert ids(q.get_all_free_blocks()) == [1, 2, 3] == _links(q)
    q.prepend_n([taken[0]])
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3] == _links(q)
    assert q.num_free_blocks == 4


def test_insertions_into_an_emptied_queue():
    blocks, q = _queue(3)
    taken = q.popleft_n(3)
    q.prepend_n([taken[1]])
    q.append_n([taken[2]])
    q.prepend_n([taken[0]])
    assert ids(q.get_all_free_blocks()) == [0, 1, 2] == _links(q)
