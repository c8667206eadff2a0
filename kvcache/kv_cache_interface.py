"""KV cache specs and configs: immutable value objects describing the groups of a model.

No tensors here: the manager only needs block sizes and attention windows.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum, StrEnum
from typing import Any, Self

from kvfuzz.kvcache.block_math import (  # the Mamba checkpoint rules: where vLLM 0.34 has them
    chunked_local_admission_cap,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
    sliding_window_admission_cap,
)
from kvfuzz.kvcache.kv_cache_utils import check_positive_int


class KVQuantMode(IntEnum):
    """How a layer's KV is quantized (vLLM 0.34's values, kv_cache_interface.py:40-69); a layout
    field the manager does not read, but two specs of different modes are different specs."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5
    TURBOQUANT_K8V4 = 6
    TURBOQUANT_4BIT_NC = 7
    TURBOQUANT_K3V4_NC = 8
    TURBOQUANT_3BIT_NC = 9
    NVFP4_DS_MLA = 10
    ULTRAQUANT_4BIT = 11
    OCTAVE_K3V4 = 12
    OCTAVE_K3V3 = 13
    OCTAVE_K3V3_COMPACT = 14
    CUSTOM = 12  # in vLLM 0.34 too: an alias of OCTAVE_K3V4, the same value


def _require(condition: bool, message: str) -> None:
    """vLLM's merge rules fail with AssertionError (its tests expect that type); raised, not
    asserted, so that `python -O` keeps the check."""
    if not condition:
        raise AssertionError(message)


def _require_agree(specs: list[Any], names: Collection[str]) -> None:
    """A merge's rule: the layers of a group have one value for each field in `names`."""
    for name in names:
        _require(len({getattr(spec, name) for spec in specs}) == 1,
                 f"All attention layers in the same KV cache group must have the same {name}.")


def _require_same_attention(specs: list[Any], merged: AttentionSpec) -> None:
    """A merge's rule: every layer agrees with the merged spec on AttentionSpec's compared
    fields (block size, heads, dtype, quantization, ...)."""
    for f in fields(AttentionSpec):
        if f.compare:
            _require(all(getattr(spec, f.name) == getattr(merged, f.name) for spec in specs),
                     "All attention layers in the same KV cache group must have the same "
                     f"attention spec ({f.name} differs).")


def _one_size(sizes: Any) -> int | None:
    """The window (or chunk) size a group's layers give, None where none gives one."""
    given = {size for size in sizes if size is not None}
    if len(given) > 1:
        raise ValueError("All attention layers in the same KV cache group must have the "
                         f"same window size, got {sorted(given)}.")
    return given.pop() if given else None


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
    # A draft model's layer; not part of the format, so it never splits a group.
    is_draft: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        check_positive_int("block_size", self.block_size)

    @property
    def prefix_cacheable(self) -> bool:
        """Whether this spec's group takes part in prefix caching."""
        return True

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """The one spec of a group's layers: here they must all be equal."""
        _require(all(spec == specs[0] for spec in specs[1:]),
                 "All layers in the same KV cache group must be the same.")
        return copy.deepcopy(specs[0])


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer's spec; its tensor layout fields are accepted and not read."""

    num_kv_heads: int = 1
    head_size: int = 1
    dtype: Any = None
    head_size_v: int | None = None
    max_tp_shards: int | None = None
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
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

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """One spec for full-attention layers (vLLM's rule, kv_cache_interface.py:673-728): they
        agree on every attention field; the group keeps the one window (or chunk) size its
        layers give, and is non-causal if any layer is. Not for MLA layers (their own merge)."""
        _require(all(isinstance(spec, FullAttentionSpec) for spec in specs),
                 "All attention layers in the same KV cache group must be FullAttentionSpec.")
        _require(not any(isinstance(spec, MLAAttentionSpec) for spec in specs),
                 "MLAAttentionSpec should be merged in MLAAttentionSpec.merge")
        merged = replace(
            specs[0],
            sliding_window=_one_size(spec.sliding_window for spec in specs),
            attention_chunk_size=_one_size(spec.attention_chunk_size for spec in specs),
            non_causal=any(spec.non_causal for spec in specs),
            is_draft=False,
        )
        _require_same_attention(specs, merged)
        _require(merged.sliding_window is None or merged.attention_chunk_size is None,
                 "Model with both sliding window layers and chunked local attention "
                 "layers is not supported.")
        return merged


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

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """One spec for MLA layers (kv_cache_interface.py:761-818): they agree on the attention
        fields and on the MLA ones below; non-causal multi-token decode if any layer has it."""
        _require(all(isinstance(spec, MLAAttentionSpec) for spec in specs),
                 "All attention layers in the same KV cache group must be MLAAttentionSpec.")
        _require_agree(specs, ("cache_dtype_str", "topk_buffer_width", "tokens_per_state",
                               "model_version", "cache_role", "is_index_group_leader",
                               "block_stride_alignment"))
        merged = replace(
            specs[0],
            non_causal_multi_token_decode=any(s.non_causal_multi_token_decode for s in specs),
            is_draft=False,
        )
        _require_same_attention(specs, merged)
        return merged


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

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """Full attention's merge, for layers of one `rswa_window`."""
        _require(all(isinstance(spec, RSWASpec) for spec in specs),
                 "All attention layers in the same KV cache group must be RSWASpec.")
        _require_agree(specs, ("rswa_window",))
        return super().merge(specs)


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


