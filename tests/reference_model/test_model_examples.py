"""docs/spec.md §9 worked examples E1-E9, with exact block ids and free-queue orders."""

from __future__ import annotations

from rm_support import Runner, chunked, config, full, swa

PROMPT10 = list(range(10))


def key(group: int, tokens: list[int], salt: str | None = None):
    return (group, salt, tuple(tokens))


def e1_runner() -> Runner:
    m = Runner(config(10, full(4)), "api")
    assert m.snap.free_queue == tuple(range(1, 10))
    m.add("A", PROMPT10)
    assert m.run("get_computed_blocks", request_id="A") == {
        "block_ids": [[]],
        "num_computed_tokens": 0,
    }
    assert m.run("allocate_slots", request_id="A", num_new_tokens=10, use_lookup=True) == {
        "block_ids": [[1, 2, 3]]
    }
    return m


def test_e1_sharing_and_release_order():
    m = e1_runner()
    s = m.snap
    assert s.num_free_blocks == 6
    assert s.block_keys[1] == key(0, PROMPT10[:4]) and s.block_keys[2] == key(0, PROMPT10[:8])
    assert s.block_key_tokens[1:4] == (4, 8, None)
    assert s.requests["A"].num_cached_blocks == (2,)

    m.add("B", PROMPT10)
    assert m.run("get_computed_blocks", request_id="B") == {
        "block_ids": [[1, 2]],
        "num_computed_tokens": 8,
    }
    assert m.run("allocate_slots", request_id="B", num_new_tokens=2, use_lookup=True) == {
        "block_ids": [[4]]
    }
    assert m.probes[0].prediction == 1 and m.probes[0].outcome == "blocks"
    s = m.snap
    assert s.num_free_blocks == 5 and s.ref_cnt[1:5] == (2, 2, 1, 1)

    m.run("free", request_id="A")
    assert m.snap.free_queue == (3, 5, 6, 7, 8, 9)
    assert m.snap.ref_cnt[1:3] == (1, 1)
    m.run("free", request_id="B")
    assert m.snap.free_queue == (4, 3, 5, 6, 7, 8, 9, 2, 1)
    assert m.snap.requests["B"].status == "FINISHED_STOPPED"

    m.add("C", PROMPT10)
    assert m.admit("C", 2) == {"block_ids": [[4]]}
    assert m.probes[0].prediction == 3
    s = m.snap
    assert s.free_queue == (3, 5, 6, 7, 8, 9)
    assert s.requests["C"].tables == ((1, 2, 4),)


def test_e2_evictable_hits_counted():
    m = e1_runner()
    m.add("B", PROMPT10)
    m.admit("B", 2)
    m.run("free", request_id="A")
    m.run("free", request_id="B")
    m.add("D", list(range(100, 128)))  # 7 blocks: takes 4, 3, 5, 6, 7, 8, 9
    assert m.admit("D", 28) == {"block_ids": [[4, 3, 5, 6, 7, 8, 9]]}
    assert m.snap.free_queue == (2, 1)
    m.add("C", PROMPT10)
    assert m.run("get_computed_blocks", request_id="C")["block_ids"] == [[1, 2]]
    before = m.snap
    assert m.run("allocate_slots", request_id="C", num_new_tokens=2, use_lookup=True) is None
    assert [p.compared() for p in m.probes] == [("C", "capacity", 3)]
    assert m.snap == before


def test_e3_sliding_window_hit():
    m = Runner(config(20, swa(4, 8)), "api")
    prompt = list(range(16))
    m.add("P", prompt)
    assert m.admit("P", 16) == {"block_ids": [[1, 2, 3, 4]]}
    m.add("Q", prompt)
    assert m.run("get_computed_blocks", request_id="Q") == {
        "block_ids": [[0, 2, 3]],
        "num_computed_tokens": 12,
    }
    assert m.run("allocate_slots", request_id="Q", num_new_tokens=4, use_lookup=True) == {
        "block_ids": [[5]]
    }
    assert m.probes[0].prediction == 1  # b1, b2 held by P: E = 0
    assert m.snap.requests["Q"].tables == ((0, 2, 3, 5),)
    assert m.snap.requests["Q"].num_cached_blocks == (4,)


