"""019 — a refused allocation leaves a Mamba prefill checkpoint record that cache_blocks reads

kvfuzz finding 019-checkpoint-record-kept, exported by `kvfuzz export docs/findings/019-checkpoint-record-kept.json --vllm-test`.
It asserts which blocks carry a cache key after the calls.
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
        num_blocks=9,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=DTYPE)),
            KVCacheGroupSpec(["layer.1"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align', num_speculative_blocks=2, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)),
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


@pytest.mark.skipif("num_prefill_checkpoint_blocks" not in MambaSpec.__dataclass_fields__, reason="this vLLM's Mamba spec has no prefill checkpoint blocks")
def test_checkpoint_record_kept():
    manager = make_manager()
    r = make_request('r', [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], max_tokens=16)
    out = manager.allocate_slots(r, 8)
    assert out is not None, "r fits: allocate_slots must not refuse it"
    schedule(r, 8)
    out = manager.allocate_slots(r, 17)
    assert out is None, "r does not fit: allocate_slots refuses it"
    manager.cache_blocks(r, 8)
    keyed = [block.block_id for block in manager.block_pool.blocks
             if block.block_hash is not None]
    assert keyed == [1, 2], (
        f"blocks {keyed} carry a cache key where only [1, 2] hold the state their key names: a later hit resumes from the wrong state")
