"""031 — a failing synchronous KV load on several KV cache groups crashes the engine or is ignored

kvfuzz finding 031-sync-failure-several-groups, exported by `kvfuzz export docs/findings/vllm-tests/031-sync-failure-several-groups-budget.json --vllm-test`.
It drives vLLM's own Scheduler as an engine does: add_request, then per step schedule(), the
forward pass and update_from_output() with one sampled token per request that needs one.
It asserts which requests each step finishes (those that leave the Scheduler), as the reference model finishes them.
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import inspect
import json

import torch

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256

DTYPE = torch.float16
BLOCK_SIZE = 4
HASH_BLOCK_SIZE = 4
NUM_BLOCKS = 24
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
                               enable_prefix_caching=True)
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, device_config=DeviceConfig(device="cpu"),
                             kv_transfer_config=KVTransferConfig(
                                 kv_connector="SyncLoadConnector", kv_connector_module_path=__name__,
                                 kv_role="kv_consumer", kv_load_failure_policy="fail"))
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE)),
            KVCacheGroupSpec(["layer.1"], SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE, sliding_window=8)),
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


def step(scheduler: Scheduler, sample: int = 0) -> list:
    """One engine step: schedule(), the forward pass, update_from_output(); a request that has
    computed all its tokens samples (sample + its token count) mod VOCAB_SIZE.
    Returns the ids of the requests it finished (that left the Scheduler), sorted."""
    before = set(scheduler.requests)
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([(sample + request.num_tokens) % VOCAB_SIZE] if done else [])
    scheduler.update_from_output(output, load_failures(
        scheduler, output, model_output(req_ids, sampled)))
    return sorted(before - set(scheduler.requests))


class TraceConnector(KVConnectorBase_V1, SupportsHMA):
    """A scheduler-side KV connector on vLLM's base class, in the consumer role: it offers a
    request the external tokens the test names (if any), as an asynchronous load; the test
    reports the load's end as a worker does (finish_load). It supports hybrid models (each
    group's blocks); it never holds a finished request's blocks. Its worker side never runs."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.offers: dict[str, int] = {}  # request id -> external tokens at its next lookup
        self.loading: dict[str, int] = {}  # request id -> external tokens of its load

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        offered = self.offers.pop(request.request_id, 0)
        n = min(offered, request.num_tokens - num_computed_tokens)
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        if num_external_tokens:
            self.loading[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        raise NotImplementedError("scheduler side only")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError("scheduler side only")

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        raise NotImplementedError("scheduler side only")

    def wait_for_save(self) -> None:
        raise NotImplementedError("scheduler side only")


class SyncLoadConnector(TraceConnector):
    """The connector offering synchronous loads too: a request it names is offered its
    external tokens at every lookup until a step admits it; the worker loads them in that
    step's forward pass (the request counts them computed at once)."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.sync_offers: dict[str, int] = {}  # request id -> external tokens offered
        self.sync_valid: dict[str, int] = {}  # request id -> the external tokens that fill
        self.admitted: dict[str, int] = {}  # request id -> external tokens admitted this step

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        if request.request_id in self.sync_offers:
            # vLLM computes at least one token of a request it admits: the last is left.
            n = request.num_tokens - 1 - num_computed_tokens
            return max(min(self.sync_offers[request.request_id], n), 0), False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        if self.sync_offers.pop(request.request_id, None) is not None:
            if num_external_tokens:
                self.admitted[request.request_id] = num_external_tokens
        else:
            super().update_state_after_alloc(request, blocks, num_external_tokens)


def sync_load(scheduler: Scheduler, request_id: str, num_external_tokens: int,
              num_loaded_tokens: int | None = None) -> None:
    """The connector offers the request num_external_tokens, loaded synchronously by the step
    that admits it, of which only the first num_loaded_tokens fill their blocks (None: all)."""
    scheduler.connector.sync_offers[request_id] = num_external_tokens
    if num_loaded_tokens is not None:
        scheduler.connector.sync_valid[request_id] = num_loaded_tokens


def load_failures(scheduler: Scheduler, output, runner_output: ModelRunnerOutput):
    """The worker's report of the synchronous loads the step admitted, on a model with several
    KV cache groups: each that failed to fill its blocks by its request (failed_recving), as
    vLLM's Scheduler asks of a connector there (block ids are unique only within a group);
    returns runner_output with it."""
    admitted, scheduler.connector.admitted = scheduler.connector.admitted, {}
    failed = {request_id for request_id, external in admitted.items()
              if scheduler.connector.sync_valid.pop(request_id, external) < external}
    if failed:
        runner_output.kv_connector_output = KVConnectorOutput(failed_recving=failed)
    return runner_output


def test_sync_failure_several_groups(tmp_path):
    scheduler = create_scheduler(tmp_path)
    scheduler.add_request(make_request('r1', [2, 1, 3, 3, 1, 2, 1, 0, 1, 2, 2, 2], arrival_time=0, max_tokens=2))
    sync_load(scheduler, 'r1', 8, 2)
    finished = step(scheduler)
    assert finished == ['r1'], (
        f"trace op 3 finished {finished}; the reference model finishes ['r1']")
    finished = step(scheduler)
    assert finished == [], (
        f"trace op 4 finished {finished}; the reference model finishes []")
