"""Steps in flight on an encoder-decoder config (a `cross` group) on vLLM's own Scheduler.

vLLM runs encoder-decoder models with async scheduling: 0.34.0 refuses async scheduling only
for a ROCm DeepEP DBO setup or an executor without it (`vllm/config/vllm.py:1598-1637`; on by
default, off by default only for pooling models), so an engine keeps two batches in flight
(`VllmConfig.max_concurrent_batches`, `config/vllm.py:559-566`; the engine's batch queue
schedules the next step before it takes the last one's output, `v1/engine/core.py:222-228`,
`:770-820`). What it refuses beside cross attention is a KV connector
(`assert not self.is_encoder_decoder`, `v1/core/sched/scheduler.py:173-176`), and with it the
one setting that defers frees behind steps in flight (`defer_block_free`, a KV-consumer
connector and more than one batch in flight, `:189-193`): without it vLLM returns a freed
request's blocks at once, the step in flight still writing them (the worker's stream orders
that write before any later step's).

kvfuzz's driver and the model keep a freed request's blocks until the steps in flight that
read them complete (docs/spec.md §7.1), as vLLM does with the deferral on. To compare the
encoder cache under steps in flight, target `vllm-async-scheduler` turns vLLM's own deferral
on for an encoder-decoder config with `deferred_frees` (`defer_cross_frees`): the deferral code
that runs is vLLM's (`_free_request_blocks`, `_drain_deferred_frees`, the fenced preemption),
and only when the block pool gets a freed request's blocks back differs from an engine's; the
encoder cache accounting, which a connector never touches, is vLLM's as an engine runs it.
Target `vllm-scheduler` keeps no step in flight there: its steps in flight are two pipeline
stages, which vLLM refuses for a model without `SupportsPP` (`config/model.py:1588-1596`), as
Whisper is (`WhisperForConditionalGeneration`, `model_executor/models/whisper.py:803-808`).
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config


def defer_cross_frees(scheduler: Any, config: Config) -> None:
    """Turn on vLLM's `defer_block_free` for an encoder-decoder config with `deferred_frees`
    under async scheduling."""
    if (config.has_cross_attention and config.deferred_frees
            and scheduler.scheduler_config.async_scheduling):
        scheduler.defer_block_free = True
