"""docs/spec.md §9 worked examples E1-E9 as traces through the one executor.

Every op runs in lockstep with the reference model, and every registered check (P1-P4, I1-I20,
state and transition) runs after every op, beside the exact block ids and free-queue orders
asserted here. Always on kvcache; three-way with the installed vLLM where it is importable (the
`vllm` parameter, run by .ci/run from the venv of ci/install-vllm.sh).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import builtin_config
from kvfuzz.harness.executor import Execution
from kvfuzz.harness.vllm_api import VllmUnsupported
from kvfuzz.harness.vllm_target import vllm_available


@pytest.fixture(
    params=[
        pytest.param(("kvcache",), id="kvcache"),
        pytest.param(
            ("kvcache", "vllm"),
            id="kvcache+vllm",
            marks=[
                pytest.mark.vllm,
                pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
            ],
        ),
    ]
)
def sides(request: pytest.FixtureRequest) -> tuple[str, ...]:
    return request.param


PROMPT10 = list(range(100, 110))


def _full(bs: int) -> GroupConfig:
    return GroupConfig("full", bs)


def _swa(bs: int, window: int) -> GroupConfig:
    return GroupConfig("sliding_window", bs, sliding_window=window)


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


def _lookup(ex: Execution, rid: str) -> dict[str, Any]:
    return ex.apply({"op": "get_computed_blocks", "request_id": rid})


def _alloc(ex: Execution, rid: str, n: int, **fields: Any) -> Any:
    return ex.apply({"op": "allocate_slots", "request_id": rid, "num_new_tokens": n, **fields})


def _admit(ex: Execution, rid: str, n: int | None = None, **fields: Any) -> Any:
    """Lookup, then allocate the rest of the prompt (or n tokens) with the hit."""
    hit = _lookup(ex, rid)["num_computed_tokens"]
    tokens = ex.state.requests[rid].num_tokens - hit if n is None else n
    return _alloc(ex, rid, tokens, use_lookup=True, **fields)


def _table(ex: Execution, rid: str, group: int = 0) -> tuple[int, ...] | None:
    return ex.state.requests[rid].tables[group]


def test_e1_e2_sharing_release_order_and_evictable_hits(sides):
    ex = Execution(Config(10, (_full(4),)), "api", sides)
    for rid in ("a", "b", "c", "d"):
        ex.apply(_add(rid, PROMPT10 if rid != "d" else list(range(28))))
    assert _admit(ex, "a") == {"block_ids": [[1, 2, 3]]}
    assert _lookup(ex, "b") == {"block_ids": [[1, 2]], "num_computed_tokens": 8}
    assert _alloc(ex, "b", 2, use_lookup=True) == {"block_ids": [[4]]}
    ex.apply({"op": "free", "request_id": "a"})
    ex.apply({"op": "free", "request_id": "b"})
    assert ex.state.free_queue == (4, 3, 5, 6, 7, 8, 9, 2, 1)
    # E2: the only free blocks are c's hit blocks; adopting them costs capacity.
    assert _admit(ex, "d") == {"block_ids": [[4, 3, 5, 6, 7, 8, 9]]}
    assert _admit(ex, "c") is None
    assert ex.state.free_queue == (2, 1)
    ex.apply({"op": "free", "request_id": "d"})
    assert _admit(ex, "c") == {"block_ids": [[9]]}
    assert _table(ex, "c") == (1, 2, 9)


def test_e3_sliding_window_hit(sides):
    ex = Execution(Config(16, (_swa(4, 8),), max_model_len=64), "api", sides)
    ex.apply(_add("a", list(range(16))))
    ex.apply(_add("b", list(range(16))))
    _admit(ex, "a")
    a_table = _table(ex, "a")
    hit = _lookup(ex, "b")
    assert hit == {"block_ids": [[0, a_table[1], a_table[2]]], "num_computed_tokens": 12}
    _alloc(ex, "b", 4, use_lookup=True)
    assert _table(ex, "b")[:3] == (0, a_table[1], a_table[2])


def test_e4_chunked_local_null_prefix_hit(sides):
    ex = Execution(Config(12, (GroupConfig("chunked_local", 4, attention_chunk_size=8),)),
                   "api", sides)
    ex.apply(_add("a", list(range(17))))
    assert _lookup(ex, "a") == {"block_ids": [[0, 0, 0, 0]], "num_computed_tokens": 16}
    _alloc(ex, "a", 1, use_lookup=True)
    assert len(_table(ex, "a")) == 5


def test_e5_watermark_applies_to_admission_only(sides):
    ex = Execution(Config(100, (_full(4),), max_model_len=512, watermark=0.05), "api", sides)
    ex.apply(_add("filler", list(range(364))))
    ex.apply(_add("r", list(range(1000, 1016))))
    ex.apply(_add("w", list(range(2000, 2012))))
    _alloc(ex, "filler", 364)
    _alloc(ex, "r", 4)
    assert ex.state.num_free_blocks == 7
    assert _alloc(ex, "w", 12, has_scheduled_reqs=True) is None  # 3 + 5 > 7
    assert _alloc(ex, "r", 12) is not None  # running: 3 <= 7
    assert _alloc(ex, "w", 12, has_scheduled_reqs=False) is not None


def test_e6_hybrid_fixed_point(sides):
    ex = Execution(Config(64, (_full(32), _swa(16, 16)), max_model_len=256), "api", sides)
    prompt = list(range(112))
    ex.apply(_add("a", prompt))
    ex.apply(_add("b", prompt))
    _admit(ex, "a")
    assert _lookup(ex, "b")["num_computed_tokens"] == 96
    ex.apply({"op": "evict_blocks", "block_ids": [_table(ex, "a", 1)[5]]})
    hit = _lookup(ex, "b")
    assert hit["num_computed_tokens"] == 64
    assert [len(ids) for ids in hit["block_ids"]] == [2, 4]


def test_eagle_drop_verified_at_a_longer_candidate_holds_at_a_shorter_one(sides):
    """The hybrid fixed point's EAGLE bookkeeping (docs/mutation.md, the survivors at
    `new_hit_length < curr_hit_length`): only a search that shortens the candidate voids the
    drops verified before it. Windows of one, one and two blocks; the second window loses
    block 1, the third block 2. Round 1 drops everywhere and the third window cuts the
    candidate to 4; in round 2 the first window's search keeps 4, so the second window's drop,
    verified at 12, still stands and the hit is 4 (clearing it would re-drop and miss block 1)."""
    groups = (_full(4), _swa(4, 4), _swa(4, 5), _swa(4, 8))
    ex = Execution(Config(32, groups, max_model_len=48, use_eagle=True), "api", sides)
    prompt = list(range(1, 17))
    ex.apply(_add("a", prompt))
    _admit(ex, "a")
    holes = [_table(ex, "a", 2)[1], _table(ex, "a", 3)[2]]
    ex.apply({"op": "free", "request_id": "a"})
    ex.apply({"op": "evict_blocks", "block_ids": holes})
    ex.apply(_add("q", prompt))
    hit = _lookup(ex, "q")
    assert hit["num_computed_tokens"] == 4
    assert [len(ids) for ids in hit["block_ids"]] == [1, 1, 1, 1]


def test_a_resumed_request_reserves_its_checkpoint_at_its_prefill_end(sides):
    """Sparse retention (0) with prefill checkpoints: only the chunk reaching the prefill end
    `max(prompt, num_tokens - 1)` reserves one (docs/spec.md §11.6). A 10-token prompt with 2
    outputs, preempted, comes back in one 11-token chunk, one short of its end: each state
    group reserves its checkpoint column, so no column of the chunk is a null block
    (docs/mutation.md, survivor #14: `num_tokens // 1` there reserves none)."""
    ex = Execution(builtin_config("qwen3_5_checkpoint_replay"), "api", sides)
    ex.apply(_add("a", list(range(1, 11))))
    _alloc(ex, "a", 10)
    ex.apply({"op": "append_tokens", "request_id": "a", "tokens": [11, 12]})
    ex.apply({"op": "free", "request_id": "a", "preempt": True})
    taken = _alloc(ex, "a", 11)["block_ids"]
    assert [len(ids) for ids in taken] == [2, 4, 4, 4]
    assert all(0 not in _table(ex, "a", g) for g in (1, 2, 3))


def test_external_tokens_inside_a_partial_hit_block_take_no_block(sides):
    """A sub-block (Tier B) hit of 4 tokens in an 8-token block, then 2 external (connector)
    tokens: all 6 lie in the hit's block, so the full group takes no block for them, only the
    copy-on-write of the shared tail (docs/mutation.md, survivor #15: `max(1, ...)` there takes
    one more)."""
    config = Config(24, (_full(8), _swa(4, 4)), max_model_len=64, partial_hits=True,
                    kv_connector=True)
    ex = Execution(config, "api", sides)
    ex.apply(_add("a", [0, 1, 2, 3, 4]))
    _alloc(ex, "a", 5)
    ex.apply({"op": "free", "request_id": "a"})
    ex.apply(_add("b", [0, 1, 2, 3] + [9] * 6))
    assert _lookup(ex, "b")["num_computed_tokens"] == 4
    _alloc(ex, "b", 1, use_lookup=True, num_external_computed_tokens=2)
    assert len(_table(ex, "b", 0)) == 1
    assert ex.state.num_free_blocks == 19


def test_an_eagle_state_keyed_at_a_block_end_is_no_partial_tail(sides):
    """EAGLE on Mamba align groups with retention 0: a 10-token prompt's last hash boundary
    steps down to 8, a block end that the replay boundaries (0 with EAGLE) do not retain, so
    the state is keyed there by the partial-tail path; at a block end that is a whole block,
    not a tail for copy-on-write (docs/mutation.md, survivor #20: `num_tokens * block_size`
    there records one)."""
    config = replace(builtin_config("qwen3_next_eagle"), prefix_cache_retention_interval=0)
    ex = Execution(config, "api", sides)
    ex.apply(_add("a", [0, 3, 0, 1, 2, 3, 2, 3, 1, 3]))
    _alloc(ex, "a", 8)
    view = ex.state.requests["a"]
    assert view.partial_hit == (None,) * 4
    assert view.num_cached_blocks == (1,) * 4


def test_a_window_run_that_ends_off_the_alignment_is_no_hit(sides):
    """A window (bs 4, window 8) beside full attention (bs 8): a lookup whose window run
    would end on an odd 4-token block is cut back to the 8-token alignment (I12 sees a hit off
    it). docs/mutation.md, vLLM 0.33.0's EAGLE lines: the skip test of the run's last block
    made a no-op (`== 0` → `< 0`, `!=` → `==` or `>=`, `%` → `>>`, `!= 0` → `< 0`) fails here."""
    config = Config(17, (_full(8), _swa(4, 8)), max_model_len=64)
    ex = Execution(config, "scheduler", sides)
    prompt = [3, 1, 3, 2, 0, 2, 3, 3, 1, 3, 3, 1, 3, 3, 2, 1, 2, 3, 0, 1, 1, 1, 2, 2, 3]
    longer = prompt + [3, 1, 0, 0, 3, 2, 0, 2, 0, 0, 2, 1]
    ex.apply(_add("r2", prompt, max_tokens=2))
    ex.apply(_add("r3", longer, cache_salt="a", max_tokens=5))
    for _ in range(3):
        ex.apply({"op": "step"})
    ex.apply(_add("r5", prompt, max_tokens=1))
    for _ in range(3):
        ex.apply({"op": "step"})
    ex.apply(_add("r6", prompt, cache_salt="a", max_tokens=1))
    ex.apply({"op": "step"})
    ex.apply({"op": "finish", "request_id": "r5"})
    scheduled = ex.apply({"op": "step"})["scheduled"]
    assert all(hit % 8 == 0 for _, _, hit in scheduled)


def test_a_window_block_a_quarter_of_the_alignment_ends_its_run_at_the_hit(sides):
    """Full attention (bs 16) beside a window (bs 4, window 8): the prompt's 16 tokens are
    cached, and a longer prompt hits all 16 (the window's run ends on block 3, at the
    alignment). docs/mutation.md, vLLM 0.33.0's EAGLE lines: the run's end `i + 1` made
    `i - 1`, which agrees whenever two window blocks make the alignment, fails here."""
    config = Config(8, (_full(16), _swa(4, 8)), max_model_len=64)
    ex = Execution(config, "scheduler", sides)
    prompt = [2, 2, 1, 2, 1, 3, 2, 1, 3, 1, 2, 2, 2, 1, 1, 2]
    ex.apply(_add("r1", prompt, cache_salt="a", max_tokens=1))
    ex.apply({"op": "step"})
    ex.apply(_add("r2", prompt + [3], cache_salt="a", max_tokens=1))
    assert ex.apply({"op": "step"})["scheduled"] == [["r2", 1, 16]]


def test_e7_e8_salt_isolation_and_reset_refusal(sides):
    ex = Execution(Config(16, (_full(4),)), "api", sides)
    ex.apply(_add("a", PROMPT10, cache_salt="a"))
    ex.apply(_add("b", PROMPT10, cache_salt="b"))
    _admit(ex, "a")
    assert _lookup(ex, "b")["num_computed_tokens"] == 0
    assert ex.apply({"op": "reset_prefix_cache"}) is False
    ex.apply({"op": "free", "request_id": "a"})
    assert ex.apply({"op": "reset_prefix_cache"}) is True
    ex.apply(_add("c", PROMPT10, cache_salt="a"))
    assert _lookup(ex, "c")["num_computed_tokens"] == 0


def test_e9_partial_hit_and_copy_on_write(sides):
    config = Config(200, (_full(32), _swa(16, 16)), max_model_len=256, partial_hits=True)
    ex = Execution(config, "api", sides)
    prompt = list(range(90))
    ex.apply(_add("p", prompt))
    ex.apply(_add("q", prompt))
    assert _admit(ex, "p") == {"block_ids": [[1, 2, 3], [4, 5, 6, 7, 8, 9]]}
    assert _lookup(ex, "q") == {"block_ids": [[1, 2, 3], [0, 0, 0, 0, 8]],
                                "num_computed_tokens": 80}
    assert _alloc(ex, "q", 10, use_lookup=True) == {"block_ids": [[10], [11]]}
    assert ex.state.requests["q"].tables == ((1, 2, 10), (0, 0, 0, 0, 8, 11))
    assert ex.state.pending_copies == ((3, 10),)
    assert ex.apply({"op": "take_kv_cache_block_copies"}) == [[3, 10]]
    assert ex.apply({"op": "take_new_block_ids"}) == [10]
    assert ex.state.ref_cnt[3] == 2 and ex.state.ref_cnt[10] == 2
    ex.apply({"op": "release_copies"})
    assert ex.state.ref_cnt[3] == 1 and ex.state.ref_cnt[10] == 1


def test_multi_module_mtp_caches_no_re_prefillable_token_of_the_eagle_group(sides):
    """Multi-module MTP (prefill lookahead 2) with EAGLE's block drop (lookahead hashes off) on
    a Mamba align hybrid (hash blocks of 2, blocks of 8): after a whole 8-token prompt, the
    drafter's KV at token 7 may be re-prefilled, so the EAGLE group (full attention) caches 7
    tokens and keys nothing, while the state group keys its 8-token state (docs/mutation.md,
    the 200-mutant measure: `cached > 0` → `<= 0` in the hybrid coordinator's cacheable
    tokens keys the full group's block too)."""
    try:
        ex = Execution(builtin_config("qwen3_next_mtp_eagle"), "api", sides)
    except VllmUnsupported as exc:  # a release without what the config needs
        pytest.skip(str(exc))
    ex.apply(_add("a", [5, 6, 7, 8, 1, 2, 3, 4], max_tokens=1))
    _alloc(ex, "a", 8)
    full, state = _table(ex, "a", 0)[0], _table(ex, "a", 1)[0]
    assert ex.state.block_keys[full] is None
    assert ex.state.block_key_tokens[state] == 8


def test_a_partial_key_promoted_by_the_hash_lookahead_replaces_the_shorter_one(sides):
    """Hash blocks of 2 covering the next 2 tokens (qwen3_next_mtp, full bs 8): a 7-token
    prompt's tail entry wants 6 tokens, but its prefill hashes only 4, so the block is keyed
    at 4; the first output hashes 6, and the block is promoted: the 6-token key replaces the
    4-token one (vLLM 0.34.0 block_pool.py:521-528; docs/mutation.md, S32: `n * hbs` → `n -
    hbs` keeps the 4-token key as the primary and files the 6-token one beside it)."""
    try:
        ex = Execution(builtin_config("qwen3_next_mtp"), "api", sides)
    except VllmUnsupported as exc:  # 0.32's manager has no hash lookahead
        pytest.skip(str(exc))
    ex.apply(_add("a", list(range(1, 8)), max_tokens=4))
    _alloc(ex, "a", 7)
    block = _table(ex, "a", 0)[0]
    assert ex.state.block_key_tokens[block] == 4
    ex.apply({"op": "append_tokens", "request_id": "a", "tokens": [50]})
    _alloc(ex, "a", 1)
    assert ex.state.block_key_tokens[block] == 6
    assert block not in ex.state.extra_keys
    assert ex.state.block_keys[block] is not None
    assert [ids for key, ids in ex.state.cache.items() if key[0] == 0] == [(block,)]


def test_a_state_block_as_small_as_the_hash_block_is_keyed_on_the_hit_alignment(sides):
    """EAGLE on full attention (bs 16) beside a Mamba align group (bs 8), hash blocks of 8:
    no sub-block hits (the state block is not above the hash block), so hits land on 16 and an
    8-token prompt's state is not keyed (docs/mutation.md, the 200-mutant measure: `block_size
    > hash_block_size` → `>=` in `partial_hash_hits_enabled`, and the hybrid coordinator's
    EAGLE cap taken below the alignment, `cached > 0` → `> -1`, key it)."""
    ex = Execution(builtin_config("full16_mamba8_align"), "api", sides)
    ex.apply(_add("a", [2, 1, 3, 3, 2, 2, 0, 1], max_tokens=1))
    _alloc(ex, "a", 8)
    assert [ex.state.block_keys[_table(ex, "a", g)[0]] for g in (0, 1)] == [None, None]


def test_a_resumed_request_keys_its_state_at_a_block_end_checkpoint(sides):
    """Prefill checkpoints without retention: a 6-token prompt with 4 outputs, preempted,
    comes back in one 9-token chunk; its checkpoint lies on the block end at token 8, not the
    prompt's, and without retention every state is kept, so each state group keys it there
    (docs/mutation.md, the 200-mutant measure: `position % block_size == 0` → `*` there leaves
    it unkeyed)."""
    ex = Execution(builtin_config("qwen3_5_checkpoint"), "api", sides)
    ex.apply(_add("a", list(range(1, 7)), max_tokens=8))
    _alloc(ex, "a", 6)
    ex.apply({"op": "append_tokens", "request_id": "a", "tokens": [50, 51, 52, 53]})
    ex.apply({"op": "free", "request_id": "a", "preempt": True})
    _alloc(ex, "a", 9)
    keyed = [b for g in (1, 2, 3) for b in _table(ex, "a", g) if ex.state.block_key_tokens[b] == 8]
    assert len(keyed) == 3


def test_a_one_token_state_is_keyed_with_hash_blocks_of_one(sides):
    """Mamba align beside full attention (bs 4) with hash blocks of 1: a 2-token prompt's
    first step stops at its last hash boundary, token 1, and the state group keys its 1-token
    state there (docs/mutation.md, the 200-mutant measure: the partial tail's guard
    `num_tokens <= 0` → `<= 1` leaves it unkeyed)."""
    config = Config(40, (_full(4), GroupConfig("mamba", 4, mamba_cache_mode="align")),
                    max_model_len=64, hash_block_size=1)
    ex = Execution(config, "scheduler", sides)
    ex.apply(_add("r", [3, 2], max_tokens=1))
    ex.apply({"op": "step"})
    assert ex.state.block_key_tokens[_table(ex, "r", 1)[0]] == 1
