"""kvcache as a drop-in for `vllm.v1.core`: code written against vLLM's KV cache API runs on
kvcache with only the imports changed.

`_scheduler_code` is written the way vLLM's scheduler and tests use the manager: specs with
their tensor layout fields, a `KVCacheConfig` with tensors and groups, the manager built with
vLLM's keyword arguments (their neutral values), a prefix hit adopted by `allocate_slots`, and
`free` of a request aborted while waiting (vLLM's scheduler frees every finished request).
It runs on kvcache always, and on the installed vLLM where one is importable; both must give
the same answers. Requests come from each side's own Request class (`vllm.v1.request` is not
part of `vllm.v1.core`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvfuzz.harness.vllm_target import vllm_available

BLOCK = 16


def _kvcache() -> SimpleNamespace:
    from kvfuzz.kvcache import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheManager,
        SlidingWindowSpec,
    )
    from kvfuzz.kvcache.kv_cache_utils import get_request_block_hasher
    from kvfuzz.kvcache.request import Request

    hasher = get_request_block_hasher(BLOCK)

    def request(rid: str, tokens: list[int]) -> Any:
        return Request(rid, tokens, max_tokens=4, block_hasher=hasher)

    return SimpleNamespace(FullAttentionSpec=FullAttentionSpec, SlidingWindowSpec=SlidingWindowSpec,
                           KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
                           KVCacheManager=KVCacheManager, request=request, dtype=None)


def _vllm() -> SimpleNamespace:
    from kvfuzz.harness.vllm_api import load_vllm

    v = load_vllm()
    iface = v["interface"]
    v["utils"].init_none_hash(v["sha256"])
    hasher = v["utils"].get_request_block_hasher(BLOCK, v["sha256"])
    params = v["SamplingParams"](max_tokens=4)

    def request(rid: str, tokens: list[int]) -> Any:
        return v["Request"](rid, tokens, params, None, block_hasher=hasher)

    return SimpleNamespace(FullAttentionSpec=iface.FullAttentionSpec,
                           SlidingWindowSpec=iface.SlidingWindowSpec,
                           KVCacheConfig=iface.KVCacheConfig,
                           KVCacheGroupSpec=iface.KVCacheGroupSpec,
                           KVCacheManager=v["KVCacheManager"], request=request, dtype=v["dtype"])


def _scheduler_code(ns: SimpleNamespace, window: bool) -> dict[str, Any]:
    """vLLM-style use of the manager; returns what it observed."""
    layout = {"num_kv_heads": 8, "head_size": 64, "dtype": ns.dtype}
    specs = [ns.FullAttentionSpec(block_size=BLOCK, **layout)]
    if window:
        specs.append(ns.SlidingWindowSpec(block_size=BLOCK, sliding_window=32, **layout))
    config = ns.KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=[],
        kv_cache_groups=[ns.KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)],
    )
    manager = ns.KVCacheManager(
        kv_cache_config=config, max_model_len=256, scheduler_block_size=BLOCK,
        hash_block_size=BLOCK, max_in_flight_tokens=64, enable_caching=True, use_eagle=False,
        num_prefill_lookahead=0, log_stats=False,
        enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1, metrics_collector=None,
        watermark=0.0,
    )
    seen: dict[str, Any] = {}
    prompt = list(range(1000, 1050))
    a = ns.request("a", prompt)
    blocks, hit, _ = manager.get_computed_blocks(a)
    seen["a hit"] = hit
    out = manager.allocate_slots(a, a.num_tokens, hit, blocks)
    seen["a blocks"] = out.get_block_ids()
    a.num_computed_tokens = a.num_tokens
    b = ns.request("b", prompt[:40] + [7] * 10)
    blocks, hit, _ = manager.get_computed_blocks(b)
    seen["b hit"] = (hit, blocks.get_block_ids())
    out = manager.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    seen["b new blocks"] = out.get_block_ids()
    seen["b table"] = manager.get_block_ids("b")
    aborted = ns.request("c", [5] * 20)
    manager.free(aborted)  # aborted while waiting: never allocated
    manager.free(a)
    manager.free(b)
    seen["free after"] = manager.block_pool.get_num_free_blocks()
    seen["reset"] = manager.reset_prefix_cache()
    return seen


SIDES = [
    pytest.param(_kvcache, id="kvcache"),
    pytest.param(_vllm, id="vllm", marks=[
        pytest.mark.vllm,
        pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
    ]),
]


@pytest.mark.parametrize("window", [False, True], ids=["full", "full+swa"])
@pytest.mark.parametrize("side", SIDES)
def test_vllm_style_code_runs_and_agrees(side, window):
    seen = _scheduler_code(side(), window)
    expected = _scheduler_code(_kvcache(), window)
    assert seen == expected
    assert seen["b hit"][0] == 32 and seen["free after"] == 39 and seen["reset"] is True


def test_a_feature_kvcache_lacks_is_refused_by_name():
    ns = _kvcache()
    config = ns.KVCacheConfig(num_blocks=8, kv_cache_groups=[
        ns.KVCacheGroupSpec(["l"], ns.FullAttentionSpec(block_size=BLOCK))])
    ns.KVCacheManager(config, 64, BLOCK, BLOCK, num_hash_lookahead_tokens=1)  # MTP: taken
    with pytest.raises(ValueError, match=r"dcp_world_size=2 is not supported"):
        ns.KVCacheManager(config, 64, BLOCK, BLOCK, dcp_world_size=2)
