"""Assert the state invariants on a live vLLM-shaped manager, for hand-written example tests.

    assert_invariants(manager, requests=[a, b], retained=blocks_taken_by_the_caller)

Pass the requests you created so cache keys read as content; without them, keys stay opaque and
only their structure is checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.harness.reading import KeyTranslator, read_snapshot
from kvfuzz.core.sides import Observations
from kvfuzz.properties.registry import REGISTRY, CheckContext


def assert_invariants(
    manager: Any, *, requests: Iterable[Any] = (), retained: Sequence[Any] = ()
) -> None:
    """Raise AssertionError naming the first state invariant the manager breaks."""
    requests = list(requests)
    pool = manager.block_pool
    keys = KeyTranslator(pool.hash_block_size, strict=bool(requests))
    for request in requests:
        keys.learn(request)
    requests += _untold_requests(manager, {r.request_id for r in requests})
    pairs = [(src.block_id, dst.block_id) for src, dst in zip(retained[::2], retained[1::2])]
    snapshot = read_snapshot(manager, requests, keys, pairs)
    ctx = CheckContext(_config_of(manager), "api", -1, {"op": "spot_check"}, None,
                       Observations(), {})
    for check in REGISTRY:
        if check.kind != "state":
            continue
        message = check.fn(snapshot, ctx)
        if message:
            raise AssertionError(f"[{check.name}] {message}\n{snapshot.render()}")


def _untold_requests(manager: Any, known: set[str]) -> list[Any]:
    """Stand-ins for requests the manager tracks but the caller did not pass: their tables
    still count as holders."""
    ids = {rid for m in manager.coordinator.single_type_managers for rid in m.req_to_blocks}
    running = SimpleNamespace(name="RUNNING")
    return [
        SimpleNamespace(request_id=rid, status=running, num_computed_tokens=0, num_tokens=0,
                        all_token_ids=(), block_hashes=[], cache_salt=None,
                        shared_prefix_boundary=0)
        for rid in sorted(ids - known)
    ]


def _config_of(manager: Any) -> Config:
    """A harness Config describing a live manager (what the state checks read of it)."""
    groups = []
    for single in manager.coordinator.single_type_managers:
        spec = single.kv_cache_spec
        kind = type(spec).__name__
        if kind == "SlidingWindowSpec":
            groups.append(GroupConfig("sliding_window", spec.block_size, spec.sliding_window,
                                      spec.extra_retained_tokens))
        elif kind == "ChunkedLocalAttentionSpec":
            groups.append(GroupConfig("chunked_local", spec.block_size,
                                      attention_chunk_size=spec.attention_chunk_size))
        elif kind == "CrossAttentionSpec":
            groups.append(GroupConfig("cross", spec.block_size))
        else:
            groups.append(GroupConfig("full", spec.block_size))
    # Caching off keeps Config's size checks out of the way: the state checks read only the
    # groups, the pool size and the model length.
    return Config(
        num_blocks=len(manager.block_pool.blocks),
        groups=tuple(groups),
        enable_caching=False,
        max_model_len=max(2, manager.max_model_len),
    )
