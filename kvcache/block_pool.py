"""Layer 4: the one owner of blocks, reference counts, the free queue and the hash map."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, repeat
from operator import add, length_hint
from typing import TYPE_CHECKING, NoReturn

from kvfuzz.kvcache.errors import PreconditionError
from kvfuzz.kvcache.kv_cache_utils import (
    BlockHash,
    BlockHashList,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    check_positive_int,
    group_id_suffix,
    make_block_hash_with_group_id,
)

if TYPE_CHECKING:
    from kvfuzz.kvcache.kv_events import KVCacheEvent
    from kvfuzz.kvcache.request import Request

logger = logging.getLogger(__name__)


def _before_current(
    items: Sequence[KVCacheBlock], remaining: Iterator[KVCacheBlock]
) -> Sequence[KVCacheBlock]:
    """The items a loop over `remaining` (an iterator of `items`) finished before its current
    one: what an error there must undo. Avoids counting positions in the loop itself.
    """
    return items[: len(items) - length_hint(remaining) - 1]


class BlockHashToBlockMap:
    """Key -> the cached blocks under it, in vLLM 0.34's layout (block_pool.py:38-104).

    `_cache` maps each key to the id of the earliest inserted block still under it; `_dup_ids`
    holds, for a key that several blocks hold, all their ids in insertion order (the one in
    `_cache` first). Entries are ids, not blocks, so `_cache` holds only bytes and ints: CPython
    (3.11 to 3.13) leaves such a dict out of the cyclic GC, which never walks the cache.
    Identical content cached twice is kept twice (no de-duplication), so block ids already
    handed out never change.

    `_cache` is the map itself, a plain dict: code that sets, pops or clears its keys directly
    (vLLM's tests do) changes what every lookup sees. The managers' runs of lookups go through
    `get_one_block_run`, which looks keys up in C.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._blocks = blocks
        """The pool's blocks, by id (what the ids name)."""
        self._cache: dict[BlockHashWithGroupId, int] = {}
        self._dup_ids: dict[BlockHashWithGroupId, dict[int, None]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """vLLM's: the earliest inserted block still under `key`, or None."""
        block_id = self._cache.get(key)
        return None if block_id is None else self._blocks[block_id]

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        """vLLM's: `block_id` is one of the blocks under `key`."""
        dup_ids = self._dup_ids.get(key)
        return block_id in dup_ids if dup_ids is not None else self._cache.get(key) == block_id

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """vLLM's: add `block` under `key`, after any blocks already there (none moves)."""
        block_id = block.block_id
        first = self._cache.setdefault(key, block_id)
        if first != block_id:
            self._dup_ids.setdefault(key, {first: None})[block_id] = None

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """vLLM's: remove `block_id` from the blocks under `key`; the block, or None if it is
        not there. The key then names the earliest inserted block left, if any."""
        dup_ids = self._dup_ids.get(key)
        if dup_ids is None:
            if self._cache.get(key) != block_id:
                return None
            del self._cache[key]
        else:
            if dup_ids.pop(block_id, False) is False:
                return None
            for first in dup_ids:  # the earliest left (a key of dups keeps two or more)
                self._cache[key] = first
                break
            if len(dup_ids) == 1:
                del self._dup_ids[key]
        return self._blocks[block_id]

    def get_one_block_run(
        self, fine_hashes: Sequence[BlockHash], start: int, stop: int, step: int, group_id: int
    ) -> list[KVCacheBlock]:
        """The earliest inserted block still under each key at indices `start`, `start + step`,
        ... before `stop` (within `fine_hashes`) in `group_id`, up to the first miss."""
        blocks = self._blocks
        run: list[KVCacheBlock] = []
        append = run.append
        # The keys are built and looked up in C.
        for block_id in map(self._cache.get, map(add, fine_hashes[start:stop:step],
                                                 repeat(group_id_suffix(group_id)))):
            if block_id is None:
                break
            append(blocks[block_id])
        return run

    def clear(self) -> None:
        """Remove every key, in place (holders of this map or its dicts see it emptied)."""
        self._cache.clear()
        self._dup_ids.clear()

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """All blocks of one pool. Block 0 is the null block: a placeholder for table positions that
    hold no KV (tokens outside a window); it is never queued, cached, counted or handed out.
    """

    num_hash_lookahead_tokens = 0
    """Tokens after each block its hash covers (MTP / draft lookahead; the coordinator sets it)."""

    def __init__(
        self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
        enable_kv_cache_events: bool = False,
    ) -> None:
        check_positive_int("num_gpu_blocks", num_gpu_blocks)
        check_positive_int("hash_block_size", hash_block_size)
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        # This pool's blocks are instances of a subclass of its own: `type(b) is
        # self.block_type` tells them from another pool's blocks and from non-blocks with one
        # pointer compare on the object header, which any use of the block reads anyway.
        self.block_type: type[KVCacheBlock] = type(
            "KVCacheBlock", (KVCacheBlock,), {"__slots__": (), "__module__": KVCacheBlock.__module__}
        )
        self.blocks: list[KVCacheBlock] = [self.block_type(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap(self.blocks)
        # Keys beyond the primary one (partial entries), per block id, in insertion order.
        self.cached_block_hashes_by_block: dict[int, dict[BlockHashWithGroupId, None]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Scratch heads of `release`'s two runs (head of the queue, tail of the queue): never
        # in the queue, and no link left on them between calls.
        self._run_heads = (KVCacheBlock(block_id=-1), KVCacheBlock(block_id=-1))
        # Token counts at hash block ends (entry k is k * hash_block_size), grown on demand: the
        # counts that keys record are these shared ints, so registering a block allocates none
        # and evicting one releases none (an int last touched when the block was registered).
        self._hash_block_ends: list[int] = [0]
        if enable_kv_cache_events:  # the pool becomes an EventfulBlockPool (kv_events.py)
            from kvfuzz.kvcache.kv_events import EventfulBlockPool

            EventfulBlockPool.enable_on(self)

    def fine_hashes(
        self, block_hashes: BlockHashList, block_size: int
    ) -> tuple[Sequence[BlockHash], int]:
        """The request's fine hashes behind `block_hashes` (its list, or a view of it) and how
        many make a block of `block_size`: block i's key is fine hash (i + 1) * m - 1."""
        if type(block_hashes) is BlockHashListWithBlockSize:
            block_hashes = block_hashes.block_hashes
        return block_hashes, block_size // self.hash_block_size

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        """vLLM's: the earliest inserted block under `block_hash` in each group, or None if any
        group misses. Pure read; the managers use `get_cached_block_at` and the runs below,
        which build the keys from a request's hashes."""
        cached_blocks = []
        get_one_block = self.cached_block_hash_to_block.get_one_block
        for group_id in kv_cache_group_ids:
            block = get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            cached_blocks.append(block)
        return cached_blocks

    def get_cached_block_at(
        self, block_hashes: BlockHashList, block_size: int, index: int,
        kv_cache_group_ids: Sequence[int],
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for block `index` of `block_hashes` (a request's hashes,
        or a view of them at `block_size`), or None if any group misses. Pure read."""
        fine, scale = self.fine_hashes(block_hashes, block_size)
        return self._cached_in(fine[(index + 1) * scale - 1], kv_cache_group_ids)

    def _cached_in(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """`get_cached_block_at` of the key at `block_hash`."""
        cached_blocks = []
        get = self.cached_block_hash_to_block._cache.get
        blocks = self.blocks
        for group_id in kv_cache_group_ids:
            # Keys are built by plain concatenation here (calling the NewType costs a call).
            block_id = get(block_hash + group_id_suffix(group_id))
            if block_id is None:
                return None
            cached_blocks.append(blocks[block_id])
        return cached_blocks

    def get_rightmost_cached_block(
        self, block_hashes: BlockHashList, block_size: int, indices: Iterable[int],
        kv_cache_group_ids: Sequence[int],
    ) -> tuple[int, list[KVCacheBlock]] | None:
        """The first of `indices` (blocks of `block_hashes`, as in `get_cached_block_at`) that
        `get_cached_block_at` hits, with its blocks; None if none does. Pure read (a state
        group's right-to-left search)."""
        fine, scale = self.fine_hashes(block_hashes, block_size)
        cache = self.cached_block_hash_to_block._cache
        suffix = group_id_suffix(kv_cache_group_ids[0])
        for index in indices:
            block_hash = fine[(index + 1) * scale - 1]
            if block_hash + suffix not in cache:
                continue
            cached = self._cached_in(block_hash, kv_cache_group_ids)
            if cached is not None:
                return index, cached
        return None

    def get_cached_block_run(
        self, block_hashes: BlockHashList, block_size: int, start: int, stop: int,
        kv_cache_group_ids: Sequence[int],
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest run of blocks `start`, `start + 1`, ... before `stop` of `block_hashes`
        (as in `get_cached_block_at`) that `get_cached_block_at` hits, one block list per group;
        the same blocks as calling it block by block until the first miss. Pure read.
        """
        if type(block_hashes) is BlockHashListWithBlockSize:  # `fine_hashes`, inlined
            block_hashes = block_hashes.block_hashes
        scale = block_size // self.hash_block_size
        first = (start + 1) * scale - 1
        fine_stop = stop * scale
        if fine_stop > len(block_hashes):
            fine_stop = len(block_hashes)
        get_run = self.cached_block_hash_to_block.get_one_block_run
        if len(kv_cache_group_ids) == 1:  # the common case: one run, nothing to reconcile
            return (get_run(block_hashes, first, fine_stop, scale, kv_cache_group_ids[0]),)
        runs = []
        for group_id in kv_cache_group_ids:
            run = get_run(block_hashes, first, fine_stop, scale, group_id)
            fine_stop = first + len(run) * scale
            runs.append(run)
        num_blocks = len(runs[-1])
        # A later group may have stopped earlier: every group keeps the common prefix.
        for run in runs:
            del run[num_blocks:]
        return tuple(runs)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]` under the request's hashes.

        Null blocks and blocks masked out are skipped. A block that already has a key may only
        be a partial entry being promoted to its full key. Counts that are not ints, or blocks
        that are not this pool's, raise ValueError and change nothing.
        """
        counts = {"num_cached_blocks": num_cached_blocks, "num_full_blocks": num_full_blocks,
                  "block_size": block_size, "kv_cache_group_id": kv_cache_group_id}
        for name, n in counts.items():
            if type(n) is not int or n < 0:
                raise ValueError(f"cache_full_blocks(): {name}={n!r} is not an int >= 0")
        if block_size == 0:
            raise ValueError("cache_full_blocks(): block_size=0 is not a block size")
        blocks = self._block_list("cache_full_blocks", blocks)
        self.check_own("cache_full_blocks()", blocks[num_cached_blocks:num_full_blocks])
        self.register_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                  kv_cache_group_id, block_mask)

    def register_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """`cache_full_blocks` of a manager's own table (this pool's blocks, int counts)."""
        num_new_blocks = num_full_blocks - num_cached_blocks
        if num_new_blocks <= 0:
            return
        if num_new_blocks == 1 and self._register_one(
            request, blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask
        ):
            return
        # A block's key is the fine hash at its end: fine index (i + 1) * scale - 1 for block i.
        fine_hashes = request.block_hashes
        if block_size == self.hash_block_size:  # the common case: one hash per block
            scale = 1
        else:
            scale, rest = divmod(block_size, self.hash_block_size)
            if rest:
                raise ValueError(f"cache_full_blocks(): block_size {block_size} is not a "
                                 f"multiple of hash_block_size {self.hash_block_size}")
        first = (num_cached_blocks + 1) * scale - 1
        last = num_full_blocks * scale
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        if num_cached_blocks < 0 or len(new_blocks) != num_new_blocks or last > len(fine_hashes):
            raise ValueError(
                f"cache_full_blocks({request.request_id!r}): blocks [{num_cached_blocks}, "
                f"{num_full_blocks}) need {len(blocks)} blocks and "
                f"{len(fine_hashes) * self.hash_block_size // block_size} hashes "
                f"of {block_size} tokens to cover them"
            )
        if block_mask is not None and len(block_mask) != num_new_blocks:
            raise ValueError(
                f"cache_full_blocks({request.request_id!r}): block_mask has {len(block_mask)} "
                f"entries for {num_new_blocks} blocks"
            )
        # The keys, built in C.
        keys: list[BlockHashWithGroupId] = list(map(  # type: ignore[arg-type]
            add, fine_hashes[first:last:scale], repeat(group_id_suffix(kv_cache_group_id))))
        ends = self._hash_block_ends
        if last >= len(ends):
            ends = self._ends_through(last)
        token_counts = ends[first + 1:last + 1:scale]
        cache_map = self.cached_block_hash_to_block
        setdefault = cache_map._cache.setdefault
        # Entries are (block, its key, the tokens its key covers), built in C.
        entries: Iterable[tuple[KVCacheBlock, BlockHashWithGroupId, int]] = zip(
            new_blocks, keys, token_counts)
        if block_mask is not None:
            entries = compress(entries, block_mask)
        for block, key, num_tokens in entries:
            if block._block_hash is None:
                if block.is_null:
                    continue
                # A block without a primary key has no extras either: nothing else to check, so
                # the slots are set directly (what set_block_hash does after its check), and a
                # new key (the common case) costs one dict operation.
                block._block_hash = key
                block._block_hash_num_tokens = num_tokens
                block._hashed = True
                block_id = block.block_id
                if setdefault(key, block_id) != block_id:
                    cache_map.insert(key, block)
            elif not block.is_null:
                self._promote(block, key, num_tokens)

    def _promote(self, block: KVCacheBlock, key: BlockHashWithGroupId, num_tokens: int) -> None:
        """Re-key a block that has a key: only a partial entry, promoted to its full key."""
        assert (
            block.block_hash_num_tokens is not None
            and block.block_hash_num_tokens < num_tokens
        ), f"block {block.block_id} is already cached at {block.block_hash_num_tokens}"
        self._remove_cached_block_hashes(block)
        self._insert_block_hash(key, block, num_tokens)

    def _register_one(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None,
    ) -> bool:
        """`register_full_blocks` of the one block before `num_full_blocks` (a decode step or a
        short chunk fills one), when it is the common case: in range, no mask, a real block
        without a key. False (nothing done) otherwise."""
        index = num_full_blocks - 1
        fine_hashes = request.block_hashes
        hash_block_size = self.hash_block_size
        # The block's key is the fine hash at its end.
        hash_index = num_full_blocks * block_size // hash_block_size - 1
        if (
            block_mask is not None
            or block_size % hash_block_size
            or not 0 <= index < len(blocks)
            or hash_index >= len(fine_hashes)
        ):
            return False
        block = blocks[index]
        if block._block_hash is not None or block.is_null:
            return False
        key: BlockHashWithGroupId = (  # type: ignore[assignment]
            fine_hashes[hash_index] + group_id_suffix(kv_cache_group_id))
        ends = self._hash_block_ends
        if hash_index + 1 >= len(ends):
            ends = self._ends_through(hash_index + 1)
        block._block_hash = key
        block._block_hash_num_tokens = ends[hash_index + 1]
        block._hashed = True
        # `insert` inlined for a new key (a decode step's cold path: the call costs as much).
        block_id = block.block_id
        cache_map = self.cached_block_hash_to_block
        if cache_map._cache.setdefault(key, block_id) != block_id:
            cache_map.insert(key, block)
        return True

    def _ends_through(self, last: int) -> list[int]:
        """`_hash_block_ends`, grown to hold entry `last`."""
        ends = self._hash_block_ends
        if last >= len(ends):
            hash_block_size = self.hash_block_size
            ends.extend(range(len(ends) * hash_block_size, (last + 1) * hash_block_size,
                              hash_block_size))
        return ends

    def cache_partial_block(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId | None:
        """Make `block` reachable from the interior prefix boundary `num_tokens` (Tier B).

        The key is the fine hash at that boundary. A new key covering more tokens than the
        block's current primary replaces its keys; otherwise it is added as an extra.
        """
        if type(block) is not self.block_type:
            raise ValueError(f"cache_partial_block(): {self.describe_foreign(block)}")
        if block.is_null:
            return None
        hbs = self.hash_block_size
        if block_size % hbs:
            raise PreconditionError(
                f"block_size {block_size} is not a multiple of hash_block_size {hbs}")
        if num_tokens <= 0 or num_tokens % hbs or num_tokens // hbs > len(request.block_hashes):
            raise PreconditionError(
                f"num_tokens {num_tokens} is not a positive multiple of {hbs} within the "
                f"{len(request.block_hashes)} hashes of request {request.request_id!r}"
            )
        key = make_block_hash_with_group_id(
            request.block_hashes[num_tokens // hbs - 1], kv_cache_group_id
        )
        return self.register_partial_block(request, block, num_tokens, key,
                                           replace_existing_hashes)

    def register_partial_block(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        key: BlockHashWithGroupId,
        replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId:
        """`cache_partial_block` of a manager's own real block at a hash boundary within the
        request's hashes, under the key the manager built for it (its checks already done)."""
        if replace_existing_hashes:
            self._remove_cached_block_hashes(block)
        elif (
            block._block_hash is not None
            and not self.carries_key(block, key)
            and block._block_hash_num_tokens is not None
            and block._block_hash_num_tokens < num_tokens
        ):
            self._remove_cached_block_hashes(block)
        self._insert_block_hash(key, block, num_tokens)
        return key

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Re-point every key of `src_block` (primary first) to `dst_block`, which has none:
        its owner writes on in `src_block` while the cache keeps a private copy."""
        assert dst_block._block_hash is None
        extras_by_block = self.cached_block_hashes_by_block
        assert dst_block.block_id not in extras_by_block
        num_tokens = src_block._block_hash_num_tokens
        primary = src_block._block_hash
        if primary is None:
            return
        cache_map = self.cached_block_hash_to_block
        cache = cache_map._cache
        if (cache.get(primary) == src_block.block_id and primary not in cache_map._dup_ids
                and src_block.block_id not in extras_by_block):
            # The common case, one key that the source alone holds: what the removal and the
            # insertion below do, without their checks, the slots set directly.
            cache[primary] = dst_block.block_id
            src_block.reset_hash()
            dst_block._block_hash = primary
            dst_block._block_hash_num_tokens = num_tokens
            dst_block._hashed = True
            return
        keys = [primary, *sorted(extras_by_block.get(src_block.block_id, ()))]
        # The entries stay live, only their block changes: no KV event (the base removal).
        BlockPool._remove_cached_block_hashes(self, src_block)
        for key in keys:
            self._insert_block_hash(key, dst_block, num_tokens)  # type: ignore[arg-type]

    def carries_key(self, block: KVCacheBlock, key: BlockHashWithGroupId) -> bool:
        """The block is reachable under `key`, as its primary key or another one."""
        return block._block_hash == key or key in self.cached_block_hashes_by_block.get(
            block.block_id, ()
        )

    def _insert_block_hash(
        self, key: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int
    ) -> None:
        """Make `block` reachable under `key`."""
        primary = block._block_hash
        if primary is None:  # a block without a primary key has no other key either
            # `set_block_hash` after its check, and the insertion.
            block._block_hash = key
            block._block_hash_num_tokens = num_tokens
            block._hashed = True
            self.cached_block_hash_to_block.insert(key, block)
            return
        if self.carries_key(block, key):
            return
        self.cached_block_hash_to_block.insert(key, block)
        self.cached_block_hashes_by_block.setdefault(block.block_id, {})[key] = None

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> None:
        """Drop every key of the block (primary and extras) from the map and the block."""
        extras_by_block = self.cached_block_hashes_by_block
        extras = extras_by_block.pop(block.block_id, None) if extras_by_block else None
        key = block._block_hash
        if key is None and not extras:
            return
        pop = self.cached_block_hash_to_block.pop
        if key is not None:
            pop(key, block.block_id)
        if extras:
            for extra in extras:
                pop(extra, block.block_id)
        block.reset_hash()

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the queue head, evicting their cache entries: the only place memory
        pressure evicts. Nothing changes if the pool is short.
        """
        queue = self.free_block_queue
        # The exact-type test first: the common case then skips the two isinstance calls.
        if type(num_blocks) is not int and (
            not isinstance(num_blocks, int) or isinstance(num_blocks, bool)
        ) or num_blocks < 0:
            raise ValueError(f"Cannot get {num_blocks!r} blocks: the count must be an int >= 0")
        if num_blocks > queue.num_free_blocks:
            raise ValueError(
                f"Cannot get {num_blocks} free blocks from the pool ({queue.num_free_blocks} free)"
            )
        if not num_blocks:
            return []
        # `popleft_n` inlined: one walk unlinks, evicts and takes the reference.
        head = queue.fake_free_list_head
        block = head.next_free_block
        ret = []
        # Blocks without a key (caching off, or a decode step's one block off a head that
        # freed partial blocks fill) need no eviction.
        if not self.enable_caching or num_blocks == 1 and not block._hashed:
            for _ in range(num_blocks):
                ret.append(block)
                nxt = block.next_free_block
                block.prev_free_block = block.next_free_block = None
                block.ref_cnt = 1
                block = nxt
            head.next_free_block = block
            block.prev_free_block = head
            queue.num_free_blocks -= num_blocks
            return ret
        extras_by_block = self.cached_block_hashes_by_block
        cache_map = self.cached_block_hash_to_block
        cache_pop = cache_map._cache.pop
        dup_ids = cache_map._dup_ids
        for _ in range(num_blocks):
            ret.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            # Only a block with a primary key has keys (extras come after the primary). The
            # common case, a primary key alone, is `_remove_cached_block_hashes` inlined, and
            # the block alone under its key is `BlockHashToBlockMap.pop` inlined.
            if block._hashed:  # the key itself is read only when there is one
                if extras_by_block and block.block_id in extras_by_block:
                    self._remove_cached_block_hashes(block)
                else:
                    key = block._block_hash
                    if dup_ids and key in dup_ids:
                        cache_map.pop(key, block.block_id)
                    else:
                        # One lookup when the block is alone under its key.
                        block_id = cache_pop(key, None)
                        if block_id != block.block_id and block_id is not None:
                            cache_map._cache[key] = block_id  # another block's: put it back
                    block._block_hash = block._block_hash_num_tokens = None
                    block._hashed = False
            block.ref_cnt = 1
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head
        queue.num_free_blocks -= num_blocks
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """vLLM's: drop every key of `block` from the map and the block; whether it had a
        primary key (a block without one has no key to drop)."""
        hashed = block._hashed
        self._remove_cached_block_hashes(block)
        return hashed

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on each (prefix-hit) block, rescuing free ones from the queue.

        A bad entry (not a block of this pool) raises ValueError and changes nothing: every
        entry is checked before the first reference is taken.
        """
        blocks = self._block_list("touch", blocks)
        self.check_own("touch()", blocks)
        self.touch_own(blocks)

    def touch_own(self, blocks: Sequence[KVCacheBlock]) -> None:
        """`touch` of blocks known to be this pool's (hits `allocate_slots` checked).

        A free block missing from the queue raises RuntimeError after dropping the references
        taken before it; the queue is only touched once every block passed.
        """
        rescued: list[KVCacheBlock] = []
        remaining = iter(blocks)
        for block in remaining:
            ref_cnt = block.ref_cnt
            if ref_cnt == 0:
                if block.is_null:  # only a count of 0 can be the null block's
                    continue
                if block.prev_free_block is None or block.next_free_block is None:
                    self._untouch(_before_current(blocks, remaining))
                    raise RuntimeError(
                        f"touch(): block {block.block_id} has ref_cnt 0 but is not in the "
                        "free queue"
                    )
                # A repeat of this block now sees ref_cnt 1, so each is rescued once.
                rescued.append(block)
            block.ref_cnt = ref_cnt + 1
        self.free_block_queue.remove_n(rescued)

    @staticmethod
    def _untouch(done: Sequence[KVCacheBlock]) -> None:
        for block in done:
            if not block.is_null:
                block.ref_cnt -= 1

    def _block_list(self, operation: str, blocks: object) -> list[KVCacheBlock]:
        """`blocks` as a list (a list is not copied), or ValueError if it is not a sequence."""
        if type(blocks) is list:
            return blocks
        if isinstance(blocks, str | bytes) or not hasattr(blocks, "__iter__"):
            raise ValueError(f"{operation}(): {blocks!r} is not a sequence of blocks")
        return list(blocks)  # type: ignore[call-overload]

    def describe_foreign(self, block: object) -> str:
        """Why `block` is refused: not a block, or a block of another pool."""
        if isinstance(block, KVCacheBlock):
            return f"block {block.block_id} belongs to another pool"
        return f"{block!r} is not a block of this pool"

    def check_own(self, operation: str, blocks: Iterable[object]) -> None:
        """ValueError unless every entry is a block of this pool (nothing is changed)."""
        own = self.block_type
        for block in blocks:
            if type(block) is not own:
                raise ValueError(f"{operation}: {self.describe_foreign(block)}")

    def free_blocks(
        self, ordered_blocks: Iterable[KVCacheBlock], evict_first: bool = False
    ) -> None:
        """Drop one reference per block; the first block is the first to evict.

        Blocks reaching zero without a key go to the queue head as one run (reused first, for
        locality); cached ones go to the tail (evicted oldest release first), or with
        `evict_first` (their contents held by another tier) into the head run too, keeping
        their keys until popped. An entry that is not a block of this pool, a block that is not
        held, or an `evict_first` that is not a bool raises ValueError and changes nothing.
        """
        if type(evict_first) is not bool:
            raise ValueError(f"free_blocks(): evict_first={evict_first!r} is not a bool")
        blocks = self._block_list("free_blocks", ordered_blocks)
        self.check_own("free_blocks()", blocks)
        self.release(blocks, evict_first)

    def release(self, blocks: list[KVCacheBlock], evict_first: bool = False) -> None:
        """`free_blocks` of blocks known to be this pool's (the managers' own tables).

        A block that is not held raises ValueError and changes nothing.

        One pass: each released block is threaded onto its run as it is met, and the two runs
        are spliced into the queue at the end. Held blocks are never linked, so a run's links
        are all this call's. Each run starts after a scratch head, so linking a block needs no
        test for the run's first one. A lone block with one holder (a state group's passed
        state, most often) is spliced in at its end of the queue directly.
        """
        if len(blocks) == 1 and blocks[0].ref_cnt == 1:
            block = blocks[0]
            block.ref_cnt = 0
            if block._hashed and self.enable_caching and not evict_first:
                self.free_block_queue.append_chain(block, block, 1)
            else:
                self.free_block_queue.prepend_chain(block, block, 1)
            return
        first_head, last_head = self._run_heads
        first_tail, last_tail = first_head, last_head
        # The released count is what the held blocks (and nulls) leave.
        num_kept = 0
        remaining = iter(blocks)
        if self.enable_caching and not evict_first:
            for block in remaining:
                if block.ref_cnt == 1:  # the common case, tested without a local
                    block.ref_cnt = 0
                    # `_hashed` leaves the key object, likely out of the CPU cache by now,
                    # untouched.
                    if block._hashed:
                        last_tail.next_free_block = block
                        block.prev_free_block = last_tail
                        last_tail = block
                    else:
                        first_tail.next_free_block = block
                        block.prev_free_block = first_tail
                        first_tail = block
                elif block.ref_cnt > 1:
                    block.ref_cnt -= 1
                    num_kept += 1
                elif block.is_null:  # its count stays 0: never pooled
                    num_kept += 1
                else:
                    self._undo_release(blocks, remaining, block)
        else:
            # Without caching, or evicting first, every released block joins the head run.
            for block in remaining:
                if block.ref_cnt == 1:
                    block.ref_cnt = 0
                    first_tail.next_free_block = block
                    block.prev_free_block = first_tail
                    first_tail = block
                elif block.ref_cnt > 1:
                    block.ref_cnt -= 1
                    num_kept += 1
                elif block.is_null:
                    num_kept += 1
                else:
                    self._undo_release(blocks, remaining, block)
        # The queue's `prepend_chain` and `append_chain`, inlined, with one count update.
        queue = self.free_block_queue
        if first_tail is not first_head:
            first = first_head.next_free_block
            first_head.next_free_block = None
            head = queue.fake_free_list_head
            nxt = head.next_free_block
            head.next_free_block = first
            first.prev_free_block = head  # type: ignore[union-attr]
            first_tail.next_free_block = nxt
            nxt.prev_free_block = first_tail  # type: ignore[union-attr]
        if last_tail is not last_head:
            first = last_head.next_free_block
            last_head.next_free_block = None
            tail = queue.fake_free_list_tail
            prev = tail.prev_free_block
            prev.next_free_block = first  # type: ignore[union-attr]
            first.prev_free_block = prev  # type: ignore[union-attr]
            last_tail.next_free_block = tail
            tail.prev_free_block = last_tail
        queue.num_free_blocks += len(blocks) - num_kept

    def _undo_release(
        self, blocks: list[KVCacheBlock], remaining: Iterator[KVCacheBlock], block: KVCacheBlock
    ) -> NoReturn:
        """Raise for `block` (not held) after undoing the releases before it: restore each
        count and unlink every block, since none was linked before this call.
        """
        for head in self._run_heads:
            head.next_free_block = None
        for done in _before_current(blocks, remaining):
            if not done.is_null:
                done.ref_cnt += 1
                done.prev_free_block = done.next_free_block = None
        raise ValueError(f"free_blocks(): block {block.block_id} is not held")

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Strip the cache keys of these blocks without moving or releasing them."""
        if isinstance(block_ids, str | bytes) or not hasattr(block_ids, "__iter__"):
            raise ValueError(f"evict_blocks(): {block_ids!r} is not a collection of block ids")
        ids = tuple(block_ids)
        for block_id in ids:
            if (
                not isinstance(block_id, int)
                or isinstance(block_id, bool)
                or not 0 <= block_id < self.num_gpu_blocks
            ):
                raise ValueError(
                    f"evict_blocks(): block id {block_id!r} is outside [0, {self.num_gpu_blocks})"
                )
        for block_id in ids:
            self._remove_cached_block_hashes(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cache entry; refused (False, nothing changed) while any block is held."""
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used_blocks - 1,
            )
            return False
        self.cached_block_hash_to_block.clear()  # in place, as vLLM does
        self.cached_block_hashes_by_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached eviction candidates included."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable (non-null) blocks held."""
        total = self.num_gpu_blocks - 1
        if not total:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM's: the events queued since the last call; a pool without events queues none."""
        return []

    def emit_cached_block_events(
        self, request: Request, num_cached_blocks: int, block_size: int, kv_cache_group_id: int,
    ) -> None:
        """vLLM's: announce the blocks a prefix hit reused; a pool without events has none to
        queue (EventfulBlockPool's does)."""

    def emit_hit_block_events(
        self, request: Request, blocks: Sequence[KVCacheBlock], block_size: int,
        kv_cache_group_id: int, num_hit_tokens: int | None = None,
    ) -> None:
        """Announce a prefix hit of `num_hit_tokens` over `blocks` (its null placeholders
        skipped, a block it ends inside as its partial entry); a pool without
        events has none to queue (EventfulBlockPool's does)."""

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        """Only a sole, unhashed owner may write: hashed content is a function of its key."""
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None
