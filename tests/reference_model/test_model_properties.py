"""Random traces through apply(): the model's snapshots, results and probes keep SPEC §8's
invariants (partition, free count, map consistency, content of cached blocks, cleanup, hit
bounds, predictor exactness)."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from rm_random import random_prompt, random_run
from rm_support import Runner, chunked, config, full, swa

from harness.config import Config, GroupConfig, SchedulerConfig
from harness.snapshot import Snapshot

CONFIGS = [
    config(16, full(4)),
    config(16, swa(4, 8)),
    config(16, chunked(4, 8)),
    config(24, full(8), swa(4, 8)),
    config(40, full(32), swa(16, 16), hash_block_size=16, partial_hits=True),
    config(40, full(16), swa(8, 20), hash_block_size=8, partial_hits=True, use_eagle=True),
    config(24, full(4), full(8)),
    config(16, full(4), enable_caching=False),
    config(16, full(4), GroupConfig("cross", 4), enable_caching=False),
    config(16, full(4), use_eagle=True),
    config(24, full(8), swa(4, 8), use_eagle=True),
    config(24, swa(4, 6, extra=2), max_model_len=64),
    config(30, full(8), swa(4, 8), chunked(8, 16)),
    config(20, full(4), watermark=0.1),
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_snapshot(cfg: Config, s: Snapshot, tokens: dict[str, tuple[str | None, list[int]]]):
    n = s.num_blocks
    # Free queue and partition (I1, I4).
    assert len(set(s.free_queue)) == len(s.free_queue) == s.num_free_blocks
    assert 0 not in s.free_queue and all(0 < b < n for b in s.free_queue)
    assert s.linked == frozenset(s.free_queue)
    assert list(s.ref_cnt) == s.holders() and s.ref_cnt[0] == 0
    for b in range(1, n):
        assert (b in s.free_set()) == (s.ref_cnt[b] == 0), b
    # Map consistency (I5); a key fingerprints exactly its recorded token count.
    for key, blocks in s.cache.items():
        assert blocks and len(set(blocks)) == len(blocks)
        for b in blocks:
            assert b != 0 and (s.block_keys[b] == key or key in s.extra_keys.get(b, ()))
    for b in range(n):
        primary = s.block_keys[b]
        assert (primary is None) == (s.block_key_tokens[b] is None)
        if primary is not None:
            assert b in s.cache[primary] and s.block_key_tokens[b] == len(primary[2])
        for extra in s.extra_keys.get(b, ()):
            assert primary is not None and b in s.cache[extra]
    # Tables: one group per block, no duplicates (I3); content of cached blocks (I11);
    # cleanup (I16); num_cached_block bound (I15).
    group_of: dict[int, int] = {}
    for rid, view in s.requests.items():
        tracked = view.tables[0] is not None
        assert tracked == (view.status == "RUNNING"), (rid, view)
        assert all((t is not None) == tracked for t in view.tables)
        if not tracked:
            assert set(view.num_cached_blocks) == {None} and set(view.partial_hit) == {None}
            continue
        salt, toks = tokens[rid]
        for g, table in enumerate(view.tables):
            real = [b for b in table if b != 0]
            assert len(set(real)) == len(real)
            cached = view.num_cached_blocks[g]
            assert cached is None or cached <= len(table)
            for b in real:
                assert group_of.setdefault(b, g) == g
                for key in [s.block_keys[b], *s.extra_keys.get(b, ())]:
                    if key is not None:
                        assert key[0] == g and key[1] == salt
                        assert key[2] == tuple(toks[: len(key[2])]), (rid, b, key)
    pairs = s.pending_copies + s.retained_copies
    assert all(s.ref_cnt[src] >= 1 and s.ref_cnt[dst] >= 1 for src, dst in pairs)


def check_step(cfg: Config, m: Runner, op: dict[str, Any], result: Any, s: Snapshot):
    obs = m.model.observations()
    assert obs.pool_shortages == []
    for probe in obs.allocations:
        if probe.outcome == "blocks":
            assert probe.free_before - probe.free_after == probe.prediction  # I8
        if probe.outcome in ("gate", "error"):
            assert probe.prediction is None
    if op["op"] == "get_computed_blocks":
        hit, lists = result["num_computed_tokens"], result["block_ids"]
        view = s.requests[op["request_id"]]
        assert 0 <= hit <= view.num_tokens - 1 and hit % cfg.alignment_tokens == 0  # I12
        for g, lst in zip(cfg.groups, lists):
            assert len(lst) == cdiv(hit, g.block_size)
            if g.kind == "full":
                assert 0 not in lst


def run_checked(cfg: Config, seed: int, n_ops: int) -> int:
    """Run a random trace, checking after every op; returns the number of CoW pairs seen."""
    m = Runner(cfg, "api")
    tokens: dict[str, tuple[str | None, list[int]]] = {}
    copies = 0
    for op, result in random_run(m, random.Random(seed), n_ops):
        if op["op"] == "add_request":
            tokens[op["request_id"]] = (op.get("cache_salt") or None, list(op["prompt"]))
        elif op["op"] == "append_tokens":
            tokens[op["request_id"]][1].extend(op["tokens"])
        s = m.snap
        check_snapshot(cfg, s, tokens)
        check_step(cfg, m, op, result, s)
        copies += len(s.pending_copies)
    return copies


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), index=st.integers(0, len(CONFIGS) - 1))
def test_random_api_traces_keep_invariants(seed: int, index: int):
    run_checked(CONFIGS[index], seed, 120)


def test_random_traces_reach_copy_on_write():
    """The CoW path is exercised by the random traces (guards the property test's reach)."""
    assert sum(run_checked(CONFIGS[4], seed, 120) for seed in range(20)) > 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), index=st.integers(0, len(CONFIGS) - 1))
