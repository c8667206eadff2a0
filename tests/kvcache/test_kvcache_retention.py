"""Prefix-cache retention intervals and replay boundaries (docs/spec.md §4.9.2, §11.3): which
sliding-window blocks and Mamba "align" state blocks get keys, and the settings vLLM refuses."""

from __future__ import annotations

import dataclasses

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import ConfigError
from kvfuzz.kvcache import FullAttentionSpec, KVCacheManager, MambaSpec, SlidingWindowSpec
from kvfuzz.kvcache.block_math import replay_boundaries
from kvfuzz.kvcache.kv_cache_utils import resolve_kv_cache_block_sizes
from kvfuzz.kvcache.scheduler import Scheduler

from kvcache_testkit import make_config, make_request


def make_manager(num_blocks, *specs, prefix_cache_retention_interval, hash_block_size=None):
    config = dataclasses.replace(make_config(num_blocks, *specs),
                                 prefix_cache_retention_interval=prefix_cache_retention_interval)
    sbs, hbs = resolve_kv_cache_block_sizes(config, True, hash_block_size)
    return KVCacheManager(config, 1024, sbs, hbs)


def _keyed_window_positions(retention, prompt_len=30):
    manager = make_manager(40, FullAttentionSpec(block_size=4),
                           SlidingWindowSpec(block_size=4, sliding_window=8),
                           prefix_cache_retention_interval=retention)
    request = make_request("r", list(range(prompt_len)), 4)
    assert manager.allocate_slots(request, prompt_len) is not None
    table = manager.coordinator.single_type_managers[1].req_to_blocks["r"]
    return [i for i, b in enumerate(table) if b.block_hash is not None]


@pytest.mark.parametrize("retention, keyed", [
    (None, [0, 1, 2, 3, 4, 5, 6]),  # dense: a window needs 2 blocks, alignment 4 is 1 block
    (0, [5, 6]),                    # only the replay boundary 29 -> 28
    (16, [2, 3, 5, 6]),             # segment end 16, and the replay boundary
    (8, [0, 1, 2, 3, 4, 5, 6]),     # a segment of 2 blocks is all a window needs: dense
])
def test_window_blocks_keyed_at_kept_boundaries(retention, keyed):
    assert _keyed_window_positions(retention) == keyed


def _keyed_state_boundaries(retention, prompt_len=35, chunks=(8, 8, 8, 8, 2, 1)):
    """Granite-4.0-H-shaped (full + Mamba align, bs 8, hash blocks of 2): the prompt prefilled
    in chunks, each chunk ending on a block end or the prompt's last hash boundary (34). The
    token counts of the state keys registered along the way."""
    manager = make_manager(40, FullAttentionSpec(block_size=8),
                           MambaSpec(block_size=8, mamba_cache_mode="align"),
                           prefix_cache_retention_interval=retention, hash_block_size=2)
    state = manager.coordinator.single_type_managers[1]
    request = make_request("r", list(range(prompt_len)), 2)
    keyed: set[int] = set()
    for n in chunks:
        assert manager.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
        keyed |= {b.block_hash_num_tokens for b in state.req_to_blocks["r"]
                  if b.block_hash is not None}
        keyed |= {copy.block_hash_num_tokens for _, copy in state._pending_cow_copies}
    return sorted(keyed)


@pytest.mark.parametrize("retention, keyed", [
    (None, [8, 16, 24, 32, 34]),  # dense: every chunk end, and the prompt's last hash boundary
    (0, [32, 34]),                # the replay boundary 34 falls back to the block end 32
    (16, [16, 32, 34]),           # segment ends every 16 tokens, and the replay boundary
    (24, [24, 32, 34]),
    (8, [8, 16, 24, 32, 34]),     # a segment of one block keeps every block
])
def test_state_blocks_keyed_at_kept_checkpoints(retention, keyed):
    """docs/spec.md §11.3: under a retention interval a state block keeps a key only at a
    segment end or at the caching request's replay boundary; the prompt's last hash boundary
    (a sub-block state) is registered whatever the interval."""
    assert _keyed_state_boundaries(retention) == keyed


