"""Worked examples for vLLM mutants that raise on most inputs but answer wrongly on these.

docs/mutation.md, "Kills by a vLLM exception alone, the open ones (2026-12-07)": each trace
passes on kvcache and three-way with the installed vLLM, and a named check fires on it, at a
step where vLLM returns normally, once the mutant is written into vLLM 0.34.0.
"""

from __future__ import annotations

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import builtin_config
from kvfuzz.harness.executor import Execution
from tests.vllm.test_worked_examples import _add, _alloc, sides  # noqa: F401 (the fixture)


def _lookup(ex: Execution, rid: str) -> int:
    return ex.apply({"op": "get_computed_blocks", "request_id": rid})["num_computed_tokens"]


def test_a_coarse_block_cached_by_a_short_chunk_carries_its_own_key(sides):
    """`hybrid`: full attention (bs 8) hashed in 4-token blocks. The first 8-token chunk of a
    48-token prompt caches the full group's block 0 under the key of those 8 tokens, and a
    request sharing only them hits it. kv_cache_utils.py:1220 `//` → `|` makes the hash view's
    scale 12: block 0 is keyed by the 12th hash (48 tokens) without raising, and I5 sees a key
    covering 48 tokens on a block recording 8 (past this shape, every caching raises)."""
    ex = Execution(builtin_config("hybrid"), "api", sides)
    prompt = list(range(48))
    ex.apply(_add("a", prompt))
    _alloc(ex, "a", 8)
    block = ex.state.requests["a"].tables[0][0]
    assert ex.state.block_key_tokens[block] == 8
    ex.apply(_add("b", prompt[:8] + [99] * 4))
    assert _lookup(ex, "b") == 8


def test_a_positive_hit_limit_still_looks_up(sides):
    """A per-request prefix-cache hit limit: a positive one caps the hit, 0 turns the lookup
    off. kv_cache_manager.py:253 `!= 0` → `<= 0` raises a TypeError for every request without
    a limit; when every request carries one, a positive limit turns the lookup off (DIFF-result:
    0 cached tokens, the reference 8) and a zero one on."""
    ex = Execution(builtin_config("full"), "api", sides)
    if not ex.offers("prefix_cache_hit_limit"):
        pytest.skip("this vLLM has no per-request prefix-cache hit limit")
    prompt = list(range(12))
    ex.apply(_add("a", prompt, prefix_cache_hit_limit=63))
    assert _lookup(ex, "a") == 0
    _alloc(ex, "a", 12, use_lookup=True)
    ex.apply(_add("b", prompt, prefix_cache_hit_limit=63))
    assert _lookup(ex, "b") == 8
    ex.apply(_add("c", prompt, prefix_cache_hit_limit=0))
    assert _lookup(ex, "c") == 0


def test_a_retention_segment_keeps_only_its_end_state(sides):
    """`qwen3_5_retention`: Mamba align groups (bs 8) keeping one state per 16-token segment.
    A 63-token prompt computed as 16 then 24 tokens leaves the state at token 40 unkeyed in
    every state group: 40 is no segment end, nor the prompt's last hash boundary.
    single_type_kv_cache_manager.py:1596 `start + per` → `start ^ per` starts the second
    chunk's retention mask (cached blocks 2 to 5) at block -1: indexed from the mask's end, it
    marks blocks 2, 3 and 4 without raising, and RT1 sees the state at 40 keyed. (Where the
    mask is shorter than that start, it raises.)"""
    ex = Execution(builtin_config("qwen3_5_retention"), "api", sides)
    ex.apply(_add("a", list(range(63))))
    _alloc(ex, "a", 16)
    _alloc(ex, "a", 24)
    view = ex.state.requests["a"]
    for g in (1, 2, 3):
        assert ex.state.block_keys[view.tables[g][4]] is None


def test_a_connector_offer_past_a_sub_block_tail_drops_the_tail_block(sides):
    """Full attention and a Mamba align group of block size 2, hashed per token, with a KV
    connector: a prompt sharing 3 tokens with a finished one hits 3 (a sub-block tail of 1),
    and an offer of 4 external tokens cuts the hit back to 2, so each group keeps only the
    blocks below token 2. kv_cache_manager.py:850 `//` → `|` keeps `2 | 2` blocks: in the full
    group the shared tail block (the assertion beside it holds only for this block size and
    hit), in the state group the whole hit, and DIFF-state sees the shared blocks held. On the
    built-in configs (attention blocks of 4 or more) the same line fails that assertion."""
    config = Config(24, (GroupConfig("full", 2), GroupConfig("mamba", 2, mamba_cache_mode="align")),
                    max_model_len=32, hash_block_size=1, kv_connector=True)
    ex = Execution(config, "scheduler", sides)
    ex.apply(_add("a", [1, 2, 3, 4], max_tokens=1))
    for _ in range(4):
        ex.apply({"op": "step"})
    ex.apply(_add("b", [1, 2, 3, 9, 9, 9, 9, 9], max_tokens=1))
    loaded = ex.apply({"op": "load_remote", "request_id": "b", "num_external_tokens": 4})
    assert loaded == {"hit": 2, "external": 4, "diverged": False}
    assert [table[1:2] for table in ex.state.requests["b"].tables] == [(6,), (0,)]
