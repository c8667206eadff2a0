"""A trace's hit bound as vLLM's users set it: `SamplingParams(prompt_logprobs=)`.

A request asking for prompt logprobs reads no prefix-cache hit: vLLM derives
`skip_reading_prefix_cache` from it (vLLM 0.34 `vllm/sampling_params.py:628-635`). Prompt
scoring from row S (`prompt_logprob_start=S`, with `skip_reading_prefix_cache=False` to reuse
the cached rows before it) bounds the hit at S tokens (`vllm/v1/request.py:364-377`). Target
`vllm-scheduler` builds a bounded request so, and vLLM's Request derives the bound itself.
"""

from __future__ import annotations

import inspect
from typing import Any

from kvfuzz.core.trace import Op


def prompt_logprobs_params(op: Op, sampling_params: type) -> dict[str, Any] | None:
    """`SamplingParams` arguments that bound `op`'s hits through prompt logprobs: all cache
    reads skipped, or a hit limit as the first scored row. None: the request is unbounded, or
    this release's SamplingParams has no `prompt_logprob_start` for its limit."""
    if op["skip_reading_prefix_cache"]:
        return {"prompt_logprobs": 1}
    limit = op["prefix_cache_hit_limit"]
    if limit is None or "prompt_logprob_start" not in inspect.signature(
            sampling_params).parameters:
        return None
    return {"prompt_logprobs": 1, "prompt_logprob_start": limit,
            "skip_reading_prefix_cache": False}
