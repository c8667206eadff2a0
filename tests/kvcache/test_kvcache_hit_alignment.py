"""Where hits land, under vLLM's names: `resolve_cache_hit_alignment_tokens` (the coordinator's
alignment, for the workers that place Mamba checkpoints there) and `resolve_block_hashes`'
gate between a block-size view and the raw hashes of fine-grained lookups."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvfuzz.kvcache import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvfuzz.kvcache.kv_cache_utils import (
    BlockHashListWithBlockSize,
    resolve_block_hashes,
    resolve_cache_hit_alignment_tokens,
)
from kvcache_testkit import make_config, make_manager

RAW = [bytes([i]) * 32 for i in range(8)]


def _vllm_config(caching: bool = True, dcp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=caching),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=dcp))


def test_equal_sizes_and_fine_grained_partial_hits_keep_the_raw_hashes():
    assert resolve_block_hashes(RAW, 2, 2, alignment_tokens=2) is RAW
    assert resolve_block_hashes(
        RAW, 2, 4, supports_fine_grained_hash_lookup=True, alignment_tokens=2) is RAW


@pytest.mark.parametrize("fine_grained, alignment", [(True, 4), (True, 8), (True, 3),
                                                      (True, None), (False, 2)])
def test_otherwise_a_block_size_view(fine_grained, alignment):
    view = resolve_block_hashes(RAW, 2, 4, supports_fine_grained_hash_lookup=fine_grained,
                                alignment_tokens=alignment)
    assert isinstance(view, BlockHashListWithBlockSize)
    assert view.scale_factor == 2 and view[1] == RAW[3]


SPECS = {
    "full": FullAttentionSpec(block_size=2),
    "mamba": MambaSpec(block_size=8, mamba_cache_mode="align"),
    "mamba_hbs": MambaSpec(block_size=2, mamba_cache_mode="align"),
    "swa": SlidingWindowSpec(block_size=4, sliding_window=4),
}


@pytest.mark.parametrize("kinds, expected", [
    (("full", "mamba"), 2),  # partial hits: a hash block
    (("full", "mamba", "swa"), 8),  # the window has no fine-grained lookups: off
    (("full", "mamba_hbs"), 2),  # no state block larger than a hash block: off (sbs 2)
    (("full", "swa"), 4),
])
def test_the_alignment_is_the_coordinators(kinds, expected):
    specs = [SPECS[k] for k in kinds]
    coordinator = make_manager(64, *specs, hash_block_size=2).coordinator
    alignment = resolve_cache_hit_alignment_tokens(
        make_config(64, *specs), _vllm_config(), coordinator.scheduler_block_size, 2)
    assert alignment == coordinator._cache_hit_alignment_tokens == expected


def test_one_group_or_caching_off_aligns_to_a_scheduler_block():
    config = make_config(64, SPECS["full"], SPECS["mamba"])
    assert resolve_cache_hit_alignment_tokens(config, _vllm_config(caching=False), 8, 2) == 8
    one = make_config(64, SPECS["mamba"])
    assert resolve_cache_hit_alignment_tokens(one, _vllm_config(), 8, 2) == 8


def test_decode_context_parallelism_is_refused():
    with pytest.raises(ValueError, match="decode_context_parallel_size=2"):
        resolve_cache_hit_alignment_tokens(
            make_config(64, SPECS["full"], SPECS["mamba"]), _vllm_config(dcp=2), 8, 2)
