"""007 — vLLM 0.32 moves the null block's ref_cnt on touch and free

kvfuzz finding 007-null-block-ref-count, exported by `kvfuzz export docs/findings/007-null-block-ref-count.json --vllm-test`.
It asserts that the null block's ref_cnt stays 0.
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, ChunkedLocalAttentionSpec
from vllm.v1.request import Request, RequestStatus

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256

DTYPE = torch.float16
HASH_BLOCK_SIZE = 4


def make_manager() -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=2,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE, attention_chunk_size=4)),
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=64,
        scheduler_block_size=4,
        hash_block_size=HASH_BLOCK_SIZE,
        max_in_flight_tokens=16,
        enable_caching=True,
        use_eagle=False,
        watermark=0.0,
    )


def make_request(request_id: str, prompt: list[int], max_tokens: int = 1, **kwargs) -> Request:
    init_none_hash(sha256)
    limit = kwargs.pop("prefix_cache_hit_limit", None)
    embeds = kwargs.pop("prompt_embeds", None)
    if embeds is not None:  # -1 marks a token-id position (its row is ignored, filled with 0)
        kwargs["prompt_is_token_ids"] = [v < 0 for v in embeds]
        kwargs["prompt_embeds"] = torch.tensor([[float(max(v, 0))] for v in embeds])
    request = Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens), None,
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


def test_null_block_ref_count():
    manager = make_manager()
    r2 = make_request('r2', [1, 3, 1, 2, 3])
    r2_hit_blocks, r2_hit = lookup(manager, r2)
    out = manager.allocate_slots(r2, 0, num_new_computed_tokens=r2_hit, new_computed_blocks=r2_hit_blocks, has_scheduled_reqs=False)
    assert out is not None, "r2 fits: allocate_slots must not refuse it"
    schedule(r2, r2_hit)
    manager.free(r2)
    r2.status = RequestStatus.FINISHED_STOPPED
    assert manager.block_pool.null_block.ref_cnt == 0, (
        f"the null block is neither queued nor counted, but its ref_cnt is {manager.block_pool.null_block.ref_cnt}")