def test_e3_sliding_window_hit_on_free_blocks_counts_them():
    m = Runner(config(20, swa(4, 8)), "api")
    prompt = list(range(16))
    m.add("P", prompt)
    m.admit("P", 16)
    m.run("free", request_id="P")
    assert m.snap.free_queue == tuple(range(5, 20)) + (4, 3, 2, 1)
    m.add("Q", prompt)
    assert m.admit("Q", 4) == {"block_ids": [[5]]}
    assert m.probes[0].prediction == 3  # new 1 + E 2
    assert m.snap.free_queue == tuple(range(6, 20)) + (4, 1)


def test_e4_chunked_local_null_prefix_without_probe():
    m = Runner(config(20, chunked(4, 8)), "api")
    m.add("R", list(range(17)))
    assert m.run("get_computed_blocks", request_id="R") == {
        "block_ids": [[0, 0, 0, 0]],
        "num_computed_tokens": 16,
    }
    assert m.run("allocate_slots", request_id="R", num_new_tokens=1, use_lookup=True) == {
        "block_ids": [[1]]
    }
    assert m.probes[0].prediction == 1
    view = m.snap.requests["R"]
    assert view.tables == ((0, 0, 0, 0, 1),) and view.num_computed_tokens == 17


def test_e4_chunked_local_probes_current_chunk():
    m = Runner(config(20, chunked(4, 8)), "api")
    prompt = list(range(16))
    m.add("P", prompt)
    assert m.run("get_computed_blocks", request_id="P")["num_computed_tokens"] == 8  # §10.11
    m.run("allocate_slots", request_id="P", num_new_tokens=16)
    assert m.snap.requests["P"].tables == ((1, 2, 3, 4),)
    m.add("Q", prompt)
    # max_length 15: nulls for blocks 0-1, probe block 2 (hit).
    assert m.run("get_computed_blocks", request_id="Q") == {
        "block_ids": [[0, 0, 3]],
        "num_computed_tokens": 12,
    }
    m.add("S", prompt[:12] + [99, 99, 99, 99])
    # Block 2 is P's block 3 (tokens 0..11): S shares it.
    assert m.run("get_computed_blocks", request_id="S")["block_ids"] == [[0, 0, 3]]
    m.add("T", [7] + prompt[1:])
    assert m.run("get_computed_blocks", request_id="T") == {
        "block_ids": [[0, 0]],
        "num_computed_tokens": 8,
    }


def e5_runner() -> Runner:
    m = Runner(config(100, full(4), watermark=0.05, max_model_len=400), "api")
    m.add("A", list(range(364)))
    m.admit("A", 364)  # 91 blocks
    m.add("B", [1000, 1001, 1002, 1003])
    m.admit("B", 4)
    assert m.snap.num_free_blocks == 7
    m.add("W", list(range(2000, 2012)))
    return m


def test_e5_watermark_applies_to_waiting_requests():
    m = e5_runner()
    before = m.snap
    assert m.admit("W", 12) is None
    assert [p.compared() for p in m.probes] == [("W", "capacity", 3)]
    assert m.snap == before
    m.run("append_tokens", request_id="B", tokens=list(range(3000, 3012)))
    assert m.run("allocate_slots", request_id="B", num_new_tokens=12) == {
        "block_ids": [[93, 94, 95]]
    }
    assert m.snap.num_free_blocks == 4


def test_e5_watermark_ignored_without_scheduled_requests():
    m = e5_runner()
    m.run("get_computed_blocks", request_id="W")
    result = m.run(
        "allocate_slots",
        request_id="W",
        num_new_tokens=12,
        use_lookup=True,
        has_scheduled_reqs=False,
    )
    assert result == {"block_ids": [[93, 94, 95]]}


def e6_runner() -> Runner:
    m = Runner(config(64, full(32), swa(16, 16)), "api")
    prompt = list(range(100))
    m.add("P", prompt)
    assert m.run("allocate_slots", request_id="P", num_new_tokens=100) == {
        "block_ids": [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]
    }
    m.add("Q", prompt)
    return m


def test_e6_hybrid_hit_and_sparse_window_caching():
    m = e6_runner()
    s = m.snap
    # FA caches up to 96 (a multiple of sbs = 32): blocks 1, 2, 3.
    assert s.block_key_tokens[1:5] == (32, 64, 96, None)
    # SWA: need 1 < A/bs = 2 -> only odd block indices 1, 3, 5 get keys.
    assert s.block_key_tokens[5:12] == (None, 32, None, 64, None, 96, None)
    assert s.requests["P"].num_cached_blocks == (3, 6)
    assert m.run("get_computed_blocks", request_id="Q") == {
        "block_ids": [[1, 2, 3], [0, 0, 0, 0, 0, 10]],
        "num_computed_tokens": 96,
    }


