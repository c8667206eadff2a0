"""Layer 4: the one owner of blocks, reference counts, the free queue and the hash map."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, islice, repeat
from operator import add, length_hint
from typing import TYPE_CHECKING, NoReturn

from kvfuzz.kvcache.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    check_positive_int,
    group_id_suffix,
)

if TYPE_CHECKING:
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
    """Key -> one block, or -> {block_id: block} in insertion order when duplicated.

    Identical content cached twice is kept twice (no de-duplication), so block ids already
    handed out never change. The single-block form avoids an inner dict per key. BlockPool's
    two per-block loops (registration, eviction) handle that form on `_cache` directly and
    call the methods for the rest: a call per block is most of their cost.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """The earliest inserted block still present under key."""
        blocks = self._cache.get(key)
        if type(blocks) is dict:
            for block in blocks.values():  # the first; a loop costs less than next(iter(...))
                return block
        return blocks  # type: ignore[return-value]

    def get_one_block_run(
        self, block_hashes: Iterable[BlockHash], group_id: int
    ) -> list[KVCacheBlock]:
        """`get_one_block` of each hash's key in `group_id`, up to the first miss."""
        suffix = group_id_suffix(group_id)
        get = self._cache.get
        run: list[KVCacheBlock] = []
        append = run.append
        for block_hash in block_hashes:
            blocks = get(block_hash + suffix)
            if blocks is None:
                break
            if type(blocks) is dict:
                for blocks in blocks.values():  # the first, as in get_one_block
                    break
            append(blocks)
        return run

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        blocks = self._cache.get(key)
        if blocks is None:
            return False
        if type(blocks) is dict:
            return block_id in blocks
        return blocks.block_id == block_id

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        # A new key (the common case) costs one dict operation.
        blocks = self._cache.setdefault(key, block)
        if blocks is block:
            return
        if type(blocks) is dict:
            blocks[block.block_id] = block
        else:
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove only `block_id` under key; another single block under key is left alone."""
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if type(blocks) is dict:
            block = blocks.pop(block_id, None)
            if not blocks:
                del self._cache[key]
            return block
        if blocks.block_id != block_id:
            return None
        del self._cache[key]
        return blocks

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """All blocks of one pool. Block 0 is the null block: a placeholder for table positions that
    hold no KV (tokens outside a window); it is never queued, cached, counted or handed out.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int) -> None:
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
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Keys beyond the primary one (partial entries), per block id.
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Scratch heads of `release`'s two runs (head of the queue, tail of the queue): never
        # in the queue, and no link left on them between calls.
        self._run_heads = (KVCacheBlock(block_id=-1), KVCacheBlock(block_id=-1))
        # Token counts at hash block ends (entry k is k * hash_block_size), grown on demand: the
        # counts that keys record are these shared ints, so registering a block allocates none
        # and evicting one releases none (an int last touched when the block was registered).
        self._hash_block_ends: list[int] = [0]

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for this hash, or None if any group misses. Pure read."""
        get_one_block = self.cached_block_hash_to_block.get_one_block
        cached_blocks = []
        for group_id in kv_cache_group_ids:
            # Keys are built by plain concatenation here: calling the NewType costs a call.
            block = get_one_block(block_hash + group_id_suffix(group_id))  # type: ignore[arg-type]
            if block is None:
                return None
            cached_blocks.append(block)
        return cached_blocks

    def get_rightmost_cached_block(
        self, block_hashes: Sequence[BlockHash], indices: Iterable[int],
        kv_cache_group_ids: Sequence[int],
    ) -> tuple[int, list[KVCacheBlock]] | None:
        """The first of `indices` whose hash `get_cached_block` hits, with its blocks; None if
        none does. Pure read (a state group's right-to-left search)."""
        get = self.cached_block_hash_to_block._cache.get
        first = group_id_suffix(kv_cache_group_ids[0])
        for index in indices:
            block_hash = block_hashes[index]
            if get(block_hash + first) is None:  # type: ignore[operator]
                continue
            cached = self.get_cached_block(block_hash, kv_cache_group_ids)
            if cached is not None:
                return index, cached
        return None

    def get_cached_block_run(
        self, block_hashes: Sequence[BlockHash], kv_cache_group_ids: Sequence[int]
    ) -> tuple[list[KVCacheBlock], ...]:
        """The longest prefix of `block_hashes` that `get_cached_block` hits, one block list per
        group; the same blocks as calling it hash by hash until the first miss. Pure read.
        """
        get_run = self.cached_block_hash_to_block.get_one_block_run
        if len(kv_cache_group_ids) == 1:  # the common case: one run, nothing to reconcile
            return (get_run(block_hashes, kv_cache_group_ids[0]),)
        runs = []
        num_blocks = len(block_hashes)
        for group_id in kv_cache_group_ids:
            run = get_run(islice(block_hashes, num_blocks), group_id)
            num_blocks = len(run)
            runs.append(run)
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
        # A block's key is the fine hash at its end: a strided slice of the request's hashes.
        fine_hashes = request.block_hashes
        if block_size == self.hash_block_size:  # the common case: one hash per block
            new_hashes = fine_hashes[num_cached_blocks:num_full_blocks]
        else:
            scale, rest = divmod(block_size, self.hash_block_size)
            if rest:
                raise ValueError(f"cache_full_blocks(): block_size {block_size} is not a "
                                 f"multiple of hash_block_size {self.hash_block_size}")
            new_hashes = fine_hashes[(num_cached_blocks + 1) * scale - 1:
                                     num_full_blocks * scale:scale]
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        if num_cached_blocks < 0 or len(new_blocks) != num_new_blocks or (
            len(new_hashes) != num_new_blocks
        ):
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
        # Group 0's keys are the hashes themselves; the others' are built in C.
        keys: Iterable[BlockHashWithGroupId] = (
            map(add, new_hashes, repeat(group_id_suffix(kv_cache_group_id)))  # type: ignore[arg-type]
            if kv_cache_group_id else new_hashes
        )
        cache_map = self.cached_block_hash_to_block
        setdefault = cache_map._cache.setdefault
        scale = block_size // self.hash_block_size
        last = num_full_blocks * scale
        token_counts = self._ends_through(last)[(num_cached_blocks + 1) * scale:last + 1:scale]
        # (block, its key, the tokens its key covers), masked blocks left out, all in C.
        entries: Iterable[tuple[KVCacheBlock, BlockHashWithGroupId, int]] = zip(
            new_blocks, keys, token_counts
        )
        if block_mask is not None:
            entries = compress(entries, block_mask)
        for block, key, num_tokens in entries:
            if block.is_null:
                continue
            if block._block_hash is None:  # the slot, as in free_blocks
                # A block without a primary key has no extras either: nothing else to check,
                # so the slots are set directly (what set_block_hash does after its check).
                block._block_hash = key
                block._block_hash_num_tokens = num_tokens
                block._hashed = True
                # `insert`, with a new key (the common case) costing one dict operation.
                if setdefault(key, block) is not block:
                    cache_map.insert(key, block)
                continue
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
            fine_hashes[hash_index] + group_id_suffix(kv_cache_group_id)
        )
        block._block_hash = key
        block._block_hash_num_tokens = self._ends_through(hash_index + 1)[hash_index + 1]
        block._hashed = True
        # `insert` inlined for a new key (a decode step's cold path: the call costs as much).
        cache_map = self.cached_block_hash_to_block
        if cache_map._cache.setdefault(key, block) is not block:
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
            raise ValueError(f"block_size {block_size} is not a multiple of hash_block_size {hbs}")
        if num_tokens <= 0 or num_tokens % hbs or num_tokens // hbs > len(request.block_hashes):
            raise ValueError(
                f"num_tokens {num_tokens} is not a positive multiple of {hbs} within the "
                f"{len(request.block_hashes)} hashes of request {request.request_id!r}"
            )
        key: BlockHashWithGroupId = (  # type: ignore[assignment]
            request.block_hashes[num_tokens // hbs - 1] + group_id_suffix(kv_cache_group_id)
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
        cache = self.cached_block_hash_to_block._cache
        if cache.get(primary) is src_block and src_block.block_id not in extras_by_block:
            # The common case, one key that the source alone holds: what the removal and the
            # insertion below do, without their checks, the slots set directly.
            del cache[primary]
            cache[primary] = dst_block
            src_block._block_hash = src_block._block_hash_num_tokens = None
            src_block._hashed = False
            dst_block._block_hash = primary
            dst_block._block_hash_num_tokens = num_tokens
            dst_block._hashed = True
            return
        extras = sorted(extras_by_block.get(src_block.block_id, ()))
        # The entries stay live, only their block changes: no KV event (the base removal).
        BlockPool._remove_cached_block_hashes(self, src_block)
        for key in (primary, *extras):
            self._insert_block_hash(key, dst_block, num_tokens)  # type: ignore[arg-type]

    def carries_key(self, block: KVCacheBlock, key: BlockHashWithGroupId) -> bool:
        """The block is reachable under `key`, as its primary key or another one."""
        return block._block_hash == key or self.cached_block_hash_to_block.contain(
            key, block.block_id
        )

    def _insert_block_hash(
        self, key: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int
    ) -> None:
        primary = block._block_hash
        if primary is None:  # a block without a primary key has no other key either
            # `set_block_hash` after its check, and `insert` of a new key in one dict operation.
            block._block_hash = key
            block._block_hash_num_tokens = num_tokens
            block._hashed = True
            if self.cached_block_hash_to_block._cache.setdefault(key, block) is not block:
                self.cached_block_hash_to_block.insert(key, block)
            return
        if primary == key or self.cached_block_hash_to_block.contain(key, block.block_id):
            return
        self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert(key, block)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> None:
        """Drop every key of the block (primary and extras) from the map and the block."""
        extras_by_block = self.cached_block_hashes_by_block
        extras = extras_by_block.pop(block.block_id, ()) if extras_by_block else ()
        key = block._block_hash
        if key is None and not extras:
            return
        cache = self.cached_block_hash_to_block
        if key is not None:
            cache.pop(key, block.block_id)
        for extra in extras:
            cache.pop(extra, block.block_id)
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
        pop = self.cached_block_hash_to_block._cache.pop
        for _ in range(num_blocks):
            ret.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            # Only a block with a primary key has keys (extras come after the primary). The
            # common case, a primary key alone, is `_remove_cached_block_hashes` inlined, and
            # the block alone under its key is `BlockHashToBlockMap.pop` inlined.
            if block._hashed:  # the key itself is read only when there is one
                key = block._block_hash
                if extras_by_block and block.block_id in extras_by_block:
                    self._remove_cached_block_hashes(block)
                else:
                    entry = pop(key, None)  # one lookup when the block is alone under its key
                    if entry is not block and entry is not None:
                        # Several blocks under the key: put them back, drop only this one.
                        cache_map = self.cached_block_hash_to_block
                        cache_map._cache[key] = entry
                        cache_map.pop(key, block.block_id)
                    block._block_hash = block._block_hash_num_tokens = None
                    block._hashed = False
            block.ref_cnt = 1
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head
        queue.num_free_blocks -= num_blocks
        return ret

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
        self.cached_block_hash_to_block = BlockHashToBlockMap()
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

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        """Only a sole, unhashed owner may write: hashed content is a function of its key."""
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None