SLIDING_WINDOW_MLA_MODEL_VERSIONS = (None, "deepseek_v4")


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window attention whose layers store MLA latents (DeepSeek-V4); managed as a
    sliding window, in a group of its own kind.

    `bounded_replay` layers are not prefix-cached: vLLM recomputes their window from a replay
    of the last `sliding_window` tokens, which kvcache lacks, so building a manager from such a
    spec is refused. The other fields are vLLM 0.34's layout fields
    (kv_cache_interface.py:1021-1034), taken so that vLLM-written code builds the spec.
    """

    cache_dtype_str: str | None = None
    alignment: int | None = None
    model_version: str | None = None
    bounded_replay: bool = False
    non_causal_multi_token_decode: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_version not in SLIDING_WINDOW_MLA_MODEL_VERSIONS:
            raise ValueError(f"model_version must be one of {SLIDING_WINDOW_MLA_MODEL_VERSIONS}, "
                             f"got {self.model_version!r}")

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        """One spec for these layers (kv_cache_interface.py:1051-1107): they agree on the fields
        below, KV quantization included, and may differ in heads and head size."""
        _require(all(isinstance(spec, SlidingWindowMLASpec) for spec in specs),
                 "All attention layers in the same KV cache group must be SlidingWindowMLASpec.")
        _require_agree(specs, ("dcp_sharded", "max_tp_shards", "cache_dtype_str",
                               "tokens_per_state", "model_version", "sliding_window",
                               "extra_retained_tokens", "bounded_replay",
                               "block_stride_alignment", "kv_quant_mode", "alignment"))
        return replace(
            specs[0],
            non_causal_multi_token_decode=any(s.non_causal_multi_token_decode for s in specs),
            is_draft=False,
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

    @property
    def _page_layout(self) -> Any:
        """What decides the page size: the padded size where given, else the state shapes and
        dtypes (kvcache computes no byte sizes, so unpadded states of other shapes but an equal
        size count as different, where vLLM compares bytes)."""
        return self.page_size_padded if self.page_size_padded is not None else (
            self.shapes, self.dtypes)


# vLLM 0.34's grouping (kv_cache_spec_registry.py, single_type_kv_cache_manager.py:2682-2752 and
# each spec's is_uniform_with_collection): the layers of one UniformTypeKVCacheSpecs are
# instances of the first layer's base and agree with it on the fields named. A subclass before
# its base; full attention's variants (MLA, sink, R-SWA) group with it.
_UNIFORM_TYPES: tuple[tuple[type[KVCacheSpec], tuple[str, ...]], ...] = (
    (SlidingWindowMLASpec, ("sliding_window", "bounded_replay")),
    (SlidingWindowSpec, ("sliding_window",)),
    (ChunkedLocalAttentionSpec, ("attention_chunk_size",)),
    (FullAttentionSpec, ()),
    (MambaSpec, ("num_speculative_blocks", "num_prefill_checkpoint_blocks",
                 "prefill_checkpoint_alignment", "_page_layout", "state_alignment",
                 "tp_replicated")),
)


def _uniform_type(spec: KVCacheSpec) -> tuple[type[KVCacheSpec], tuple[str, ...]]:
    """The base a layer groups by and the fields its group agrees on (a spec of no listed
    base groups with its own class)."""
    for base, agree in _UNIFORM_TYPES:
        if isinstance(spec, base):
            return base, agree
    return type(spec), ()


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """The layers of one group, each with its own spec, that need the same token slots
    (e.g. full-attention layers of different head sizes; not windows of different sizes).

    vLLM's engine builds it when it plans memory and gives the manager one layer's spec
    instead; no manager takes the wrapper itself.
    """

    kv_cache_specs: dict[str, KVCacheSpec]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_cache_specs:
            first = next(iter(self.kv_cache_specs.values()))
            object.__setattr__(self, "dcp_sharded", first.dcp_sharded)

    @property
    def prefix_cacheable(self) -> bool:
        return all(spec.prefix_cacheable for spec in self.kv_cache_specs.values())

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """Whether the layers have one block size, one DCP sharding, and the first's type."""
        specs = list(kv_cache_specs.values())
        if len({spec.block_size for spec in specs}) > 1:
            return False
        if len({spec.dcp_sharded for spec in specs}) > 1:
            return False
        base, agree = _uniform_type(specs[0])
        return all(
            isinstance(spec, base)
            and all(getattr(spec, name) == getattr(specs[0], name) for name in agree)
            for spec in specs
        )

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> Self | None:
        """The layers as one spec, or None where they are not of one type."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=kv_cache_specs)


def iter_layer_specs(kv_cache_spec: KVCacheSpec) -> Collection[KVCacheSpec]:
    """The layer specs a group's spec stands for: a wrapper's members, else the spec itself."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        return kv_cache_spec.kv_cache_specs.values()
    return (kv_cache_spec,)


