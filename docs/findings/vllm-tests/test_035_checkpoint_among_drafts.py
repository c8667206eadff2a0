"""035 — a step verifying drafts reserves a Mamba prefill checkpoint among them, and cache_blocks asserts

kvfuzz finding 035-checkpoint-among-drafts, exported by `kvfuzz export docs/findings/035-checkpoint-among-drafts.json --vllm-test`.
It drives vLLM's own Scheduler as an engine does: add_request, then per step schedule(), the
forward pass and update_from_output() with one sampled token per request that needs one.
It asserts that no step raises: each is a valid step the reference model takes.
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import inspect
import json

import torch

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec, MambaSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256

DTYPE = torch.float16
BLOCK_SIZE = 4
HASH_BLOCK_SIZE = 1
NUM_BLOCKS = 16
MAX_MODEL_LEN = 64
VOCAB_SIZE = 4
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
                               enable_prefix_caching=True, mamba_cache_mode="align")
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, device_config=DeviceConfig(device="cpu"))
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE)),
            KVCacheGroupSpec(["layer.1"], MambaSpec(block_size=2, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align', num_speculative_blocks=4, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)),
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


def step(scheduler: Scheduler, sample: int = 0, draft: int = 0,
         accept: int | None = None, drafted: dict | None = None) -> None:
    """One engine step with speculative decoding: schedule(), the forward pass, then
    update_from_output() where a request that has computed all its tokens accepts the first
    `accept` (None: all) of the drafts scheduled for it and samples (sample + its token count
    + accepted) mod VOCAB_SIZE; then the drafter proposes `draft` tokens for every request of
    the batch, the i-th (sample + 1 + its token count + i) mod VOCAB_SIZE; a request
    `drafted` names proposes only the first drafted[request id] of them."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    requests = [scheduler.requests[req_id] for req_id in req_ids]
    spec = output.scheduled_spec_decode_tokens or {}
    sampled = []
    for request in requests:
        accepted = list(spec.get(request.request_id, ()))[:accept]
        done = request.num_computed_tokens >= request.num_tokens
        token = (sample + request.num_tokens + len(accepted)) % VOCAB_SIZE
        sampled.append([*accepted, token] if done else [])
    scheduler.update_from_output(output, model_output(req_ids, sampled))
    if draft:
        proposals = [[(sample + 1 + request.num_tokens + i) % VOCAB_SIZE for i in range(draft)]
                     for request in requests]
        proposals = [p[:(drafted or {}).get(request.request_id, draft)]
                     for p, request in zip(proposals, requests)]
        scheduler.update_draft_token_ids(DraftTokenIds(req_ids, proposals))


def test_checkpoint_among_drafts(tmp_path):
    scheduler = create_scheduler(tmp_path)
    scheduler.add_request(make_request('r1', [0, 0, 0, 0, 0, 0, 0, 0], arrival_time=0, max_tokens=16))
    step(scheduler)
    step(scheduler, draft=4, drafted={'r1': 3})
    step(scheduler)
