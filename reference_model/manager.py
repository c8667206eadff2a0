"""The layer-1 KVCacheManager API (docs/spec.md §6) over the model's state, recording an
AllocationProbe for every allocate_slots it runs."""

from __future__ import annotations

from kvfuzz.core.sides import AllocationProbe, Observations
from kvfuzz.reference_model.allocation import allocate_slots, free_request, pop_request_blocks
from kvfuzz.reference_model.caching import cache_request
from kvfuzz.reference_model.layout import Layout
from kvfuzz.reference_model.lookup import (
    Lists,
    get_computed_blocks,
    get_computed_blocks_for_connector,
)
from kvfuzz.reference_model.requests import Request
from kvfuzz.reference_model.state import NULL, State


class Manager:
    """Pool, tables and cache of one KVCacheManager (docs/spec.md §6.1)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.state = State.fresh(layout.num_blocks, len(layout.groups), layout.caching)
        self.observations = Observations()

    def tracked(self, rid: str) -> bool:
        """The request has a table entry (from its first successful allocation to its free)."""
        return any(rid in group for group in self.state.tables)

    def get_computed_blocks(self, req: Request,
                            bound: int | None = None) -> tuple[Lists, int, int]:
        return get_computed_blocks(self.layout, self.state, req, bound)

    def get_computed_blocks_for_connector(self, req: Request) -> tuple[Lists, int, int, bool]:
        return get_computed_blocks_for_connector(self.layout, self.state, req)

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        hit: int = 0,
        hits: Lists | None = None,
        num_lookahead_tokens: int = 0,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        external: int = 0,
        delay_cache: bool = False,
    ) -> Lists | None:
        """docs/spec.md §6.4 (arguments already checked): the new block ids per group, or None."""
        self.state, done = allocate_slots(
            self.layout,
            self.state,
            req,
            num_new_tokens,
            hit,
            hits,
            num_lookahead_tokens,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            external,
            delay_cache,
        )
        if done.shortage is not None:
            self.observations.pool_shortages.append(done.shortage)
        self.observations.allocations.append(
            AllocationProbe(
                req.request_id,
                done.outcome,  # type: ignore[arg-type]
                done.prediction,
                done.free_before,
                done.free_after,
                done.group_taken,
                done.group_taken,
            )
        )
        return done.new_blocks

    def record_error(self, rid: str) -> None:
        """An allocate_slots that raised ValueError (API misuse)."""
        self.observations.allocations.append(AllocationProbe(rid, "error"))

    def free(self, rid: str) -> None:
        free_request(self.layout, self.state, rid)

    def pop_blocks_for_free(self, rid: str) -> list[list[int]]:
        return pop_request_blocks(self.layout, self.state, rid)

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        cache_request(self.layout, self.state, req, num_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """docs/spec.md §3.7: strip keys; ref counts, queue positions and num_cached_block unchanged."""
        for b in block_ids:
            if b != NULL:
                self.state.drop_keys(b)

    def reset_prefix_cache(self) -> bool:
        return self.state.reset_cache()

    def take_new_block_ids(self) -> list[int]:
        ids = [b for group in self.state.new_block_ids for b in group]
        self.state.new_block_ids = [[] for _ in self.layout.groups]
        return ids

    def take_kv_cache_block_copies(self) -> list[tuple[int, int]]:
        """Drain every group's pending CoW pairs; their endpoints stay held (retained)."""
        copies = [pair for group in self.state.pending_copies for pair in group]
        self.state.pending_copies = [[] for _ in self.layout.groups]
        self.state.retained.extend(copies)
        return copies

    def new_step_starts(self) -> None:
        """Forget the keys registered in the last step (docs/spec.md §11.3)."""
        self.state.cached_this_step = [set() for _ in self.layout.groups]

    def release_copies(self) -> None:
        """free_blocks of every retained endpoint (src, dst per pair), in the order taken."""
        ordered = [b for pair in self.state.retained for b in pair]
        self.state.retained = []
        self.state.release(ordered)
