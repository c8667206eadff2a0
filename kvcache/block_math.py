"""Pure token/block arithmetic of layer 3 (docs/spec.md §2.5, §4.2, §4.3, §4.9).

Small functions of ints (and, for the predictor, the evictability of each hit block) that the
managers and specs call, so that `kvfuzz prove` can check their contracts symbolically
(`fuzz/contracts.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvfuzz.kvcache.kv_cache_utils import cdiv


def sliding_window_skipped_tokens(
    num_computed_tokens: int, sliding_window: int, extra_retained_tokens: int
) -> int:
    """Tokens before the next token's window, less the extra retained ones (§4.2)."""
    num_skipped = num_computed_tokens - sliding_window + 1 - extra_retained_tokens
    return num_skipped if num_skipped > 0 else 0


def chunked_local_skipped_tokens(num_computed_tokens: int, attention_chunk_size: int) -> int:
    """Tokens left of the current chunk (§4.2)."""
    return num_computed_tokens // attention_chunk_size * attention_chunk_size


def sliding_window_admission_cap(
    sliding_window: int,
    extra_retained_tokens: int,
    max_in_flight_tokens: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """`cdiv(min(w - 1 + x + F, M), bs) + 1`; the +1 covers a window off a block boundary."""
    num_tokens = min(sliding_window - 1 + extra_retained_tokens + max_in_flight_tokens,
                     max_model_len)
    return cdiv(num_tokens, block_size) + 1


def chunked_local_admission_cap(
    attention_chunk_size: int, max_in_flight_tokens: int, max_model_len: int, block_size: int
) -> int:
    """`cdiv(min(c + F, M), bs)`: one chunk plus the in-flight tokens."""
    return cdiv(min(attention_chunk_size + max_in_flight_tokens, max_model_len), block_size)


def required_blocks(num_tokens: int, block_size: int, admission_cap: int | None) -> int:
    """R of the predictor (§4.3 step 1): `cdiv(T, bs)`, capped when a cap applies."""
    num_blocks = -(-num_tokens // block_size)  # cdiv, inlined: this runs on every step
    return num_blocks if admission_cap is None or num_blocks < admission_cap else admission_cap


def running_blocks_to_allocate(num_required_blocks: int, num_held_blocks: int) -> int:
    """The predictor's fast path (§4.3 step 3): rejected drafts can leave R < H."""
    num_blocks = num_required_blocks - num_held_blocks
    return num_blocks if num_blocks > 0 else 0


def first_blocks_to_allocate(
    num_required_blocks: int,
    num_held_blocks: int,
    num_skipped_blocks: int,
    hit_evictable: Sequence[bool],
    partial_hit: bool,
) -> int:
    """The predictor's slow path (§4.3 step 4): `new + P + E`.

    `hit_evictable[i]` says whether hit block i sits in the free queue (ref_cnt 0, not null);
    the leading hits that fall out of the window become nulls and are not adopted.
    """
    # Conditional expressions instead of max(), and no copy without dropped hits: this runs
    # on every admission, refused ones included.
    num_local_blocks = len(hit_evictable) + num_held_blocks
    num_new_blocks = num_required_blocks - (
        num_skipped_blocks if num_skipped_blocks > num_local_blocks else num_local_blocks
    )
    if num_new_blocks < 0:
        num_new_blocks = 0
    num_dropped_hits = num_skipped_blocks - num_held_blocks
    num_evictable = (
        hit_evictable[num_dropped_hits:] if num_dropped_hits > 0 else hit_evictable
    ).count(True)
    return num_new_blocks + (1 if partial_hit else 0) + num_evictable


def first_blocks_to_allocate_undropped(
    num_required_blocks: int,
    num_held_blocks: int,
    num_hit_blocks: int,
    num_evictable_hits: int,
    partial_hit: bool,
) -> int:
    """`first_blocks_to_allocate` when no hit falls out of the window (at most the held blocks
    are skipped, always so for kinds that skip none): the hits enter through two counts, so
    the caller counts the evictable ones without building a flag per hit."""
    num_new_blocks = num_required_blocks - num_held_blocks - num_hit_blocks
    if num_new_blocks < 0:
        num_new_blocks = 0
    return num_new_blocks + (1 if partial_hit else 0) + num_evictable_hits


def is_partial_hit(num_hit_blocks: int, num_local_computed_tokens: int, block_size: int) -> bool:
    """A hit ending inside a block: its shared tail block needs a private copy (P)."""
    return num_hit_blocks > 0 and num_local_computed_tokens % block_size != 0


def trim_hit(
    hit_length: int, block_size: int, alignment_tokens: int, drop_eagle_block: bool
) -> tuple[int, int]:
    """§4.9.1 steps 4-5: the EAGLE drop, then the alignment trim; (hit, blocks kept).

    EAGLE recomputes the last matched unit: one hash unit when fine-grained, else a block.
    """
    if drop_eagle_block and hit_length > 0:
        hit_length -= min(alignment_tokens, block_size)
    hit_length -= hit_length % alignment_tokens
    return hit_length, cdiv(hit_length, block_size)


def aligned_num_blocks(num_blocks: int, block_size: int, alignment_tokens: int) -> int:
    """The most of `num_blocks` whose token count is a multiple of the alignment (§4.9.2)."""
    return num_blocks - num_blocks % (alignment_tokens // math.gcd(alignment_tokens, block_size))


def sliding_window_hit_blocks(sliding_window: int, block_size: int, drop_eagle_block: bool) -> int:
    """`need` of §4.9.2: cached blocks ending at the boundary that cover the next token's
    window; EAGLE needs one more, which it then drops.
    """
    return cdiv(sliding_window - 1, block_size) + (1 if drop_eagle_block else 0)


def get_mamba_prefill_checkpoint_position(
    num_tokens: int, hash_block_size: int, drop_eagle_block: bool,
    num_hash_lookahead_tokens: int = 0,
) -> int:
    """The last position below `num_tokens` whose Mamba state can be cached (§11.3): one token
    (or the hash lookahead) is left to recompute the logits; EAGLE's drop already leaves the
    last hash block to recompute, so with it the aligned count steps down one hash block."""
    if drop_eagle_block:
        return max(num_tokens // hash_block_size * hash_block_size - hash_block_size, 0)
    limit = num_tokens - max(1, num_hash_lookahead_tokens)
    return max(limit // hash_block_size * hash_block_size, 0)


def is_mamba_prefill_checkpoint_valid(
    query_start: int,
    query_end: int,
    checkpoint_position: int,
    hash_block_size: int,
    mamba_block_size: int,
    checkpoint_alignment: int | None,
) -> bool:
    """Whether a chunk `[query_start, query_end)` can export the state at
    `checkpoint_position` mid-chunk (docs/spec.md §11.6): it starts on a hash boundary, the
    checkpoint lies at least one hash block past its start, strictly inside it and on the
    kernel's alignment from its start, and the checkpoint's column (the block before the
    chunk's last) lies past the column of the state the chunk starts from."""
    if checkpoint_alignment is None:
        return False
    initial_state_col = (query_start - 1) // mamba_block_size
    checkpoint_col = cdiv(query_end, mamba_block_size) - 2
    return (
        query_start % hash_block_size == 0
        and checkpoint_col > initial_state_col
        and query_start + hash_block_size <= checkpoint_position
        and query_start < checkpoint_position < query_end
        and (checkpoint_position - query_start) % checkpoint_alignment == 0
    )


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """Positions a later request replaying a prompt can resume at (§4.9.2): a resend stops at
    `num_prompt_tokens − 1`; with EAGLE, one block below the resend's and the extension's
    scheduler-block boundaries."""
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))