def test_e6_window_miss_truncates_full_attention():
    m = e6_runner()
    m.run("evict_blocks", block_ids=[10])  # SWA block 5 (tokens 80-95)
    assert m.snap.requests["P"].num_cached_blocks == (3, 6)  # §10.24
    assert m.snap.block_keys[10] is None and m.snap.ref_cnt[10] == 1
    assert m.run("get_computed_blocks", request_id="Q") == {
        "block_ids": [[1, 2], [0, 0, 0, 8]],
        "num_computed_tokens": 64,
    }


def test_e7_salt_isolation():
    m = Runner(config(20, full(4)), "api")
    tokens = list(range(9))
    m.add("A", tokens, cache_salt="a")
    m.admit("A", 9)
    assert m.snap.block_keys[1] == key(0, tokens[:4], "a")
    m.add("B", tokens, cache_salt="b")
    assert m.run("get_computed_blocks", request_id="B")["num_computed_tokens"] == 0
    m.add("C", tokens)
    assert m.run("get_computed_blocks", request_id="C")["num_computed_tokens"] == 0
    m.add("D", tokens, cache_salt="a")
    assert m.run("get_computed_blocks", request_id="D") == {
        "block_ids": [[1, 2]],
        "num_computed_tokens": 8,
    }
    # "" counts as no salt.
    m.add("E", tokens, cache_salt="")
    m.admit("E", 9)
    m.add("F", tokens)
    assert m.run("get_computed_blocks", request_id="F")["num_computed_tokens"] == 8


def test_e8_reset_refusal():
    m = e1_runner()
    before = m.snap
    assert m.run("reset_prefix_cache") is False
    assert m.snap == before
    m.run("free", request_id="A")
    assert m.run("reset_prefix_cache") is True
    s = m.snap
    assert s.cache == {} and set(s.block_keys) == {None}
    assert s.free_queue == before.free_queue[:0] + (3, 4, 5, 6, 7, 8, 9, 2, 1)
    m.add("B", PROMPT10)
    assert m.run("get_computed_blocks", request_id="B")["num_computed_tokens"] == 0


def test_e9_partial_hit_and_copy_on_write():
    m = Runner(config(200, full(32), swa(16, 16), hash_block_size=16, partial_hits=True), "api")
    prompt = list(range(90))
    m.add("P", prompt)
    assert m.run("allocate_slots", request_id="P", num_new_tokens=90) == {
        "block_ids": [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    }
    s = m.snap
    assert s.block_key_tokens[1:4] == (32, 64, 80)
    assert s.block_keys[3] == key(0, prompt[:80])
    m.add("Q", prompt)
    assert m.run("get_computed_blocks", request_id="Q") == {
        "block_ids": [[1, 2, 3], [0, 0, 0, 0, 8]],
        "num_computed_tokens": 80,
    }
    assert m.run("allocate_slots", request_id="Q", num_new_tokens=10, use_lookup=True) == {
        "block_ids": [[10], [11]]
    }
    assert m.probes[0].prediction == 2 and m.probes[0].group_taken == (1, 1)
    s = m.snap
    q = s.requests["Q"]
    assert q.tables == ((1, 2, 10), (0, 0, 0, 0, 8, 11))
    assert s.ref_cnt[3] == 2 and s.ref_cnt[10] == 2
    assert s.pending_copies == ((3, 10),)
    assert q.num_cached_blocks[0] == 2 and q.partial_hit == (None, None)
    assert s.new_block_ids == (10,)
    assert m.run("take_new_block_ids") == [10]
    assert m.run("take_kv_cache_block_copies") == [[3, 10]]
    s = m.snap
    assert s.pending_copies == () and s.retained_copies == ((3, 10),) and s.new_block_ids == ()
    assert s.ref_cnt[3] == 2 and s.ref_cnt[10] == 2
    assert m.run("reset_prefix_cache") is False
    m.run("release_copies")
    s = m.snap
    assert s.ref_cnt[3] == 1 and s.ref_cnt[10] == 1 and s.retained_copies == ()
