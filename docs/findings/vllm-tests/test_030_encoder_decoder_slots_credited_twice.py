"""030 — an encoder-decoder input's room in the encoder cache is given back after every output

kvfuzz finding 030-encoder-decoder-slots-credited-twice, exported by `kvfuzz export docs/findings/030-encoder-decoder-slots-credited-twice.json --vllm-test`.
It drives vLLM's own Scheduler as an engine does: add_request, then per step schedule(), the
forward pass and update_from_output() with one sampled token per request that needs one.
It asserts what each step schedules (tokens per request), as the reference model schedules it.
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import inspect
import json

import torch

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.encoder_cache_manager import EncoderDecoderCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, CrossAttentionSpec, FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256

DTYPE = torch.float16
BLOCK_SIZE = 4
HASH_BLOCK_SIZE = 4
NUM_BLOCKS = 16
MAX_MODEL_LEN = 64
VOCAB_SIZE = 4
ENCODER_BUDGET = 24
ENCODER_CACHE_SIZE = 12
MODEL = {'architectures': ['OPTForCausalLM'], 'model_type': 'opt', 'hidden_size': 8, 'num_attention_heads': 1, 'num_hidden_layers': 1, 'ffn_dim': 8, 'word_embed_proj_dim': 8, 'do_layer_norm_before': True, 'vocab_size': 4, 'max_position_embeddings': 64}
"""A model's config.json (OPT's shape): the Scheduler reads only its kind and lengths."""


def create_scheduler(model_dir) -> Scheduler:
    """vLLM's Scheduler as tests/v1/core/utils.py create_scheduler builds it, on the CPU, for
    a model described by a local config.json (no weights, no tokenizer, no network)."""
    (model_dir / "config.json").write_text(json.dumps(MODEL))
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16",
                               max_model_len=MAX_MODEL_LEN, seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy='fcfs',
        watermark=0.0,
        scheduler_reserve_full_isl=False,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE,
                               enable_prefix_caching=False)
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, device_config=DeviceConfig(device="cpu"))
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE)),
            KVCacheGroupSpec(["layer.1"], CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE)),
        ],
    )
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        hash_block_size=HASH_BLOCK_SIZE,
        log_stats=False,
    )
    # Made encoder-decoder as vLLM's own tests make one (tests/v1/core/test_scheduler.py,
    # _create_encoder_decoder_scheduler): the text model leaves it decoder-only.
    scheduler.is_encoder_decoder = True
    scheduler.max_num_encoder_input_tokens = ENCODER_BUDGET
    scheduler.encoder_cache_manager = EncoderDecoderCacheManager(
        cache_size=ENCODER_CACHE_SIZE)
    return scheduler


def make_request(request_id: str, prompt: list[int], arrival_time: float,
                 max_tokens: int = 1, num_encoder_tokens: int = 0, **kwargs) -> Request:
    """A request; an encoder-decoder one has its encoder input of num_encoder_tokens
    embeddings at offset 0 (what the encoder encodes with its first chunk)."""
    init_none_hash(sha256)
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens), None,
        arrival_time=arrival_time, block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
        mm_features=[MultiModalFeatureSpec(
            data=None, modality="audio", identifier=f"encoder-{request_id}",
            mm_position=PlaceholderRange(offset=0, length=num_encoder_tokens),
        )] if num_encoder_tokens else None,
        **kwargs,
    )


def model_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """The forward pass's output; releases before 0.34 also take each request's index."""
    extra = {}
    if "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)


def step(scheduler: Scheduler, sample: int = 0) -> dict:
    """One engine step: schedule(), the forward pass, update_from_output(); a request that has
    computed all its tokens samples (sample + its token count) mod VOCAB_SIZE.
    Returns the tokens it scheduled per request."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([(sample + request.num_tokens) % VOCAB_SIZE] if done else [])
    scheduler.update_from_output(output, model_output(req_ids, sampled))
    return dict(output.num_scheduled_tokens)


def test_encoder_decoder_slots_credited_twice(tmp_path):
    scheduler = create_scheduler(tmp_path)
    scheduler.add_request(make_request('a', [0, 1, 2, 3], arrival_time=0, max_tokens=4, num_encoder_tokens=8))
    scheduled = step(scheduler)
    assert scheduled == {'a': 4}, (
        f"trace op 2 scheduled {scheduled}; the reference model schedules {{'a': 4}}")
    scheduled = step(scheduler)
    assert scheduled == {'a': 1}, (
        f"trace op 3 scheduled {scheduled}; the reference model schedules {{'a': 1}}")
    scheduled = step(scheduler)
    assert scheduled == {'a': 1}, (
        f"trace op 4 scheduled {scheduled}; the reference model schedules {{'a': 1}}")
    scheduler.add_request(make_request('b', [10, 11, 12, 13], arrival_time=1, max_tokens=2, num_encoder_tokens=9))
    scheduler.add_request(make_request('c', [20, 21, 22, 23], arrival_time=2, max_tokens=2, num_encoder_tokens=9))
    scheduled = step(scheduler)
    assert scheduled == {'a': 1, 'b': 4}, (
        f"trace op 7 scheduled {scheduled}; the reference model schedules {{'a': 1, 'b': 4}}")
