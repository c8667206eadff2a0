"""KV cache specs and configs: immutable value objects describing the groups of a model.

No tensors here: the manager only needs block sizes and attention windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvfuzz.kvcache.block_math import (  # the Mamba checkpoint rules: where vLLM 0.34 has them
    chunked_local_admission_cap,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
    sliding_window_admission_cap,
)
from kvfuzz.kvcache.kv_cache_utils import check_positive_int


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """The KV cache format of one layer; equal specs can share a lookup.

    Besides `block_size`, the specs take vLLM's layout fields (`num_kv_heads`, `head_size`,
    `dtype`, ... and `dcp_sharded`, `block_stride_alignment`) so that code written against
    `vllm.v1.kv_cache_interface` builds them unchanged. The manager never reads them: they
    describe the tensors, which it does not hold.
    """

    block_size: int
    dcp_sharded: bool = False
    block_stride_alignment: Any = None

    def __post_init__(self) -> None:
        check_positive_int("block_size", self.block_size)

    @property
    def prefix_cacheable(self) -> bool:
        """Whether this spec's group takes part in prefix caching."""
        return True


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer's spec; its tensor layout fields are accepted and not read."""

    num_kv_heads: int = 1
    head_size: int = 1
    dtype: Any = None
    head_size_v: int | None = None
    max_tp_shards: int | None = None
    kv_quant_mode: Any = None
    page_size_padded: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    kv_head_major_slots: bool = False
    tokens_per_state: Any = 1


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token keeps its KV for the request's lifetime.

    `sliding_window` / `attention_chunk_size` are informational: window layers treated as full
    attention when the hybrid allocator is off.
    """

    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token, managed as full attention.

    A different spec from FullAttentionSpec, so a hybrid looks its groups up separately.
    The other fields are vLLM 0.34's layout fields (kv_cache_interface.py:741-755), taken so
    that vLLM-written code builds the spec; the manager does not read them.
    """

    cache_dtype_str: str | None = None
    topk_buffer_width: int | None = None
    alignment: int | None = None
    model_version: str | None = None
    cache_role: Any = None
    is_index_group_leader: bool = False
    non_causal_multi_token_decode: bool = False


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with `sink_len` attention-sink tokens; the manager is full attention's,
    and building it refuses a `sink_len` that is not a whole number of blocks (the spec itself
    is built as vLLM builds it)."""

    sink_len: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("sink_len", self.sink_len)


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding window: the prompt stays visible, decode keeps only its last
    `rswa_window` tokens; the blocks between the two are released as decode moves on."""

    rswa_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("rswa_window", self.rswa_window)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """The next token attends to the previous `sliding_window - 1` tokens and itself.

    `extra_retained_tokens` keeps that many more tokens below the window alive (never attended).
    """

    sliding_window: int
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("sliding_window", self.sliding_window)
        if not isinstance(self.extra_retained_tokens, int) or self.extra_retained_tokens < 0:
            raise ValueError(
                f"extra_retained_tokens must be a non-negative int, "
                f"got {self.extra_retained_tokens!r}"
            )

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Most blocks one request holds at once; the one bound for admission and pool sizing.

        The +1 covers a window that does not start on a block boundary.
        """
        return sliding_window_admission_cap(
            self.sliding_window,
            self.extra_retained_tokens,
            max_in_flight_tokens,
            max_model_len,
            self.block_size,
        )


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Token t attends only within its chunk `[t // c * c, t]`."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("attention_chunk_size", self.attention_chunk_size)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Most blocks one request holds at once: one chunk plus the in-flight tokens."""
        return chunked_local_admission_cap(
            self.attention_chunk_size, max_in_flight_tokens, max_model_len, self.block_size
        )


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder-side KV of an encoder-decoder model: allocated once, never prefix-cached."""


@dataclass(frozen=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional attention over one request's tokens in a single forward: no KV is kept.

    vLLM's layers return no spec for it, so they never form a group; kvcache keeps the group
    and gives it a manager that holds nothing (docs/spec.md §12.4).
    """

    @property
    def prefix_cacheable(self) -> bool:
        return False


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """A per-request ring of `block_size` slots (e.g. a compressor's open group): one block for
    the request's whole life, never prefix-cached."""

    @property
    def prefix_cacheable(self) -> bool:
        return False