def test_random_scheduler_traces_keep_invariants(seed: int, index: int):
    rng = random.Random(seed)
    base = CONFIGS[index]
    cfg = base.replace(
        scheduler=SchedulerConfig(
            policy=rng.choice(["fcfs", "priority"]),
            token_budget=rng.choice([4, 16, 32]),
            max_running=rng.choice([1, 2, 4]),
            chunked_prefill=rng.random() < 0.7,
            full_sequence_must_fit=rng.random() < 0.3,
            num_lookahead_tokens=rng.choice([0, 0, 2]),
            reserved_blocks=rng.choice([0, 0, 1]),
        )
    )
    m = Runner(cfg, "scheduler")
    tokens: dict[str, tuple[str | None, list[int]]] = {}
    for sample in range(80):
        choice = rng.random()
        if choice < 0.25 and len(tokens) < 8:
            rid = f"r{len(tokens)}"
            prompt = random_prompt(rng, 30)
            m.add(rid, prompt, priority=rng.randint(0, 3), max_tokens=rng.randint(1, 6),
                  num_encoder_tokens=rng.choice([0, 5]))
            tokens[rid] = (None, prompt)
        elif choice < 0.3 and tokens:
            m.run(rng.choice(["abort", "finish"]), request_id=rng.choice(list(tokens)))
        else:
            before = {r: v.num_tokens for r, v in m.snap.requests.items()}
            result = m.run("step", sample=sample)
            assert all(n >= 1 and hit >= 0 for _, n, hit in result["scheduled"])
            for r, view in m.snap.requests.items():
                if view.num_tokens == before[r] + 1:
                    tokens[r][1].append((sample + before[r]) % cfg.scheduler.vocab_size)
        s = m.snap
        assert all(len(tokens[r][1]) == v.num_tokens for r, v in s.requests.items())
        check_snapshot(cfg, s, tokens)
        assert m.model.observations().pool_shortages == []
        for probe in m.model.observations().allocations:
            if probe.outcome == "blocks":
                assert probe.free_before - probe.free_after == probe.prediction
        assert set(s.waiting).isdisjoint(s.running)
        assert len(s.running) <= cfg.scheduler.max_running
        for r, view in s.requests.items():
            in_queue = r in s.waiting or r in s.running
            assert in_queue != view.status.startswith("FINISHED")
            if r in s.waiting:
                assert view.status in ("WAITING", "PREEMPTED")
                assert view.num_computed_tokens == 0  # I17
            if r in s.running:
                assert view.status == "RUNNING"
