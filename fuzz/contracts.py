"""Contracts on kvcache's pure arithmetic, checked symbolically by `kvfuzz prove` (CrossHair).

Each function is a thin wrapper over the kvcache function of the same name
(kvcache/block_math.py, kvcache/kv_cache_utils.py, or a manager method) with PEP 316
`pre:`/`post:` lines in its docstring. Postconditions state what the number means (docs/spec.md §2.5,
§4.2, §4.3, §4.9) rather than how it is computed, wherever the spec allows; the predictor's
slow path is checked against the §4.3 formula itself. A condition must fit on one line
(CrossHair's parser has no continuation lines), hence the long ones.
"""

from __future__ import annotations

from kvfuzz.kvcache import block_math, kv_cache_utils
from kvfuzz.kvcache.block_pool import BlockPool
from kvfuzz.kvcache.kv_cache_interface import CrossAttentionSpec, FullAttentionSpec
from kvfuzz.kvcache.single_type_kv_cache_manager import CrossAttentionManager, FullAttentionManager

_POOL = BlockPool(2, False, 4)
_FULL = FullAttentionManager(FullAttentionSpec(block_size=4), block_pool=_POOL,
                             enable_caching=False, kv_cache_group_id=0, scheduler_block_size=4)
_CROSS = CrossAttentionManager(CrossAttentionSpec(block_size=4), block_pool=_POOL,
                               enable_caching=False, kv_cache_group_id=1, scheduler_block_size=4)


def cdiv(a: int, b: int) -> int:
    """The ceiling of a / b.

    pre: a >= 0 and b > 0
    post: (__return__ - 1) * b < a <= __return__ * b
    """
    return kv_cache_utils.cdiv(a, b)


def full_attention_skipped_tokens(num_computed_tokens: int) -> int:
    """Full attention keeps every token (§4.2).

    pre: num_computed_tokens >= 0
    post: __return__ == 0
    """
    return _FULL.get_num_skipped_tokens(num_computed_tokens)


def cross_attention_skipped_tokens(num_computed_tokens: int) -> int:
    """Cross attention keeps every token (§4.2).

    pre: num_computed_tokens >= 0
    post: __return__ == 0
    """
    return _CROSS.get_num_skipped_tokens(num_computed_tokens)


def sliding_window_skipped_tokens(
    num_computed_tokens: int, sliding_window: int, extra_retained_tokens: int
) -> int:
    """Skipped: below the next token's window; kept: the w - 1 tokens before it plus x more.

    pre: num_computed_tokens >= 0 and sliding_window >= 1 and extra_retained_tokens >= 0
    post: 0 <= __return__ <= num_computed_tokens
    post: num_computed_tokens - __return__ <= sliding_window - 1 + extra_retained_tokens
    post: __return__ == 0 or num_computed_tokens - __return__ == sliding_window - 1 + extra_retained_tokens
    """
    return block_math.sliding_window_skipped_tokens(
        num_computed_tokens, sliding_window, extra_retained_tokens
    )


def chunked_local_skipped_tokens(num_computed_tokens: int, attention_chunk_size: int) -> int:
    """Skipped: exactly the whole chunks before the next token's chunk.

    pre: num_computed_tokens >= 0 and attention_chunk_size >= 1
    post: __return__ % attention_chunk_size == 0
    post: __return__ <= num_computed_tokens < __return__ + attention_chunk_size
    """
    return block_math.chunked_local_skipped_tokens(num_computed_tokens, attention_chunk_size)


def required_blocks(num_tokens: int, block_size: int, admission_cap: int | None) -> int:
    """R: the fewest blocks holding the tokens, unless the cap is lower (§4.3 step 1).

    pre: num_tokens >= 0 and block_size >= 1
    pre: admission_cap is None or admission_cap >= 0
    post: admission_cap is None or __return__ <= admission_cap
    post: __return__ * block_size >= num_tokens or __return__ == admission_cap
    post: (__return__ - 1) * block_size < num_tokens or __return__ == 0
    """
    return block_math.required_blocks(num_tokens, block_size, admission_cap)


def running_blocks_to_allocate(num_required_blocks: int, num_held_blocks: int) -> int:
    """Fast path: exactly the blocks that bring the table to R, none when it has R already.

    pre: num_required_blocks >= 0 and num_held_blocks >= 0
    post: __return__ >= 0
    post: num_held_blocks + __return__ >= num_required_blocks
    post: __return__ == 0 or num_held_blocks + __return__ == num_required_blocks
    """
    return block_math.running_blocks_to_allocate(num_required_blocks, num_held_blocks)


def first_blocks_to_allocate(
    num_required_blocks: int,
    num_held_blocks: int,
    num_skipped_blocks: int,
    hit_evictable: list[bool],
    partial_hit: bool,
) -> int:
    """Slow path: new + P + E with S, L and skip_new as §4.3 step 4 defines them.

    pre: num_required_blocks >= 0 and num_held_blocks >= 0 and num_skipped_blocks >= 0
    post: __return__ >= 0
    post: __return__ == _spec_first_blocks(num_required_blocks, num_held_blocks, num_skipped_blocks, hit_evictable, partial_hit)
    post: hit_evictable or num_skipped_blocks or partial_hit or __return__ == max(num_required_blocks - num_held_blocks, 0)
    """
    return block_math.first_blocks_to_allocate(
        num_required_blocks, num_held_blocks, num_skipped_blocks, hit_evictable, partial_hit
    )


