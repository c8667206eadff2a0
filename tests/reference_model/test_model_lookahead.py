"""MTP / draft lookahead in the model (docs/spec.md §5.7): hits decided by comparing the tokens
after a block too, re-prefillable tokens left uncached, and the config's rule."""

from __future__ import annotations

import pytest
from rm_support import Runner, config, full

from kvfuzz.core.config import GroupConfig
from kvfuzz.core.configs import BUILTIN, builtin_config
from kvfuzz.core.errors import ConfigError


def _hit(m: Runner, rid: str, prompt: list[int]) -> int:
    m.add(rid, prompt)
    return m.run("get_computed_blocks", request_id=rid)["num_computed_tokens"]


def test_a_hit_compares_the_lookahead_tokens():
    m = Runner(config(16, full(4), num_hash_lookahead_tokens=2), "api")
    m.add("A", list(range(12)))
    m.admit("A", 12)
    # Blocks 0 and 1 are cached: block 2 lacks the two tokens after it.
    assert {len(key[2]) for key in m.snap.cache} == {4, 8}
    assert _hit(m, "B", list(range(12))) == 8
    assert _hit(m, "C", [0, 1, 2, 3, 9, 9, 9, 9, 9]) == 0
    assert _hit(m, "D", [0, 1, 2, 3, 4, 5, 9, 9, 9]) == 4


def test_the_reprefillable_tokens_are_not_cached():
    m = Runner(config(16, full(4), num_prefill_lookahead=3), "api")
    m.add("A", list(range(13)))
    m.admit("A", 9)  # 9 computed, the last 2 may be re-prefilled: 7 final
    assert {len(key[2]) for key in m.snap.cache} == {4}


def test_multi_module_mtp_needs_a_scheduler_block_as_large_as_its_lookahead():
    eagle = GroupConfig("full", 4, eagle=True)
    with pytest.raises(ConfigError, match=r"scheduler_block_size \(=4\) >= "
                                          r"num_speculative_tokens \(=5\)"):
        config(8, eagle, num_prefill_lookahead=5)
    config(8, full(4), num_prefill_lookahead=5)  # no EAGLE group: no rule
    with pytest.raises(ConfigError, match="num_hash_lookahead_tokens must be an int"):
        config(8, full(4), num_hash_lookahead_tokens=-1)


def test_a_hash_lookahead_with_the_eagle_drop_is_refused():
    """vLLM's Scheduler clears EAGLE's block drop when it hashes ahead (sched/scheduler.py:
    342-345 in 0.34.0): the pairing is refused, naming both knobs; either alone is taken."""
    with pytest.raises(ConfigError, match="use_eagle with num_hash_lookahead_tokens 1: "):
        config(8, full(4), use_eagle=True, num_hash_lookahead_tokens=1, num_prefill_lookahead=1)
    config(8, full(4), use_eagle=True, num_prefill_lookahead=1)
    config(8, GroupConfig("full", 4, eagle=True), num_hash_lookahead_tokens=1,
           num_prefill_lookahead=1)


@pytest.mark.parametrize("name", [n for n, (_, c) in BUILTIN.items() if c.num_prefill_lookahead])
def test_the_mtp_built_ins_are_the_engines_shapes(name):
    """As vLLM 0.34.0 builds an MTP manager with prefix caching: an EAGLE group (the drafter's
    layers, kv_cache_planning.py:1755-1761), and either hashes covering the prefill lookahead
    in place of the drop (config/vllm.py:633-654, sched/scheduler.py:342-345) or the drop with
    lookahead hashes off."""
    c = builtin_config(name)
    assert c.enable_caching and any(g.eagle for g in c.groups)
    assert c.num_hash_lookahead_tokens in (0, c.num_prefill_lookahead)
    assert c.use_eagle == (c.num_hash_lookahead_tokens == 0)


def test_the_driver_ends_no_chunk_inside_the_prefill_lookahead():
    m = Runner(config(16, full(4), num_prefill_lookahead=3,
                      scheduler={"token_budget": 9}), "scheduler")
    m.add("A", list(range(10)), max_tokens=1)
    assert m.run("step")["scheduled"] == [["A", 7, 0]]
