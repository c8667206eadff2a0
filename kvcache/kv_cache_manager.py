"""Layer 1: admission policy and the public API the scheduler calls."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

from kvfuzz.kvcache.errors import PreconditionError
from kvfuzz.kvcache.kv_cache_coordinator import get_kv_cache_coordinator
from kvfuzz.kvcache.kv_cache_interface import (
    CircularBufferSpec,
    EncoderOnlyAttentionSpec,
    CrossAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from kvfuzz.kvcache.kv_events import BlockStored, EventfulBlockPool, KVCacheEvent
from kvfuzz.kvcache.kv_cache_utils import (
    KVCacheBlock,
    KVCacheBlockCopy,
    check_cache_keys,
    check_positive_int,
)
from kvfuzz.kvcache.single_type_kv_cache_manager import MambaManager
from kvfuzz.kvcache.request import Request, RequestStatus  # Request: vLLM's tests import it here
from kvfuzz.kvcache.stats import PrefixCacheStats

logger = logging.getLogger(__name__)

# Statuses measured against the watermark: admitting costs more than continuing to serve.
_ADMITTED_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
# CPython's cached small int: every int 0 an int operation produces is this object.
_ZERO = 0
# A lookup result whose first group holds at least this many blocks is issued in tuples: the
# copy is cheap beside such a lookup, and spares allocate_slots a check per block. Below it,
# the copy costs the lookup about what it saves the admission.
_MIN_ISSUED_HITS = 64


def _reject_counts(call: str, **counts: object) -> None:
    """Raise ValueError naming every count that is not an int >= 0 (bools are not counts)."""
    bad = ", ".join(
        f"{name}={value!r}"
        for name, value in counts.items()
        if type(value) is not int or value < 0  # type: ignore[operator]
    )
    raise ValueError(f"{call}: negative or non-integer count {bad}")


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks per group (group-major: groups may hold different numbers of blocks).

    A long lookup result and the manager's shared empty instance hold tuples.
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(list(itertools.chain(a, b)) for a, b in zip(self.blocks, other.blocks))
        )

    @overload
    def get_block_ids(
        self, allow_none: Literal[False] = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(
        self, allow_none: Literal[True], *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None: ...

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        """Ids per selected group (nulls as 0); with `allow_none`, None if all are empty."""
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if allow_none and all(len(group) == 0 for group in groups):
            return None
        return tuple([block.block_id for block in group] for group in groups)

    def get_unhashed_block_ids(self) -> list[int]:
        """Single group only: ids of blocks without a cache key."""
        if len(self.blocks) != 1:
            raise ValueError(f"get_unhashed_block_ids needs one group, got {len(self.blocks)}")
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """vLLM's: per group, the ids of real (not null) blocks without a cache key."""
        return [[block.block_id for block in group
                 if block.block_hash is None and not block.is_null] for group in self.blocks]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


