"""Multimodal inputs on vLLM's own Scheduler: an encoder budget and cache that never bind.

vLLM's Scheduler schedules a request's encoder inputs (`mm_features`) beside its tokens, each
step against an encoder compute budget (`max_num_encoder_input_tokens`) and an encoder cache
(`EncoderCacheManager`). Both are sized from a multimodal model's processor (vLLM 0.34
`vllm/v1/core/sched/scheduler.py:268-295`, `MultiModalBudget`); the model stand-in target
`vllm-scheduler` builds is a text model, so both are 0 and no encoder input could run.

The adapter sets both after the Scheduler is built, as vLLM's own tests do
(`tests/v1/core/test_scheduler.py:897-898` in the 0.34.0 sdist), to a size no trace can fill:
every multimodal input a trace holds at once fits (`max_model_len` embeddings per request, for
the most requests a trace adds). `_try_schedule_encoder_inputs` (`scheduler.py:2066`) then
schedules every input a chunk overlaps and never cuts the chunk, which is what kvfuzz's
driver models (it has no encoder budget): the comparison covers the multimodal keys, hits
and chunks, and leaves a binding encoder budget undriven (docs/vllm.md, "Not driven yet").
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.core.limits import MAX_REQUESTS


def unbounded_encoder(scheduler: Any, config: Config) -> None:
    """Give `scheduler` an encoder budget and encoder cache no trace on `config` can fill."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    size = config.max_model_len * MAX_REQUESTS
    scheduler.max_num_encoder_input_tokens = size
    scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=size)
