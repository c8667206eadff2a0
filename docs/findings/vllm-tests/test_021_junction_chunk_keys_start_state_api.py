"""021 — vLLM keys the start block of a chunk cut at a junction at a state it does not hold

kvfuzz finding 021-junction-chunk-keys-start-state, exported by `kvfuzz export docs/findings/vllm-tests/021-junction-chunk-keys-start-state-api.json --vllm-test`.
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
HASH_BLOCK_SIZE = 2


def make_manager() -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=26,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=DTYPE)),
            KVCacheGroupSpec(["layer.1"], MambaSpec(block_size=8, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align', num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=2)),
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
def test_junction_chunk_keys_start_state():
    manager = make_manager()
    a = make_request('a', [2, 0, 1, 3, 1, 1, 0, 2, 3, 3, 0, 1, 2, 2, 1, 0, 3, 1, 0, 2])
    out = manager.allocate_slots(a, 20)
    assert out is not None, "a fits: allocate_slots must not refuse it"
    schedule(a, 20)
    manager.free(a)
    a.status = RequestStatus.FINISHED_STOPPED
    manager.new_step_starts()
    b = make_request('b', [2, 0, 1])
    out = manager.allocate_slots(b, 2)
    assert out is not None, "b fits: allocate_slots must not refuse it"
    schedule(b, 2)
    manager.new_step_starts()
    out = manager.allocate_slots(b, 1)
    assert out is not None, "b fits: allocate_slots must not refuse it"
    schedule(b, 1)
    manager.free(b)
    b.status = RequestStatus.FINISHED_STOPPED
    manager.new_step_starts()
    c = make_request('c', [2, 0, 1, 3, 1, 1, 0, 2, 3, 3, 0, 1, 2, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    c_hit_blocks, c_hit = lookup(manager, c)
    out = manager.allocate_slots(c, 8, num_new_computed_tokens=c_hit, new_computed_blocks=c_hit_blocks)
    assert out is not None, "c fits: allocate_slots must not refuse it"
    schedule(c, c_hit + 8)
    keyed = [block.block_id for block in manager.block_pool.blocks
             if block.block_hash is not None]
    assert keyed == [1, 2, 3, 4, 5, 7, 8], (
        f"blocks {keyed} carry a cache key where only [1, 2, 3, 4, 5, 7, 8] hold the state their key names: a later hit resumes from the wrong state")
