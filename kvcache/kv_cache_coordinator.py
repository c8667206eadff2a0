"""Layer 2: builds the pool and one manager per group, fans calls out, reconciles hits."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvfuzz.kvcache.block_pool import BlockPool
from kvfuzz.kvcache.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvfuzz.kvcache.kv_cache_utils import BlockHash, KVCacheBlock, cdiv, check_positive_int
from kvfuzz.kvcache.single_type_kv_cache_manager import (
    CrossAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_class,
    get_manager_for_kv_cache_spec,
)

if TYPE_CHECKING:
    from kvfuzz.kvcache.request import Request

HitResult = tuple[tuple[list[KVCacheBlock], ...], int, int]
"""Per-group hit blocks, the hit length, and the uncached common prefix (Tier C, else 0)."""


def validate_prefix_cache_retention_interval(
    retention_interval: int | None,
    scheduler_block_size: int,
    kv_cache_config: KVCacheConfig,
) -> None:
    """vLLM's rules for the retention interval (docs/spec.md §4.9.2), with its messages."""
    if retention_interval is None:
        return
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    if not any(isinstance(spec, SlidingWindowSpec | MambaSpec) for spec in specs):
        if retention_interval == 0:
            return
        raise ValueError(
            "prefix_cache_retention_interval is set but this model has no sliding-window or "
            "Mamba KV cache group, so retention has no effect. Set it to 0 (it only applies to "
            "sliding-window and Mamba attention)."
        )
    if retention_interval < 0 or retention_interval % scheduler_block_size != 0:
        raise ValueError(
            f"prefix_cache_retention_interval ({retention_interval}) must be non-negative and "
            f"a multiple of scheduler_block_size ({scheduler_block_size})."
        )


