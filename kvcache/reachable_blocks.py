"""Which blocks a cache registration keeps under sparse retention (docs/spec.md §4.9.2, §11.3):
vLLM's `reachable_block_mask(start_block, end_block, alignment_tokens, kv_cache_spec, ...)` of
each manager class, a pure function of its arguments so that a KV connector can ask it without a
manager (vLLM 0.34: vllm/v1/core/single_type_kv_cache_manager.py:549-572, 1072-1155,
1553-1608).

A mask covers blocks [start_block, end_block) of a request's table; None keeps them all.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfuzz.kvcache.block_math import sliding_window_hit_blocks
from kvfuzz.kvcache.kv_cache_interface import KVCacheSpec, MambaSpec, SlidingWindowSpec


def every_block_reachable(
    start_block: int, end_block: int, alignment_tokens: int | None, kv_cache_spec: KVCacheSpec,
    use_eagle: bool, retention_interval: int | None = None,
    reachable_boundaries: Sequence[int] = (), dcp_world_size: int = 1,
    final_segment_end_block: int | None = None,
) -> None:
    """Every kind whose hit may end at any block keeps them all (full attention, chunks)."""
    return None


def window_blocks_reachable(
    start_block: int, end_block: int, alignment_tokens: int | None, kv_cache_spec: KVCacheSpec,
    use_eagle: bool, retention_interval: int | None = None,
    reachable_boundaries: Sequence[int] = (), dcp_world_size: int = 1,
    final_segment_end_block: int | None = None,
) -> list[bool] | None:
    """A window hit at an aligned boundary reads the `need` blocks before it (EAGLE's extra
    block shifts that run right by one), so block i is kept iff it is among the last `need` of
    its segment: `(i - shift) % per >= per - need`, with `per` blocks per segment (the
    alignment; the retention interval when one is set; no segment when it is 0). DCP shards
    scale the block size.

    Without EAGLE, a request's final segment ending at `final_segment_end_block` before a full
    segment also keeps the `need` blocks before that end. Under retention, the `need` blocks
    before each reachable boundary (aligned down) are kept too. Dense when there is no
    alignment, when it is not a whole number of blocks, or when every block qualifies.
    """
    assert isinstance(kv_cache_spec, SlidingWindowSpec)
    block_size = kv_cache_spec.block_size * dcp_world_size
    if alignment_tokens is None or alignment_tokens % block_size:
        return None
    need = sliding_window_hit_blocks(kv_cache_spec.sliding_window, block_size, use_eagle)
    shift = 1 if use_eagle else 0
    segment = alignment_tokens if retention_interval is None else retention_interval
    per = segment // block_size
    if segment and need >= per:  # every block qualifies (most configs): no list built
        return None
    mask = [False] * (end_block - start_block)
    if segment:
        mask = [
            i >= shift and (i - shift) % per >= per - need
            for i in range(start_block, end_block)
        ]
        if final_segment_end_block is not None and not use_eagle:
            final_size = final_segment_end_block % per
            if final_size:
                first = max(final_segment_end_block - final_size, final_segment_end_block - need)
                for i in range(max(start_block, first), min(end_block, final_segment_end_block)):
                    mask[i - start_block] = True
    if retention_interval is not None:
        for boundary in reachable_boundaries:
            end = boundary // alignment_tokens * alignment_tokens // block_size + shift
            for j in range(max(start_block, end - need), min(end_block, end)):
                mask[j - start_block] = True
    return mask


def state_blocks_reachable(
    start_block: int, end_block: int, alignment_tokens: int | None, kv_cache_spec: KVCacheSpec,
    use_eagle: bool, retention_interval: int | None = None,
    reachable_boundaries: Sequence[int] = (), dcp_world_size: int = 1,
    final_segment_end_block: int | None = None,
) -> list[bool] | None:
    """A state hit reads only the one block ending at its boundary (no window, no EAGLE shift;
    DCP does not apply to state groups), so under a retention interval R block i is kept when
    it ends a segment (`(i + 1) % (R // bs) == 0`; every block when a segment is at most one
    block; none when R is 0) or ends at a reachable boundary rounded down to the alignment and
    then to a block end. Dense without R or an alignment."""
    if retention_interval is None or alignment_tokens is None:
        return None
    assert isinstance(kv_cache_spec, MambaSpec)
    block_size = kv_cache_spec.block_size
    mask = [False] * (end_block - start_block)
    if retention_interval:
        per_segment = retention_interval // block_size
        if per_segment <= 1:
            return None
        for i in range(-(-(start_block + 1) // per_segment) * per_segment - 1, end_block,
                       per_segment):
            mask[i - start_block] = True
    for boundary in reachable_boundaries:
        block_idx = boundary // alignment_tokens * alignment_tokens // block_size - 1
        if start_block <= block_idx < end_block:
            mask[block_idx - start_block] = True
    return mask
