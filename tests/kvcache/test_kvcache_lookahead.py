"""MTP / draft lookahead in kvcache (docs/spec.md §5.7): hashes that cover the tokens after a
block, and re-prefillable tokens left uncached, as vLLM 0.34's manager takes them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvfuzz.kvcache import FullAttentionSpec, MambaSpec, Request, get_request_block_hasher
from kvfuzz.kvcache.block_math import get_mamba_prefill_checkpoint_position

from kvcache_testkit import make_config, make_manager


def _request(request_id: str, tokens: list[int], lookahead: int, hbs: int = 4) -> Request:
    hasher = get_request_block_hasher(hbs, None, lookahead, none_hash_seed="t")
    return Request(request_id, tokens, block_hasher=hasher)


def test_a_hit_needs_the_tokens_after_the_block_too():
    manager = make_manager(16, FullAttentionSpec(block_size=4), num_hash_lookahead_tokens=2)
    first = _request("a", list(range(12)), 2)
    assert len(first.block_hashes) == 2  # block 2 lacks its two lookahead tokens
    assert manager.allocate_slots(first, 12) is not None
    assert manager.get_num_cached_tokens(_request("b", list(range(12)), 2)) == 8
    # Same first block, different tokens right after it: no block is a hit.
    diverging = _request("c", [0, 1, 2, 3, 9, 9, 9, 9, 9], 2)
    assert manager.get_num_cached_tokens(diverging) == 0
    # Same block 0 and the two tokens after it: block 0 only.
    assert manager.get_num_cached_tokens(_request("d", [0, 1, 2, 3, 4, 5, 9, 9, 9], 2)) == 4


def test_reprefillable_tokens_stay_uncached():
    manager = make_manager(16, FullAttentionSpec(block_size=4), num_prefill_lookahead=3)
    assert manager.coordinator.num_reprefillable_tokens == 2
    request = _request("a", list(range(13)), 0)
    assert manager.allocate_slots(request, 9) is not None
    # 9 computed, 2 re-prefillable: 7 finalized, one full block cached.
    assert manager.get_num_cached_tokens(_request("b", list(range(13)), 0)) == 4
    request.num_computed_tokens = 9
    assert manager.allocate_slots(request, 4) is not None  # 13 computed: 11 finalized
    assert manager.get_num_cached_tokens(_request("c", list(range(13)), 0)) == 8


def test_multi_module_mtp_needs_a_scheduler_block_as_large_as_its_lookahead():
    config = make_config(8, FullAttentionSpec(block_size=4), eagle=(0,))
    from kvfuzz.kvcache import KVCacheManager

    with pytest.raises(ValueError, match=r"scheduler_block_size \(=4\) >= "
                                         r"num_speculative_tokens \(=5\)"):
        KVCacheManager(config, 64, 4, 4, num_prefill_lookahead=5)
    KVCacheManager(config, 64, 4, 4, num_prefill_lookahead=4)
    KVCacheManager(config, 64, 4, 4, enable_caching=False, num_prefill_lookahead=5)


def test_the_mamba_checkpoint_leaves_the_hash_lookahead_to_come():
    manager = make_manager(16, FullAttentionSpec(block_size=4), MambaSpec(
        block_size=8, mamba_cache_mode="align"), num_hash_lookahead_tokens=3)
    assert manager.block_pool.num_hash_lookahead_tokens == 3
    assert get_mamba_prefill_checkpoint_position(18, 4, False, 3) == 12
    assert get_mamba_prefill_checkpoint_position(18, 4, False) == 16


@pytest.mark.parametrize("computed, new, want", [
    (0, 9, 7),    # would leave 1 < 3: stops 3 short
    (0, 8, 7),    # would leave 2 < 3
    (0, 7, 7),    # leaves exactly 3
    (0, 10, 10),  # finishes the prefill
    (8, 1, 0),    # nothing fits
])
def test_a_prefill_chunk_stops_clear_of_the_prefill_lookahead(computed, new, want):
    from kvfuzz.kvcache.scheduler import reserve_prefill_lookahead

    assert reserve_prefill_lookahead(10, computed, new, 3) == want


def _mtp_execution(name: str) -> Any:
    from kvfuzz.core.configs import BUILTIN
    from kvfuzz.harness.executor import Execution

    base = BUILTIN[name][1]
    config = base.replace(scheduler=dataclasses.replace(base.scheduler, token_budget=16))
    return Execution(config, "scheduler", ("kvcache",))


def test_a_waiting_request_the_prefill_lookahead_leaves_no_tokens_is_passed_over():
    """vLLM 0.34's `skip_request` (sched/scheduler.py:1456-1460): with 1 token of budget left,
    r1 (2 tokens) would end inside the 3-token lookahead and is passed over; r2 is admitted,
    and r1 keeps its place for the next step (kvcache and the model agree)."""
    ex = _mtp_execution("deepseek_v3_mtp3")
    for rid, prompt in (("r0", [2, 1, 2, 3, 1, 2, 0, 2, 1, 3, 0, 0, 2, 3, 3]), ("r1", [2, 1]),
                        ("r2", [2, 1, 0, 1])):
        ex.apply({"op": "add_request", "request_id": rid, "prompt": prompt, "max_tokens": 1})
    assert ex.apply({"op": "step"})["scheduled"] == [["r0", 15, 0], ["r2", 1, 0]]
    assert ex.apply({"op": "step"})["scheduled"] == [["r2", 3, 0], ["r1", 2, 0]]


def test_the_block_a_sampled_token_completes_is_cached_after_the_output():
    """On a Mamba hybrid with prefix caching the driver caches after each output (vLLM 0.34's
    `update_from_output`): the token sampled from a 3-token prompt completes hash block 0's
    2-token lookahead, so the block is cached before the request finishes and frees it."""
    ex = _mtp_execution("qwen3_next_mtp")
    ex.apply({"op": "add_request", "request_id": "r", "prompt": [3, 2, 0], "max_tokens": 1})
    assert ex.apply({"op": "step"})["finished"] == ["r"]
    assert {tuple(tokens) for _, _, tokens in ex.state.cache} == {(3, 2)}