def is_full_attention_spec(kv_cache_spec: KVCacheSpec) -> bool:
    """Whether a group's spec is full attention: every layer it stands for (at least one)."""
    layer_specs = iter_layer_specs(kv_cache_spec)
    return bool(layer_specs) and all(isinstance(s, FullAttentionSpec) for s in layer_specs)


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
    (SlidingWindowMLASpec, KVCacheSpecKind.SLIDING_WINDOW_MLA),
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
    """The kind of a spec (UNKNOWN for one of no listed kind, e.g. a circular buffer).

    A wrapper has its layers' kind where they have one; layers of several kinds that all
    group as full attention (MLA and plain) are FULL_ATTENTION; any other mix is UNKNOWN.
    """
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        layer_specs = kv_cache_spec.kv_cache_specs.values()
        kinds = {get_kv_cache_spec_kind(spec) for spec in layer_specs}
        if len(kinds) == 1:
            return kinds.pop()
        if {_uniform_type(spec)[0] for spec in layer_specs} == {FullAttentionSpec}:
            return KVCacheSpecKind.FULL_ATTENTION
        return KVCacheSpecKind.UNKNOWN
    for spec_type, kind in _KINDS:
        if isinstance(kv_cache_spec, spec_type):
            return kind
    return KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(kv_cache_spec: KVCacheSpec) -> int | None:
    """A sliding-window spec's window; a wrapper's where its layers have one, else None;
    None for any other spec."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        windows = {get_kv_cache_spec_sliding_window(s) for s in kv_cache_spec.kv_cache_specs.values()}
        return windows.pop() if len(windows) == 1 else None
    return kv_cache_spec.sliding_window if isinstance(kv_cache_spec, SlidingWindowSpec) else None


@dataclass
class KVCacheTensor:
    """Where the worker places a set of same-shaped layers in its KV allocation (vLLM 0.34's
    fields, kv_cache_interface.py:1509-1530): layer `layers[l]`'s page of block `b` starts
    `offset + l * layer_stride + b * block_stride` bytes into `size` bytes. The manager
    does not read it."""

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0
    host_resident: bool = False


@dataclass
class KVCacheGroupSpec:
    """Layers sharing one block table."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False
    # vLLM's placement fields, accepted with their neutral meaning and not read by the
    # managers. `enable_kv_transfer=False` keeps the group out of the config's transfer groups.
    host_resident: bool = False
    enable_kv_transfer: bool = True
    role: Any = "default"


