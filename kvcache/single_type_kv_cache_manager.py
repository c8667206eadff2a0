"""Layer 3: per-group arithmetic (tokens -> blocks), block tables and the per-kind hit search."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvfuzz.kvcache.block_math import (
    aligned_num_blocks,
    chunked_local_skipped_tokens,
    first_blocks_to_allocate,
    first_blocks_to_allocate_undropped,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
    replay_boundaries,
    is_partial_hit,
    required_blocks,
    running_blocks_to_allocate,
    sliding_window_hit_blocks,
    sliding_window_skipped_tokens,
    trim_hit,
)
from kvfuzz.kvcache.block_pool import BlockPool
from kvfuzz.kvcache.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from kvfuzz.kvcache.kv_cache_utils import (
    BlockHashList,
    KVCacheBlock,
    cdiv,
    group_id_suffix,
    null_prefix_len,
    resolve_block_hashes,
)
from kvfuzz.kvcache.reachable_blocks import (
    every_block_reachable,
    state_blocks_reachable,
    window_blocks_reachable,
)

if TYPE_CHECKING:
    from kvfuzz.kvcache.request import Request

HitBlocks = tuple[list[KVCacheBlock], ...]


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group; every group shares the coordinator's one pool."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = False
    # Whether `cache_blocks` also registers a partial tail block (set per instance).
    caches_partial_tail_block = False
    # Whether `get_num_skipped_tokens` can be positive: only then can blocks leave the window.
    recycles_blocks: ClassVar[bool] = False

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        needs_kv_cache_zeroing: bool = False,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise ValueError(
                "kvcache does not implement decode or prefill context parallelism: "
                f"dcp_world_size={dcp_world_size!r}, pcp_world_size={pcp_world_size!r}"
            )
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        # Specs are frozen: read once, not on every cache_blocks.
        self._prefix_cacheable = kv_cache_spec.prefix_cacheable
        # Whether this kind masks blocks out of registration: the call is left out otherwise.
        self._masks_blocks = type(self).reachable_block_mask is not every_block_reachable
        self.block_pool = block_pool
        self._hash_block_size = block_pool.hash_block_size
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        # What this group's keys append to a block hash (a partial block's key is built here).
        self._group_suffix = group_id_suffix(kv_cache_group_id)
        self.scheduler_block_size = scheduler_block_size
        # The hybrid coordinator may lower this (fine-grained hits) after validating groups.
        self.cache_hit_alignment_tokens = scheduler_block_size
        # Recycling kinds (window, chunk) cap what the full-sequence gate asks for.
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        # vLLM's rule: the worker zeroes new attention blocks only (never a ring's or a state
        # group's), and only when the config needs zeroing.
        self._record_new_block_ids = (
            needs_kv_cache_zeroing and isinstance(kv_cache_spec, AttentionSpec)
            and not isinstance(kv_cache_spec, CircularBufferSpec)
        )
        self.new_block_ids: list[int] = []
        # A plain dict: inspecting a request must never create its entry.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading entries already registered (or null, or hits). Membership also marks a
        # request that went through its first allocation (the predictor's fast path).
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        # Set by the coordinator for groups that take the EAGLE last-block drop.
        self.use_eagle = False
        # Set by KVCacheManager (enable_mamba_shared_prefix_checkpoint, narrowed): a Mamba
        # 'align' group also registers the state at the request's junction (docs/spec.md §11.3).
        self.shared_prefix_checkpoint = False
        # Set by the coordinator: sparse prefix-cache retention (§4.9.2) and whether replay
        # boundaries follow EAGLE's (any group drops the last matched block).
        self.retention_interval: int | None = None
        self.replay_use_eagle = False
        # The reachable boundaries of a vLLM caller's `cache_blocks`, during that call.
        self._call_boundaries: tuple[int, ...] | None = None
        # Tier B copy-on-write: request -> (table index, shared source block) ...
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        # ... and (source, private copy) pairs waiting for the worker.
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        # Boundary states for a KV connector to offload, (request, group, block, the tokens
        # its state covers): an align-mode table is not append-only, so a connector is told
        # the exact block (Mamba 'align' only; drained by take_pending_boundary_state_offloads).
        self._pending_boundary_state_offloads: list[tuple[str, int, KVCacheBlock, int]] = []

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Blocks that adopting the hits and growing to `num_tokens` slots take from the free
        count: new blocks, evictable hit blocks rescued from the queue, and a CoW copy.

        Pure (Mamba's leaves its checkpoint record for the allocation to commit).
        `num_tokens_main_model` and `prefill_end` only matter to recurrent kinds.
        """
        num_required_blocks = (
            required_blocks(num_tokens, self.block_size, self.max_admission_blocks_per_request)
            if apply_admission_cap
            else -(-num_tokens // self.block_size)  # `required_blocks` uncapped, inlined
        )
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "a running request never adopts hits"
            return running_blocks_to_allocate(
                num_required_blocks, len(self.req_to_blocks[request_id])
            )
        req_blocks = self.req_to_blocks.get(request_id)
        num_req_blocks = len(req_blocks) if req_blocks is not None else 0
        # Only recycling kinds skip tokens: the others spare the call.
        num_skipped_blocks = (
            self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
            if self.recycles_blocks else 0
        )
        if not new_computed_blocks:  # no hits: no per-block pass, no partial hit
            return first_blocks_to_allocate(
                num_required_blocks, num_req_blocks, num_skipped_blocks, (), False
            )
        partial_hit = is_partial_hit(
            len(new_computed_blocks), num_local_computed_tokens, self.block_size
        )
        # Evictable: in the free queue (which never holds the null block).
        if num_skipped_blocks <= num_req_blocks:  # no hit dropped: only their count matters
            return first_blocks_to_allocate_undropped(
                num_required_blocks,
                num_req_blocks,
                len(new_computed_blocks),
                len([block for block in new_computed_blocks
                     if not block.ref_cnt and block.prev_free_block is not None]),
                partial_hit,
            )
        return first_blocks_to_allocate(
            num_required_blocks,
            num_req_blocks,
            num_skipped_blocks,
            [not block.ref_cnt and block.prev_free_block is not None
             for block in new_computed_blocks],
            partial_hit,
        )

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> None:
        """Adopt prefix-hit blocks on a request's first allocation: touch them so they can no
        longer be evicted, and pad the part outside the window with nulls.
        """
        assert request_id not in self.req_to_blocks, f"{request_id} already has a table"
        num_skipped_blocks = (
            self.get_num_skipped_tokens(num_local_computed_tokens + num_external_computed_tokens)
            // self.block_size
            if self.recycles_blocks else 0
        )
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if not new_computed_blocks:  # nothing to touch (a lookup's miss, most often)
            self.req_to_blocks[request_id] = [self._null_block] * num_skipped_blocks
            self.num_cached_block[request_id] = num_skipped_blocks
            return
        if self.enable_caching:
            self.block_pool.touch_own(new_computed_blocks)  # allocate_slots checked them
        else:
            assert not new_computed_blocks, "hits without prefix caching"
        req_blocks = [self._null_block] * num_skipped_blocks
        req_blocks.extend(new_computed_blocks)
        self.req_to_blocks[request_id] = req_blocks
        self.num_cached_block[request_id] = len(req_blocks)
        if is_partial_hit(len(new_computed_blocks), num_local_computed_tokens, self.block_size):
            # Count only the full blocks as cached, so the private copy gets hashed once full.
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, new_computed_blocks[-1])
            self.num_cached_block[request_id] = block_idx

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Blocks for KV connector tokens after the adopted hits, up to the end of the prefix;
        those wholly outside the window stay nulls (after every group adopted its hits)."""
        num_prefix_tokens = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_prefix_tokens)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(
                num_prefix_tokens - num_skipped_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = max(0, -(-num_prefix_tokens // self.block_size) - len(req_blocks))
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(block.block_id for block in new_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Grow the table to `num_tokens` slots; the CoW copy of a partial hit comes first."""
        cow_blocks: list[KVCacheBlock] = []
        if self._partial_hit_reqs and request_id in self._partial_hit_reqs:
            block_idx, source_block = self._partial_hit_reqs.pop(request_id)
            cow_block = self.block_pool.get_new_blocks(1)[0]
            self._apply_cow(request_id, block_idx, source_block, cow_block)
            # Recorded even without zeroing: the worker must learn about the copy target.
            self.new_block_ids.append(cow_block.block_id)
            cow_blocks.append(cow_block)
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_new_blocks = -(-num_tokens // self.block_size) - len(req_blocks)  # cdiv, inlined
        if num_new_blocks <= 0:
            return cow_blocks
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self._record_new_block_ids:
            self.new_block_ids.extend([block.block_id for block in new_blocks])
        return cow_blocks + new_blocks if cow_blocks else new_blocks

    def _apply_cow(
        self, request_id: str, block_idx: int, source_block: KVCacheBlock, cow_block: KVCacheBlock
    ) -> None:
        """Point the table at the private copy and retain both copy endpoints.

        `source_block` keeps the reference its touch took although it leaves the table;
        `cow_block` gets one more beyond the table's. The consumer of the pending copy frees
        both after copying, so a same-step free cannot recycle either before the copy ran.
        """
        req_blocks = self.req_to_blocks[request_id]
        assert block_idx < len(req_blocks) and req_blocks[block_idx] is source_block
        assert not source_block.is_null and source_block.ref_cnt > 0
        req_blocks[block_idx] = cow_block
        self._pending_cow_copies.append((source_block, cow_block))
        cow_block.ref_cnt += 1

    def cache_blocks(
        self, request: Request, num_tokens: int, retention_interval: int | None = None, *,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Register the request's full blocks up to `num_tokens` (and not beyond its hashes).
        Given `replay_boundaries` (vLLM's callers), this call's `retention_interval` and
        boundaries stand in for the coordinator's."""
        if replay_boundaries is not None:
            return self._cache_blocks_with(request, num_tokens, retention_interval,
                                           replay_boundaries)
        if not self._prefix_cacheable:
            return
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_hashed_tokens = len(request.block_hashes) * self._hash_block_size
        num_full_blocks = (
            num_tokens if num_tokens < num_hashed_tokens else num_hashed_tokens
        ) // self.block_size
        if num_cached_blocks < num_full_blocks:
            blocks = self.req_to_blocks[request_id]
            if num_full_blocks > len(blocks):
                # A request longer than max_model_len: its table stops there, and only the
                # blocks it has are cached (as vLLM's slice of the table does).
                num_full_blocks = len(blocks)
            self.block_pool.register_full_blocks(
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                self.block_size,
                self.kv_cache_group_id,
                self._reachable_mask(num_cached_blocks, num_full_blocks, request)
                if self._masks_blocks else None,
            )
            self.num_cached_block[request_id] = num_full_blocks
        if self.caches_partial_tail_block:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        """Tier B: register the prompt's last hash boundary inside a block (full attention)."""

    # vLLM's class-level mask (reachable_blocks.py); callable without a manager.
    reachable_block_mask = staticmethod(every_block_reachable)

    def _reachable_mask(
        self, start_block: int, end_block: int, request: Request
    ) -> list[bool] | None:
        """`reachable_block_mask` for `request`'s blocks [start, end) under this group's
        alignment, EAGLE drop and retention interval (with its reachable boundaries)."""
        retention = self.retention_interval
        return self.reachable_block_mask(
            start_block, end_block, self.cache_hit_alignment_tokens, self.kv_cache_spec,
            self.use_eagle, retention,
            () if retention is None else self._reachable_boundaries(request),
        )

    def _cache_blocks_with(
        self, request: Request, num_tokens: int, retention_interval: int | None,
        replay_boundaries: Sequence[int],
    ) -> None:
        """`cache_blocks` under vLLM's per-call retention interval and reachable boundaries
        (its caller's replay boundaries and junction), the manager's own restored after."""
        own = self.retention_interval, self._call_boundaries
        self.retention_interval, self._call_boundaries = retention_interval, tuple(
            replay_boundaries)
        try:
            self.cache_blocks(request, num_tokens)
        finally:
            self.retention_interval, self._call_boundaries = own

    def _reachable_boundaries(self, request: Request) -> tuple[int, ...]:
        """Positions whose blocks a retention mask keeps for `request`: its replay boundaries
        and its shared-prefix junction (§6.3; with EAGLE also one block below it), or those a
        vLLM caller gave `cache_blocks`."""
        if self._call_boundaries is not None:
            return self._call_boundaries
        boundaries = replay_boundaries(
            request.num_prompt_tokens, self.scheduler_block_size, self.replay_use_eagle
        )
        junction = request.shared_prefix_boundary
        if not junction:
            return boundaries
        return (*boundaries, junction, *((junction - self.block_size,) if self.use_eagle else ()))

    def _forget(self, request_id: str) -> list[KVCacheBlock] | None:
        """Drop every per-request entry; the request's table as it was (None without one)."""
        self.num_cached_block.pop(request_id, None)
        if self._partial_hit_reqs:  # almost always empty: skips the call
            self._partial_hit_reqs.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, None)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; return its blocks, leading nulls dropped, still referenced.

        The caller frees them later, in reverse order (tail first).
        """
        req_blocks = self._forget(request_id)
        if not req_blocks:
            return []
        if req_blocks[0] is self._null_block:  # only windows null a head
            return req_blocks[null_prefix_len(req_blocks, self._null_block):]
        return req_blocks

    def free(self, request_id: str) -> None:
        """Release the request's blocks tail first, so a chain is evicted from its end and the
        surviving cached prefix stays reachable.
        """
        blocks = self._forget(request_id)
        if not blocks:
            return
        null_block = self._null_block
        # Only windows null a head, released before: one reversed slice leaves it out.
        num_nulls = null_prefix_len(blocks, null_block) if blocks[0] is null_block else 0
        if num_nulls < len(blocks):  # this pool's blocks, as a list
            self.block_pool.release(blocks[:num_nulls - 1:-1] if num_nulls else blocks[::-1])

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Null and release the blocks no future token attends to.

        Nulls only ever fill a prefix of these tables (`null_prefix_len`), so the newly skipped
        blocks run from the end of that prefix to the last skipped block: released from the
        last one down, and nulled, by slices.
        """
        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        last = num_skipped_tokens // self.block_size - 1
        if last >= len(blocks):
            last = len(blocks) - 1
        null_block = self._null_block
        if last < 0 or blocks[last] is null_block:  # most steps: nothing newly skipped
            return
        first = null_prefix_len(blocks, null_block)
        removed = blocks[last:first - 1:-1] if first else blocks[last::-1]
        blocks[first:last + 1] = [null_block] * (last + 1 - first)
        self.block_pool.release(removed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no future token attends to, given `num_computed_tokens`."""
        return 0

    def new_step_starts(self) -> None:
        """Hook at the start of each scheduling step; nothing to do for attention kinds."""

    @property
    def records_new_block_ids(self) -> bool:
        """Whether this manager's new blocks are recorded for the worker to zero."""
        return self._record_new_block_ids

    def take_new_block_ids(self) -> list[int]:
        ids = self.new_block_ids
        self.new_block_ids = []
        return ids

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        copies = self._pending_cow_copies
        self._pending_cow_copies = []
        return copies

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """vLLM's: drain the boundary states offered to a connector since the last call."""
        pending = self._pending_boundary_state_offloads
        self._pending_boundary_state_offloads = []
        return pending

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """vLLM's: a finishing request's boundary state still in its table; none but Mamba
        'align' keeps one."""
        return None

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[HitBlocks, int]:
        """Longest prefix of at most `max_length` tokens cached in every listed group, as one
        block list per group (skipped positions hold the null block) and its length.

        A classmethod: groups sharing a spec are looked up jointly, so all context comes in as
        arguments. Pure with respect to the pool.
        """
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[HitBlocks, int]:
        assert isinstance(kv_cache_spec, FullAttentionSpec | ChunkedLocalAttentionSpec)
        block_size = kv_cache_spec.block_size
        hash_block_size = block_pool.hash_block_size
        assert block_size % hash_block_size == 0, (block_size, hash_block_size)
        fine_grained = alignment_tokens < block_size and block_size % alignment_tokens == 0
        # Phase 1: hashes are chained, so the first miss ends the hit.
        computed = block_pool.get_cached_block_run(
            block_hashes, block_size, 0, max_length // block_size, kv_cache_group_ids)
        num_full = len(computed[0])
        hit_length = num_full * block_size

        if fine_grained:
            # Phase 2: interior boundaries of the first missing block, longest first. Only
            # partial entries can match: its end boundary already missed.
            assert alignment_tokens == hash_block_size, (alignment_tokens, hash_block_size)
            scale = block_size // alignment_tokens
            first = num_full * scale
            top = min(first + scale - 1, max_length // alignment_tokens, len(block_hashes))
            found = block_pool.get_rightmost_cached_block(
                block_pool.fine_hashes(block_hashes, block_size)[0], hash_block_size,
                range(top - 1, first - 1, -1), kv_cache_group_ids,
            )
            if found is not None:
                fine_idx, cached = found
                for blocks, block in zip(computed, cached):
                    blocks.append(block)
                hit_length = (fine_idx + 1) * alignment_tokens

        hit_length, num_blocks = trim_hit(
            hit_length, block_size, alignment_tokens, drop_eagle_block
        )
        for blocks in computed:
            del blocks[num_blocks:]
        return computed, hit_length

    def __init__(self, kv_cache_spec: KVCacheSpec, **kwargs: object) -> None:
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]
        self.caches_partial_tail_block = self.block_size != self._hash_block_size

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        """Register the prompt's last hash boundary when it ends inside a block (Tier B).

        A resend matches at most `prompt - 1` tokens; EAGLE reads the whole prompt before
        dropping a unit. Interior boundaries other than this one are not registered.
        """
        hash_block_size = self._hash_block_size
        num_units = (request.num_prompt_tokens - (0 if self.use_eagle else 1)) // hash_block_size
        num_hashes = len(request.block_hashes)
        boundary = (num_units if num_units < num_hashes else num_hashes) * hash_block_size
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        block_idx = boundary // self.block_size
        if block_idx >= len(blocks):
            return
        block = blocks[block_idx]
        if block.is_null:
            return
        key = request.block_hashes[boundary // hash_block_size - 1] + self._group_suffix
        if self.block_pool.carries_key(block, key):
            return  # every step after the first: already registered
        self.block_pool.register_partial_block(request, block, boundary, key)


class RSWAManager(FullAttentionManager):
    """Full attention whose decode keeps only the last `rswa_window` tokens: the blocks wholly
    between the prompt's last block and the window are released (docs/spec.md §12.2)."""

    recycles_blocks: ClassVar[bool] = True

    def __init__(self, kv_cache_spec: RSWASpec, **kwargs: object) -> None:
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]
        self.rswa_window = kv_cache_spec.rswa_window

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Release [cdiv(prompt, bs), max(prompt, processed - window) // bs), walking back from
        the end and stopping at the first null (the part below was released earlier)."""
        if num_prompt_tokens is None:
            return  # without a prompt length there is no gap: full attention skips nothing
        window_start = processed_computed_tokens - self.rswa_window
        if window_start <= num_prompt_tokens:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        block_size = self.block_size
        first = -(-num_prompt_tokens // block_size)
        last = min(window_start // block_size, len(blocks))
        null_block = self._null_block
        removed: list[KVCacheBlock] = []
        for i in range(last - 1, first - 1, -1):
            if blocks[i] is null_block:
                break
            removed.append(blocks[i])
            blocks[i] = null_block
        if removed:
            self.block_pool.release(removed)  # the table's own blocks: no checks to repeat


class CircularBufferManager(FullAttentionManager):
    """One ring block per request, claimed at its first allocation and kept until it is freed;
    no hits, no caching, no zeroing (docs/spec.md §12.3)."""

    def __init__(self, kv_cache_spec: CircularBufferSpec, **kwargs: object) -> None:
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, *args: Any, **kwargs: Any
    ) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        return self._claim_ring_block(request_id)

    def _claim_ring_block(self, request_id: str) -> list[KVCacheBlock]:
        """The request's one ring block, taken if it has none yet."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        if req_blocks:
            return []
        new_blocks = self.block_pool.get_new_blocks(1)
        req_blocks.extend(new_blocks)
        return new_blocks

    def add_local_computed_blocks(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        """Nothing to adopt: the ring is claimed by the allocation."""

    def allocate_external_computed_blocks(self, request_id: str, *args: Any, **kwargs: Any
                                          ) -> None:
        """External tokens claim the ring, whatever their count (it is never zeroed)."""
        self._claim_ring_block(request_id)

    def cache_blocks(
        self, request: Request, num_tokens: int, retention_interval: int | None = None, *,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Scratch: never registered."""

    @classmethod
    def find_longest_cache_hit(  # type: ignore[override]
        cls, block_hashes: BlockHashList, max_length: int, kv_cache_group_ids: Sequence[int],
        *args: Any,
    ) -> tuple[HitBlocks, int]:
        return tuple([] for _ in kv_cache_group_ids), 0


class EncoderOnlyAttentionManager(SingleTypeKVCacheManager):
    """A group that takes no KV cache (docs/spec.md §12.4): a scheduled request gets an empty
    table, no block is ever predicted, allocated, cached or hit."""

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, *args: Any, **kwargs: Any
    ) -> int:
        return 0

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        self.req_to_blocks.setdefault(request_id, [])
        return []

    def add_local_computed_blocks(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        """Nothing to adopt: the group is never prefix-cached."""

    def allocate_external_computed_blocks(self, request_id: str, *args: Any, **kwargs: Any
                                          ) -> None:
        """Nothing to load: the group keeps no KV."""

    def cache_blocks(
        self, request: Request, num_tokens: int, retention_interval: int | None = None, *,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        raise ValueError("encoder-only attention keeps no KV; prefix caching must be off")

    @classmethod
    def find_longest_cache_hit(  # type: ignore[override]
        cls, block_hashes: BlockHashList, max_length: int, kv_cache_group_ids: Sequence[int],
        *args: Any,
    ) -> tuple[HitBlocks, int]:
        return tuple([] for _ in kv_cache_group_ids), 0


class SlidingWindowManager(SingleTypeKVCacheManager):
    recycles_blocks: ClassVar[bool] = True

    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs: object) -> None:
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]
        self.sliding_window = kv_cache_spec.sliding_window
        self.extra_retained_tokens = kv_cache_spec.extra_retained_tokens

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[HitBlocks, int]:
        """The rightmost window of `need` cached blocks whose end is a valid hit boundary
        (longest hit first); with none, the cached run from block 0 (shorter than a window).

        Window ends are tried right to left. A window is probed left to right in one pool
        call; its first miss rules out every window containing it, so the next end tried is
        that miss. The same result as vLLM's block-by-block right-to-left scan, with one
        probe per block at most.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        # vLLM's scan decides on a hit, so even a window of one token needs one cached block.
        need = max(
            sliding_window_hit_blocks(kv_cache_spec.sliding_window, block_size, drop_eagle_block),
            1,
        )
        max_num_blocks = min(max_length // block_size, len(hashes))
        # Aligned (the block is the hit unit): every block boundary can end a hit, and no trim
        # to the alignment is needed.
        aligned = block_size == alignment_tokens
        edge_shift = 1 if drop_eagle_block else 0
        computed: HitBlocks | None = None
        # The cached run from block 0, once a window starting there has been probed.
        head_run: HitBlocks | None = None
        end = max_num_blocks
        while end >= need:
            if not aligned and not cls._is_hit_end(end, edge_shift, block_size, alignment_tokens):
                end -= 1
                continue
            run = block_pool.get_cached_block_run(
                hashes, block_size, end - need, end, kv_cache_group_ids)
            num_hits = len(run[0])
            if num_hits == need:
                null_blocks = [block_pool.null_block] * (end - need)
                computed = tuple(null_blocks + blocks for blocks in run)
                break
            if end == need:
                head_run = run
            end = end - need + num_hits
        if computed is None:
            # The run reaching block 0 is a hit even when shorter than the window.
            computed = head_run or block_pool.get_cached_block_run(
                hashes, block_size, 0, max_num_blocks, kv_cache_group_ids
            )
            if not aligned:
                num_blocks = len(computed[0])
                while num_blocks > 0 and not cls._is_hit_end(
                    num_blocks, edge_shift, block_size, alignment_tokens
                ):
                    num_blocks -= 1
                for blocks in computed:
                    del blocks[num_blocks:]
                cls._trim_to_alignment(computed, block_size, alignment_tokens)
        if drop_eagle_block and computed[0]:
            for blocks in computed:
                blocks.pop()
            if not aligned:
                cls._trim_to_alignment(computed, block_size, alignment_tokens)
        return computed, len(computed[0]) * block_size

    @staticmethod
    def _is_hit_end(end: int, edge_shift: int, block_size: int, alignment_tokens: int) -> bool:
        """Whether a window may end after block `end - 1`: its right edge (one block less
        under EAGLE, which drops the last block) must be a multiple of the alignment.
        """
        return (end - edge_shift) * block_size % alignment_tokens == 0

    @staticmethod
    def _trim_to_alignment(computed: HitBlocks, block_size: int, alignment_tokens: int) -> None:
        num_blocks = aligned_num_blocks(len(computed[0]), block_size, alignment_tokens)
        for blocks in computed:
            del blocks[num_blocks:]

    reachable_block_mask = staticmethod(window_blocks_reachable)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token: with w = 4 and 7 computed, the next
        token (7) attends to 4..7, so 4 are skipped. Extra retained tokens stay alive.
        """
        return sliding_window_skipped_tokens(
            num_computed_tokens, self.sliding_window, self.extra_retained_tokens
        )


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    recycles_blocks: ClassVar[bool] = True

    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, **kwargs: object) -> None:
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[HitBlocks, int]:
        """Blocks before the current chunk count as computed without any lookup (nulls); the
        chunk's blocks are probed left to right. A hit can be positive with no cached block.
        """
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        assert not drop_eagle_block, "EAGLE is not supported with chunked local attention"
        block_size = kv_cache_spec.block_size
        assert block_size == alignment_tokens, (block_size, alignment_tokens)
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        chunk = kv_cache_spec.attention_chunk_size
        start_block = (max_length // chunk * chunk if max_length > 0 else 0) // block_size
        computed = tuple([block_pool.null_block] * start_block for _ in kv_cache_group_ids)
        for i in range(start_block, min(max_length // block_size, len(hashes))):
            cached = block_pool.get_cached_block_at(hashes, block_size, i, kv_cache_group_ids)
            if cached is None:
                break
            for blocks, block in zip(computed, cached):
                blocks.append(block)
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens left of the current chunk: c = 8 gives 13 -> 8, 8 -> 8, 7 -> 0."""
        return chunked_local_skipped_tokens(num_computed_tokens, self.attention_chunk_size)


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Encoder KV: sized once by the encoder token count, never shared, never cached."""

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> None:
        assert not new_computed_blocks, "cross attention has no prefix hits"

    def allocate_external_computed_blocks(self, request_id: str, *args: Any, **kwargs: Any
                                          ) -> None:
        """Encoder KV is never loaded: external tokens take no block here."""

    def cache_blocks(
        self, request: Request, num_tokens: int, retention_interval: int | None = None, *,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        raise ValueError("cross-attention blocks are never cached; prefix caching must be off")

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[HitBlocks, int]:
        raise NotImplementedError("CrossAttentionManager does not support prefix caching")


class MambaManager(SingleTypeKVCacheManager):
    """Recurrent state groups (docs/spec.md §11).

    Mode "none": the table grows like full attention (plus `num_speculative_blocks` blocks for
    draft-token states) and every block before the one holding the last computed token's
    state is released. Mode "align": only the state blocks a step reads or writes are real
    (the rest are null), states are cached at block boundaries and at the prompt's last hash
    boundary, and sub-block hits are copied on write (docs/spec.md §11.3); with prefill
    checkpoint blocks, a chunk reaching the prefill end also reserves the block its mid-chunk
    checkpoint state is written to, cached at that position (§11.6).

    The per-step methods call the base class by name: a `super()` call builds a proxy object
    each time (about 0.1 µs on CPython 3.11, and three state groups call each method).
    """

    supports_fine_grained_hash_lookup: ClassVar[bool] = True
    recycles_blocks: ClassVar[bool] = True

    def __init__(self, kv_cache_spec: MambaSpec, **kwargs: object) -> None:
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]
        self.align = kv_cache_spec.mamba_cache_mode == "align"
        if self.enable_caching and not self.align:
            raise ValueError("Mamba prefix caching requires mamba_cache_mode='align'")
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        # Extra slots for the states of speculative (draft) tokens.
        self._speculative_tokens = kv_cache_spec.num_speculative_blocks * self.block_size
        # Keys registered in this scheduling step: a hit on one waits for the next step,
        # since its state is written by this step's forward pass.
        self.cached_blocks_this_step: set[bytes] = set()
        # Align mode: index of the state block of the previous step, freed once passed ...
        self.last_state_block_idx: dict[str, int] = {}
        # ... how far `remove_skipped_blocks` has nulled the table ...
        self._num_retired_blocks: dict[str, int] = {}
        # ... and the requests past their first allocation.
        self._allocated_block_reqs: set[str] = set()
        # EAGLE: the prompt's state checkpoint moves to EAGLE's replay boundary (the
        # coordinator sets it, docs/spec.md §11.3).
        self.drop_eagle_checkpoint_block = False
        self.has_prefill_checkpoint_blocks = (
            self.align and kv_cache_spec.num_prefill_checkpoint_blocks > 0
        )
        self._prefill_checkpoint_alignment = kv_cache_spec.prefill_checkpoint_alignment
        # Prefill checkpoints (§11.6): request -> (checkpoint position, reserved table index)
        # of its last allocation, for `cache_blocks` (vLLM's record shape) ...
        self._checkpoints: dict[str, tuple[int, int]] = {}
        # ... the start of its last allocated step, checkpoint or not ...
        self._step_starts: dict[str, int] = {}
        # ... and the per-step count's (request, record or None, start), which the allocation
        # that follows commits: a refused allocate_slots leaves both as they were.
        self._counted_checkpoint: tuple[str, tuple[int, int] | None, int] | None = None
        # A request whose prompt state it cached inside a block (its producer): that block and
        # the boundary, until the copy that preserves the state is offered to a connector.
        self._producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]] = {}

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Mode "none": the base formula with no hits, inlined: blocks for `num_tokens` +
        draft slots beyond both the table and the released head. Mode "align": at most one
        state block per step (plus a CoW copy, plus the draft blocks on the first step)."""
        if new_computed_blocks and (
            new_computed_blocks[-1]._block_hash in self.cached_blocks_this_step
        ):
            # The hit state is written by this step's forward pass: never fits this step.
            return self.block_pool.num_gpu_blocks + 1
        if self.align:
            checkpoint_block = 0
            if self.has_prefill_checkpoint_blocks:
                checkpoint_block = self._count_checkpoint(
                    request_id, total_computed_tokens, num_tokens_main_model, prefill_end,
                    apply_admission_cap,
                )
            if (not new_computed_blocks and request_id in self._allocated_block_reqs
                    and request_id not in self._partial_hit_reqs):
                # A running request (most calls): one new state block, or two with a checkpoint.
                num_new_blocks = (-(-num_tokens_main_model // self.block_size)
                                  + self.num_speculative_blocks
                                  - len(self.req_to_blocks[request_id]))
                if num_new_blocks <= 0:
                    return 0
                return 1 + checkpoint_block if num_new_blocks > 1 + checkpoint_block else (
                    num_new_blocks)
            return self._align_blocks_to_allocate(
                request_id, num_tokens_main_model, new_computed_blocks, num_local_computed_tokens,
                total_computed_tokens, checkpoint_block,
            )
        block_size = self.block_size
        num_required_blocks = -(-(num_tokens + self._speculative_tokens) // block_size)
        req_blocks = self.req_to_blocks.get(request_id)
        num_req_blocks = len(req_blocks) if req_blocks is not None else 0
        if request_id not in self.num_cached_block:
            num_skipped_blocks = (total_computed_tokens - 1) // block_size
            if num_skipped_blocks > num_req_blocks:
                num_req_blocks = num_skipped_blocks
        return num_required_blocks - num_req_blocks if num_required_blocks > num_req_blocks else 0

    def _count_checkpoint(
        self, request_id: str, num_computed_tokens: int, num_tokens: int, prefill_end: int,
        apply_admission_cap: bool,
    ) -> int:
        """1 when the step `[num_computed_tokens, num_tokens)` exports a prefill checkpoint
        into a block of its own (§11.6), else 0; the per-step count (not the full-sequence
        gate) leaves the record for the allocation to commit."""
        checkpoint_position = get_mamba_prefill_checkpoint_position(
            num_tokens, self.cache_hit_alignment_tokens, self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        )
        needed = self._needs_internal_checkpoint(
            request_id, num_computed_tokens, num_tokens, checkpoint_position, prefill_end
        )
        if not apply_admission_cap:
            self._counted_checkpoint = (request_id, (
                checkpoint_position, -(-num_tokens // self.block_size) - 2
            ) if needed else None, num_computed_tokens)
        return int(needed)

    def _commit_checkpoint(self, request_id: str) -> int:
        """Take the checkpoint record the count left for this request's allocation (vLLM
        writes it in the count itself, so that a refused allocation changes it too: kvcache
        keeps the record of the last allocation); 1 when the step reserves a block."""
        counted, self._counted_checkpoint = self._counted_checkpoint, None
        if counted is None or counted[0] != request_id:
            self._checkpoints.pop(request_id, None)
            self._step_starts.pop(request_id, None)
            return 0
        self._step_starts[request_id] = counted[2]
        if counted[1] is None:
            self._checkpoints.pop(request_id, None)
            return 0
        self._checkpoints[request_id] = counted[1]
        return 1

    def _needs_internal_checkpoint(
        self, request_id: str, query_start: int, query_end: int, checkpoint_position: int,
        prefill_end: int,
    ) -> bool:
        """The chunk reaches the prefill end, can export its checkpoint (block_math), and the
        checkpoint's slot (the block before the chunk's last) can take a fresh block: past
        the table, null, or one of a running request's draft blocks."""
        if query_end < prefill_end or not is_mamba_prefill_checkpoint_valid(
            query_start, query_end, checkpoint_position, self._hash_block_size,
            self.block_size, self._prefill_checkpoint_alignment,
        ):
            return False
        checkpoint_idx = -(-query_end // self.block_size) - 2
        blocks = self.req_to_blocks.get(request_id, ())
        return checkpoint_idx >= 0 and (
            checkpoint_idx >= len(blocks)
            or blocks[checkpoint_idx] is self._null_block
            or (request_id in self._allocated_block_reqs
                and checkpoint_idx >= len(blocks) - self.num_speculative_blocks)
        )

    def _align_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        total_computed_tokens: int,
        checkpoint_block: int,
    ) -> int:
        """vLLM's align-mode count for a request adopting hits, new or with a partial hit to
        copy (the caller answers a running one), with the new blocks floored at 0. A prefill
        checkpoint raises the cap by one (the null padding then stops one slot short, which
        the checkpoint's block takes). External tokens on a first allocation are counted
        exactly (below)."""
        num_required_blocks = -(-num_tokens // self.block_size) + self.num_speculative_blocks
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None and total_computed_tokens > num_local_computed_tokens:
            return self._align_external_blocks_to_allocate(
                num_required_blocks, new_computed_blocks, num_local_computed_tokens,
                total_computed_tokens, checkpoint_block,
            )
        num_new_blocks = num_required_blocks - len(new_computed_blocks) - (
            len(req_blocks) if req_blocks is not None else 0
        )
        has_partial_hit = (
            is_partial_hit(len(new_computed_blocks), num_local_computed_tokens, self.block_size)
            or request_id in self._partial_hit_reqs
        )
        if num_new_blocks < 0:
            num_new_blocks = 0
        if has_partial_hit:
            num_new_blocks += 1
        if num_new_blocks > 0:
            physical_block_cap = (2 if has_partial_hit else 1) + checkpoint_block
            if request_id not in self._allocated_block_reqs:
                physical_block_cap += self.num_speculative_blocks
            if num_new_blocks > physical_block_cap:
                num_new_blocks = physical_block_cap
        null_block = self._null_block
        for block in new_computed_blocks:  # a hit: nulls, then its state block
            if block.ref_cnt == 0 and block is not null_block:
                num_new_blocks += 1  # evictable: rescuing it takes a free block
        return num_new_blocks

    def _align_external_blocks_to_allocate(
        self, num_required_blocks: int, new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int, total_computed_tokens: int, checkpoint_block: int,
    ) -> int:
        """A first allocation with external tokens, block for block as it happens: the hits
        the prefix passes become nulls, the external tokens take the block of the prefix's
        state, then the step takes its own state block (a checkpoint's block before it, and
        a partial hit's copy). vLLM caps
        this at one state block and under-counts by one when the step's tokens leave the
        external state's block (docs/findings/017-external-state-block-uncounted.md)."""
        block_size = self.block_size
        num_skipped_blocks = (total_computed_tokens - 1) // block_size
        kept = new_computed_blocks[num_skipped_blocks:]
        table_len = max(num_skipped_blocks, len(new_computed_blocks))
        num_prefix_blocks = -(-total_computed_tokens // block_size)
        num_external_blocks = max(0, num_prefix_blocks - table_len)
        table_len = max(table_len, num_prefix_blocks)
        has_partial_hit = is_partial_hit(len(kept), num_local_computed_tokens, block_size)
        num_new_blocks = 0
        if num_required_blocks > table_len or has_partial_hit or checkpoint_block:
            num_state_index = (
                num_required_blocks - self.num_speculative_blocks - 1 - checkpoint_block
            )
            num_new_blocks = max(num_required_blocks - max(table_len, num_state_index), 0) + int(
                has_partial_hit)
        num_evictable = sum(1 for block in kept if block.ref_cnt == 0 and not block.is_null)
        return num_external_blocks + num_new_blocks + num_evictable

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Mode "none": grow the table to `num_tokens` + draft slots. Mode "align", for the
        main model's tokens (draft models have no state layers): positions before the new
        state block become null, the previous state block is remembered (freed once passed),
        exclusively owned draft blocks the step leaves behind move to the end, and a partial
        hit gets its copy-on-write block first.

        Align mode returns the table's new entries (nulls and moved draft blocks included), as
        vLLM does.
        """
        if not self.align:
            num_tokens += self._speculative_tokens
            req_blocks = self.req_to_blocks.get(request_id)
            if req_blocks is not None and num_tokens <= len(req_blocks) * self.block_size:
                return []  # most decode steps: the table already covers the slots
            return SingleTypeKVCacheManager.allocate_new_blocks(
                self, request_id, num_tokens, num_tokens_main_model
            )
        num_spec = self.num_speculative_blocks
        num_required_blocks = -(-num_tokens_main_model // self.block_size) + num_spec
        partial_hit = self._partial_hit_reqs.get(request_id) if self._partial_hit_reqs else None
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        prev_block_len = len(req_blocks)
        checkpoint_block = (
            self._commit_checkpoint(request_id) if self.has_prefill_checkpoint_blocks else 0
        )
        if num_required_blocks <= prev_block_len and partial_hit is None and not (
            checkpoint_block
        ):
            self._allocated_block_reqs.add(request_id)  # most decode steps: nothing to do
            return []
        blocks_allocated = request_id in self._allocated_block_reqs
        if blocks_allocated:
            # The running state lives in the last (1 + num_spec) blocks.
            self.last_state_block_idx[request_id] = prev_block_len - 1 - num_spec
        elif prev_block_len > 0:
            # A hit's last block holds the state it resumes from.
            self.last_state_block_idx[request_id] = prev_block_len - 1
        # The checkpoint's slot, the one before the state block, gets a fresh block (§11.6).
        num_skipped_blocks = num_required_blocks - num_spec - 1 - checkpoint_block
        if prev_block_len < num_skipped_blocks:
            req_blocks.extend([self._null_block] * (num_skipped_blocks - prev_block_len))
        if blocks_allocated:
            for block_idx in range(prev_block_len - num_spec, prev_block_len
                                   if prev_block_len < num_skipped_blocks else num_skipped_blocks):
                self._relocate_speculative_block(req_blocks, block_idx)
        num_new_blocks = num_required_blocks - len(req_blocks)
        if num_new_blocks < 0:
            num_new_blocks = 0
        if partial_hit is not None:
            num_new_blocks += 1
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        returned_blocks = req_blocks[prev_block_len:]
        if partial_hit is not None:
            block_idx, source_block = partial_hit
            cow_block = new_blocks.pop(0)
            if blocks_allocated:
                self._move_cached_state(request_id, req_blocks, block_idx, source_block,
                                        cow_block)
            else:
                self._apply_cow(request_id, block_idx, source_block, cow_block)
                returned_blocks.insert(0, cow_block)
        req_blocks.extend(new_blocks)
        self._allocated_block_reqs.add(request_id)
        if partial_hit is not None:
            del self._partial_hit_reqs[request_id]
        returned_blocks.extend(new_blocks)
        return returned_blocks

    def _move_cached_state(
        self, request_id: str, req_blocks: list[KVCacheBlock], block_idx: int,
        source_block: KVCacheBlock, cow_block: KVCacheBlock,
    ) -> None:
        """A running request keeps writing its state block, which is cached at a sub-block
        boundary: the cache entry moves to the copy, which the pending copy fills before the
        forward pass overwrites the source. The copy is held only by the pending pair; the
        producer's copy is offered to a connector."""
        assert req_blocks[block_idx] is source_block
        self.block_pool.move_block_hashes(source_block, cow_block)
        self._pending_cow_copies.append((source_block, cow_block))
        source_block.ref_cnt += 1
        producer_tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer_tail is not None:
            assert producer_tail[0] is source_block
            self._pending_boundary_state_offloads.append(
                (request_id, self.kv_cache_group_id, cow_block, producer_tail[1]))
        if cow_block._block_hash is not None:
            self.cached_blocks_this_step.add(cow_block._block_hash)

    def _relocate_speculative_block(self, req_blocks: list[KVCacheBlock], block_idx: int) -> None:
        block = req_blocks[block_idx]
        assert self.block_pool.is_block_writable(block), (
            "Speculative Mamba blocks must be exclusively owned and unhashed before relocation"
        )
        req_blocks.append(block)
        req_blocks[block_idx] = self._null_block

    def cache_blocks(
        self, request: Request, num_tokens: int, retention_interval: int | None = None, *,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Register full state blocks, then (align) the step's prefill checkpoint or else the
        prompt's last hash boundary; every key registered is remembered for this step. As
        the base with `replay_boundaries`."""
        if replay_boundaries is not None:
            return self._cache_blocks_with(request, num_tokens, retention_interval,
                                           replay_boundaries)
        request_id = request.request_id
        num_cached_before = self.num_cached_block.get(request_id, 0)
        checkpoint = self._checkpoints.get(request_id) if self._checkpoints else None
        if (num_tokens // self.block_size <= num_cached_before and checkpoint is None
                and (not self.align or num_tokens % self._hash_block_size)):
            return  # most decode steps: no full block, no hash boundary
        blocks = self.req_to_blocks[request_id]
        num_hashed_tokens = len(request.block_hashes) * self._hash_block_size
        num_full_blocks = (
            num_tokens if num_tokens < num_hashed_tokens else num_hashed_tokens
        ) // self.block_size
        if num_cached_before < num_full_blocks:
            # Align-mode tables are mostly null, and nulls are never registered: start at the
            # first real block.
            first = num_cached_before
            null_block = self._null_block
            if num_full_blocks > len(blocks):  # a request longer than max_model_len, as above
                num_full_blocks = len(blocks)
            while first < num_full_blocks and blocks[first] is null_block:
                first += 1
            if first < num_full_blocks:
                mask = self._reachable_mask(first, num_full_blocks, request)
                start = self._step_starts.get(request_id) if self._step_starts else None
                if start is not None:
                    mask = self._without_start_state(mask, start, first, num_full_blocks,
                                                     num_tokens)
                self.block_pool.register_full_blocks(
                    request, blocks, first, num_full_blocks, self.block_size,
                    self.kv_cache_group_id, mask,
                )
            self.num_cached_block[request_id] = num_full_blocks
            num_cached_after = num_full_blocks
        else:
            num_cached_after = num_cached_before
        if checkpoint is not None:
            partial_key = self._cache_checkpoint_block(request, checkpoint[0], checkpoint[1])
            if partial_key is not None:
                self.cached_blocks_this_step.add(partial_key)
        elif self.align and not num_tokens % self._hash_block_size:  # else: no tail to cache
            partial_key = self._cache_state_tail_block(request, num_tokens)
            if partial_key is not None:
                self.cached_blocks_this_step.add(partial_key)
        if num_cached_after > num_cached_before:
            null_block = self._null_block
            offloads = self._pending_boundary_state_offloads if self.align else None
            for block in blocks[num_cached_before:num_cached_after]:
                if block is not null_block and block._block_hash is not None:
                    self.cached_blocks_this_step.add(block._block_hash)
                    if offloads is not None:  # every retained state, with its exact block
                        offloads.append((request_id, self.kv_cache_group_id, block,
                                         block._block_hash_num_tokens))

    reachable_block_mask = staticmethod(state_blocks_reachable)

    def _without_start_state(
        self, mask: list[bool] | None, start: int, first: int, end: int, num_tokens: int
    ) -> list[bool] | None:
        """`mask` over blocks `[first, end)`, without the block a step starting inside it
        resumed from when the step ran past that block's end (to `num_tokens`) without
        stopping there: the block holds the state at `start`, not its block end's (vLLM keys
        it there: a checkpointed step, §11.6; a chunk cut at a junction, §11.3)."""
        column = (start - 1) // self.block_size
        if (not start % self.block_size or not first <= column < end
                or num_tokens <= (column + 1) * self.block_size):
            return mask
        mask = [True] * (end - first) if mask is None else list(mask)
        mask[column - first] = False
        return mask

    def _cache_checkpoint_block(
        self, request: Request, checkpoint_position: int, checkpoint_idx: int
    ) -> bytes | None:
        """Re-key the checkpoint's block to the state it holds, the one at
        `checkpoint_position` (its keys so far, such as the full-block key just registered,
        name another state). A position no later request can resume at (not the prompt's
        checkpoint, not a retained block end, not the request's junction) is not registered,
        and the block loses its keys."""
        block = self.req_to_blocks[request.request_id][checkpoint_idx]
        if checkpoint_position != get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, self.cache_hit_alignment_tokens,
            self.drop_eagle_checkpoint_block, self.block_pool.num_hash_lookahead_tokens,
        ) and not self._is_retained_block_end(checkpoint_position) and (
            checkpoint_position != request.shared_prefix_boundary
        ):
            self.block_pool.evict_blocks((block.block_id,))  # vLLM's _maybe_evict_cached_block
            return None
        if block._block_hash_num_tokens == checkpoint_position:
            return None
        return self.block_pool.cache_partial_block(
            request, block, checkpoint_position, self.kv_cache_group_id, self.block_size,
            replace_existing_hashes=True,
        )

    def _is_retained_block_end(self, num_tokens: int) -> bool:
        """`num_tokens` ends a block that sparse retention keeps as a segment end (every
        block without an interval; the request's replay boundaries do not count here)."""
        if num_tokens % self.block_size:
            return False
        retention = self.retention_interval
        if retention is None:
            return True
        per_segment = retention // self.block_size
        return bool(retention) and (per_segment <= 1 or num_tokens // self.block_size
                                    % per_segment == 0)

    def _cache_partial_tail_block(
        self, request: Request, num_tokens: int, retention_interval: int | None
    ) -> bytes | None:
        """vLLM's: the step's checkpoint block re-keyed, or else the state tail at
        `num_tokens` registered, under this call's `retention_interval`."""
        own = self.retention_interval
        self.retention_interval = retention_interval
        try:
            checkpoint = self._checkpoints.get(request.request_id)
            if checkpoint is not None:
                return self._cache_checkpoint_block(request, *checkpoint)
            return self._cache_state_tail_block(request, num_tokens)
        finally:
            self.retention_interval = own

    def _cache_state_tail_block(self, request: Request, num_tokens: int) -> bytes | None:
        """Register the state at the prompt's checkpoint (`(P - 1) // hbs * hbs`; with EAGLE
        `P // hbs * hbs - hbs`), or, with `shared_prefix_checkpoint`, at the request's
        junction when this prompt chunk ends exactly there, when `num_tokens` is exactly at
        one; inside a block, the request must copy it on its next allocation before writing
        on (its own partial-hit record)."""
        hash_block_size = self._hash_block_size
        # Both lie within the prompt: later counts (decode) never reach them.
        if num_tokens <= 0 or num_tokens % hash_block_size or (
            num_tokens > request.num_prompt_tokens
        ):
            return None
        if num_tokens != get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, hash_block_size, self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        ) and not (
            self.shared_prefix_checkpoint and num_tokens == request.shared_prefix_boundary
            and request.num_computed_tokens < num_tokens
        ):
            return None
        blocks = self.req_to_blocks[request.request_id]
        block_idx = -(-num_tokens // self.block_size) - 1  # cdiv, inlined
        if block_idx >= len(blocks):
            return None
        source_block = blocks[block_idx]
        if source_block is self._null_block or source_block._block_hash_num_tokens == num_tokens:
            return None
        key = self.block_pool.register_partial_block(
            request, source_block, num_tokens,
            request.block_hashes[num_tokens // hash_block_size - 1] + self._group_suffix,
        )
        if num_tokens % self.block_size:
            self._partial_hit_reqs[request.request_id] = (block_idx, source_block)
            self.num_cached_block[request.request_id] = block_idx
            # The next step's forward overwrites this state: the copy that preserves it is
            # offered to a connector then (`_move_cached_state`).
            self._producer_partial_tail_reqs[request.request_id] = (source_block, num_tokens)
        return key

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """The producer's boundary state, when the request finishes exactly there (nothing
        later was forwarded over it): (group, block, boundary)."""
        producer_tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer_tail is None:
            return None
        source_block, boundary_tokens = producer_tail
        if num_in_flight_tokens or num_computed_tokens != boundary_tokens:
            return None
        return self.kv_cache_group_id, source_block, boundary_tokens

    def _forget(self, request_id: str) -> list[KVCacheBlock] | None:
        """As the base, and the state bookkeeping of align mode."""
        if self.align:
            self._allocated_block_reqs.discard(request_id)
            self.last_state_block_idx.pop(request_id, None)
            self._num_retired_blocks.pop(request_id, None)
            self._checkpoints.pop(request_id, None)
            self._step_starts.pop(request_id, None)
            self._producer_partial_tail_reqs.pop(request_id, None)
            if self._pending_boundary_state_offloads:
                # Its blocks go back to the pool: offers not yet taken are withdrawn.
                self._pending_boundary_state_offloads = [
                    entry for entry in self._pending_boundary_state_offloads
                    if entry[0] != request_id
                ]
        return SingleTypeKVCacheManager._forget(self, request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """As the base; align-mode tables also have nulls between states, which stay."""
        req_blocks = self._forget(request_id)
        if not req_blocks:
            return []
        null_block = self._null_block
        if self.align:
            num_nulls = next((i for i, block in enumerate(req_blocks) if block is not null_block),
                             len(req_blocks))
            return req_blocks[num_nulls:] if num_nulls else req_blocks
        if req_blocks[0] is null_block:  # the released head, counted only when there
            return req_blocks[null_prefix_len(req_blocks, null_block):]
        return req_blocks

    def free(self, request_id: str) -> None:
        """As the base; in align mode tail first, skipping the nulls between states (one
        pass over the table, not `pop_blocks_for_free`'s scan of the leading nulls)."""
        if not self.align:
            SingleTypeKVCacheManager.free(self, request_id)
            return
        req_blocks = self._forget(request_id)
        if req_blocks:
            null_block = self._null_block
            self.block_pool.release([b for b in reversed(req_blocks) if b is not null_block])

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        if not self.align:
            if processed_computed_tokens > self.block_size:  # else block 0 holds the state
                SingleTypeKVCacheManager.remove_skipped_blocks(
                    self, request_id, processed_computed_tokens
                )
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        block_size = self.block_size
        last_block = (processed_computed_tokens - 1) // block_size
        if last_block > len(blocks):
            last_block = len(blocks)
        first_block = self._num_retired_blocks.get(request_id, 0)
        last_state_block_idx = self.last_state_block_idx.get(request_id)
        if first_block >= last_block and (
            last_state_block_idx is None
            or last_state_block_idx >= -(-processed_computed_tokens // block_size) - 1
        ):
            return  # most decode steps: nothing passed
        null_block = self._null_block
        if processed_computed_tokens > 1 and first_block < last_block:
            # Align-mode tables have null gaps between states: skip nulls, do not stop. The
            # passed part is often nulls only, which `count` tells at C speed.
            passed = blocks[first_block:last_block]
            if passed.count(null_block) != len(passed):
                freed = [block for block in reversed(passed) if block is not null_block]
                blocks[first_block:last_block] = [null_block] * len(passed)
                self.block_pool.release(freed)  # the table's own blocks: no checks to repeat
            self._num_retired_blocks[request_id] = last_block
        # The previous step's state block was the copy source of this step's: now passed.
        if (
            last_state_block_idx is not None
            and last_state_block_idx < -(-processed_computed_tokens // block_size) - 1
            and blocks[last_state_block_idx] is not null_block
        ):
            self.block_pool.release([blocks[last_state_block_idx]])
            blocks[last_state_block_idx] = null_block

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Only the state after the last computed token is read again."""
        return num_computed_tokens - 1

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[HitBlocks, int]:
        """The rightmost cached state at or below `max_length`: at a hash boundary under
        fine-grained hits, else at a block end that is a multiple of the alignment. The hit
        block comes after nulls for every earlier position."""
        assert isinstance(kv_cache_spec, MambaSpec)
        block_size = kv_cache_spec.block_size
        hash_block_size = block_pool.hash_block_size
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            # Every hash boundary, right to left: a hash block's index is its end's.
            top = max_length // hash_block_size
            if top > len(block_hashes):
                top = len(block_hashes)
            if top <= 0:
                return tuple([[] for _ in kv_cache_group_ids]), 0
            unit, hashes = hash_block_size, block_hashes
            indices = range(top - 1, -1, -1)
        else:
            unit = block_size
            hashes = resolve_block_hashes(block_hashes, hash_block_size, block_size)
            step = alignment_tokens // block_size if alignment_tokens % block_size == 0 else 0
            top = max_length // block_size
            indices = (range(top // step * step - 1, -1, -step) if step
                       else (i for i in range(top - 1, -1, -1)
                             if (i + 1) * block_size % alignment_tokens == 0))
        found = block_pool.get_rightmost_cached_block(hashes, unit, indices, kv_cache_group_ids)
        if found is None:
            return tuple([[] for _ in kv_cache_group_ids]), 0
        index, cached = found
        hit_length = (index + 1) * unit
        nulls = [block_pool.null_block] * ((hit_length - 1) // block_size)
        return tuple([nulls + [block] for block in cached]), hit_length


_MANAGER_CLASSES: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    SlidingWindowMLASpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    CrossAttentionSpec: CrossAttentionManager,
    MambaSpec: MambaManager,
    # Full-attention variants (vLLM registers them the same way).
    MLAAttentionSpec: FullAttentionManager,
    SinkFullAttentionSpec: FullAttentionManager,
    RSWASpec: RSWAManager,
    CircularBufferSpec: CircularBufferManager,
    # vLLM registers none: its encoder-only layers form no group (docs/spec.md §12.4).
    EncoderOnlyAttentionSpec: EncoderOnlyAttentionManager,
}


def get_manager_class(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    manager_class = _MANAGER_CLASSES.get(type(kv_cache_spec))
    if manager_class is None:
        raise ValueError(f"no KV cache manager for spec {kv_cache_spec!r}")
    return manager_class


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, max_in_flight_tokens: int, max_model_len: int, **kwargs: object
) -> SingleTypeKVCacheManager:
    """The manager for the spec's kind; recycling kinds get the admission cap the pool sizer
    uses, so admission and sizing cannot disagree (vLLM #39734).
    """
    if isinstance(kv_cache_spec, SinkFullAttentionSpec) and (
        kv_cache_spec.sink_len % kv_cache_spec.block_size
    ):
        raise ValueError(f"sink_len {kv_cache_spec.sink_len} must be a multiple of block_size "
                         f"{kv_cache_spec.block_size}")
    if isinstance(kv_cache_spec, SlidingWindowMLASpec) and kv_cache_spec.bounded_replay:
        raise ValueError("SlidingWindowMLASpec: bounded_replay=True is not supported by kvcache "
                         "(only False)")
    if isinstance(kv_cache_spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
        kwargs["max_admission_blocks_per_request"] = (
            kv_cache_spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
        )
    return get_manager_class(kv_cache_spec)(kv_cache_spec, **kwargs)  # type: ignore[arg-type]