class KVCacheCoordinator(ABC):
    """Fan-out over the groups of one shared pool: groups compete for the same free blocks."""

    enable_partial_hash_hits = False

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        scheduler_block_size: int,
        hash_block_size: int,
        record_new_block_ids: bool = False,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        groups = kv_cache_config.kv_cache_groups
        check_positive_int("scheduler_block_size", scheduler_block_size)
        check_positive_int("hash_block_size", hash_block_size)
        if scheduler_block_size % hash_block_size:
            raise ValueError(
                f"scheduler_block_size {scheduler_block_size} is not a multiple of "
                f"hash_block_size {hash_block_size}"
            )
        for i, group in enumerate(groups):
            block_size = group.kv_cache_spec.block_size
            if scheduler_block_size % block_size:
                raise ValueError(
                    f"scheduler_block_size {scheduler_block_size} is not a multiple of "
                    f"group {i}'s block_size {block_size}"
                )
        self._retention_interval = kv_cache_config.prefix_cache_retention_interval
        validate_prefix_cache_retention_interval(
            self._retention_interval, scheduler_block_size, kv_cache_config,
        )
        if enable_caching:
            if not groups:
                raise ValueError("a config with no KV cache groups needs enable_caching=False")
            for i, group in enumerate(groups):
                spec = group.kv_cache_spec
                if isinstance(spec, CrossAttentionSpec):
                    raise ValueError(
                        f"group {i} is cross attention, which needs enable_caching=False"
                    )
                if isinstance(spec, EncoderOnlyAttentionSpec):
                    raise ValueError(
                        f"group {i} is encoder-only attention, which needs enable_caching=False"
                        " (Pooling models with bidirectional attn do not support prefix caching.)"
                    )
                if use_eagle and isinstance(spec, ChunkedLocalAttentionSpec):
                    raise ValueError(
                        f"group {i} is chunked local attention, which does not support EAGLE"
                    )
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, hash_block_size)

        self.eagle_group_ids: set[int] = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        # Groups whose lookups drop the last matched unit.
        self.drop_eagle_group_ids: set[int] = self.eagle_group_ids if use_eagle else set()

        # Whether the worker zeroes new attention blocks (a state group's are read before
        # written, vLLM's #35219; mixed precisions): the config decides, as in vLLM.
        zeroing = record_new_block_ids or kv_cache_config.needs_kv_cache_zeroing
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                group.kv_cache_spec,
                max_in_flight_tokens,
                max_model_len,
                block_pool=self.block_pool,
                enable_caching=enable_caching,
                kv_cache_group_id=i,
                scheduler_block_size=scheduler_block_size,
                needs_kv_cache_zeroing=zeroing,
            )
            for i, group in enumerate(groups)
        )
        # Sparse retention: read by sliding-window (§4.9.2) and Mamba 'align' (§11.3) masks.
        # With EAGLE, Mamba checkpoints follow the attention replay boundary (§11.3).
        for manager in self.single_type_managers:
            if use_eagle and isinstance(manager.kv_cache_spec, MambaSpec):
                manager.drop_eagle_checkpoint_block = True
            manager.retention_interval = self._retention_interval
            manager.replay_use_eagle = bool(self.drop_eagle_group_ids)
        # Only these can have blocks fall out of the window: the rest never skip a token.
        self._recycling_managers = tuple(
            m for m in self.single_type_managers if m.recycles_blocks
        )
        self.recycles_blocks = bool(self._recycling_managers)
        # Each group's tables and block size when every group grows by the base rule (`covers`).
        self._base_growth: tuple[tuple[dict[str, list[KVCacheBlock]], int], ...] | None = (
            tuple((m.req_to_blocks, m.block_size) for m in self.single_type_managers)
            if all(
                type(m).allocate_new_blocks is SingleTypeKVCacheManager.allocate_new_blocks
                and not isinstance(m, CrossAttentionManager)
                for m in self.single_type_managers
            )
            else None
        )

    @property
    def retention_interval(self) -> int | None:
        """vLLM's: the prefix-cache retention interval (None: dense)."""
        return self._retention_interval

    @retention_interval.setter
    def retention_interval(self, retention_interval: int | None) -> None:
        """Set for every group too: vLLM's coordinator passes its own to each call."""
        self._retention_interval = retention_interval
        for manager in self.single_type_managers:
            manager.retention_interval = retention_interval

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Sum of the groups' predictions. Pure, but for a Mamba group's prefill checkpoint
        record, which only the allocation that follows commits (docs/spec.md §11.6).

        `apply_admission_cap` is for the full-sequence gate only: the per-step check must
        equal what allocation takes. Caching coordinators have no cross-attention group
        (`KVCacheCoordinatorNoPrefixCache` sizes those).
        """
        num_blocks = 0
        for manager, blocks in zip(self.single_type_managers, new_computed_blocks):
            num_blocks += manager.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                blocks,
                total_computed_tokens,
                num_local_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap,
                prefill_end,
            )
        return num_blocks

    def covers(self, request_id: str, num_tokens: int) -> bool:
        """Whether every group grows by the base rule and the request's table already has
        `num_tokens` slots in each: growing to them would then take and change nothing
        (`allocate_slots` leaves the call out, on most decode steps)."""
        if self._base_growth is None:
            return False
        for tables, block_size in self._base_growth:
            table = tables.get(request_id)
            if table is None or len(table) * block_size < num_tokens:
                return False
        return True

    def tracks(self, request_id: str) -> bool:
        """Whether some group holds a table for the request (it was allocated, not freed)."""
        for manager in self.single_type_managers:
            if request_id in manager.req_to_blocks:
                return True
        return False

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> None:
        """Adopt the hits of a request's first allocation in every group, then take the blocks
        of its external (KV connector) tokens.

        All touches finish before anything is popped, so no group's allocation can evict
        another group's hit blocks (vLLM #33775). A tracked request never adopts.
        """
        if self.tracks(request_id):
            assert all(not blocks for blocks in new_computed_blocks)
            return
        for i, manager in enumerate(self.single_type_managers):
            manager.add_local_computed_blocks(
                request_id,
                new_computed_blocks[i],
                num_local_computed_tokens,
                num_external_computed_tokens,
            )
        if num_external_computed_tokens > 0:
            for i, manager in enumerate(self.single_type_managers):
                manager.allocate_external_computed_blocks(
                    request_id, num_local_computed_tokens, num_external_computed_tokens,
                    i not in skip_zeroing_group_ids,
                )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Grow every group's table; commits group by group, no check and no rollback."""
        return tuple([
            manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            for manager in self.single_type_managers
        ])

    num_reprefillable_tokens = 0
    """Trailing computed tokens a multi-module MTP drafter may re-prefill: never cached."""

    def set_lookahead(self, num_hash_lookahead_tokens: int, num_prefill_lookahead: int) -> None:
        """MTP / draft lookahead (docs/spec.md §5.7), as vLLM 0.34's coordinator takes it
        (kv_cache_coordinator.py:118-159): each block hash covers the `num_hash_lookahead_tokens`
        tokens after its block (the pool keeps the count for the Mamba checkpoints), and the
        last `num_prefill_lookahead - 1` computed tokens stay uncached. With caching, EAGLE
        groups and a scheduler block smaller than the prefill lookahead, ValueError."""
        for name, value in (("num_hash_lookahead_tokens", num_hash_lookahead_tokens),
                            ("num_prefill_lookahead", num_prefill_lookahead)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if (self.enable_caching and self.eagle_group_ids
                and self.scheduler_block_size < num_prefill_lookahead):
            raise ValueError(
                f"Multi-module MTP with prefix caching requires scheduler_block_size"
                f" (={self.scheduler_block_size}) >= num_speculative_tokens"
                f" (={num_prefill_lookahead})."
            )
        self.block_pool.num_hash_lookahead_tokens = int(num_hash_lookahead_tokens)
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """Prefix eligible for hashing in a group: the finalized tokens."""
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for group_id, manager in enumerate(self.single_type_managers):
            if manager.enable_caching:
                manager.cache_blocks(
                    request, self.get_num_cacheable_tokens(num_computed_tokens, group_id)
                )

    def free(self, request_id: str) -> None:
        """Free every group's table of the request (a group holding none is left alone)."""
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Every group's blocks, group after group; the caller frees each group tail first."""
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        for manager in self._recycling_managers:
            manager.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def emit_cached_block_events(
        self, request: Request, computed_blocks: tuple[list[KVCacheBlock], ...],
        num_hit_tokens: int | None = None,
    ) -> None:
        """Announce the blocks a prefix hit of `num_hit_tokens` reuses (kv_cache_report_mode
        "full", docs/spec.md §3.10): per group, one BlockStored per run of its hit's full real
        blocks, the null placeholders before a window's or a state's hit skipped (finding
        027), and a block the hit ends inside as its partial entry (finding 036)."""
        for group_id, blocks in enumerate(computed_blocks):
            if blocks:
                manager = self.single_type_managers[group_id]
                self.block_pool.emit_hit_block_events(
                    request, blocks, manager.block_size, group_id, num_hit_tokens)

    def new_step_starts(self) -> None:
        for manager in self.single_type_managers:
            manager.new_step_starts()

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> HitResult:
        """The longest prefix of at most `max_cache_hit_length` tokens every group accepts."""


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Caching disabled; any number of groups, zero included."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        scheduler_block_size: int,
        hash_block_size: int,
        record_new_block_ids: bool = False,
    ) -> None:
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            False,
            scheduler_block_size,
            hash_block_size,
            record_new_block_ids,
        )

        self._is_cross = tuple(
            isinstance(m, CrossAttentionManager) for m in self.single_type_managers
        )
        # The order `free` releases the groups in.
        self._managers_last_first = self.single_type_managers[::-1]

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """As the base, but cross attention is sized by the encoder tokens alone."""
        num_blocks = 0
        # Arguments by position: a keyword argument costs a dict in `*args, **kwargs` managers.
        for manager, is_cross, blocks in zip(
            self.single_type_managers, self._is_cross, new_computed_blocks
        ):
            if is_cross:
                num_blocks += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_encoder_tokens,
                    (),
                    0,
                    0,
                    num_encoder_tokens,
                    apply_admission_cap,
                )
            else:
                num_blocks += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    blocks,
                    total_computed_tokens,
                    num_local_computed_tokens,
                    num_tokens_main_model,
                    apply_admission_cap,
                    prefill_end,
                )
        return num_blocks

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple([
            manager.allocate_new_blocks(
                request_id, num_encoder_tokens if is_cross else num_tokens, num_tokens_main_model
            )
            for manager, is_cross in zip(self.single_type_managers, self._is_cross)
        ])

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> HitResult:
        return tuple([] for _ in self.single_type_managers), 0, 0

    def free(self, request_id: str) -> None:
        """As the base, in one release: without caching every released block goes to the
        queue head, so the tables of the last group down to the first, each tail first, as
        one run give the queue that freeing group after group gives. Nulls stay in the run
        (`release` keeps the null block out of the queue).
        """
        blocks: list[KVCacheBlock] = []
        for manager in self._managers_last_first:
            req_blocks = manager._forget(request_id)
            if req_blocks:
                blocks += req_blocks[::-1]  # a slice extends faster than `reversed`
        if blocks:
            self.block_pool.release(blocks)


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one group: its manager's search is the whole lookup."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        scheduler_block_size: int,
        hash_block_size: int,
        record_new_block_ids: bool = False,
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"UnitaryKVCacheCoordinator needs one group, got {len(groups)}")
        block_size = groups[0].kv_cache_spec.block_size
        if enable_caching and hash_block_size != block_size:
            raise ValueError(
                f"hash_block_size {hash_block_size} must equal the block_size {block_size} "
                "of a single-group config with caching on"
            )
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_caching,
            scheduler_block_size,
            hash_block_size,
            record_new_block_ids,
        )
        self.kv_cache_spec = groups[0].kv_cache_spec
        self.block_size = block_size
        self._drop_eagle_block = 0 in self.drop_eagle_group_ids
        self.single_type_managers[0].use_eagle = self._drop_eagle_block

    # One group, never cross attention (that needs caching off): the fan-outs below are a
    # single call each.

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        return self.single_type_managers[0].get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks[0],
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
            prefill_end,
        )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        return (
            self.single_type_managers[0].allocate_new_blocks(
                request_id, num_tokens, num_tokens_main_model
            ),
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        # Every finalized token is cacheable, and caching is on.
        self.single_type_managers[0].cache_blocks(
            request, num_computed_tokens - self.num_reprefillable_tokens
            if num_computed_tokens > self.num_reprefillable_tokens else 0
        )

    def free(self, request_id: str) -> None:
        self.single_type_managers[0].free(request_id)

    def tracks(self, request_id: str) -> bool:
        return request_id in self.single_type_managers[0].req_to_blocks

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> HitResult:
        hit_blocks, hit_length = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            (0,),
            self.block_pool,
            self.kv_cache_spec,
            self._drop_eagle_block,
            self.block_size,
        )
        # One group: no other group can lag behind it.
        return hit_blocks, hit_length, 0