@dataclass
class KVCacheConfig:
    """The pool size and the groups of a model.

    `num_blocks` counts the null block. `kv_cache_tensors` is opaque to the manager, and so
    are vLLM's worker-side fields after `prefix_cache_retention_interval` (accepted, not read;
    the manager's own `hash_block_size` argument decides hashing).

    `needs_kv_cache_zeroing` (computed, settable, as in vLLM: kv_cache_interface.py:1600-1606, 1675-1695):
    whether the worker zeroes new attention blocks, so that the managers record their ids;
    needed with a state (Mamba) layer, whose blocks are read before written, or with
    attention layers of more than one precision (dtype, quantization) outside host groups.
    """

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)
    prefix_cache_retention_interval: int | None = None
    kv_cache_layout: str | None = None
    hash_block_size: int | None = None
    cache_hit_alignment_tokens: int | None = None
    hisparse_host_num_blocks: int | None = None
    hisparse_host_block_stride: int | None = None
    hisparse_shared_host_pool: bool = False
    kv_tp_replicas: int = 1
    needs_kv_cache_zeroing: bool = field(init=False)

    def __post_init__(self) -> None:
        layer_specs = [
            (group, spec) for group in self.kv_cache_groups
            for spec in iter_layer_specs(group.kv_cache_spec)
        ]
        has_mamba = any(isinstance(spec, MambaSpec) for _, spec in layer_specs)
        precisions = {
            (spec.dtype, spec.kv_quant_mode) for group, spec in layer_specs
            if isinstance(spec, AttentionSpec) and not group.host_resident
        }
        self.needs_kv_cache_zeroing = has_mamba or len(precisions) > 1

    # Which groups a KV connector sees (vLLM 0.34: kv_cache_interface.py:1607-1658). Computed on
    # each read, so that a config whose groups are edited after construction never answers stale.

    @property
    def transfer_group_ids(self) -> tuple[int, ...]:
        """Indices, in order, of the groups whose KV a connector moves (`enable_kv_transfer`)."""
        return tuple(i for i, group in enumerate(self.kv_cache_groups) if group.enable_kv_transfer)

    @property
    def transfer_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """The groups of `transfer_group_ids`, in that order."""
        return tuple(self.kv_cache_groups[i] for i in self.transfer_group_ids)

    @property
    def transfer_group_index_by_layer(self) -> dict[str, int]:
        """Each transferred layer's position in `transfer_groups` (not its group index)."""
        return {name: position for position, group in enumerate(self.transfer_groups)
                for name in group.layer_names}

    @property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        """The transfer groups whose spec is `prefix_cacheable`: those a hash-keyed store keeps."""
        return tuple(i for i in self.transfer_group_ids
                     if self.kv_cache_groups[i].kv_cache_spec.prefix_cacheable)

    @property
    def prefix_cacheable_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """The groups of `prefix_cacheable_group_ids`, in that order."""
        return tuple(self.kv_cache_groups[i] for i in self.prefix_cacheable_group_ids)

    def select_transfer_block_ids(self, block_ids: Sequence[list[int]]) -> tuple[list[int], ...]:
        """From one block-id list per group, the lists of the transfer groups (the same list
        objects). ValueError when the count is not one per group."""
        if len(block_ids) != len(self.kv_cache_groups):
            raise ValueError(f"select_transfer_block_ids: {len(block_ids)} block-id lists given, "
                             f"the config has {len(self.kv_cache_groups)} KV cache groups")
        return tuple(block_ids[i] for i in self.transfer_group_ids)
