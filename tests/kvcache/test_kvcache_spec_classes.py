"""vLLM 0.34's spec classes in kvcache/kv_cache_interface.py: each spec's `merge` rule, the
draft tag, `UniformTypeKVCacheSpecs` and its grouping, the spec-kind helpers that unwrap it,
`SlidingWindowMLASpec`'s manager, the config's `needs_kv_cache_zeroing` and its transfer and
prefix-cacheable group selection."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfuzz.kvcache import SlidingWindowManager
from kvfuzz.kvcache.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpecKind,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
    is_full_attention_spec,
    iter_layer_specs,
)

from kvcache_testkit import make_manager, make_request

FULL = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float16")
MLA = MLAAttentionSpec(block_size=4, head_size=576, dtype="float16")
SWA = SlidingWindowSpec(block_size=4, sliding_window=8, dtype="float16")
SWA_MLA = SlidingWindowMLASpec(block_size=4, sliding_window=8, head_size=576, dtype="float16")


def test_full_attention_merge_keeps_the_one_window_and_refuses_disagreement():
    merged = FULL.merge([FULL, replace(FULL, sliding_window=4), replace(FULL, non_causal=True)])
    assert (merged.sliding_window, merged.non_causal, merged.num_kv_heads) == (4, True, 2)
    with pytest.raises(ValueError, match="same window size"):
        FULL.merge([replace(FULL, sliding_window=4), replace(FULL, sliding_window=8)])
    with pytest.raises(AssertionError, match="num_kv_heads"):
        FULL.merge([FULL, replace(FULL, num_kv_heads=4)])
    with pytest.raises(AssertionError, match="chunked local"):
        FULL.merge([replace(FULL, sliding_window=4), replace(FULL, attention_chunk_size=8)])
    for mixed in ([FULL, MLA], [FULL, SWA]):
        with pytest.raises(AssertionError):
            FULL.merge(mixed)


def test_variants_merge_by_their_own_rules():
    assert MLA.merge([MLA, replace(MLA, non_causal_multi_token_decode=True)]) == replace(
        MLA, non_causal_multi_token_decode=True)
    with pytest.raises(AssertionError, match="cache_dtype_str"):
        MLA.merge([MLA, replace(MLA, cache_dtype_str="fp8_ds_mla")])
    with pytest.raises(AssertionError):
        MLA.merge([MLA, FULL])
    sink = SinkFullAttentionSpec(block_size=4, sink_len=4, kv_head_major_slots=True)
    assert sink.merge([sink, sink]) == sink
    rswa = RSWASpec(block_size=4, rswa_window=8)
    with pytest.raises(AssertionError, match="rswa_window"):
        rswa.merge([rswa, replace(rswa, rswa_window=16)])
    # Other specs merge only equal layers.
    assert SWA.merge([SWA, SWA]) == SWA
    with pytest.raises(AssertionError):
        SWA.merge([SWA, replace(SWA, sliding_window=16)])


def test_sliding_window_mla_layers_may_differ_in_heads_but_not_in_quantization():
    fp8 = replace(SWA_MLA, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    merged = SlidingWindowMLASpec.merge([fp8, replace(fp8, head_size=1024)])
    assert (merged.kv_quant_mode, merged.head_size) == (KVQuantMode.FP8_PER_TENSOR, 576)
    with pytest.raises(AssertionError, match="kv_quant_mode"):
        SlidingWindowMLASpec.merge([fp8, SWA_MLA])
    with pytest.raises(AssertionError):
        SlidingWindowMLASpec.merge([SWA_MLA, SWA])


def test_the_draft_tag_is_not_part_of_the_format():
    draft = replace(FULL, is_draft=True)
    assert draft == FULL and hash(draft) == hash(FULL)
    assert not FULL.merge([draft, FULL]).is_draft


def test_uniform_type_groups_layers_of_the_same_token_slots():
    wrapped = UniformTypeKVCacheSpecs.from_specs({"a": FULL, "b": MLA})
    assert wrapped == UniformTypeKVCacheSpecs(block_size=4, kv_cache_specs={"a": FULL, "b": MLA})
    assert list(iter_layer_specs(wrapped)) == [FULL, MLA] and iter_layer_specs(FULL) == (FULL,)
    not_uniform = [
        {"a": FULL, "b": SWA},
        {"a": SWA, "b": replace(SWA, sliding_window=16)},
        {"a": SWA_MLA, "b": replace(SWA_MLA, bounded_replay=True)},
        {"a": FULL, "b": replace(FULL, block_size=8)},
        {"a": FULL, "b": replace(FULL, dcp_sharded=True)},
        {"a": MLA, "b": SWA_MLA},
    ]
    for specs in not_uniform:
        assert UniformTypeKVCacheSpecs.from_specs(specs) is None, specs
    # Mamba pages: a padded size decides; unpadded, the state shapes (kvcache sizes no bytes).
    mamba = MambaSpec(block_size=4, shapes=((4, 1),), dtypes=("float32",))
    padded = replace(mamba, page_size_padded=64)
    assert UniformTypeKVCacheSpecs.from_specs({"a": padded, "b": replace(padded, shapes=((2,),))})
    assert UniformTypeKVCacheSpecs.from_specs({"a": mamba, "b": replace(mamba, shapes=((2,),))}) \
        is None


def test_spec_kind_helpers_unwrap_a_group_of_layers():
    def wrap(*specs):
        return UniformTypeKVCacheSpecs(
            block_size=4, kv_cache_specs={str(i): spec for i, spec in enumerate(specs)})

    assert get_kv_cache_spec_kind(SWA_MLA) == KVCacheSpecKind.SLIDING_WINDOW_MLA
    assert get_kv_cache_spec_kind(wrap(MLA, replace(MLA, head_size=64))) \
        == KVCacheSpecKind.MLA_ATTENTION
    assert get_kv_cache_spec_kind(wrap(MLA, FULL)) == KVCacheSpecKind.FULL_ATTENTION
    assert get_kv_cache_spec_kind(wrap(MLA, SWA_MLA)) == KVCacheSpecKind.UNKNOWN
    assert get_kv_cache_spec_sliding_window(wrap(SWA, replace(SWA, num_kv_heads=2))) == 8
    assert get_kv_cache_spec_sliding_window(wrap(SWA, replace(SWA, sliding_window=16))) is None
    assert is_full_attention_spec(wrap(MLA, FULL)) and is_full_attention_spec(MLA)
    assert not is_full_attention_spec(wrap(MLA, SWA_MLA)) and not is_full_attention_spec(wrap())


def test_a_sliding_window_mla_group_is_managed_as_a_sliding_window():
    manager = make_manager(16, SWA_MLA)
    assert type(manager.coordinator.single_type_managers[0]) is SlidingWindowManager
    assert manager.allocate_slots(make_request("r", list(range(9)), 4), 9) is not None
    replay = replace(SWA_MLA, bounded_replay=True)
    assert not replay.prefix_cacheable
    with pytest.raises(ValueError, match="bounded_replay=True is not supported"):
        make_manager(16, replay)
    with pytest.raises(ValueError, match="model_version"):
        replace(SWA_MLA, model_version="deepseek_v3")


def test_the_config_decides_whether_new_attention_blocks_are_zeroed():
    def config(*specs, host=()):
        groups = [KVCacheGroupSpec([str(i)], spec, host_resident=i in host)
                  for i, spec in enumerate(specs)]
        return KVCacheConfig(num_blocks=8, kv_cache_groups=groups)

    mamba = MambaSpec(block_size=4, shapes=((4, 1),), dtypes=("float32",))
    assert not config(FULL, SWA).needs_kv_cache_zeroing
    assert config(FULL, replace(SWA, dtype="float32")).needs_kv_cache_zeroing
    assert config(FULL, replace(SWA, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)) \
        .needs_kv_cache_zeroing
    assert not config(FULL, replace(SWA, dtype="float32"), host=(1,)).needs_kv_cache_zeroing
    wrapped = UniformTypeKVCacheSpecs(block_size=4, kv_cache_specs={"m": mamba})
    assert config(wrapped).needs_kv_cache_zeroing
    # The managers record new attention blocks for the worker exactly when the config says so.
    for swa, zeroed in ((SWA, False), (replace(SWA, dtype="float32"), True)):
        manager = make_manager(16, FULL, swa)
        blocks = manager.allocate_slots(make_request("r", list(range(8)), 4), 8)
        assert bool(manager.take_new_block_ids()) is zeroed, blocks


def test_the_config_selects_the_groups_a_connector_moves_and_those_a_prefix_store_keeps():
    ring = CircularBufferSpec(block_size=4, dtype="float16")
    groups = [KVCacheGroupSpec(["a.0", "a.1"], FULL),
              KVCacheGroupSpec(["b"], SWA, enable_kv_transfer=False),
              KVCacheGroupSpec(["c"], ring),
              KVCacheGroupSpec(["d"], MLA)]
    config = KVCacheConfig(num_blocks=8, kv_cache_groups=groups)
    assert config.transfer_group_ids == (0, 2, 3)
    assert config.transfer_groups == (groups[0], groups[2], groups[3])
    # A layer's index counts transfer groups only: "c" is the second of them, group 2 of the config.
    assert config.transfer_group_index_by_layer == {"a.0": 0, "a.1": 0, "c": 1, "d": 2}
    # The ring is transferred but never prefix-cached; the untransferred SWA group is neither.
    assert config.prefix_cacheable_group_ids == (0, 3)
    assert config.prefix_cacheable_groups == (groups[0], groups[3])
    per_group = ([1, 2], [3], [4], [5, 6])
    selected = config.select_transfer_block_ids(per_group)
    assert selected == ([1, 2], [4], [5, 6]) and selected[0] is per_group[0]
    with pytest.raises(ValueError, match="3 block-id lists given, the config has 4"):
        config.select_transfer_block_ids(per_group[:3])
    # Read on each access: a group turned off after construction leaves the selection at once.
    groups[0].enable_kv_transfer = False
    assert config.transfer_group_ids == (2, 3) and config.prefix_cacheable_group_ids == (3,)
