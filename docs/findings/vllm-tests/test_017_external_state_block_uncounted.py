"""017 — vLLM's align-mode predictor under-counts a first allocation with external tokens

kvfuzz finding 017-external-state-block-uncounted, exported by `kvfuzz export docs/findings/017-external-state-block-uncounted.json --vllm-test`.
It asserts that allocate_slots takes exactly the blocks its admission check counts.
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import inspect

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec, MambaSpec
from vllm.v1.request import Request, RequestStatus

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256

DTYPE = torch.float16
HASH_BLOCK_SIZE = 4


def make_manager() -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=DTYPE)),
            KVCacheGroupSpec(["layer.1"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align')),
            KVCacheGroupSpec(["layer.2"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align')),
            KVCacheGroupSpec(["layer.3"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align')),
            KVCacheGroupSpec(["layer.4"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align')),
            KVCacheGroupSpec(["layer.5"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align')),
            KVCacheGroupSpec(["layer.6"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align')),
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


@pytest.mark.skipif("num_external_computed_tokens" not in inspect.signature(KVCacheManager.allocate_slots).parameters, reason="this vLLM's allocate_slots takes no external (KV connector) tokens")
def test_external_state_block_uncounted():
    manager = make_manager()
    counted = []  # what the admission check counts, call by call
    count = manager.coordinator.get_num_blocks_to_allocate
    manager.coordinator.get_num_blocks_to_allocate = (
        lambda *args, **kwargs: counted.append(count(*args, **kwargs)) or counted[-1])
    a = make_request('a', [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], max_tokens=16)
    free_before = manager.block_pool.get_num_free_blocks()
    out = manager.allocate_slots(a, 8, num_external_computed_tokens=8)
    assert out is not None, "a fits: allocate_slots must not refuse it"
    taken = free_before - manager.block_pool.get_num_free_blocks()
    assert taken == counted[-1], (
        f"allocate_slots of a took {taken} blocks but its admission check counted {counted[-1]}: a pool holding only the counted blocks raises 'Cannot get N free blocks' mid-allocation")
    schedule(a, 8 + 8)