class SpecGroup(NamedTuple):
    """Groups with one spec, looked up jointly; EAGLE drops for all if any member drops."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool
    is_full: bool
    """Full attention: downward-closed, so searched once per lookup."""


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups: a hit must land on a length every group accepts.

    Fine-grained, hash-block-aligned hits are on when vLLM turns them on (a Mamba "align"
    group with block_size > hash_block_size, `partial_hash_hits_enabled`);
    `enable_partial_hash_hits` (Tier B) forces them on for other configs too.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        scheduler_block_size: int,
        hash_block_size: int,
        record_new_block_ids: bool = False,
        enable_partial_hash_hits: bool = False,
    ) -> None:
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_caching,
            scheduler_block_size,
            hash_block_size,
            record_new_block_ids,
        )
        groups = kv_cache_config.kv_cache_groups
        enable_partial_hash_hits = enable_partial_hash_hits or partial_hash_hits_enabled(
            [group.kv_cache_spec for group in groups], hash_block_size
        )
        alignment = hash_block_size if enable_partial_hash_hits else scheduler_block_size
        for i, group in enumerate(groups):
            spec = group.kv_cache_spec
            if not spec.prefix_cacheable:
                continue
            if spec.block_size % hash_block_size:
                raise ValueError(
                    f"group {i}'s block_size {spec.block_size} is not a multiple of "
                    f"hash_block_size {hash_block_size}"
                )
            fine_grained = get_manager_class(spec).supports_fine_grained_hash_lookup
            if enable_partial_hash_hits and not fine_grained and spec.block_size != hash_block_size:
                raise ValueError(
                    f"partial hash hits need group {i} ({type(spec).__name__}) to have "
                    f"block_size {spec.block_size} equal to hash_block_size {hash_block_size}"
                )
            if isinstance(spec, ChunkedLocalAttentionSpec) and spec.block_size != alignment:
                raise ValueError(
                    f"group {i} (chunked local) block_size {spec.block_size} must equal "
                    f"the hit alignment {alignment}"
                )
        self.enable_partial_hash_hits = enable_partial_hash_hits
        self._cache_hit_alignment_tokens = alignment
        for manager in self.single_type_managers:
            manager.cache_hit_alignment_tokens = alignment
        self.attention_groups = self._split_spec_groups()
        self._has_eagle_groups = any(m.use_eagle for m in self.single_type_managers)
        # Only full attention plus one other kind: one round of the fixed point suffices,
        # as full attention accepts any shorter length.
        self._is_simple_hybrid = (
            len(self.attention_groups) == 2 and self.attention_groups[0].is_full
        )
        # ... and without EAGLE's drops that round is two plain searches.
        self._two_searches = self._is_simple_hybrid and not any(
            spec_group.use_eagle for spec_group in self.attention_groups
        )
        # Whether the two searches' lists, full attention's then the other's, are already in
        # group order (every group prefix-cacheable, full attention's groups first).
        self._two_searches_in_order = self._two_searches and (
            [*self.attention_groups[0].group_ids, *self.attention_groups[1].group_ids]
            == list(range(len(groups)))
        )

    def _split_spec_groups(self) -> list[SpecGroup]:
        """Merge groups with equal spec, class and pool; full attention first, because its
        left-to-right scan gives the tightest first bound.
        """
        spec_groups: list[SpecGroup] = []
        for i, group in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if not spec.prefix_cacheable:
                continue
            manager = self.single_type_managers[i]
            use_eagle = i in self.drop_eagle_group_ids
            for idx, existing in enumerate(spec_groups):
                if (
                    existing.spec == spec
                    and existing.manager_cls is type(manager)
                    and self.single_type_managers[existing.group_ids[0]].block_pool
                    is manager.block_pool
                ):
                    existing.group_ids.append(i)
                    if use_eagle and not existing.use_eagle:
                        spec_groups[idx] = existing._replace(use_eagle=True)
                    break
            else:
                spec_groups.append(
                    SpecGroup(
                        spec, [i], type(manager), use_eagle, isinstance(spec, FullAttentionSpec)
                    )
                )
        if not spec_groups:
            raise ValueError("HybridKVCacheCoordinator needs at least one prefix-cacheable group")
        spec_groups.sort(key=lambda g: not g.is_full)
        for spec_group in spec_groups:
            if spec_group.use_eagle:
                for group_id in spec_group.group_ids:
                    self.single_type_managers[group_id].use_eagle = True
        return spec_groups

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        return self._cacheable_tokens(num_computed_tokens)[kv_cache_group_id]

    def _cacheable_tokens(self, num_computed_tokens: int) -> list[int]:
        """Per group: round down to the hit alignment, as a later hit cannot use the part past
        it. EAGLE groups keep one block more of the finalized tokens (all but the
        re-prefillable ones), which their lookups match and then drop; the other groups do not
        hold the re-prefillable tokens back (vLLM 0.34, kv_cache_coordinator.py:787-803).
        """
        cacheable = self._align_cacheable(num_computed_tokens)
        if cacheable <= 0 or not self._has_eagle_groups:
            return [cacheable] * len(self.single_type_managers)
        finalized = max(0, num_computed_tokens - self.num_reprefillable_tokens)
        aligned_finalized = self._align_cacheable(finalized)
        return [
            min(finalized, aligned_finalized + manager.block_size)
            if manager.use_eagle
            else cacheable
            for manager in self.single_type_managers
        ]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if self._has_eagle_groups:
            for manager, num_tokens in zip(
                self.single_type_managers, self._cacheable_tokens(num_computed_tokens)
            ):
                manager.cache_blocks(request, num_tokens)
            return
        # Without EAGLE every group caches the same aligned length.
        cacheable = self._align_cacheable(num_computed_tokens)
        for manager in self.single_type_managers:
            manager.cache_blocks(request, cacheable)

    def _align_cacheable(self, num_tokens: int) -> int:
        if self.enable_partial_hash_hits:
            return num_tokens
        return num_tokens // self.scheduler_block_size * self.scheduler_block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> HitResult:
        """Fixed point: each spec group accepts the candidate length or lowers it, and any
        lowering restarts the round. Terminates because the length only decreases.

        Full attention is downward-closed (any prefix of a hit is a hit), so it is searched
        once and truncated at the end. An EAGLE group drops at most once per candidate length
        (vLLM #32802): a non-dropping search that shortens the candidate voids earlier drops.
        """
        if self._two_searches:
            return self._find_in_two_searches(block_hashes, max_cache_hit_length)
        num_groups = len(self.single_type_managers)
        hit_length = max_cache_hit_length
        longest_hit_length = 0
        hit_blocks_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        hit_length_by_group = [0] * num_groups
        eagle_verified: set[int] = set()
        num_hashed_tokens = len(block_hashes) * self.hash_block_size
        block_pool = self.block_pool
        alignment_tokens = self._cache_hit_alignment_tokens
        while True:
            curr_hit_length = hit_length
            for idx, (spec, group_ids, manager_cls, use_eagle, is_full) in enumerate(
                self.attention_groups
            ):
                first_id = group_ids[0]
                if is_full and hit_blocks_by_group[first_id] is not None:
                    if hit_length_by_group[first_id] < curr_hit_length:
                        curr_hit_length = hit_length_by_group[first_id]
                    continue
                drop_eagle_block = use_eagle and idx not in eagle_verified
                max_length = curr_hit_length
                if drop_eagle_block:
                    # Match one unit past the candidate, then drop it: back at the candidate.
                    max_length = min(
                        curr_hit_length + self._eagle_margin(spec, manager_cls), num_hashed_tokens
                    )
                hit_blocks, new_hit_length = manager_cls.find_longest_cache_hit(
                    block_hashes,
                    max_length,
                    group_ids,
                    block_pool,
                    spec,
                    drop_eagle_block,
                    alignment_tokens,
                )
                if drop_eagle_block:
                    eagle_verified.add(idx)
                elif new_hit_length < curr_hit_length:
                    eagle_verified.clear()
                curr_hit_length = new_hit_length
                for group_id, blocks in zip(group_ids, hit_blocks):
                    hit_blocks_by_group[group_id] = blocks
                    hit_length_by_group[group_id] = new_hit_length
                if curr_hit_length > longest_hit_length:
                    longest_hit_length = curr_hit_length
            if curr_hit_length >= hit_length:
                break
            hit_length = curr_hit_length
            if self._is_simple_hybrid:
                break

        for spec_group in self.attention_groups:
            if not spec_group.is_full:
                continue
            num_blocks = cdiv(hit_length, spec_group.spec.block_size)
            for group_id in spec_group.group_ids:
                blocks = hit_blocks_by_group[group_id]
                if blocks is not None:
                    del blocks[num_blocks:]
        return (
            tuple([blocks if blocks is not None else [] for blocks in hit_blocks_by_group]),
            hit_length,
            longest_hit_length - hit_length,
        )

    @property
    def full_attention_group_id(self) -> int | None:
        """The first full-attention group (sorted first), the reference of per-group lookups;
        None without full attention."""
        first = self.attention_groups[0]
        return first.group_ids[0] if first.is_full else None

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Every spec group searched on its own up to `max_cache_hit_length`, no fixed point:
        the blocks and the hit length per group (0 and no blocks for groups that are never
        looked up). An EAGLE group matches its margin past the bound (never past the hashed
        tokens), then drops its last unit, as in the fixed point."""
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        hit_lengths = [0] * len(self.single_type_managers)
        num_hashed_tokens = len(block_hashes) * self.hash_block_size
        for spec, group_ids, manager_cls, use_eagle, _ in self.attention_groups:
            max_length = max_cache_hit_length
            if use_eagle:
                max_length = min(
                    max_length + self._eagle_margin(spec, manager_cls), num_hashed_tokens
                )
            blocks, hit_length = manager_cls.find_longest_cache_hit(
                block_hashes, max_length, group_ids, self.block_pool, spec, use_eagle,
                self._cache_hit_alignment_tokens,
            )
            for group_id, group_blocks in zip(group_ids, blocks):
                hit_blocks[group_id] = group_blocks
                hit_lengths[group_id] = hit_length
        return tuple(hit_blocks), tuple(hit_lengths)

    def _find_in_two_searches(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> HitResult:
        """The fixed point of full attention plus one other kind, without EAGLE: full
        attention's hit bounds the other kind's search, whose hit then cuts full attention's.
        """
        full, other = self.attention_groups
        block_pool = self.block_pool
        alignment_tokens = self._cache_hit_alignment_tokens
        full_blocks, full_hit_length = full.manager_cls.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, full.group_ids, block_pool, full.spec, False,
            alignment_tokens,
        )
        if not full_hit_length:
            # A miss (half the lookups): no kind hits within 0 tokens, so no second search.
            return tuple([[] for _ in self.single_type_managers]), 0, 0
        other_blocks, hit_length = other.manager_cls.find_longest_cache_hit(
            block_hashes, full_hit_length, other.group_ids, block_pool, other.spec, False,
            alignment_tokens,
        )
        num_full_blocks = -(-hit_length // full.spec.block_size)  # cdiv, inlined
        for blocks in full_blocks:
            del blocks[num_full_blocks:]
        if self._two_searches_in_order:
            return (*full_blocks, *other_blocks), hit_length, full_hit_length - hit_length
        hit_blocks_by_group: list[list[KVCacheBlock]] = [
            [] for _ in self.single_type_managers
        ]
        for group_id, blocks in zip(full.group_ids, full_blocks):
            hit_blocks_by_group[group_id] = blocks
        for group_id, blocks in zip(other.group_ids, other_blocks):
            hit_blocks_by_group[group_id] = blocks
        return tuple(hit_blocks_by_group), hit_length, full_hit_length - hit_length

    def _eagle_margin(self, spec: KVCacheSpec, manager_cls: type[SingleTypeKVCacheManager]) -> int:
        """One hash unit for fine-grained lookups under partial hits, else one block; none for
        Mamba, whose search never drops (draft models have no state layers)."""
        if isinstance(spec, MambaSpec):
            return 0
        if (
            self.enable_partial_hash_hits
            and manager_cls.supports_fine_grained_hash_lookup
            and spec.block_size > self.hash_block_size
        ):
            return self.hash_block_size
        return spec.block_size


def partial_hash_hits_enabled(specs: Sequence[KVCacheSpec], hash_block_size: int) -> bool:
    """vLLM's rule: a Mamba "align" group whose block is larger than a hash block, and every
    other prefix-cacheable group either supports fine-grained lookups or has block_size equal
    to hash_block_size."""
    if not any(
        isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"
        and spec.block_size > hash_block_size
        for spec in specs
    ):
        return False
    return all(
        not spec.prefix_cacheable
        or get_manager_class(spec).supports_fine_grained_hash_lookup
        or spec.block_size == hash_block_size
        for spec in specs
    )


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_in_flight_tokens: int,
    use_eagle: bool,
    enable_caching: bool,
    scheduler_block_size: int,
    hash_block_size: int,
    record_new_block_ids: bool = False,
    enable_partial_hash_hits: bool = False,
    *,
    num_hash_lookahead_tokens: int = 0,
    num_prefill_lookahead: int = 0,
) -> KVCacheCoordinator:
    """Caching off -> NoPrefixCache; one group -> Unitary; otherwise Hybrid; then the MTP /
    draft lookahead (`KVCacheCoordinator.set_lookahead`)."""
    if enable_partial_hash_hits and (
        not enable_caching or len(kv_cache_config.kv_cache_groups) < 2
    ):
        raise ValueError(
            "enable_partial_hash_hits needs prefix caching and at least two KV cache groups, "
            f"got enable_caching={enable_caching} and "
            f"{len(kv_cache_config.kv_cache_groups)} group(s)"
        )
    common = (
        kv_cache_config,
        max_model_len,
        max_in_flight_tokens,
        use_eagle,
    )
    coordinator: KVCacheCoordinator
    if not enable_caching:
        coordinator = KVCacheCoordinatorNoPrefixCache(
            *common, scheduler_block_size, hash_block_size, record_new_block_ids
        )
    elif len(kv_cache_config.kv_cache_groups) == 1:
        coordinator = UnitaryKVCacheCoordinator(
            *common, True, scheduler_block_size, hash_block_size, record_new_block_ids
        )
    else:
        coordinator = HybridKVCacheCoordinator(
            *common,
            True,
            scheduler_block_size,
            hash_block_size,
            record_new_block_ids,
            enable_partial_hash_hits,
        )
    coordinator.set_lookahead(num_hash_lookahead_tokens, num_prefill_lookahead)
    return coordinator
