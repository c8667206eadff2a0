"""Target `kvcache`: kvfuzz's production implementation, driven through the shared harness."""

from __future__ import annotations

import os
from typing import Any

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.extra_keys import lora_path
from kvfuzz.harness.manager_side import ManagerSide
from kvfuzz.harness.router_hash import BlockChain, kvcache_chain
from kvfuzz.core.trace import Op


def kvcache_spec(group: GroupConfig) -> Any:
    """The kvcache spec object of a config group."""
    from kvfuzz.kvcache import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        RSWASpec,
        SinkFullAttentionSpec,
        SlidingWindowSpec,
    )

    if group.kind == "full":
        return FullAttentionSpec(block_size=group.block_size)
    if group.kind == "sliding_window":
        return SlidingWindowSpec(
            block_size=group.block_size,
            sliding_window=group.sliding_window,
            extra_retained_tokens=group.extra_retained_tokens,
        )
    if group.kind == "chunked_local":
        return ChunkedLocalAttentionSpec(
            block_size=group.block_size, attention_chunk_size=group.attention_chunk_size
        )
    if group.kind == "circular_buffer":
        return CircularBufferSpec(block_size=group.block_size)
    if group.kind == "mla":
        return MLAAttentionSpec(block_size=group.block_size)
    if group.kind == "sink_full":
        return SinkFullAttentionSpec(block_size=group.block_size, sink_len=group.sink_len)
    if group.kind == "rswa":
        return RSWASpec(block_size=group.block_size, rswa_window=group.rswa_window)
    if group.kind == "mamba":
        return MambaSpec(
            block_size=group.block_size,
            mamba_cache_mode=group.mamba_cache_mode,
            num_speculative_blocks=group.num_speculative_blocks,
            num_prefill_checkpoint_blocks=group.num_prefill_checkpoint_blocks,
            prefill_checkpoint_alignment=group.prefill_checkpoint_alignment,
        )
    if group.kind == "encoder_only":
        return EncoderOnlyAttentionSpec(block_size=group.block_size)
    return CrossAttentionSpec(block_size=group.block_size)


def build_kvcache_manager(config: Config) -> Any:
    """A kvcache KVCacheManager for a harness config."""
    from kvfuzz.kvcache import KVCacheConfig, KVCacheGroupSpec, KVCacheManager

    kv_cache_config = KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{i}"], kvcache_spec(g), is_eagle_group=g.eagle)
            for i, g in enumerate(config.groups)
        ],
    )
    if config.kv_events:
        # Events then carry the block hashes themselves, which the harness reads as content.
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    return KVCacheManager(
        kv_cache_config,
        max_model_len=config.max_model_len,
        scheduler_block_size=config.scheduler_block_size,
        hash_block_size=config.resolved_hash_block_size,
        max_in_flight_tokens=config.max_in_flight_tokens,
        enable_caching=config.enable_caching,
        use_eagle=config.use_eagle,
        watermark=config.watermark,
        enable_partial_hash_hits=config.partial_hits,
        num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
        num_prefill_lookahead=config.num_prefill_lookahead,
        enable_mamba_shared_prefix_checkpoint=config.enable_mamba_shared_prefix_checkpoint,
        **({"enable_kv_cache_events": True} if config.kv_events else {}),
    )


class KvcacheSide(ManagerSide):
    """kvcache's KVCacheManager and Request."""

    name = "kvcache"

    def build_manager(self, config: Config) -> Any:
        from kvfuzz.kvcache import RequestStatus
        from kvfuzz.kvcache.kv_cache_utils import get_request_block_hasher

        self.request_status = RequestStatus
        self._hasher = get_request_block_hasher(
            config.resolved_hash_block_size, None, config.num_hash_lookahead_tokens,
            none_hash_seed=config.none_hash_seed,
        )
        return build_kvcache_manager(config)

    def router_chain(self, config: Config) -> BlockChain | None:
        return kvcache_chain(config.none_hash_seed, config.num_hash_lookahead_tokens)

    def make_request(self, op: Op, arrival_time: float) -> Any:
        from kvfuzz.kvcache.request import LoRARequest, MultiModalFeature, Request

        embeds = op["prompt_embeds"]
        return Request(
            op["request_id"],
            list(op["prompt"]),
            max_tokens=op["max_tokens"],
            cache_salt=op["cache_salt"],
            priority=op["priority"],
            arrival_time=arrival_time,
            block_hasher=self._hasher,
            skip_reading_prefix_cache=op["skip_reading_prefix_cache"],
            num_encoder_tokens=op["num_encoder_tokens"],
            prefix_cache_hit_limit=op["prefix_cache_hit_limit"],
            kv_cache_report_mode=self.config.kv_cache_report_mode,
            lora_request=None if op["lora_name"] is None
            else LoRARequest(op["lora_name"], op["lora_id"],
                             lora_path(op["lora_id"], op["lora_path"])),
            mm_features=[MultiModalFeature(f"mm-{i}", o, n) for i, o, n in op["mm_inputs"] or ()],
            prompt_embeds=None if embeds is None else [max(v, 0) for v in embeds],
            prompt_is_token_ids=None if embeds is None else [v < 0 for v in embeds],
        )
