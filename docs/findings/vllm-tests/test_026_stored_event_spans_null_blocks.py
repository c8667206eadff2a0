"""026 — a Mamba "align" BlockStored carries the token ids of blocks it has no hash for

kvfuzz finding 026-stored-event-spans-null-blocks, exported by `kvfuzz export docs/findings/026-stored-event-spans-null-blocks.json --vllm-test`.
It asserts that each BlockStored carries block_size token ids per block hash it names, no more and no fewer.
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import inspect

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request, RequestStatus

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256

DTYPE = torch.float16
HASH_BLOCK_SIZE = 1


def make_manager() -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=2,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], MambaSpec(block_size=1, shapes=((8,),), dtypes=(DTYPE,), mamba_cache_mode='align')),
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=128,
        scheduler_block_size=1,
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


@pytest.mark.skipif("enable_kv_cache_events" not in inspect.signature(KVCacheManager).parameters, reason="this vLLM's manager emits no KV cache events")
def test_stored_event_spans_null_blocks():
    manager = make_manager()
    r0 = make_request('r0', [0, 0])
    out = manager.allocate_slots(r0, 2)
    assert out is not None, "r0 fits: allocate_slots must not refuse it"
    schedule(r0, 2)
    for event in manager.take_events():
        if type(event).__name__ != "BlockStored":
            continue
        hashes, tokens = len(event.block_hashes), len(event.token_ids)
        assert tokens == hashes * event.block_size, (
            f"a BlockStored names {hashes} block hash(es) of {event.block_size} tokens but carries {tokens} token ids: a KV-event consumer that pairs each hash with its block_size slice of the token ids keys a cached block under the wrong prefix")
