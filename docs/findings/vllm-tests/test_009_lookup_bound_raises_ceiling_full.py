"""009 — vLLM 0.33 lets a lookup bound raise the hit ceiling past num_tokens − 1

kvfuzz finding 009-lookup-bound-raises-ceiling, exported by `kvfuzz export docs/findings/vllm-tests/009-lookup-bound-raises-ceiling-full.json --vllm-test`.
It asserts that a lookup leaves at least one token to compute.
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import inspect

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
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
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE)),
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=64,
        scheduler_block_size=4,
        hash_block_size=HASH_BLOCK_SIZE,
        max_in_flight_tokens=None,
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


@pytest.mark.skipif("max_cache_hit_length" not in inspect.signature(KVCacheManager.get_computed_blocks).parameters, reason='this vLLM has no lookup bound')
def test_lookup_bound_raises_ceiling():
    manager = make_manager()
    r0 = make_request('r0', [0, 2, 1, 3])
    r1 = make_request('r1', [0, 2, 1, 3, 1])
    out = manager.allocate_slots(r1, 4, has_scheduled_reqs=False)
    assert out is not None, "r1 fits: allocate_slots must not refuse it"
    schedule(r1, 4)
    r0_hit_blocks, r0_hit = lookup(manager, r0, 8)
    assert r0_hit <= r0.num_tokens - 1, (
        f"a lookup bounded by 8 hits {r0_hit} of r0's {r0.num_tokens} tokens: none is left to compute its logits")
