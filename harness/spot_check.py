"""Assert the state invariants on a live vLLM-shaped manager, for hand-written example tests.

    assert_invariants(manager, requests=[a, b], retained=blocks_taken_by_the_caller)

Pass the requests you created so cache keys read as content; without them, keys stay opaque and
only their structure is checked.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

from kvfuzz.core.config import Config, GroupConfig, SchedulerConfig
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


def _group_of(spec: Any) -> GroupConfig:
    """The config group of a live manager's spec, by the spec's class (or the nearest base
    class kvfuzz knows: vLLM's and kvcache's specs have the same names)."""
    size = spec.block_size
    for cls in type(spec).__mro__:
        name = cls.__name__
        if name == "SlidingWindowSpec":
            return GroupConfig("sliding_window", size, spec.sliding_window,
                               getattr(spec, "extra_retained_tokens", 0))
        if name == "ChunkedLocalAttentionSpec":
            return GroupConfig("chunked_local", size,
                               attention_chunk_size=spec.attention_chunk_size)
        if name == "MambaSpec":
            return GroupConfig(
                "mamba", size, mamba_cache_mode=getattr(spec, "mamba_cache_mode", "none"),
                num_speculative_blocks=getattr(spec, "num_speculative_blocks", 0),
                num_prefill_checkpoint_blocks=getattr(spec, "num_prefill_checkpoint_blocks", 0),
                prefill_checkpoint_alignment=getattr(spec, "prefill_checkpoint_alignment", None))
        if name == "SinkFullAttentionSpec":
            return GroupConfig("sink_full", size, sink_len=spec.sink_len)
        if name == "RSWASpec":
            return GroupConfig("rswa", size, rswa_window=spec.rswa_window)
        if name in _SIMPLE_KINDS:
            return GroupConfig(_SIMPLE_KINDS[name], size)
    raise TypeError(f"assert_invariants does not know the KV cache spec "
                    f"{type(spec).__name__} (nor any of its base classes)")


_SIMPLE_KINDS = {"MLAAttentionSpec": "mla", "CrossAttentionSpec": "cross",
                 "EncoderOnlyAttentionSpec": "encoder_only",
                 "CircularBufferSpec": "circular_buffer", "FullAttentionSpec": "full"}
"""Spec classes whose group needs only a kind and a block size (subclasses first)."""


def _config_of(manager: Any) -> Config:
    """A harness Config describing a live manager (what the state checks read of it)."""
    flagged = [getattr(group, "is_eagle_group", False)
               for group in manager.kv_cache_config.kv_cache_groups]
    groups = tuple(dataclasses.replace(_group_of(single.kv_cache_spec), eagle=bool(flag))
                   for single, flag in zip(manager.coordinator.single_type_managers, flagged))
    # Caching off keeps Config's size checks out of the way: the state checks read only the
    # groups, the pool size and the model length.
    return Config(
        num_blocks=len(manager.block_pool.blocks),
        groups=groups,
        enable_caching=False,
        max_model_len=max(2, manager.max_model_len),
        scheduler=SchedulerConfig(chunked_prefill=not any(g.kind == "encoder_only"
                                                          for g in groups)),
    )
