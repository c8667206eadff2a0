"""Multimodal inputs on vLLM's own Scheduler: the config's encoder budget and encoder cache.

vLLM's Scheduler schedules a request's encoder inputs (`mm_features`) beside its tokens, each
step against an encoder compute budget (`max_num_encoder_input_tokens`) and an encoder cache
(`EncoderCacheManager`). Both are sized from a multimodal model's processor (vLLM 0.34
`vllm/v1/core/sched/scheduler.py:268-295`, `MultiModalBudget`); the model stand-in target
`vllm-scheduler` builds is a text model, so both are 0 and no encoder input could run.

The adapter sets both after the Scheduler is built, as vLLM's own tests do
(`tests/v1/core/test_scheduler.py:897-898` in the 0.34.0 sdist), to the config's
`scheduler.encoder_budget` and `scheduler.encoder_cache_size` (docs/spec.md §7.2), which
kvfuzz's driver and the model keep too. One left unset gets a size no trace can fill: every
multimodal input a trace holds at once fits (`max_model_len` embeddings per request, for the
most requests a trace adds). vLLM itself raises both to at least the model's largest input
(`compute_mm_encoder_budget`, `encoder_cache_manager.py:369-374`); set here, an input larger
than either never runs, on all three sides alike.
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.core.limits import MAX_REQUESTS


def size_encoder(scheduler: Any, config: Config) -> None:
    """Give `scheduler` the config's encoder budget and encoder cache (unset: unbounded)."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    unbounded = config.max_model_len * MAX_REQUESTS
    s = config.scheduler
    scheduler.max_num_encoder_input_tokens = s.encoder_budget or unbounded
    scheduler.encoder_cache_manager = EncoderCacheManager(
        cache_size=s.encoder_cache_size or unbounded)
