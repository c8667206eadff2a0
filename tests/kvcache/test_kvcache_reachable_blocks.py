"""vLLM's `reachable_block_mask(start_block, end_block, alignment_tokens=, ...)` class methods
(docs/spec.md §4.9.2, §11.3): a pure function of their arguments, which a KV connector calls
without a manager, and the same mask a manager's own registration uses."""

from __future__ import annotations

import pytest

from kvfuzz.kvcache import BlockPool, FullAttentionManager, FullAttentionSpec, MambaManager
from kvfuzz.kvcache import MambaSpec, SlidingWindowManager, SlidingWindowSpec
from kvcache_testkit import make_request


def _kept(mask: list[bool] | None, start: int = 0) -> set[int] | None:
    return None if mask is None else {start + i for i, keep in enumerate(mask) if keep}


def _swa(start: int, end: int, alignment: int | None, window: int, block_size: int = 4,
         **kwargs: object) -> set[int] | None:
    spec = SlidingWindowSpec(block_size=block_size, sliding_window=window)
    mask = SlidingWindowManager.reachable_block_mask(
        start_block=start, end_block=end, alignment_tokens=alignment, kv_cache_spec=spec,
        use_eagle=kwargs.pop("use_eagle", False), **kwargs)
    return _kept(mask, start)


def _state(start: int, end: int, alignment: int | None, retention: int | None,
           boundaries: tuple[int, ...] = ()) -> set[int] | None:
    spec = MambaSpec(block_size=4, mamba_cache_mode="align")
    mask = MambaManager.reachable_block_mask(
        start_block=start, end_block=end, alignment_tokens=alignment, kv_cache_spec=spec,
        use_eagle=False, retention_interval=retention, reachable_boundaries=boundaries)
    return _kept(mask, start)


def test_full_attention_keeps_every_block():
    assert FullAttentionManager.reachable_block_mask(
        0, 8, 4, FullAttentionSpec(block_size=4), use_eagle=False, retention_interval=0) is None


def test_window_mask_keeps_the_run_before_each_aligned_boundary():
    # window 4 over blocks of 4: a hit needs 1 block; alignment 12 = 3 blocks per segment.
    assert _swa(0, 6, 12, window=4) == {2, 5}
    assert _swa(0, 6, None, window=4) is None  # no alignment constraint: dense
    assert _swa(0, 6, 6, window=4) is None  # not a whole number of blocks: dense
    assert _swa(0, 6, 4, window=4) is None  # every block ends a segment
    # EAGLE needs one block more, and the run sits one block right.
    assert _swa(0, 7, 12, window=4, use_eagle=True) == {2, 3, 5, 6}


def test_window_mask_final_partial_segment_without_eagle_only():
    # window 5: need 1; alignment 16: 4 blocks per segment (tails 3, 7, 11).
    assert _swa(8, 11, 16, window=5) == set()
    assert _swa(8, 11, 16, window=5, final_segment_end_block=10) == {9}
    assert _swa(8, 11, 16, window=5, final_segment_end_block=12) == set()  # segment full
    assert _swa(8, 11, 16, window=5, final_segment_end_block=10, use_eagle=True) == {8}


def test_window_mask_under_retention_keeps_the_boundary_runs():
    # window 12: need 3; retention 0 keeps only the runs before the (aligned) boundaries.
    assert _swa(0, 16, 4, window=12, retention_interval=0,
                reachable_boundaries=(63, 26)) == {3, 4, 5, 12, 13, 14}
    # retention 32 (8 blocks): segment tails {5, 6, 7, 13, 14, 15} and the boundary runs.
    assert _swa(0, 16, 4, window=12, retention_interval=32,
                reachable_boundaries=(26,)) == {3, 4, 5, 6, 7, 13, 14, 15}


def test_window_mask_scales_blocks_by_dcp_world_size():
    # block 4 x dcp 2 = 8 tokens: alignment 24 is 3 blocks of 8 (1 of need 1), not of 4.
    assert _swa(0, 6, 24, window=8, dcp_world_size=2) == {2, 5}
    assert _swa(0, 6, 24, window=8, dcp_world_size=3) == {1, 3, 5}  # 2 blocks of 12
    assert _swa(0, 6, 24, window=8, dcp_world_size=5) is None  # 24 is not blocks of 20


def test_state_mask_keeps_segment_ends_and_boundaries():
    assert _state(0, 16, 4, None) is None  # no retention: dense
    assert _state(0, 16, None, 0) is None  # no alignment: dense
    assert _state(0, 16, 4, 4) is None  # one block per segment
    assert _state(0, 16, 4, 16) == {3, 7, 11, 15}
    assert _state(0, 16, 4, 0, (63, 26)) == {5, 14}
    assert _state(0, 16, 8, 0, (26,)) == {5}  # 26 aligned down to 24: block 5 ends there
    assert _state(5, 9, 4, 16, (200,)) == {7}  # an out-of-range boundary keeps nothing


@pytest.mark.parametrize("retention", [None, 0, 8])
def test_a_managers_registration_uses_the_class_mask(retention):
    pool = BlockPool(16, True, 4)
    swa = SlidingWindowManager(SlidingWindowSpec(block_size=4, sliding_window=4), block_pool=pool,
                               enable_caching=True, kv_cache_group_id=0, scheduler_block_size=4)
    swa.cache_hit_alignment_tokens, swa.retention_interval = 8, retention
    request = make_request("r", list(range(23)), 4)
    expected = SlidingWindowManager.reachable_block_mask(
        0, 5, 8, swa.kv_cache_spec, False, retention,
        () if retention is None else swa._reachable_boundaries(request))
    assert swa._reachable_mask(0, 5, request) == expected
    swa.allocate_new_blocks("r", 20, 20)
    swa.cache_blocks(request, 20)
    registered = {i for i, b in enumerate(swa.req_to_blocks["r"]) if b.block_hash is not None}
    assert registered == (set(range(5)) if expected is None else _kept(expected))
