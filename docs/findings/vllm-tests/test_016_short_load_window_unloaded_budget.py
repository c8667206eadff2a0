"""016 — a short KV load on a lone sliding-window group resumes over a window it never loaded

kvfuzz finding 016-short-load-window-unloaded, exported by `kvfuzz export docs/findings/vllm-tests/016-short-load-window-unloaded-budget.json --vllm-test`.
It drives vLLM's own Scheduler as an engine does: add_request, then per step schedule(), the
forward pass and update_from_output() with one sampled token per request that needs one.
It keeps the KV each step writes into the attention blocks (after the step's block copies, applied as vLLM's worker applies them) and asserts that every position a scheduled request reads holds the KV of its own prefix.
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
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
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
        max_num_seqs=2,
        max_num_batched_tokens=2,
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
                                 kv_connector="TraceConnector", kv_connector_module_path=__name__,
                                 kv_role="kv_consumer", kv_load_failure_policy="recompute"))
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE, sliding_window=8)),
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


ATTENTION_GROUPS = [(0, 4, 8)]
"""(group index, block size, sliding window or None) of each attention group: a position reads
the window behind it (None: every position before it)."""


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
            for group, size, window in ATTENTION_GROUPS:
                table = tables[group]
                for position in range(max(start - window + 1, 0) if window else 0, start):
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

    def load(self, scheduler: Scheduler, request: Request, start: int, end: int) -> None:
        """The KV a connector's load writes: positions start..end-1 of the request, into the
        blocks its tables hold for them (a null block is written by no one)."""
        null = scheduler.kv_cache_manager.block_pool.null_block.block_id
        tables = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        for group, size, _ in ATTENTION_GROUPS:
            for position in range(start, end):
                block = tables[group][position // size]
                if block != null:
                    self.kv[block, position % size] = self.prefix(request, position)


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


def load_remote(scheduler: Scheduler, request_id: str, num_external_tokens: int) -> None:
    """The connector offers the request num_external_tokens; the engine's next schedule()
    looks it up and starts the load, computing nothing."""
    scheduler.connector.offers[request_id] = num_external_tokens
    output = scheduler.schedule()
    assert not output.num_scheduled_tokens, "a load's step computes nothing"
    scheduler.update_from_output(output, model_output([], []))


def finish_load(scheduler: Scheduler, forward: ForwardPass, request_id: str,
                num_loaded_tokens: int | None = None) -> None:
    """The worker reports the request's load done with its first num_loaded_tokens external
    tokens landed (None: all); a short load names the blocks it did not fill
    (invalid_block_ids), never the null block, as a worker reports what it was asked to fill."""
    request = scheduler.requests[request_id]
    external = scheduler.connector.loading.pop(request_id)
    hit = request.num_computed_tokens - external
    loaded = external if num_loaded_tokens is None else num_loaded_tokens
    forward.load(scheduler, request, hit, hit + loaded)
    report = KVConnectorOutput(finished_recving={request_id})
    if loaded < external:
        (blocks,) = scheduler.kv_cache_manager.get_blocks(request_id).blocks
        unfilled = blocks[(hit + loaded) // BLOCK_SIZE:]
        report.invalid_block_ids = {block.block_id for block in unfilled if not block.is_null}
    output = scheduler.schedule()
    assert not output.num_scheduled_tokens, "the load's end computes nothing"
    runner_output = model_output([], [])
    runner_output.kv_connector_output = report
    scheduler.update_from_output(output, runner_output)


def test_short_load_window_unloaded(tmp_path):
    scheduler = create_scheduler(tmp_path)
    forward = ForwardPass()
    scheduler.add_request(make_request('r', [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], arrival_time=0))
    load_remote(scheduler, 'r', 12)
    finish_load(scheduler, forward, 'r', 4)
    step(scheduler, forward)
