"""What a scheduler-level vLLM test of an encoder-decoder trace (a `cross` group) adds.

The test's Scheduler is made encoder-decoder as vLLM's own tests make one
(`_create_encoder_decoder_scheduler`, tests/v1/core/test_scheduler.py:7027-7114 in the 0.34.0
sdist): built for the text model, then given `is_encoder_decoder`, the trace's encoder budget
(`max_num_encoder_input_tokens`) and an `EncoderDecoderCacheManager` of the trace's encoder
cache size. Each request's `num_encoder_tokens` becomes its one encoder input at offset 0 (a
multimodal feature), as target `vllm-scheduler` gives it (harness/vllm_encoder_budget.py).
"""

from __future__ import annotations

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.limits import MAX_REQUESTS, MAX_SIZE
from kvfuzz.fuzz.vllm_test_text import SPEC_CLASSES, spec

CROSS_SPEC = "CrossAttentionSpec"
"""vLLM's spec class of a `cross` group (0.32-0.34: an `AttentionSpec`)."""

UNBOUNDED = MAX_SIZE * MAX_REQUESTS
"""An encoder budget or cache no trace fills (target `vllm-scheduler` uses the same)."""


def cross_spec_imports(config: Config) -> str:
    """The names the test imports from vllm.v1.kv_cache_interface."""
    return ", ".join(["KVCacheConfig", "KVCacheGroupSpec", *sorted(
        {CROSS_SPEC if g.kind == "cross" else SPEC_CLASSES[g.kind] for g in config.groups})])


def _spec(group: GroupConfig) -> str:
    """vLLM's KV cache spec of `group`, a `cross` group too, as Python source."""
    if group.kind != "cross":
        return spec(group)
    return f"{CROSS_SPEC}(block_size={group.block_size}, num_kv_heads=1, head_size=8, dtype=DTYPE)"


def cross_group_specs(config: Config) -> str:
    """The `kv_cache_groups` entries of the test's KVCacheConfig, one a line."""
    return "\n".join(f"            KVCacheGroupSpec([\"layer.{i}\"], {_spec(g)}),"
                     for i, g in enumerate(config.groups))


def with_encoder_decoder(text: str, config: Config) -> str:
    """The test's Scheduler made encoder-decoder with the trace's encoder budget and cache, and
    `make_request` taking an encoder input (`num_encoder_tokens`)."""
    s = config.scheduler
    budget = s.encoder_budget or UNBOUNDED
    cache = s.encoder_cache_size or UNBOUNDED
    for old, new in (
            ("from vllm.sampling_params import SamplingParams\n",
             "from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange\n"
             "from vllm.sampling_params import SamplingParams\n"
             "from vllm.v1.core.encoder_cache_manager import EncoderDecoderCacheManager\n"),
            ("MODEL = ", f"ENCODER_BUDGET = {budget}\nENCODER_CACHE_SIZE = {cache}\nMODEL = "),
            ("    return scheduler\n",
             "    # Made encoder-decoder as vLLM's own tests make one (tests/v1/core/"
             "test_scheduler.py,\n"
             "    # _create_encoder_decoder_scheduler): the text model leaves it "
             "decoder-only.\n"
             "    scheduler.is_encoder_decoder = True\n"
             "    scheduler.max_num_encoder_input_tokens = ENCODER_BUDGET\n"
             "    scheduler.encoder_cache_manager = EncoderDecoderCacheManager(\n"
             "        cache_size=ENCODER_CACHE_SIZE)\n"
             "    return scheduler\n"),
            ("                 max_tokens: int = 1, **kwargs) -> Request:\n",
             "                 max_tokens: int = 1, num_encoder_tokens: int = 0, "
             "**kwargs) -> Request:\n"
             "    \"\"\"A request; an encoder-decoder one has its encoder input of "
             "num_encoder_tokens\n"
             "    embeddings at offset 0 (what the encoder encodes with its first chunk).\"\"\"\n"),
            ("        **kwargs,\n    )\n",
             "        mm_features=[MultiModalFeatureSpec(\n"
             "            data=None, modality=\"audio\", identifier=f\"encoder-{request_id}\",\n"
             "            mm_position=PlaceholderRange(offset=0, length=num_encoder_tokens),\n"
             "        )] if num_encoder_tokens else None,\n"
             "        **kwargs,\n    )\n")):
        assert old in text, old
        text = text.replace(old, new, 1)
    return text