MAMBA_CACHE_MODES = ("none", "align")


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Recurrent state layers (Mamba, linear attention): a request needs only the state after
    its last computed token, one block of `block_size` tokens' worth of positions.

    `num_speculative_blocks` more blocks hold the states of draft tokens (MTP/EAGLE).
    `mamba_cache_mode` "none" has no prefix caching; "align" caches states at block (and
    prompt-tail hash) boundaries. In align mode, `num_prefill_checkpoint_blocks` > 0 lets a
    chunk reaching the prefill end export the state at its checkpoint mid-chunk into one more
    reserved block, at offsets that are multiples of `prefill_checkpoint_alignment` from the
    chunk's start (docs/spec.md §11.6).
    """

    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    # vLLM 0.34's layout fields (kv_cache_interface.py:1121-1136), taken so that vLLM-written
    # code builds the spec; the manager does not read them.
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[Any, ...] = ()
    state_alignment: int = 1
    page_size_padded: int | None = None
    mamba_type: Any = None
    num_heads: int = 1
    tokens_per_state: int = -1
    tp_replicated: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, "
                f"got {self.mamba_cache_mode!r}"
            )
        if not isinstance(self.num_speculative_blocks, int) or self.num_speculative_blocks < 0:
            raise ValueError(
                f"num_speculative_blocks must be a non-negative int, "
                f"got {self.num_speculative_blocks!r}"
            )
        if (not isinstance(self.num_prefill_checkpoint_blocks, int)
                or isinstance(self.num_prefill_checkpoint_blocks, bool)
                or self.num_prefill_checkpoint_blocks < 0):
            raise ValueError(
                f"num_prefill_checkpoint_blocks must be a non-negative int, "
                f"got {self.num_prefill_checkpoint_blocks!r}"
            )
        if self.prefill_checkpoint_alignment is not None:
            check_positive_int("prefill_checkpoint_alignment", self.prefill_checkpoint_alignment)

    @property
    def prefix_cacheable(self) -> bool:
        return self.mamba_cache_mode == "align"


class KVCacheSpecKind(StrEnum):
    """What a group's layers are, as KV events name it (vLLM 0.34's values)."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


_KINDS: tuple[tuple[type[KVCacheSpec], KVCacheSpecKind], ...] = (
    # A subclass before its base, so that it keeps its own kind.
    (MLAAttentionSpec, KVCacheSpecKind.MLA_ATTENTION),
    (SinkFullAttentionSpec, KVCacheSpecKind.SINK_FULL_ATTENTION),
    (FullAttentionSpec, KVCacheSpecKind.FULL_ATTENTION),
    (ChunkedLocalAttentionSpec, KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION),
    (SlidingWindowSpec, KVCacheSpecKind.SLIDING_WINDOW),
    (MambaSpec, KVCacheSpecKind.MAMBA),
    (EncoderOnlyAttentionSpec, KVCacheSpecKind.ENCODER_ONLY_ATTENTION),
    (CrossAttentionSpec, KVCacheSpecKind.CROSS_ATTENTION),
)


def get_kv_cache_spec_kind(kv_cache_spec: KVCacheSpec) -> KVCacheSpecKind:
    """The kind of a spec (UNKNOWN for one of no listed kind, e.g. a circular buffer)."""
    for spec_type, kind in _KINDS:
        if isinstance(kv_cache_spec, spec_type):
            return kind
    return KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(kv_cache_spec: KVCacheSpec) -> int | None:
    """A sliding-window spec's window; None for any other."""
    return kv_cache_spec.sliding_window if isinstance(kv_cache_spec, SlidingWindowSpec) else None


@dataclass
class KVCacheGroupSpec:
    """Layers sharing one block table."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False
    # vLLM's placement fields, accepted with their neutral meaning and not read.
    host_resident: bool = False
    enable_kv_transfer: bool = True
    role: Any = "default"


@dataclass
class KVCacheConfig:
    """The pool size and the groups of a model.

    `num_blocks` counts the null block. `kv_cache_tensors` is opaque to the manager, and so
    are vLLM's worker-side fields after `prefix_cache_retention_interval` (accepted, not read;
    the manager's own `hash_block_size` argument decides hashing).
    """

    num_blocks: int
    kv_cache_tensors: list[Any] = field(default_factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)
    prefix_cache_retention_interval: int | None = None
    kv_cache_layout: str | None = None
    hash_block_size: int | None = None
    cache_hit_alignment_tokens: int | None = None
    hisparse_host_num_blocks: int | None = None
    hisparse_host_block_stride: int | None = None
    hisparse_shared_host_pool: bool = False
    kv_tp_replicas: int = 1
