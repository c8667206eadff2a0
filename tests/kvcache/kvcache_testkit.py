"""Builders and a full structural dump for the kvcache tests (module name kept unique: the
tests directory has no packages).
"""

from __future__ import annotations

import gc
from typing import Any

from kvfuzz.kvcache import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    Request,
    get_request_block_hasher,
    resolve_kv_cache_block_sizes,
)
from kvfuzz.kvcache.block_pool import BlockPool
from kvfuzz.kvcache.kv_cache_utils import KVCacheBlock


def make_config(num_blocks: int, *specs: KVCacheSpec, eagle: tuple[int, ...] = ()) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{i}"], spec, is_eagle_group=i in eagle)
            for i, spec in enumerate(specs)
        ],
    )


def make_manager(
    num_blocks: int,
    *specs: KVCacheSpec,
    max_model_len: int = 1024,
    enable_caching: bool = True,
    hash_block_size: int | None = None,
    **kwargs: Any,
) -> KVCacheManager:
    config = make_config(num_blocks, *specs)
    sbs, hbs = resolve_kv_cache_block_sizes(config, enable_caching, hash_block_size)
    return KVCacheManager(
        config, max_model_len, sbs, hbs, enable_caching=enable_caching, **kwargs
    )


def make_request(
    request_id: str,
    tokens: list[int],
    hash_block_size: int,
    cache_salt: str | None = None,
    **kwargs: Any,
) -> Request:
    return Request(
        request_id,
        list(tokens),
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(hash_block_size, "kvfuzz-tests"),
        **kwargs,
    )


def ids(blocks: Any) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def table_ids(manager: KVCacheManager, request_id: str) -> list[list[int]]:
    return [list(g) for g in manager.get_block_ids(request_id)]


def _link(block: KVCacheBlock | None) -> int | None:
    return None if block is None else block.block_id


def assert_map(pool: BlockPool) -> None:
    """The hash map in vLLM 0.34's layout: `_cache` a plain dict of bytes -> block id that the
    cyclic GC does not track, `_dup_ids` only for keys of two or more blocks, the earliest in
    `_cache`; every key of a block (primary and extras) names it, and every id under a key is
    a block carrying that key."""
    cache_map = pool.cached_block_hash_to_block
    cache, dup_ids = cache_map._cache, cache_map._dup_ids
    assert type(cache) is dict and not gc.is_tracked(cache)
    for key, ids_of_key in dup_ids.items():
        assert len(ids_of_key) >= 2 and cache.get(key) == next(iter(ids_of_key)), key
    for b in pool.blocks:
        assert b._hashed == (b.block_hash is not None), b.block_id
        keys = [b.block_hash] if b.block_hash is not None else []
        keys += pool.cached_block_hashes_by_block.get(b.block_id, {})
        for key in keys:
            assert cache_map.contain(key, b.block_id), (b.block_id, key)
    for key, block_id in cache.items():
        for i in dup_ids.get(key, (block_id,)):
            assert pool.carries_key(pool.blocks[i], key), (i, key)


def dump_pool(pool: BlockPool) -> dict[str, Any]:
    """Everything layer 4 holds, as plain data (links by id, map entries with their shape).

    Also checks the map's layout (`assert_map`).
    """
    assert_map(pool)
    queue = pool.free_block_queue
    cache_map = pool.cached_block_hash_to_block
    cache = {
        key: ("many", list(cache_map._dup_ids[key])) if key in cache_map._dup_ids
        else ("one", block_id)
        for key, block_id in cache_map._cache.items()
    }
    return {
        "blocks": [
            (
                b.block_id,
                b.ref_cnt,
                b.block_hash,
                b.block_hash_num_tokens,
                _link(b.prev_free_block),
                _link(b.next_free_block),
                b.is_null,
            )
            for b in pool.blocks
        ],
        "queue": free_ids(pool),
        "num_free": queue.num_free_blocks,
        "head": _link(queue.fake_free_list_head.next_free_block),
        "tail": _link(queue.fake_free_list_tail.prev_free_block),
        "cache": cache,
        "extras": {bid: sorted(keys) for bid, keys in pool.cached_block_hashes_by_block.items()},
    }


def dump_manager(manager: KVCacheManager) -> dict[str, Any]:
    """The pool plus every layer-3 manager's per-request state and the layer-1 stats."""
    singles = []
    for m in manager.coordinator.single_type_managers:
        singles.append(
            {
                "req_to_blocks": {rid: ids(bs) for rid, bs in m.req_to_blocks.items()},
                "num_cached_block": dict(m.num_cached_block),
                "partial": {rid: (i, b.block_id) for rid, (i, b) in m._partial_hit_reqs.items()},
                "pending": [(s.block_id, d.block_id) for s, d in m._pending_cow_copies],
                "new_block_ids": list(m.new_block_ids),
                "use_eagle": m.use_eagle,
                "alignment": m.cache_hit_alignment_tokens,
            }
        )
    return {
        "pool": dump_pool(manager.block_pool),
        "managers": singles,
        "stats": repr(manager.prefix_cache_stats),
    }


def dump_request(request: Request) -> dict[str, Any]:
    """The request fields the manager reads or the driver writes."""
    return {
        "status": request.status,
        "num_computed_tokens": request.num_computed_tokens,
        "num_in_flight_tokens": request.num_in_flight_tokens,
        "num_preemptions": request.num_preemptions,
        "all_token_ids": list(request.all_token_ids),
        "spec_token_ids": list(request.spec_token_ids),
        "block_hashes": list(request.block_hashes),
    }


def dump_state(manager: KVCacheManager, *requests: Request) -> dict[str, Any]:
    """`dump_manager` plus the given requests: what a rejected call must leave unchanged."""
    return {
        "manager": dump_manager(manager),
        "requests": {r.request_id: dump_request(r) for r in requests},
    }


def record_predictions(manager: KVCacheManager) -> list[int]:
    """Wrap the coordinator's predictor on the instance (as the harness probes do) and collect
    the per-step predictions (the full-sequence gate's capped calls are left out).
    """
    seen: list[int] = []
    original = manager.coordinator.get_num_blocks_to_allocate

    def wrapper(*args: Any, **kwargs: Any) -> int:
        value = original(*args, **kwargs)
        if not kwargs.get("apply_admission_cap", False):
            seen.append(value)
        return value

    manager.coordinator.get_num_blocks_to_allocate = wrapper  # type: ignore[method-assign]
    return seen
