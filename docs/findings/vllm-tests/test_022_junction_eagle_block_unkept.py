"""022 — vLLM 0.32 keeps a junction's block but not, under EAGLE, the one below it

kvfuzz finding 022-junction-eagle-block-unkept, exported by `kvfuzz export docs/findings/022-junction-eagle-block-unkept.json --vllm-test`.
It drives vLLM's own Scheduler as an engine does: add_request, then per step schedule(), the
forward pass and update_from_output() with one sampled token per request that needs one.
It asserts which blocks carry a cache key after the steps.
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import inspect
import json

import torch

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched import scheduler as scheduler_module
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec, MambaSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256

DTYPE = torch.float16
BLOCK_SIZE = 8
HASH_BLOCK_SIZE = 2
NUM_BLOCKS = 17
MAX_MODEL_LEN = 64
VOCAB_SIZE = 4
MODEL = {'architectures': ['OPTForCausalLM'], 'model_type': 'opt', 'hidden_size': 8, 'num_attention_heads': 1, 'num_hidden_layers': 1, 'ffn_dim': 8, 'word_embed_proj_dim': 8, 'do_layer_norm_before': True, 'vocab_size': 4, 'max_position_embeddings': 64}
"""A model's config.json (OPT's shape): the Scheduler reads only its kind and lengths."""


def create_scheduler(model_dir, monkeypatch) -> Scheduler:
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
                               enable_prefix_caching=True, mamba_cache_mode="align")
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, device_config=DeviceConfig(device="cpu"))
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        prefix_cache_retention_interval=16,
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=DTYPE)),
            KVCacheGroupSpec(["layer.1"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align', num_speculative_blocks=1)),
            KVCacheGroupSpec(["layer.2"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align', num_speculative_blocks=1)),
            KVCacheGroupSpec(["layer.3"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align', num_speculative_blocks=1)),
        ],
    )
    # EAGLE: vLLM builds the manager with use_eagle from an EAGLE drafter's SpeculativeConfig,
    # which needs the drafter's weights; here the manager class is given use_eagle=True.
    manager_cls = scheduler_module.KVCacheManager
    monkeypatch.setattr(scheduler_module, "KVCacheManager", lambda *args, **kwargs: manager_cls(
        *args, **{**kwargs, "use_eagle": True}))
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        hash_block_size=HASH_BLOCK_SIZE,
        log_stats=False,
    )
    scheduler.use_eagle_block_drop = True  # the Mamba chunk split drops it too
    return scheduler


def make_request(request_id: str, prompt: list[int], arrival_time: float,
                 max_tokens: int = 1, **kwargs) -> Request:
    init_none_hash(sha256)
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens), None,
        arrival_time=arrival_time, block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
        **kwargs,
    )


def model_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """The forward pass's output; releases before 0.34 also take each request's index."""
    extra = {}
    if "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)


def step(scheduler: Scheduler, sample: int = 0) -> None:
    """One engine step: schedule(), the forward pass, update_from_output(); a request that has
    computed all its tokens samples (sample + its token count) mod VOCAB_SIZE."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([(sample + request.num_tokens) % VOCAB_SIZE] if done else [])
    scheduler.update_from_output(output, model_output(req_ids, sampled))


def test_junction_eagle_block_unkept(tmp_path, monkeypatch):
    scheduler = create_scheduler(tmp_path, monkeypatch)
    scheduler.add_request(make_request('r0', [0, 1, 3, 1, 1, 0, 3, 1, 3, 3, 1, 2, 3, 2, 3, 0, 0, 0, 0, 0, 1, 2, 1, 3, 0, 0, 2, 1, 1, 0, 0, 2], arrival_time=0))
    scheduler.add_request(make_request('r1', [0, 1, 3, 1, 1, 0, 3, 1, 3, 3, 1, 2, 3, 2, 3, 0, 0, 0, 0, 0, 1, 2, 1, 3, 0], arrival_time=1))
    step(scheduler)
    keyed = [block.block_id
             for block in scheduler.kv_cache_manager.block_pool.blocks
             if block.block_hash is not None]
    assert keyed == [1, 2, 3, 4, 6, 8, 10, 11, 13, 15], (
        f"blocks {keyed} carry a cache key, but blocks [1, 2, 3, 4, 6, 8, 10, 11, 13, 15] hold what their keys name: a later request with the same prefix misses or is served the wrong blocks")
