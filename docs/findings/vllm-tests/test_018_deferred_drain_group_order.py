"""018 — vLLM's deferred frees release a hybrid request's groups in reverse order

kvfuzz finding 018-deferred-drain-group-order, exported by `kvfuzz export docs/findings/vllm-tests/018-deferred-drain-group-order.json --vllm-test`.
It drives vLLM's own AsyncScheduler as an engine does: add_request, then per step schedule(), the
forward pass and update_from_output() with one sampled token per request that needs one;
a step in flight leaves its output held until the step's completion, as an engine
overlapping batches does, and vLLM defers the frees of requests it ran.
It asserts the order of the free queue after the steps: the order in which the freed blocks reached it, which is the order they are evicted.
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
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec, SlidingWindowSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256

DTYPE = torch.float16
BLOCK_SIZE = 8
HASH_BLOCK_SIZE = 4
NUM_BLOCKS = 4
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
        max_num_batched_tokens=8,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy='fcfs',
        watermark=0.0,
        async_scheduling=True,
        scheduler_reserve_full_isl=False,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE,
                               enable_prefix_caching=True)
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, device_config=DeviceConfig(device="cpu"),
                             kv_transfer_config=KVTransferConfig(
                                 kv_connector="TraceConnector", kv_connector_module_path=__name__,
                                 kv_role="kv_consumer", kv_load_failure_policy="recompute"))
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=DTYPE)),
            KVCacheGroupSpec(["layer.1"], SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE, sliding_window=9)),
        ],
    )
    scheduler = AsyncScheduler(
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


def step(scheduler: Scheduler, sample: int = 0,
         in_flight: list | None = None) -> None:
    """One engine step: schedule(), the forward pass, update_from_output(); a request that has
    computed all its tokens samples (sample + its token count) mod VOCAB_SIZE."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    requests = [scheduler.requests[req_id] for req_id in req_ids]
    done = [request.num_computed_tokens >= request.num_tokens for request in requests]

    def take_output() -> ModelRunnerOutput:
        # Sampled when the output is taken, from the tokens the request has then.
        return model_output(req_ids, [
            [(sample + request.num_tokens) % VOCAB_SIZE] if d else []
            for request, d in zip(requests, done)])

    if in_flight is None:
        scheduler.update_from_output(output, take_output())
    else:
        in_flight.append((output, take_output))


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


def complete(scheduler: Scheduler, in_flight: list) -> None:
    """The oldest step in flight completes: update_from_output() takes its output (sampled
    now), and the Scheduler returns to the free queue the blocks of requests freed while it
    ran (deferred frees)."""
    output, take_output = in_flight.pop(0)
    scheduler.update_from_output(output, take_output())


def test_deferred_drain_group_order(tmp_path):
    scheduler = create_scheduler(tmp_path)
    in_flight = []  # outputs of steps in flight, oldest first
    scheduler.add_request(make_request('r4', [0, 0, 1, 0, 0, 0, 0, 3, 0], arrival_time=0))
    step(scheduler, in_flight=in_flight)
    scheduler.finish_requests('r4', RequestStatus.FINISHED_ABORTED)
    complete(scheduler, in_flight)
    free = [block.block_id for block in
            scheduler.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free == [1, 3, 2], (
        f"the free queue is {free}, but freeing each KV cache group's blocks tail first, group after group (as a request freed with no step in flight is), leaves [1, 3, 2]: which cached prefix is evicted first depends on whether a step was in flight")