def first_blocks_to_allocate_undropped(
    num_required_blocks: int,
    num_held_blocks: int,
    num_skipped_blocks: int,
    hit_evictable: list[bool],
    partial_hit: bool,
) -> int:
    """Slow path without dropped hits: the counts alone give what §4.3 step 4 gives.

    pre: num_required_blocks >= 0 and num_held_blocks >= 0 and 0 <= num_skipped_blocks <= num_held_blocks
    post: __return__ == _spec_first_blocks(num_required_blocks, num_held_blocks, num_skipped_blocks, hit_evictable, partial_hit)
    """
    return block_math.first_blocks_to_allocate_undropped(
        num_required_blocks, num_held_blocks, len(hit_evictable), hit_evictable.count(True),
        partial_hit,
    )


def _spec_first_blocks(r: int, h: int, s: int, hits: list[bool], p: bool) -> int:
    """docs/spec.md §4.3 step 4, as written there."""
    new = max(r - max(s, len(hits) + h), 0)
    skip_new = max(0, s - h)
    e = len([evictable for evictable in hits[skip_new:] if evictable])
    return new + (1 if p else 0) + e


def sliding_window_admission_cap(
    sliding_window: int,
    extra_retained_tokens: int,
    max_in_flight_tokens: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """`cdiv(min(w - 1 + x + F, M), bs) + 1` (§2.5).

    pre: sliding_window >= 1 and extra_retained_tokens >= 0 and max_in_flight_tokens >= 1
    pre: max_model_len >= 1 and block_size >= 1
    post: (__return__ - 2) * block_size < min(sliding_window - 1 + extra_retained_tokens + max_in_flight_tokens, max_model_len) <= (__return__ - 1) * block_size
    """
    return block_math.sliding_window_admission_cap(
        sliding_window, extra_retained_tokens, max_in_flight_tokens, max_model_len, block_size
    )


def chunked_local_admission_cap(
    attention_chunk_size: int, max_in_flight_tokens: int, max_model_len: int, block_size: int
) -> int:
    """`cdiv(min(c + F, M), bs)` (§2.5).

    pre: attention_chunk_size >= 1 and max_in_flight_tokens >= 1
    pre: max_model_len >= 1 and block_size >= 1
    post: (__return__ - 1) * block_size < min(attention_chunk_size + max_in_flight_tokens, max_model_len) <= __return__ * block_size
    """
    return block_math.chunked_local_admission_cap(
        attention_chunk_size, max_in_flight_tokens, max_model_len, block_size
    )


def sliding_window_cap_at_max_model_len(
    sliding_window: int, extra_retained_tokens: int, max_model_len: int, block_size: int,
    num_tokens: int,
) -> int:
    """With F = M the sliding-window cap never binds: R is uncapped for every T <= M.

    pre: sliding_window >= 1 and extra_retained_tokens >= 0 and block_size >= 1
    pre: 0 <= num_tokens <= max_model_len
    post: block_math.required_blocks(num_tokens, block_size, __return__) * block_size >= num_tokens
    """
    return block_math.sliding_window_admission_cap(
        sliding_window, extra_retained_tokens, max_model_len, max_model_len, block_size
    )


def chunked_local_cap_at_max_model_len(
    attention_chunk_size: int, max_model_len: int, block_size: int, num_tokens: int
) -> int:
    """With F = M the chunked-local cap never binds: R is uncapped for every T <= M.

    pre: attention_chunk_size >= 1 and block_size >= 1
    pre: 0 <= num_tokens <= max_model_len
    post: block_math.required_blocks(num_tokens, block_size, __return__) * block_size >= num_tokens
    """
    return block_math.chunked_local_admission_cap(
        attention_chunk_size, max_model_len, max_model_len, block_size
    )


def trim_hit(
    hit_length: int, block_size: int, alignment_tokens: int, drop_eagle_block: bool
) -> tuple[int, int]:
    """§4.9.1 steps 4-5: aligned, at most one alignment (and one EAGLE unit) shorter, and the
    blocks kept are exactly those the hit touches.

    pre: hit_length >= 0 and block_size >= 1 and alignment_tokens >= 1
    pre: not drop_eagle_block or hit_length == 0 or hit_length >= min(alignment_tokens, block_size)
    post: __return__[0] % alignment_tokens == 0
    post: 0 <= __return__[0] <= hit_length
    post: __return__[0] > hit_length - alignment_tokens - (min(alignment_tokens, block_size) if drop_eagle_block and hit_length > 0 else 0)
    post: (__return__[1] - 1) * block_size < __return__[0] <= __return__[1] * block_size
    """
    return block_math.trim_hit(hit_length, block_size, alignment_tokens, drop_eagle_block)


def aligned_num_blocks(num_blocks: int, block_size: int, alignment_tokens: int) -> int:
    """§4.9.2 trim: the most leading blocks whose tokens are a multiple of the alignment.

    pre: num_blocks >= 0 and block_size >= 1 and alignment_tokens >= 1
    pre: alignment_tokens % block_size == 0 or block_size % alignment_tokens == 0
    post: __return__ * block_size % alignment_tokens == 0
    post: 0 <= __return__ <= num_blocks
    post: (num_blocks - __return__) * block_size < alignment_tokens
    """
    return block_math.aligned_num_blocks(num_blocks, block_size, alignment_tokens)


def sliding_window_hit_blocks(sliding_window: int, block_size: int, drop_eagle_block: bool) -> int:
    """`need` of §4.9.2: the fewest blocks covering the w - 1 tokens before the next one, plus
    EAGLE's extra block.

    pre: sliding_window >= 1 and block_size >= 1
    post: (__return__ - drop_eagle_block) * block_size >= sliding_window - 1
    post: (__return__ - drop_eagle_block - 1) * block_size < sliding_window - 1 or __return__ == drop_eagle_block
    """
    return block_math.sliding_window_hit_blocks(sliding_window, block_size, drop_eagle_block)
