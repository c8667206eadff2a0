"""023 — A request preempted after it was scheduled leaves cache keys on blocks never written

kvfuzz finding 023-preempted-after-scheduled, exported by `kvfuzz export docs/findings/hazard-preempted-after-scheduled.json --vllm-test`.
It drives vLLM's own Scheduler as an engine does: add_request, then per step schedule(), the
forward pass and update_from_output() with one sampled token per request that needs one.
It keeps the KV each step writes into the full-attention blocks (after the step's block copies, applied as vLLM's worker applies them) and asserts that every position a scheduled request reads holds the KV of its own prefix.
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import inspect
import json

import torch

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec
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
NUM_BLOCKS = 5
MAX_MODEL_LEN = 128
VOCAB_SIZE = 4
MODEL = {'architectures': ['OPTForCausalLM'], 'model_type': 'opt', 'hidden_size': 8, 'num_attention_heads': 1, 'num_hidden_layers': 1, 'ffn_dim': 8, 'word_embed_proj_dim': 8, 'do_layer_norm_before': True, 'vocab_size': 4, 'max_position_embeddings': 128}
"""A model's config.json (OPT's shape): the Scheduler reads only its kind and lengths."""


def create_scheduler(model_dir) -> Scheduler:
    """vLLM's Scheduler as tests/v1/core/utils.py create_scheduler builds it, on the CPU, for
    a model described by a local config.json (no weights, no tokenizer, no network)."""
    (model_dir / "config.json").write_text(json.dumps(MODEL))
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16",
                               max_model_len=MAX_MODEL_LEN, seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=8,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy='priority',
        watermark=0.0,
        scheduler_reserve_full_isl=False,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE,
                               enable_prefix_caching=True)
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, device_config=DeviceConfig(device="cpu"))
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE)),
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
    # The KV slots a drafter reserves past the scheduled tokens (vLLM sets them
    # from a draft model's SpeculativeConfig).
    scheduler.num_lookahead_tokens = 1
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


FULL_ATTENTION_GROUPS = [(0, 4)]
"""(group index, block size) of each full-attention group: the positions a request reads."""


def apply_copies(kv: torch.Tensor, copies) -> None:
    """The step's block copies as vLLM's worker applies them before the forward pass
    (`copy_kv_cache_blocks_inplace`, vllm/v1/worker/utils.py): `blocks[dst] = blocks[src]`,
    every source gathered before any destination is written."""
    if copies:
        src, dst = torch.tensor([list(c) for c in copies]).unbind(dim=1)
        kv[dst] = kv[src]


class ForwardPass:
    """The KV the forward passes write: per block slot, the prefix (cache salt, tokens up to
    and including that position) whose KV it holds; 0 means never written."""

    def __init__(self) -> None:
        self.kv = torch.zeros((NUM_BLOCKS, BLOCK_SIZE), dtype=torch.long)
        self.contents: list = [None]

    def prefix(self, request: Request, position: int) -> int:
        key = (request.cache_salt, tuple(request.all_token_ids[:position + 1]))
        if key not in self.contents:
            self.contents.append(key)
        return self.contents.index(key)

    def run(self, scheduler: Scheduler, output) -> None:
        apply_copies(self.kv, output.kv_cache_block_copies or [])
        for req_id, n in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            start = request.num_computed_tokens - n  # schedule() has already advanced it
            tables = scheduler.kv_cache_manager.get_block_ids(req_id)
            for group, size in FULL_ATTENTION_GROUPS:
                table = tables[group]
                for position in range(start):
                    block, slot = table[position // size], position % size
                    held = self.contents[int(self.kv[block, slot])]
                    assert held == self.contents[self.prefix(request, position)], (
                        f"{req_id} reads position {position} of group {group} through block "
                        f"{block}, which holds "
                        f"{'KV never written' if held is None else f'the KV of {held}'}, "
                        f"not the KV of its own prefix")
                for position in range(start, start + n):
                    block, slot = table[position // size], position % size
                    self.kv[block, slot] = self.prefix(request, position)


def step(scheduler: Scheduler, forward: ForwardPass, sample: int = 0) -> None:
    """One engine step: schedule(), the forward pass, update_from_output(); a request that has
    computed all its tokens samples (sample + its token count) mod VOCAB_SIZE."""
    output = scheduler.schedule()
    forward.run(scheduler, output)
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([(sample + request.num_tokens) % VOCAB_SIZE] if done else [])
    scheduler.update_from_output(output, model_output(req_ids, sampled))


def test_preempted_after_scheduled(tmp_path):
    scheduler = create_scheduler(tmp_path)
    forward = ForwardPass()
    scheduler.add_request(make_request('B', [1, 1, 1, 1, 1, 1], arrival_time=0, max_tokens=16, priority=1))
    step(scheduler, forward)
    scheduler.add_request(make_request('A', [2, 2, 2], arrival_time=1, max_tokens=2))
    step(scheduler, forward)
    step(scheduler, forward)
    scheduler.add_request(make_request('C', [1, 1, 1, 1, 1, 1, 2, 3, 0], arrival_time=2, max_tokens=16))
    step(scheduler, forward)
