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
input a trace holds at once fits (the largest size a trace may give, for the most requests a
trace adds). vLLM itself raises both to at least the model's largest input
(`compute_mm_encoder_budget`, `encoder_cache_manager.py:369-374`); set here, an input larger
than either never runs, on all three sides alike.

An encoder-decoder config (a `cross` group) is built as vLLM's own tests build one
(`_create_encoder_decoder_scheduler`, `tests/v1/core/test_scheduler.py:7027-7114`): the
Scheduler is built for the text stand-in, then made encoder-decoder (`is_encoder_decoder`, an
`EncoderDecoderCacheManager`), and each request's `num_encoder_tokens` becomes its one encoder
input, at offset 0 (`encoder_input`). vLLM then schedules that input with the request's first
chunk from 0 computed tokens and gives `allocate_slots` its length as `num_encoder_tokens`
(`scheduler.py:1470-1480`), which is what kvfuzz's driver passes on every admission. vLLM
sizes an encoder-decoder model's budget and cache as a multimodal model's (`MultiModalBudget`
of its one modality, `scheduler.py:268-295`): the config's `encoder_budget` binds that input
(one it does not fit waits, 0 tokens, `:2203-2223`; kvfuzz's driver and the model keep the
same rule, docs/spec.md §7.2); so does the config's `encoder_cache_size`, where vLLM gives
the input's room back after every output (finding 030, `harness/vllm_encoder_decoder_slots.py`).
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.core.limits import MAX_REQUESTS, MAX_SIZE
from kvfuzz.core.trace import Op
from kvfuzz.harness.vllm_api import vllm_source


def size_encoder(scheduler: Any, config: Config) -> None:
    """Give `scheduler` the config's encoder budget and encoder cache (unset: unbounded); with
    cross attention, make it encoder-decoder."""
    from vllm.v1.core import encoder_cache_manager as managers

    unbounded = MAX_SIZE * MAX_REQUESTS
    s = config.scheduler
    scheduler.max_num_encoder_input_tokens = s.encoder_budget or unbounded
    manager = managers.EncoderCacheManager
    if config.has_cross_attention:
        scheduler.is_encoder_decoder = True
        manager = managers.EncoderDecoderCacheManager
    scheduler.encoder_cache_manager = manager(cache_size=s.encoder_cache_size or unbounded)


def releases_past_placeholders() -> bool:
    """Whether this vLLM releases an encoder input only once it ends by `num_computed_tokens −
    num_output_placeholders` (`_free_encoder_inputs`, `scheduler.py:2980-2983` in 0.34.0;
    0.32 and 0.33 too), read from its source (without vLLM, as an exported test assumes: yes).
    `update_from_output` releases before it resolves the output's placeholders
    (`:2434-2435`, then `_update_request_with_output`, `:2901-2904`), and AsyncScheduler
    counts a step's samples as placeholders when it schedules them
    (`async_scheduler.py:36-38`): under async scheduling an input the output's own sample
    covers is released one output later than on the synchronous Scheduler."""
    source = vllm_source("vllm.v1.core.sched.scheduler", "Scheduler._free_encoder_inputs")
    return source is None or "num_output_placeholders" in source


def encoder_release_rule(async_scheduling: bool) -> bool:
    """The `scheduler.async_scheduling` vLLM's scheduler (AsyncScheduler with
    `async_scheduling`) releases encoder inputs by (docs/spec.md §7.2)."""
    return async_scheduling and releases_past_placeholders()


def encoder_input(op: Op) -> list[Any]:
    """An encoder-decoder request's encoder input: its `num_encoder_tokens` at offset 0, as
    vLLM's multimodal feature (none for 0 tokens)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    if not op["num_encoder_tokens"]:
        return []
    return [MultiModalFeatureSpec(data=None, modality="audio",
                                  identifier=f"encoder-{op['request_id']}",
                                  mm_position=PlaceholderRange(offset=0,
                                                               length=op["num_encoder_tokens"]))]
