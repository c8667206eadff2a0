"""KV cache events: what an external router learns about the prefix cache (docs/spec.md §3.10).

`BlockStored` announces keys a `cache_full_blocks` (`register_full_blocks`) or
`cache_partial_block` (`register_partial_block`) call registered (one event per run of
consecutive registered blocks: vLLM's one event per call also carries the token ids of the null
and masked blocks between, docs/findings/026), `BlockRemoved` a key no block holds any more, `AllBlocksCleared` a successful reset. A pool
with events on is an `EventfulBlockPool`: the plain `BlockPool` with each mutating method
wrapped, so pools without events pay nothing.

The events carry vLLM 0.34's fields in its order (vllm/distributed/kv_events.py:55-119);
kvcache fills `lora_id`, `medium` (always `MEDIUM_GPU`), `lora_name`, `group_idx` and
`session_id`, with a hash lookahead `lookahead_token_ids` (each block's lookahead tokens), the
manager's `take_events` the group's `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`,
and leaves None what it does not model (`locality`, `ownership`). `extra_keys` holds one entry per stored block, as vLLM's
(block_pool.py:293-311, kv_cache_utils.py:674-700): the block's extra keys over the window its
hash covers (the block and its lookahead tokens), tags stripped (the LoRA name, `(mm identifier,
offset)`, the salt, the embeddings' digest, and kvcache's token-id mask bytes), None for none.
Unlike vLLM's, `lora_id`, `medium` and `lora_name` default to None. Hashes are published as
vLLM's are (`maybe_convert_block_hash`): the low 64 bits as an int, the bytes themselves where
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is "0" (kvfuzz's harness sets it: it reads hashes as
content).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfuzz.kvcache.block_pool import BlockPool
from kvfuzz.kvcache.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    ExternalBlockHash,
    KVCacheBlock,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
    resolve_block_hashes,
    untag_extra_keys,
)

if TYPE_CHECKING:
    from kvfuzz.kvcache.request import Request


MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


@dataclass
class BlockStored:
    """Consecutive blocks of one group cached under `block_hashes`, chained on
    `parent_block_hash` (None: the chain starts at token 0); `token_ids` are the tokens of the
    range those blocks cover, `block_size` per block."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


@dataclass
class BlockRemoved:
    """No block of the group holds these hashes any more."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass
class AllBlocksCleared:
    """The prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

def event_extra_keys(
    request: Request, start: int, end: int, lookahead: int
) -> tuple[Any, ...] | None:
    """A BlockStored entry for block [start, end): its extra keys over [start, end + lookahead),
    each without its tag (a multimodal key keeps `(identifier, offset)`), or None."""
    return untag_extra_keys(generate_block_hash_extra_keys(request, start, end + lookahead, 0)[0])


def _split(key: BlockHashWithGroupId) -> tuple[BlockHash, int]:
    return get_block_hash(key), get_group_id(key)