def test_a_sibling_stops_at_the_junction_and_its_state_there_is_kept():
    """qwen3_5_retention's shape (full attention and a Mamba align group of bs 8, hash blocks
    of 2, retention 16), budget 32. `a`'s 40 tokens leave states at 32 and 38 only. `b` shares
    its first 28 tokens: full attention hits 24 (its last whole block), the state group
    nothing, so its lookup hits 0 with junction 24 (§6.3), which the driver writes into `b`.
    Its first chunk stops there instead of at 32, and the state block ending at 24 keeps its
    key though 24 ends no segment: `c`, sharing the same 28 tokens, hits 24 (§11.3)."""
    manager = make_manager(60, FullAttentionSpec(block_size=8),
                           MambaSpec(block_size=8, mamba_cache_mode="align"),
                           prefix_cache_retention_interval=16, hash_block_size=2)
    scheduler = Scheduler(manager, max_model_len=64, token_budget=32, max_running=4,
                          mamba_block_aligned_split=True)
    sample = lambda request: 999  # noqa: E731

    def scheduled(prompt_tail: list[int], rid: str) -> list[tuple[str, int, int]]:
        scheduler.add_request(make_request(rid, list(range(28)) + prompt_tail, 2, max_tokens=1))
        return scheduler.step(sample).scheduled

    scheduler.add_request(make_request("a", list(range(40)), 2, max_tokens=1))
    assert [scheduler.step(sample).scheduled for _ in range(3)] == [
        [("a", 32, 0)], [("a", 6, 0)], [("a", 2, 0)]]
    assert scheduled(list(range(200, 212)), "b") == [("b", 24, 0)]
    assert scheduler.running[0].shared_prefix_boundary == 24
    state = manager.coordinator.single_type_managers[1].req_to_blocks["b"]
    assert state[2].block_hash_num_tokens == 24
    assert scheduled(list(range(300, 312)), "c") == [("b", 8, 0), ("c", 8, 24)]


def test_replay_boundaries_as_vllm_computes_them():
    assert replay_boundaries(30, 8, use_eagle=False) == (29,)
    assert replay_boundaries(32, 8, use_eagle=True) == (16, 24)
    assert replay_boundaries(4, 8, use_eagle=True) == (0,)


@pytest.mark.parametrize("config, needle", [
    ({"num_blocks": 8, "groups": [{"kind": "full", "block_size": 4}],
      "prefix_cache_retention_interval": 8},
     "prefix_cache_retention_interval is set but this model has no sliding-window or Mamba KV "
     "cache group, so retention has no effect. Set it to 0 (it only applies to sliding-window "
     "and Mamba attention)."),
    (BUILTIN["gemma3_retention"][1].to_dict() | {"prefix_cache_retention_interval": -4},
     "prefix_cache_retention_interval (-4) must be non-negative and a multiple of "
     "scheduler_block_size (4)."),
    (BUILTIN["gemma3_retention"][1].to_dict() | {"prefix_cache_retention_interval": 6},
     "prefix_cache_retention_interval (6) must be non-negative and a multiple of "
     "scheduler_block_size (4)."),
    (BUILTIN["granite4"][1].to_dict() | {"prefix_cache_retention_interval": 12},
     "prefix_cache_retention_interval (12) must be non-negative and a multiple of "
     "scheduler_block_size (8)."),
], ids=["no-window", "negative", "not-a-multiple", "mamba-not-a-multiple"])
def test_config_refuses_what_vllm_refuses(config, needle):
    with pytest.raises(ConfigError) as err:
        Config.from_dict(config)
    assert needle in str(err.value)


def test_full_attention_alone_takes_retention_0():
    assert Config(8, (GroupConfig("full", 4),), prefix_cache_retention_interval=0)


def test_kvcache_refuses_with_vllm_message():
    with pytest.raises(ValueError, match=r"\(6\) must be non-negative and a multiple of "
                                         r"scheduler_block_size \(4\)"):
        make_manager(8, SlidingWindowSpec(block_size=4, sliding_window=8),
                     prefix_cache_retention_interval=6)