class KVCacheManager:
    """Decides whether an allocation happens, and checks before anything is committed: below
    the capacity check there is no rollback, so the check must be exact.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: object = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        *,
        enable_partial_hash_hits: bool = False,
        record_new_block_ids: bool = False,
    ) -> None:
        """vLLM's arguments, in vLLM's order; those kvcache does not implement are accepted
        with their neutral value (one DCP/PCP rank, no metrics collector) and refused with
        ValueError otherwise. `enable_mamba_shared_prefix_checkpoint` also registers Mamba
        'align' state at a request's shared-prefix junction (docs/spec.md §11.3) where
        `mamba_shared_prefix_checkpoint` says it applies. `num_hash_lookahead_tokens`
        and `num_prefill_lookahead` are MTP / draft lookahead (docs/spec.md §5.7): the
        requests' hasher must cover the same lookahead (`get_request_block_hasher`).
        `enable_partial_hash_hits` (Tier B) forces sub-block hits in hybrid configs;
        `record_new_block_ids` records fresh blocks for a worker that zeroes them;
        `enable_kv_cache_events` queues KV events for `take_events` (kvcache/kv_events.py).
        """
        _require_neutral(
            dcp_world_size=(dcp_world_size, 1),
            pcp_world_size=(pcp_world_size, 1),
            metrics_collector=(metrics_collector, None),
        )
        check_positive_int("max_model_len", max_model_len)
        if max_in_flight_tokens is None:
            # No effective admission cap: both caps are then at least the uncapped need.
            max_in_flight_tokens = max_model_len
        check_positive_int("max_in_flight_tokens", max_in_flight_tokens)
        if (
            not isinstance(watermark, int | float)
            or isinstance(watermark, bool)
            or not 0 <= watermark < math.inf
        ):
            raise ValueError(f"watermark must be a finite number >= 0, got {watermark!r}")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_caching,
            scheduler_block_size,
            hash_block_size,
            record_new_block_ids,
            enable_partial_hash_hits,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead,
        )
        # Both sides of the feature read this one predicate (vLLM's Scheduler too), so a chunk
        # never ends at a junction the manager would not register: EAGLE groups, sub-block
        # hits, and no multi-module MTP (which caches short of the chunk end).
        self.mamba_shared_prefix_checkpoint = bool(
            enable_mamba_shared_prefix_checkpoint and self.coordinator.eagle_group_ids
            and self.coordinator.enable_partial_hash_hits
            and not self.coordinator.num_reprefillable_tokens
        )
        for manager in self.coordinator.single_type_managers:
            if isinstance(manager, MambaManager):
                manager.shared_prefix_checkpoint = self.mamba_shared_prefix_checkpoint
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.enable_kv_cache_events = enable_kv_cache_events
        if enable_kv_cache_events:
            EventfulBlockPool.enable_on(self.coordinator.block_pool)
        # Per group, what its BlockStored events name: its spec's kind and window.
        self.kv_cache_event_metadata = tuple(
            (get_kv_cache_spec_kind(group.kv_cache_spec).value,
             get_kv_cache_spec_sliding_window(group.kv_cache_spec))
            for group in kv_cache_config.kv_cache_groups
        )
        # Layer 1 reads the free count directly, skipping layer 2.
        self.block_pool = self.coordinator.block_pool
        # Counted on N including the null block, as vLLM does.
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        # Shared, immutable empty result: avoids garbage on every miss, and allocate_slots
        # recognises "no hits to adopt" by the identity of its lists.
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        # The groups of the last lookup result issued (see `_lookup_result`).
        self._issued_hits: tuple[tuple[KVCacheBlock, ...], ...] | None = None
        # Groups whose tables do not follow the token count: encoder KV, a ring's one block,
        # encoder-only attention's none.
        self._fixed_group_ids = frozenset(
            i
            for i, group in enumerate(kv_cache_config.kv_cache_groups)
            if isinstance(
                group.kv_cache_spec,
                CrossAttentionSpec | CircularBufferSpec | EncoderOnlyAttentionSpec,
            )
        )

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Requests that must genuinely recompute their prompt (skip_reading_prefix_cache,
        or a hit limit of 0) never read the cache."""
        return self.enable_caching and request.prefix_cache_hit_limit != 0

    def get_num_cached_tokens(self, request: Request) -> int:
        """How many of the request's tokens `get_computed_blocks` would hit now: a probe that
        takes no reference and changes nothing (0 when the lookup is disabled)."""
        _request_id("get_num_cached_tokens", request)
        if not self.prefix_cache_lookup_enabled(request):
            return 0
        check_cache_keys(request)
        return self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.get_max_cache_hit_length()
        )[1]

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Record an admitted lookup; lookups whose admission failed are not counted."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats gathered so far and start new ones (None when not logging)."""
        if self.prefix_cache_stats is None:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The cached prefix of the request: (blocks, hit tokens, shared prefix boundary).

        Read-only and reserves nothing: the blocks may be free eviction candidates, so pass
        them to `allocate_slots` before any other pool mutation. The default ceiling is
        `num_tokens - 1` because one token must be computed to get logits; with block-aligned
        hits a fully cached prompt recomputes its whole last block.
        """
        try:  # inlined `_request_id` and `prefix_cache_lookup_enabled`: one call per admission
            request.request_id
        except AttributeError:
            raise ValueError(f"get_computed_blocks(): {request!r} is not a Request") from None
        if max_cache_hit_length is not None and (
            type(max_cache_hit_length) is not int or max_cache_hit_length < 0
        ):
            raise ValueError(f"max_cache_hit_length must be >= 0, got {max_cache_hit_length!r}")
        if not self.enable_caching or request.prefix_cache_hit_limit == 0:
            return self.empty_kv_cache_blocks, 0, 0
        check_cache_keys(request)
        max_cache_hit_length = request.get_max_cache_hit_length(max_cache_hit_length)
        blocks, num_hit_tokens, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        if num_hit_tokens and self.enable_kv_cache_events and getattr(
                request, "kv_cache_report_mode", "incremental") == "full":
            self.coordinator.emit_cached_block_events(request, blocks, num_hit_tokens)
        shared_prefix_boundary = num_hit_tokens + num_uncached if num_uncached else 0
        return self._lookup_result(blocks), num_hit_tokens, shared_prefix_boundary

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The local lookup of a request scheduled with a KV connector: `get_computed_blocks`'
        triple and whether a group's hit ran deeper than another's (docs/spec.md §13.1).

        On a hybrid with Mamba and full attention every group is searched on its own; the
        full-attention hit is the local prefix (the connector supplies the state at its end)
        unless another group hit deeper, which falls back to `get_computed_blocks`. The flag
        says that some group's hit (a state group's, or 0 for a group never looked up) is
        shorter than it; blocks are each group's own, and there is no shared-prefix boundary.
        """
        _request_id("get_computed_blocks_for_connector", request)
        coordinator = self.coordinator
        full_group_id = getattr(coordinator, "full_attention_group_id", None)
        if full_group_id is None or not any(
            isinstance(spec, MambaSpec) for spec in self._group_specs()
        ):
            return *self.get_computed_blocks(request, max_cache_hit_length), False
        if max_cache_hit_length is not None and (
            type(max_cache_hit_length) is not int or max_cache_hit_length < 0
        ):
            raise ValueError(f"max_cache_hit_length must be >= 0, got {max_cache_hit_length!r}")
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        check_cache_keys(request)
        blocks, hit_lengths = coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, request.get_max_cache_hit_length(max_cache_hit_length)
        )
        num_local = hit_lengths[full_group_id]
        if any(hit_length > num_local for hit_length in hit_lengths):
            # Full attention's tail was evicted under a deeper hit: the reconciled lookup.
            return *self.get_computed_blocks(request, max_cache_hit_length), False
        return self._lookup_result(blocks), num_local, 0, min(hit_lengths) < num_local

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens the request's tables hold cached: over the prefix-cached groups, the least of
        each table's deepest hashed block's token count (0 with no such group)."""
        request_id = _request_id("estimate_cached_tokens", request)
        tables = self.coordinator.get_blocks(request_id)
        cached_tokens: int | None = None
        for spec, blocks in zip(self._group_specs(), tables):
            if not spec.prefix_cacheable or isinstance(spec, CrossAttentionSpec):
                continue
            group_cached_tokens = next(
                (b.block_hash_num_tokens for b in reversed(blocks) if b.block_hash_num_tokens),
                0,
            )
            if cached_tokens is None or group_cached_tokens < cached_tokens:
                cached_tokens = group_cached_tokens
        return cached_tokens or 0

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """A lookup result cut at a token count every group's block size divides: pure slicing
        (no reference taken, `blocks` untouched). A Mamba group may end before the cut (an
        external state then stands in for its hit); PreconditionError for a cut another group's
        blocks do not end at, ValueError for a count that is not an int >= 0."""
        if type(num_computed_tokens) is not int or num_computed_tokens < 0:
            raise ValueError(
                f"truncate_computed_blocks: num_computed_tokens={num_computed_tokens!r} is not "
                "an int >= 0"
            )
        truncated: list[list[KVCacheBlock]] = []
        for group_blocks, manager, spec in zip(
            blocks.blocks, self.coordinator.single_type_managers, self._group_specs(),
            strict=True,
        ):
            if not spec.prefix_cacheable:
                truncated.append([])
                continue
            num_blocks, rest = divmod(num_computed_tokens, manager.block_size)
            if isinstance(spec, MambaSpec):
                num_blocks = min(num_blocks, len(group_blocks))
            if rest or num_blocks > len(group_blocks):
                raise PreconditionError(
                    f"truncate_computed_blocks: {num_computed_tokens} tokens is not a cut of "
                    f"{len(group_blocks)} blocks of {manager.block_size} tokens"
                )
            truncated.append(list(group_blocks[:num_blocks]))
        return self.create_kv_cache_blocks(tuple(truncated))

    def _group_specs(self) -> list[Any]:
        return [group.kv_cache_spec for group in self.kv_cache_config.kv_cache_groups]

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Adopt the prefix hits and grow the tables for `num_new_tokens` (+ lookahead).

        Layout after the call: [computed | new hits | new tokens | lookahead]; everything
        after the computed part is allocated, and the real (non-draft) tokens are cached.
        Returns only the blocks newly taken (a CoW copy first), or None when they do not fit.
        A None from the full-sequence gate changes nothing; one from the capacity check leaves
        only the out-of-window frees of step 4. Misuse raises ValueError and changes nothing.
        External (KV connector) tokens get blocks after the hits (docs/spec.md §13); with
        `delay_cache_blocks` nothing is cached: the caller caches once the load lands.
        `skip_zeroing_group_ids` names groups whose external blocks are not recorded for zeroing.
        """
        try:
            request_id = request.request_id
        except AttributeError:
            raise ValueError(f"allocate_slots(): {request!r} is not a Request") from None
        # 0. Argument checks, before step 4 frees anything.
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and (
            num_external_computed_tokens == 0
        ):
            raise ValueError(
                f"allocate_slots({request_id!r}): num_new_tokens=0 with no computed tokens to "
                "adopt"
            )
        # Every count but the first two is almost always its default 0: identity with the
        # cached int 0 accepts exactly that at once (only an int 0 can be it), anything else
        # is checked in full.
        if not (
            type(num_new_tokens) is int
            and num_new_tokens >= 0
            and type(num_new_computed_tokens) is int
            and num_new_computed_tokens >= 0
            and num_lookahead_tokens is _ZERO
            and num_encoder_tokens is _ZERO
            and reserved_blocks is _ZERO
            and (
                num_external_computed_tokens is _ZERO
                # A KV connector's load: a positive int, checked for its request at once.
                or type(num_external_computed_tokens) is int
                and num_external_computed_tokens > 0
                and self._check_external(request_id, num_external_computed_tokens)
            )
        ):
            self._check_counts(
                request_id,
                num_new_tokens=num_new_tokens,
                num_new_computed_tokens=num_new_computed_tokens,
                num_lookahead_tokens=num_lookahead_tokens,
                num_external_computed_tokens=num_external_computed_tokens,
                num_encoder_tokens=num_encoder_tokens,
                reserved_blocks=reserved_blocks,
            )
        if skip_zeroing_group_ids != ():
            self._check_group_ids(request_id, skip_zeroing_group_ids)
        if self.enable_caching and not delay_cache_blocks:
            check_cache_keys(request)
        empty_blocks = self.empty_kv_cache_blocks.blocks
        if new_computed_blocks is None:
            hit_blocks = empty_blocks
        else:
            hit_blocks = getattr(new_computed_blocks, "blocks", None)
            if type(hit_blocks) is not tuple:
                raise ValueError(
                    f"allocate_slots({request_id!r}): new_computed_blocks="
                    f"{new_computed_blocks!r} is not a KVCacheBlocks"
                )
            if hit_blocks is not empty_blocks:
                self._check_hits(request_id, new_computed_blocks, hit_blocks)

        # 1. Inputs.
        # Conditional expressions instead of min/max below: this is the hottest call there is.
        max_model_len = self.max_model_len
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_prefix_tokens = num_local_computed_tokens + num_external_computed_tokens
        total_computed_tokens = (
            num_prefix_tokens if num_prefix_tokens < max_model_len else max_model_len
        )
        watermark_blocks = self.watermark_blocks
        if watermark_blocks and not (
            has_scheduled_reqs and request.status in _ADMITTED_STATUSES
        ):
            watermark_blocks = 0
        # Where the prefill ends, as the driver splits chunks (resumed requests replay outputs).
        # Under retention 0 only the chunk reaching the prefill end reserves a Mamba prefill
        # checkpoint; otherwise every chunk may (vLLM's coordinator passes a prefill end of 0).
        prefill_end = 0
        if self.coordinator.retention_interval == 0:
            prefill_end = request.num_prompt_tokens
            if request.num_tokens - 1 > prefill_end:
                prefill_end = request.num_tokens - 1

        # 2. Full-sequence gate: chunked prefill alone would admit a huge request on the
        # strength of its first chunk. Capped for recycling kinds; ignores the reserve.
        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            num_blocks = self.coordinator.get_num_blocks_to_allocate(
                request_id,
                full_num_tokens,
                hit_blocks,
                num_encoder_tokens,
                total_computed_tokens,
                num_local_computed_tokens,
                full_num_tokens,
                apply_admission_cap=True,
                prefill_end=prefill_end,
            )
            if num_blocks + watermark_blocks > self.block_pool.get_num_free_blocks():
                return None

        # 3. Sizes.
        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = num_tokens_main_model + num_lookahead_tokens
        if num_tokens_main_model > request.num_tokens:
            # A step verifying drafts is a decode row, which the worker never checkpoints
            # (§11.6): a prefill end past the step reserves no Mamba prefill checkpoint.
            prefill_end = num_tokens_main_model + 1
        if num_tokens_need_slot > max_model_len:
            num_tokens_need_slot = max_model_len

        # 4. Free out-of-window blocks first (fewer cached blocks get evicted), on the basis
        # of settled tokens only; runs even if the request then does not fit. Only window
        # kinds have any.
        # Nothing is skipped before the first settled token (an admission, most often).
        if self.coordinator.recycles_blocks:
            num_settled_tokens = total_computed_tokens - request.num_in_flight_tokens
            if num_settled_tokens > 0:
                self.coordinator.remove_skipped_blocks(
                    request_id, num_settled_tokens, request.num_prompt_tokens
                )

        # 5-6. Exact per-step prediction (unclamped computed count, unlike the gate) and
        # capacity check.
        num_blocks = self.coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens_need_slot,
            hit_blocks,
            num_encoder_tokens,
            num_prefix_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            False,
            prefill_end,
        )
        # `get_num_free_blocks` inlined.
        available_blocks = self.block_pool.free_block_queue.num_free_blocks - reserved_blocks
        if num_blocks + watermark_blocks > available_blocks:
            return None

        # 7. Adopt hits before popping, so the pops cannot evict them. A lookup result (even
        # an empty one) is told from "no lookup" by the identity of the shared empty lists.
        if hit_blocks is not empty_blocks or num_external_computed_tokens:
            self.coordinator.allocate_new_computed_blocks(
                request_id, hit_blocks, num_local_computed_tokens, num_external_computed_tokens,
                skip_zeroing_group_ids,
            )

        # 8. Allocate, unless it would change nothing: nothing predicted, no hits (so no copy
        # of a partial one), and tables that already have the slots (most decode steps).
        if (
            not num_blocks
            and hit_blocks is empty_blocks
            and self.coordinator.covers(request_id, num_tokens_need_slot)
        ):
            new_blocks = empty_blocks
        else:
            new_blocks = self.coordinator.allocate_new_blocks(
                request_id, num_tokens_need_slot, num_tokens_main_model, num_encoder_tokens
            )
        # 9. Tier C (P/D): the caller caches once the transfer lands.
        # 10. Cache the finalized tokens only: drafts and lookahead may be rejected.
        if self.enable_caching and not delay_cache_blocks:
            num_tokens = request.num_tokens
            self.coordinator.cache_blocks(
                request,
                num_tokens_main_model if num_tokens_main_model < num_tokens else num_tokens,
            )
        # `create_kv_cache_blocks`, inlined.
        if any(new_blocks):
            return KVCacheBlocks(new_blocks)
        return self.empty_kv_cache_blocks

    def _check_counts(self, request_id: str, **counts: object) -> None:
        """Each count an int >= 0 (bools are not counts); external tokens only for a request
        that holds nothing yet (docs/spec.md §13.1)."""
        for n in counts.values():
            if type(n) is not int or n < 0:  # type: ignore[operator]
                _reject_counts(f"allocate_slots({request_id!r})", **counts)
        external = counts["num_external_computed_tokens"]
        if external:
            self._check_external(request_id, external)  # type: ignore[arg-type]

    def _check_external(self, request_id: str, external: int) -> bool:
        """External tokens (an int > 0) only for a request that holds nothing yet. True, so
        that it can close the fast check's condition."""
        if self.coordinator.tracks(request_id):
            raise ValueError(
                f"allocate_slots({request_id!r}): num_external_computed_tokens={external} for "
                "a request that already holds blocks"
            )
        return True

    def _check_group_ids(self, request_id: str, group_ids: object) -> None:
        """Each entry must be the index of a group."""
        num_groups = self.num_kv_cache_groups
        if not isinstance(group_ids, tuple | list):
            bad: list[object] = [group_ids]
        else:
            bad = [g for g in group_ids if type(g) is not int or not 0 <= g < num_groups]
        if bad:
            raise ValueError(
                f"allocate_slots({request_id!r}): skip_zeroing_group_ids {group_ids!r} names "
                f"{bad!r}, not a group of the {self.num_kv_cache_groups} groups"
            )

    def _check_hits(
        self, request_id: str, hits: KVCacheBlocks, hit_blocks: tuple[object, ...]
    ) -> None:
        """Hits to adopt come from a lookup: one sequence per group, for a first allocation.

        The last lookup result issued holds this pool's blocks by construction. Any other has
        each block's type checked first (messages built only on failure), in the same pass
        that finds whether any group has a hit (the cheap checks below run only then).
        """
        if hit_blocks is not self._issued_hits and not self._foreign_hits_adopt(
            request_id, hit_blocks
        ):
            return
        if self.coordinator.tracks(request_id):
            raise ValueError(
                f"allocate_slots({request_id!r}): a running request cannot adopt prefix hits "
                f"{hits.get_block_ids()}"
            )
        if not self.enable_caching:
            raise ValueError(
                f"allocate_slots({request_id!r}): prefix hits {hits.get_block_ids()} with "
                "prefix caching disabled"
            )

    def _foreign_hits_adopt(self, request_id: str, hit_blocks: tuple[object, ...]) -> bool:
        """Whether hits other than the last result issued have any block, each of which must
        be a block of this pool (ValueError otherwise)."""
        if len(hit_blocks) != self.num_kv_cache_groups:
            raise ValueError(
                f"allocate_slots({request_id!r}): new_computed_blocks has "
                f"{len(hit_blocks)} block lists for {self.num_kv_cache_groups} groups"
            )
        block_pool = self.block_pool
        own = block_pool.block_type
        adopting = False
        for group in hit_blocks:
            if type(group) is not list:  # a list is read as it is
                group = block_pool._block_list("allocate_slots", group)
            if group:
                adopting = True
                # Every block's type, compared in C (a loop costs twice as much on long hits).
                if list(map(type, group)).count(own) == len(group):
                    continue
                for block in group:  # the first stranger, for the message
                    if type(block) is not own:
                        raise ValueError(
                            f"allocate_slots({request_id!r}) new_computed_blocks: "
                            f"{block_pool.describe_foreign(block)}"
                        )
        return adopting

    def _check_tracked(self, request_id: str, operation: str) -> None:
        """A zero-group pool holds no tables, so every request counts as tracked there."""
        if self.coordinator.single_type_managers and not self.coordinator.tracks(request_id):
            raise ValueError(f"{operation}: request {request_id!r} is not tracked by the manager")

    def free(self, request: Request) -> None:
        """Release the request's blocks, each group tail first.

        A request that holds nothing (never allocated: aborted while waiting, or already
        freed) is a no-op, as in vLLM, whose scheduler frees every finished request.
        """
        try:  # inlined `_request_id`: free runs once per finished request
            request_id = request.request_id
        except AttributeError:
            raise ValueError(f"free(): {request!r} is not a Request") from None
        self.coordinator.free(request_id)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request but keep its references, for a deferred free: the caller frees
        each group's blocks in reverse order later.
        """
        return self.coordinator.pop_blocks_for_free(_request_id("pop_blocks_for_free", request))

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Null and release the blocks that left every window of the request."""
        counts = {"processed_computed_tokens": processed_computed_tokens}
        if num_prompt_tokens is not None:
            counts["num_prompt_tokens"] = num_prompt_tokens
        if any(type(n) is not int or n < 0 for n in counts.values()):
            _reject_counts(f"remove_skipped_blocks({request_id!r})", **counts)
        self.coordinator.remove_skipped_blocks(
            request_id, processed_computed_tokens, num_prompt_tokens
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks up to `num_computed_tokens` (if caching)."""
        request_id = _request_id("cache_blocks", request)
        if type(num_computed_tokens) is not int or num_computed_tokens < 0:
            raise ValueError(
                f"cache_blocks({request_id!r}): num_computed_tokens={num_computed_tokens!r} is "
                "not an int >= 0"
            )
        self._check_tracked(request_id, "cache_blocks")
        fixed_group_ids = self._fixed_group_ids
        for group_id, manager in enumerate(self.coordinator.single_type_managers):
            if fixed_group_ids and group_id in fixed_group_ids:
                continue
            num_slots = len(manager.req_to_blocks.get(request_id, ())) * manager.block_size
            if num_computed_tokens > num_slots:
                raise ValueError(
                    f"cache_blocks({request_id!r}): {num_computed_tokens} tokens exceed the "
                    f"{num_slots} slots of group {group_id}"
                )
        if self.enable_caching:
            check_cache_keys(request)
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks' cache entries (their content became invalid)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget the whole cache; False (nothing changed) while any block is held."""
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated (cascade attention is gone): zeros per group."""
        return [0] * self.num_kv_cache_groups

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's full tables (live lists: do not mutate)."""
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def pop_blocks_for_free_per_group(self, request: Request) -> list[list[KVCacheBlock]]:
        """`pop_blocks_for_free`, one list per group: what `free_deferred_blocks` takes."""
        return [manager.pop_blocks_for_free(request.request_id)
                for manager in self.coordinator.single_type_managers]

    def free_deferred_blocks(self, blocks_per_group: list[list[KVCacheBlock]],
                             evict_first: bool = False) -> None:
        """Release popped blocks as `free` would have: group after group, each tail first
        (`evict_first`: as `BlockPool.free_blocks` takes it, cached blocks to the head too)."""
        for blocks in blocks_per_group:
            if blocks:
                self.block_pool.free_blocks(blocks[::-1], evict_first)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events queued since the last call, each BlockStored given its group's spec
        kind and window (vLLM's; a group the config lacks is logged and left unnamed);
        ValueError when events are off."""
        if not self.enable_kv_cache_events:
            raise ValueError("take_events(): this manager was built with KV cache events off")
        events: list[KVCacheEvent] = self.block_pool.take_events()  # type: ignore[attr-defined]
        metadata = self.kv_cache_event_metadata
        for event in events:
            if type(event) is not BlockStored or event.group_idx is None:
                continue
            if not 0 <= event.group_idx < len(metadata):
                logger.warning("Group index `%s` not in KV cache metadata", event.group_idx)
                continue
            event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = (
                metadata[event.group_idx])
        return events

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids recorded since the last call; drained every step so they cannot grow."""
        ids: list[int] = []
        for manager in self.coordinator.single_type_managers:
            ids.extend(manager.take_new_block_ids())
        return ids

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """vLLM's: drain the boundary states offered to a KV connector, request ->
        [(group, block id, tokens its state covers)] (Mamba 'align' groups only)."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for manager in self.coordinator.single_type_managers:
            for request_id, group_id, block, num_tokens in (
                    manager.take_pending_boundary_state_offloads()):
                offloads.setdefault(request_id, []).append((group_id, block.block_id, num_tokens))
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """vLLM's: as the request finishes, each group's boundary state still in its table
        that nothing later was forwarded over, (group, block id, tokens)."""
        offloads = []
        for manager in self.coordinator.single_type_managers:
            finalized = manager.finalize_partial_tail_offload(
                request.request_id, request.num_computed_tokens, request.num_in_flight_tokens)
            if finalized is not None:
                group_id, block, num_tokens = finalized
                offloads.append((group_id, block.block_id, num_tokens))
        return offloads

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """Drain pending CoW copies and their retained endpoints (src, dst per copy).

        The caller runs the copies, then passes the endpoints to `block_pool.free_blocks`.
        """
        pairs: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        for manager in self.coordinator.single_type_managers:
            pairs.extend(manager.take_pending_cow_copies())
        copies = [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pairs]
        return copies, [block for pair in pairs for block in pair]

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        """A new result if any group is non-empty, else the shared empty one."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def _lookup_result(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        """A lookup's hits as a result. A long one is issued: its groups are copied into tuples,
        so that it keeps what the lookup found, and the last one is remembered, which
        `allocate_slots` adopts without checking its blocks again."""
        if not blocks or len(blocks[0]) < _MIN_ISSUED_HITS:
            return self.create_kv_cache_blocks(blocks)
        issued = self._issued_hits = tuple(map(tuple, blocks))
        return KVCacheBlocks(issued)


def _request_id(operation: str, request: Request) -> str:
    """The request's id, or ValueError naming what was passed instead of a Request."""
    try:
        return request.request_id
    except AttributeError:
        raise ValueError(f"{operation}(): {request!r} is not a Request") from None


def _require_neutral(**arguments: tuple[object, object]) -> None:
    """ValueError naming each argument that is not at its neutral value (a feature kvcache
    does not implement)."""
    for name, (value, neutral) in arguments.items():
        if value != neutral or type(value) is not type(neutral):
            raise ValueError(
                f"KVCacheManager: {name}={value!r} is not supported by kvcache (only {neutral!r})"
            )
