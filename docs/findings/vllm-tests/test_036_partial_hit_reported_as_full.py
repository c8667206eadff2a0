"""036 — a full-mode hit ending inside a block is re-announced under the block's full key

kvfuzz finding 036-partial-hit-reported-as-full, exported by `kvfuzz export docs/findings/036-partial-hit-reported-as-full.json --vllm-test`.
It asserts that the KV events of the last call announce as stored only keys that a block holds after it.
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import inspect

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec
from vllm.v1.request import Request, RequestStatus

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256

DTYPE = torch.float16
HASH_BLOCK_SIZE = 4


def make_manager() -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=3,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=DTYPE)),
            KVCacheGroupSpec(["layer.1"], FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=DTYPE)),
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=64,
        scheduler_block_size=8,
        hash_block_size=HASH_BLOCK_SIZE,
        max_in_flight_tokens=None,
        enable_caching=True,
        use_eagle=False,
        watermark=0.0,
        enable_kv_cache_events=True,
    )


def make_request(request_id: str, prompt: list[int], max_tokens: int = 1, **kwargs) -> Request:
    init_none_hash(sha256)
    limit = kwargs.pop("prefix_cache_hit_limit", None)
    embeds = kwargs.pop("prompt_embeds", None)
    if embeds is not None:  # -1 marks a token-id position (its row is ignored, filled with 0)
        kwargs["prompt_is_token_ids"] = [v < 0 for v in embeds]
        kwargs["prompt_embeds"] = torch.tensor([[float(max(v, 0))] for v in embeds])
    request = Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens, extra_args={"kv_cache_report_mode": 'full'}), None,
        block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256), **kwargs,
    )
    if limit is not None:  # what vLLM derives from prompt-scoring parameters
        request.prefix_cache_hit_limit = limit
    return request


def lookup(manager: KVCacheManager, request: Request, bound: int | None = None):
    """get_computed_blocks as (blocks, hit); newer releases return a third value."""
    args = () if bound is None else (bound,)
    result = manager.get_computed_blocks(request, *args)
    return result[0], result[1]


def schedule(request: Request, num_tokens: int) -> None:
    """What the scheduler does after a successful allocate_slots."""
    request.num_computed_tokens += num_tokens
    request.status = RequestStatus.RUNNING


@pytest.mark.skipif(not hasattr(Request, "get_max_cache_hit_length"), reason='this vLLM has no per-request prefix-cache hit limit')
@pytest.mark.skipif("enable_kv_cache_events" not in inspect.signature(KVCacheManager).parameters, reason="this vLLM's manager emits no KV cache events")
@pytest.mark.skipif(not hasattr(kv_cache_coordinator, "partial_hash_hits_enabled"), reason='this vLLM has no partial (sub-block) prefix hits')
@pytest.mark.skipif("prompt_is_token_ids" not in inspect.signature(Request).parameters, reason="this vLLM's Request takes no prompt_is_token_ids mask")
@pytest.mark.skipif(not hasattr(BlockPool, "emit_cached_block_events"), reason='this vLLM has no kv_cache_report_mode "full"')
def test_partial_hit_reported_as_full(monkeypatch):
    # Partial (sub-block) prefix hits: vLLM turns them on only beside a Mamba "align" group
    # (kv_cache_utils.partial_hash_hits_enabled); the trace's groups are attention alone,
    # so the coordinator is told they are on.
    monkeypatch.setattr(kv_cache_coordinator, "partial_hash_hits_enabled",
                        lambda *args, **kwargs: True)
    manager = make_manager()
    r3 = make_request('r3', [0, 0, 0, 0, 0, 0, 0, 0], cache_salt='a', prompt_embeds=[0, -1, 0, -1, 0, -1, 0, -1])
    r4 = make_request('r4', [0, 0, 0, 0, 0], cache_salt='a', prefix_cache_hit_limit=2, prompt_embeds=[0, -1, 0, -1, 0])
    out = manager.allocate_slots(r4, 1, has_scheduled_reqs=False)
    assert out is not None, "r4 fits: allocate_slots must not refuse it"
    schedule(r4, 1)
    out = manager.allocate_slots(r4, 3)
    assert out is not None, "r4 fits: allocate_slots must not refuse it"
    schedule(r4, 3)
    manager.take_events()  # the events of the calls before the last
    r3_hit_blocks, r3_hit = lookup(manager, r3)
    held = {(maybe_convert_block_hash(get_block_hash(block.block_hash)),
             get_group_id(block.block_hash))
            for block in manager.block_pool.blocks if block.block_hash is not None}
    for event in manager.take_events():
        if type(event).__name__ != "BlockStored":
            continue
        stored = {(h, event.group_idx or 0) for h in event.block_hashes}
        assert stored <= held, (
            f"a BlockStored announces {len(stored - held)} key(s) that no block holds: a KV-event consumer believes a prefix cached that the engine no longer has")
