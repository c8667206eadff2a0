"""Built-in configs: the shapes every campaign and state machine explores.

Pools are small on purpose, so that shortage, eviction and preemption happen all the time.
"""

from __future__ import annotations

from kvfuzz.core.config import Config, GroupConfig, SchedulerConfig
from kvfuzz.core.errors import KvfuzzError


class UnknownConfig(KvfuzzError):
    """No built-in config has that name."""


def _full(bs: int = 4) -> GroupConfig:
    return GroupConfig("full", bs)


def _swa(bs: int, window: int) -> GroupConfig:
    return GroupConfig("sliding_window", bs, sliding_window=window)


def _local(bs: int, chunk: int) -> GroupConfig:
    return GroupConfig("chunked_local", bs, attention_chunk_size=chunk)


BUILTIN: dict[str, tuple[str, Config]] = {
    c.name: (description, c)
    for description, c in [
        ("single full-attention group", Config(16, (_full(),), name="full", max_model_len=64)),
        (
            "full attention, prefix caching off",
            Config(12, (_full(),), name="no_cache", max_model_len=64, enable_caching=False),
        ),
        (
            "single sliding-window group (window 8)",
            Config(12, (_swa(4, 8),), name="sliding_window", max_model_len=64,
                   max_in_flight_tokens=16),
        ),
        (
            "single chunked-local group (chunk 8)",
            Config(12, (_local(4, 8),), name="chunked_local", max_model_len=64,
                   max_in_flight_tokens=16),
        ),
        (
            "full attention (bs 8) + sliding window (bs 4, window 8): different block sizes",
            Config(20, (_full(8), _swa(4, 8)), name="hybrid", max_model_len=64),
        ),
        (
            "full + sliding window + chunked local: the multi-round fixed point",
            Config(24, (_full(4), _swa(4, 6), _local(4, 8)), name="hybrid3", max_model_len=64),
        ),
        (
            "decoder full attention + cross attention, caching off",
            Config(16, (_full(), GroupConfig("cross", 4)), name="cross", max_model_len=64,
                   enable_caching=False),
        ),
        (
            "Tier B: full (bs 8) + sliding window (bs 4), sub-block hits and copy-on-write",
            Config(24, (_full(8), _swa(4, 4)), name="partial_hits", max_model_len=64,
                   partial_hits=True),
        ),
        (
            "watermark 0.1, 1 reserved block, full-sequence gate, 1 lookahead slot",
            Config(20, (_full(),), name="watermark", max_model_len=64, watermark=0.1,
                   scheduler=SchedulerConfig(reserved_blocks=1, full_sequence_must_fit=True,
                                             num_lookahead_tokens=1)),
        ),
        (
            "Tier B: EAGLE last-block drop on a full-attention group",
            Config(16, (_full(),), name="eagle", max_model_len=64, use_eagle=True),
        ),
        (
            "multi-tenant: LoRA adapters, multimodal inputs, prompt embeddings, cache salts",
            Config(16, (_full(),), name="tenants", max_model_len=64, extra_keys=True),
        ),
        (
            "priority scheduling, no chunked prefill",
            Config(16, (_full(),), name="priority", max_model_len=64,
                   scheduler=SchedulerConfig(policy="priority", chunked_prefill=False)),
        ),
    ]
}


def builtin_config(name: str) -> Config:
    try:
        return BUILTIN[name][1]
    except KeyError:
        raise UnknownConfig(
            f"unknown config {name!r}; built-in configs: {', '.join(BUILTIN)}"
        ) from None