class EventfulBlockPool(BlockPool):
    """A BlockPool that queues KV events; `take_events` hands them over."""

    kv_event_queue: list[KVCacheEvent]
    _evicting_inline: bool = False
    """While get_new_blocks runs: it reports what it evicts itself, once, in pop order."""

    @classmethod
    def enable_on(cls, pool: BlockPool) -> EventfulBlockPool:
        """Turn events on for a pool already shared by the managers (before any request)."""
        pool.__class__ = cls
        assert isinstance(pool, EventfulBlockPool)
        pool.kv_event_queue = []
        return pool

    def take_events(self) -> list[KVCacheEvent]:
        """Every event since the last call, oldest first; the queue is then empty."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def _stored(
        self, request: Request, block_hashes: list[BlockHash], parent: BlockHash | None,
        token_ids: list[int], block_size: int, group_idx: int, first_block: int,
    ) -> BlockStored:
        """A BlockStored of `request`'s blocks (the first at `first_block` blocks of
        `block_size`), with its adapter, session and each block's extra keys."""
        lora = getattr(request, "lora_request", None)
        lookahead = self.num_hash_lookahead_tokens
        starts = range(first_block * block_size,
                       (first_block + len(block_hashes)) * block_size, block_size)
        extra = [event_extra_keys(request, start, start + block_size, lookahead)
                 for start in starts]
        tokens = request.all_token_ids
        # vLLM's (block_pool.py:297-315, 341-344): the tokens after each block its hash covers.
        lookahead_ids = [list(tokens[start + block_size:start + block_size + lookahead])
                         for start in starts] if lookahead else None
        return BlockStored(
            [maybe_convert_block_hash(h) for h in block_hashes],
            None if parent is None else maybe_convert_block_hash(parent), token_ids, block_size,
            lora_id=lora.lora_int_id if lora is not None else None, medium=MEDIUM_GPU,
            lora_name=lora.lora_name if lora is not None else None, extra_keys=extra or None,
            group_idx=group_idx,
            session_id=getattr(request, "session_id", None), lookahead_token_ids=lookahead_ids,
        )

    def emit_cached_block_events(
        self, request: Request, num_cached_blocks: int, block_size: int, kv_cache_group_id: int,
    ) -> None:
        """vLLM's: announce the request's first `num_cached_blocks` blocks, which a prefix hit
        reused, as one BlockStored from token 0; the cache is left as it is."""
        if not num_cached_blocks:
            return
        self._queue_runs(request, [True] * num_cached_blocks, 0, block_size, kv_cache_group_id)

    def emit_hit_block_events(
        self, request: Request, blocks: Sequence[KVCacheBlock], block_size: int,
        kv_cache_group_id: int, num_hit_tokens: int | None = None,
    ) -> None:
        """Announce a prefix hit's `blocks` (the request's first), which it reused: one
        BlockStored per run of its real blocks, null placeholders skipped (docs/spec.md
        §3.10, finding 027). A block the hit of `num_hit_tokens` ends inside is announced
        under the key it holds for the request: its full key, else the partial entry the hit
        ends at, else not at all, never under a key no block holds (finding 036); the cache
        is left as it is."""
        full = len(blocks) if num_hit_tokens is None else min(
            len(blocks), num_hit_tokens // block_size)
        tail = blocks[full] if full < len(blocks) and not blocks[full].is_null else None
        if tail is not None:
            hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size,
                                          block_size)
            if full < len(hashes) and self.carries_key(
                    tail, make_block_hash_with_group_id(hashes[full], kv_cache_group_id)):
                full, tail = full + 1, None
        self._queue_runs(request, [not b.is_null for b in blocks[:full]], 0, block_size,
                         kv_cache_group_id)
        if tail is not None and num_hit_tokens is not None:
            n = num_hit_tokens // self.hash_block_size
            if self.carries_key(tail, make_block_hash_with_group_id(
                    request.block_hashes[n - 1], kv_cache_group_id)):
                self._queue_partial(request, num_hit_tokens, kv_cache_group_id)

    def _queue_runs(self, request: Request, keyed: Sequence[bool], first: int, block_size: int,
                    kv_cache_group_id: int) -> None:
        """One BlockStored per run of the blocks from `first` whose `keyed` entry is true, each
        chained on the position before it, with exactly its blocks' token ids."""
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        run_start: int | None = None
        for i in range(first, first + len(keyed) + 1):
            if i < first + len(keyed) and keyed[i - first]:
                if run_start is None:
                    run_start = i
            elif run_start is not None:
                self.kv_event_queue.append(self._stored(
                    request,
                    list(hashes[run_start:i]),
                    hashes[run_start - 1] if run_start else None,
                    list(request.all_token_ids[run_start * block_size:i * block_size]),
                    block_size,
                    kv_cache_group_id,
                    run_start,
                ))
                run_start = None

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
        super().register_full_blocks(request, blocks, num_cached_blocks, num_full_blocks,
                                     block_size, kv_cache_group_id, block_mask)
        if num_cached_blocks >= num_full_blocks:
            return
        # Null and masked blocks get no key, so they split the events.
        self._queue_runs(request, [not blocks[i].is_null and (
            block_mask is None or block_mask[i - num_cached_blocks])
            for i in range(num_cached_blocks, num_full_blocks)],
            num_cached_blocks, block_size, kv_cache_group_id)

    def register_partial_block(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        key: BlockHashWithGroupId,
        replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId:
        known = not replace_existing_hashes and self.carries_key(block, key)
        super().register_partial_block(request, block, num_tokens, key, replace_existing_hashes)
        if not known:
            self._queue_partial(request, num_tokens, get_group_id(key))
        return key

    def _queue_partial(self, request: Request, num_tokens: int, group_idx: int) -> None:
        """The BlockStored of the partial entry at `num_tokens` (a multiple of the hash block
        size): its last hash block, chained on the hash before it (vLLM's,
        block_pool.py:533-579)."""
        hbs = self.hash_block_size
        n = num_tokens // hbs
        self.kv_event_queue.append(self._stored(
            request,
            [request.block_hashes[n - 1]],
            request.block_hashes[n - 2] if n > 1 else None,
            list(request.all_token_ids[(n - 1) * hbs: n * hbs]),
            hbs,
            group_idx,
            n - 1,
        ))

    def _removed(self, keys: list[BlockHashWithGroupId]) -> None:
        """BlockRemoved for each key no block holds any more (another copy keeps it)."""
        cache = self.cached_block_hash_to_block._cache
        for key in keys:
            if key not in cache:
                block_hash, group = _split(key)
                self.kv_event_queue.append(
                    BlockRemoved([maybe_convert_block_hash(block_hash)], MEDIUM_GPU, group))

    def _keys_of(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        """The block's keys, primary first."""
        if block._block_hash is None:
            return []
        return [block._block_hash, *self.cached_block_hashes_by_block.get(block.block_id, ())]

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> None:
        keys = self._keys_of(block)
        super()._remove_cached_block_hashes(block)
        if not self._evicting_inline:
            self._removed(keys)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        # The base class evicts inline; the keys of the blocks it will pop are read first.
        ahead = self.free_block_queue.get_all_free_blocks()
        keys = [
            key for block in ahead[: num_blocks if isinstance(num_blocks, int) else 0]
            for key in self._keys_of(block)
        ]
        self._evicting_inline = True
        try:
            blocks = super().get_new_blocks(num_blocks)
        finally:
            self._evicting_inline = False
        self._removed(keys)
        return blocks

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        if done:
            self.kv_event_queue.append(AllBlocksCleared())
        return done
