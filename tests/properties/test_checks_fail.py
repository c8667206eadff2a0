"""Every registered check, seen failing on a planted violation and passing on the real state.

The base states come from short kvcache runs; each case plants one violation into a copy of
the snapshot (or the op's result / observations) and asserts that the check names it.
"""

import dataclasses

import pytest

from kvfuzz.core.config import Config, GroupConfig, SchedulerConfig
from kvfuzz.harness.executor import Execution
from kvfuzz.core.sides import (
    AllocationProbe, CachedReport, CachedTokensProbe, ForwardPass, KvEvent, Observations,
    take_events_result,
)
from kvfuzz.properties import REGISTRY, CheckContext

# Checks registered by user plugins (`--kvfuzz-plugin`) bring no planted violation here.
BUILTIN = [c.name for c in REGISTRY if c.builtin]

FULL = Config(12, (GroupConfig("full", 4),), max_model_len=64)
WINDOW = Config(12, (GroupConfig("sliding_window", 4, sliding_window=4),), max_model_len=64)
MAMBA = Config(12, (GroupConfig("full", 4), GroupConfig("mamba", 4, num_speculative_blocks=1)),
               max_model_len=64, enable_caching=False)
ALIGN = Config(12, (GroupConfig("mamba", 4, mamba_cache_mode="align"),), max_model_len=64)
ENCODER_ONLY = Config(12, (GroupConfig("mamba", 64), GroupConfig("encoder_only", 4)),
                      max_model_len=64, enable_caching=False,
                      scheduler=SchedulerConfig(chunked_prefill=False))
RETAINED = Config(12, (GroupConfig("sliding_window", 4, sliding_window=5),), max_model_len=64,
                  prefix_cache_retention_interval=0)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def _run(config, ops):
    """Snapshots after every op of a kvcache run, with the execution."""
    execution = Execution(config, "api", ["kvcache"], model=False,
                          checks=[REGISTRY.get(name) for name in BUILTIN])
    snaps = [execution.targets[0].snapshot]
    for op in ops:
        execution.apply(op)
        snaps.append(execution.targets[0].snapshot)
    return execution, snaps


@pytest.fixture(scope="module")
def base():
    """r0 and r1 share two cached blocks; r2 was freed (one cached, one uncached free)."""
    return _run(FULL, [
        {"op": "add_request", "request_id": "r0", "prompt": PROMPT},
        {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 9},
        {"op": "add_request", "request_id": "r1", "prompt": PROMPT, "cache_salt": "s"},
        {"op": "add_request", "request_id": "r2", "prompt": PROMPT},
        {"op": "get_computed_blocks", "request_id": "r2"},
        {"op": "allocate_slots", "request_id": "r2", "num_new_tokens": 1, "use_lookup": True},
        {"op": "add_request", "request_id": "r3", "prompt": [5, 5, 5, 5, 5]},
        {"op": "allocate_slots", "request_id": "r3", "num_new_tokens": 5},
        {"op": "free", "request_id": "r3"},
    ])


def _ctx(execution, op=None, result=None, observations=None, config=None):
    return CheckContext(config or execution.config, "api", 0, op or {"op": "noop"}, result,
                        observations or Observations(), execution.requests, {})


def _probe(**kwargs):
    fields = {"request_id": "r0", "outcome": "blocks", "prediction": 2, "free_before": 5,
              "free_after": 3, "group_predictions": (2,), "group_taken": (2,)}
    fields.update(kwargs)
    return Observations(allocations=[AllocationProbe(**fields)])


def _view(snap, rid, **changes):
    views = dict(snap.requests)
    views[rid] = dataclasses.replace(views[rid], **changes)
    return dataclasses.replace(snap, requests=views)


def _with(snap, **changes):
    return dataclasses.replace(snap, _derived={}, **changes)


def _cases(execution, snaps):
    s = snaps[-1]
    prev = snaps[-2]
    held = next(b for b in range(1, s.num_blocks) if s.ref_cnt[b] == 2)
    r0_table = s.requests["r0"].tables[0]
    cached_free = next(b for b in s.free_queue if s.block_keys[b] is not None)
    uncached_free = next(b for b in s.free_queue if s.block_keys[b] is None)
    lookup = {"op": "get_computed_blocks", "request_id": "r1"}
    refcnt = list(s.ref_cnt)
    refcnt[held] += 1
    return {
        "P1": (prev, s, _ctx(execution, observations=_probe(free_after=4))),
        "P2": (s, _with(s, ref_cnt=tuple(refcnt)), _ctx(execution)),
        "P3": (s, _with(s, free_queue=s.free_queue + (held,), linked=s.linked | {held},
                        num_free_blocks=s.num_free_blocks + 1), _ctx(execution)),
        "P4": (prev, s, _ctx(execution, observations=Observations(
            pool_shortages=["Cannot get 3 free blocks from the pool"]))),
        "P5": (s, s, _ctx(execution, observations=Observations(
            cached_token_probes=[CachedTokensProbe("r1", 8, 4)]))),
        "I8": (prev, s, _ctx(execution, observations=_probe(free_after=1, free_before=3,
                                                          reserved_blocks=2))),
        "I1": (s, _with(s, linked=s.linked - {s.free_queue[0]}), _ctx(execution)),
        "I3": (s, _view(s, "r0", tables=(r0_table + (r0_table[0],),)), _ctx(execution)),
        "I4": (s, _with(s, num_free_blocks=s.num_free_blocks - 1), _ctx(execution)),
        "I5": (s, _with(s, cache={**s.cache, s.block_keys[held]: (held, uncached_free)}),
               _ctx(execution)),
        "H1": (s, _with(s, hash_collisions=("hash 00ff… fingerprints two prefixes",)),
               _ctx(execution)),
        "I6": (s, _with(s, block_keys=tuple(None if b == held else k
                                            for b, k in enumerate(s.block_keys)),
                        block_key_tokens=tuple(None if b == held else t
                                               for b, t in enumerate(s.block_key_tokens))),
               _ctx(execution)),
        "I7": (s, _with(s, free_queue=(cached_free,) + tuple(
            b for b in s.free_queue if b != cached_free)), _ctx(execution)),
        "I9": (s, _with(s, num_free_blocks=s.num_free_blocks - 1), _ctx(execution, op=lookup)),
        "I10": (s, _with(s, ref_cnt=tuple(refcnt)),
                _ctx(execution, op={"op": "free", "request_id": "r0"},
                     result={"error": "ValueError"})),
        "I11": _write_into_cached(execution, snaps),
        "I12": (s, s, _ctx(execution, op=lookup,
                           result={"block_ids": [[r0_table[0]]], "num_computed_tokens": 6})),
        "I13": (s, s, _ctx(execution, op=lookup,
                           result={"block_ids": [[r0_table[0]]], "num_computed_tokens": 4})),
        "I14": (s, _view(s, "r0", tables=((r0_table[1],) + r0_table[1:],)), _ctx(execution)),
        "I15": (s, _view(s, "r0", num_cached_blocks=(len(r0_table) + 1,)), _ctx(execution)),
        "I16": (s, _view(s, "r3", tables=((6,),)), _ctx(execution)),
        "I17": (s, _view(s, "r0", num_computed_tokens=40), _ctx(execution)),
        # r3 (freed) aborted while loading, its load ended, yet it holds a block (vLLM #46283).
        "C1": (s, _view(s, "r3", status="FINISHED_ABORTED", tables=((6,),)), _ctx(execution)),
        "I18": _window_left_live(),
        "S1": _state_block_dropped(),
        "EO1": _encoder_only_block_held(),
        "RT1": _window_key_off_boundary(),
        "S2": _state_read_unwritten(),
        "S3": (s, _with(s, pending_copies=((cached_free, held),)), _ctx(execution)),
        "F1": _evict_first_queued_at_tail(),
        # A step in flight reads a block that is back in the free queue.
        "IF1": (_with(s, in_flight=((1, (uncached_free,), (("r0", 1),)),)),
                _with(s, in_flight=((1, (uncached_free,), (("r0", 1),)),)), _ctx(execution)),
        # No step in flight, yet a deferred free still holds a block.
        "IF2": (s, _with(s, deferred_frees=((held,),)),
                dataclasses.replace(_ctx(execution), level="scheduler")),
        "I19": (s, s, _ctx(execution, op={"op": "reset_prefix_cache"}, result=True)),
        "H2": (s, s, _ctx(execution, observations=Observations(
            hash_mismatches=["r0's hash 0 is 00…, the documented hash function gives 01…"]))),
        "W1": (s, s, _ctx(execution, observations=Observations(
            worker_mismatches=["r0's worker table in group 0 has 1 blocks [1], the manager's "
                               "2 [1, 2]", "r1's worker table ..."]))),
        # One new block allocated, but the result tells the worker of none (the S3 mutant).
        "W2": (prev, s, _ctx(execution, observations=_probe(
            new_block_ids=((7,),), reported_new_block_ids=None))),
        "I20": (s, s, _ctx(execution, op=lookup,
                           observations=Observations(lookups=[("r0", 4, 3)]))),
        **_event_cases(execution, s),
    }


def _event_cases(execution, s):
    """EV1: a replay missing a cached key; EV2: a removal of a key a block still holds; EV3:
    a stored event whose second key skips its tokens; EV5: a stored event naming a salt its
    key does not stand for."""
    key = next(iter(s.cache))
    short = take_events_result(set(s.cache) - {key})
    parent = (key[0], key[1], key[2][:4]) if len(key[2]) > 4 else None
    stored = KvEvent("stored", key[0], (key, key), parent, key[2][len(parent[2]) if parent
                                                                  else 0:] * 2, 4)
    return {
        "EV1": (s, s, _ctx(execution, op={"op": "take_events"}, result=short)),
        "EV2": (s, s, _ctx(execution, observations=Observations(
            kv_events=[KvEvent("removed", key[0], (key,))]))),
        "EV3": (s, s, _ctx(execution, observations=Observations(kv_events=[stored]))),
        # A cached key re-announced as stored, though no block newly holds it.
        "EV4": (s, s, _ctx(execution, config=dataclasses.replace(FULL, kv_events=True),
                           observations=Observations(kv_events=[_stored_again(key)],
                                                     events_reported=True))),
        "EV5": (s, s, _ctx(execution, observations=Observations(kv_events=[dataclasses.replace(
            _stored_again(key), extra_keys=(("not-its-salt",),))]))),
        # A full-mode hit owed a re-announcement that no event makes.
        "EV6": (s, s, _ctx(execution, observations=Observations(
            cached_reports=[CachedReport("r0", key[0], 1, len(key[2]), key[2])],
            events_reported=True))),
    }


def _stored_again(key):
    return KvEvent("stored", key[0], (key,), None, key[2], len(key[2]))


def test_ev4_wants_each_change_of_the_cache_map_announced_once(base):
    """EV4's other halves: a key that leaves the map unannounced fails; a key evicted and
    stored again in one op, announced as such, passes; a removal of a key nobody held fails."""
    execution, snaps = base
    s = snaps[-1]
    key = next(k for k, blocks in s.cache.items() if len(blocks) == 1)
    events_on = dataclasses.replace(FULL, kv_events=True)

    def check(before, after, events):
        ctx = _ctx(execution, config=events_on,
                   observations=Observations(kv_events=events, events_reported=True))
        return REGISTRY.get("EV4").fn(before, after, ctx)

    gone = _with(s, cache={k: v for k, v in s.cache.items() if k != key})
    assert "no BlockRemoved" in check(s, gone, [])
    assert check(s, gone, [KvEvent("removed", key[0], (key,))]) is None
    assert check(s, s, [KvEvent("removed", key[0], (key,)), _stored_again(key)]) is None
    assert "no block held" in check(gone, gone, [KvEvent("removed", key[0], (key,))])
    assert "newly hold" in check(gone, s, [])


def _write_into_cached(execution, snaps):
    """r0 'writes' positions 0-3 again: block r0[0] already holds its 4-token key."""
    before, after = snaps[-2], snaps[-1]
    after = _view(after, "r0", num_computed_tokens=4)
    op = {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 4}
    return before, after, _ctx(execution, op=op, result={"block_ids": [[]]})


def _state_block_dropped():
    """A Mamba request computed 6 tokens, yet its table no longer holds the state block of
    token 5 (position 1): only the speculative block after it is left."""
    execution, snaps = _run(MAMBA, [
        {"op": "add_request", "request_id": "m", "prompt": list(range(8))},
        {"op": "allocate_slots", "request_id": "m", "num_new_tokens": 6},
    ])
    s = snaps[-1]
    tables = s.requests["m"].tables
    assert tables[1][1] != 0, tables
    state = (0, 0) + tables[1][2:]
    return s, _view(s, "m", tables=(tables[0], state)), _ctx(execution, config=MAMBA)


def _encoder_only_block_held():
    """An encoder-only group's table, empty in the real run, is given block 1."""
    execution, snaps = _run(ENCODER_ONLY, [
        {"op": "add_request", "request_id": "e", "prompt": PROMPT},
        {"op": "allocate_slots", "request_id": "e", "num_new_tokens": 9},
    ])
    s = snaps[-1]
    tables = s.requests["e"].tables
    assert tables[1] == (), tables
    return s, _view(s, "e", tables=(tables[0], (1,))), _ctx(execution, config=ENCODER_ONLY)


def _window_key_off_boundary():
    """Retention 0, window 5 (one block a hit), a 12-token prompt: only the block before its
    replay boundary 8 (position 1) gets a key; position 0 is given one all the same."""
    execution, snaps = _run(RETAINED, [
        {"op": "add_request", "request_id": "w", "prompt": list(range(10)) + [0, 1]},
        {"op": "allocate_slots", "request_id": "w", "num_new_tokens": 12},
    ])
    before, after = snaps[-2], snaps[-1]
    table = after.requests["w"].tables[0]
    keyed = [i for i, b in enumerate(table) if after.block_keys[b] is not None]
    assert keyed == [1], keyed
    block, key = table[0], (0, None, tuple(range(4)))
    after = _with(after, block_keys=tuple(key if b == block else k
                                          for b, k in enumerate(after.block_keys)))
    op = {"op": "allocate_slots", "request_id": "w", "num_new_tokens": 12}
    return before, after, _ctx(execution, op=op, config=RETAINED)


STATE_RETAINED = Config(16, (GroupConfig("mamba", 4, mamba_cache_mode="align"),),
                        max_model_len=64, prefix_cache_retention_interval=0)


def test_rt1_wants_a_state_key_at_a_kept_checkpoint():
    """Retention 0, one Mamba "align" group (bs 4), a 10-token prompt prefilled 4 tokens at a
    time: the state at 4 gets no key (the replay boundary 9 keeps the one at 8); given one all
    the same, RT1 flags it (docs/spec.md §11.3)."""
    ops = [{"op": "add_request", "request_id": "m", "prompt": list(range(10))},
           {"op": "allocate_slots", "request_id": "m", "num_new_tokens": 4}]
    execution, snaps = _run(STATE_RETAINED, ops)
    before, after = snaps[-2], snaps[-1]
    block = after.requests["m"].tables[0][0]
    assert after.block_keys[block] is None
    ctx = _ctx(execution, op=ops[-1], config=STATE_RETAINED)
    check = REGISTRY.get("RT1")
    assert check.fn(before, after, ctx) is None
    planted = _with(after, block_keys=tuple((0, None, tuple(range(4))) if b == block else k
                                            for b, k in enumerate(after.block_keys)))
    assert "got a key for 4 tokens" in check.fn(before, planted, ctx)


def _state_read_unwritten():
    """An align-mode request resumes at 8 from its hit block, whose state (in this fresh
    history) nobody wrote."""
    execution, snaps = _run(ALIGN, [
        {"op": "add_request", "request_id": "a", "prompt": PROMPT},
        {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 8},
    ])
    before, after = snaps[-2], snaps[-1]
    table = after.requests["a"].tables[0]
    forward = ForwardPass("a", 8, 9, (table,))
    op = {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 1}
    return before, after, _ctx(execution, op=op, observations=Observations(forward=[forward]),
                               config=ALIGN)


def _evict_first_queued_at_tail():
    """An evict_first release of r0's deferred blocks, yet its cached blocks went to the tail
    (where a plain free puts them)."""
    config = dataclasses.replace(FULL, deferred_frees=True)
    execution, snaps = _run(config, [
        {"op": "add_request", "request_id": "r0", "prompt": PROMPT},
        {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 9},
        {"op": "free_deferred", "request_id": "r0"},
        {"op": "release_deferred", "evict_first": True},
    ])
    before, after = snaps[-2], snaps[-1]
    cached = [b for b in after.free_queue if after.block_keys[b] is not None]
    assert len(cached) == 2 and after.free_queue[:3] == (*reversed(before.deferred_frees[0]),)
    plain = _with(after, free_queue=tuple(b for b in after.free_queue if b not in cached)
                  + tuple(cached))
    op = execution.trace.ops[-1]
    return before, plain, _ctx(execution, op=op, config=config)


def _window_left_live():
    """A window-4 request computed 12 tokens, yet keeps its first block."""
    execution, snaps = _run(WINDOW, [
        {"op": "add_request", "request_id": "w", "prompt": list(range(12))},
        {"op": "allocate_slots", "request_id": "w", "num_new_tokens": 8},
        {"op": "allocate_slots", "request_id": "w", "num_new_tokens": 4},
    ])
    before, after = snaps[-2], snaps[-1]
    table = before.requests["w"].tables[0]
    after = _view(after, "w", tables=(table + after.requests["w"].tables[0][len(table):],))
    op = {"op": "allocate_slots", "request_id": "w", "num_new_tokens": 4}
    return before, after, _ctx(execution, op=op, result={"block_ids": [[]]})


def _call(check, before, after, ctx):
    return check.fn(before, after, ctx) if check.kind == "transition" else check.fn(after, ctx)


def test_every_builtin_check_has_a_planted_violation(base):
    assert set(BUILTIN) <= set(_cases(*base))


@pytest.mark.parametrize("name", BUILTIN)
def test_check_fails_on_its_violation(base, name):
    before, after, ctx = _cases(*base)[name]
    message = _call(REGISTRY.get(name), before, after, ctx)
    assert message, f"{name} did not flag its planted violation"


@pytest.mark.parametrize("name", BUILTIN)
def test_check_passes_on_the_real_state(base, name):
    execution, snaps = base
    ctx = _ctx(execution, op=execution.trace.ops[-1], result=execution.results[-1])
    assert _call(REGISTRY.get(name), snaps[-2], snaps[-1], ctx) is None


def test_w2_wants_none_exactly_when_no_group_got_a_block(base):
    """W2 per group: the allocated ids in order, None only for an allocation of nothing, and
    nothing judged where no probe read the result (the reference model)."""
    execution, snaps = base
    check = REGISTRY.get("W2")

    def told(allocated, reported):
        ctx = _ctx(execution, observations=_probe(
            new_block_ids=allocated, reported_new_block_ids=reported))
        return check.fn(snaps[-2], snaps[-1], ctx)

    assert told(((7,), ()), ((7,), ())) is None
    assert told(((), ()), None) is None
    assert told(None, None) is None
    assert "no new block" in told(((7,), (9,)), None)
    assert "other blocks" in told(((), ()), ((), ()))
    assert "other blocks" in told(((7, 8),), ((8, 7),))
    assert "other blocks" in told(((7,), (9,)), ((7,), ()))


def test_c1_wants_a_load_in_flight_for_a_request_waiting_for_remote_kv(base):
    """The other halves of C1: waiting for remote KV without a load, a load for a runner."""
    execution, snaps = base
    s = snaps[-1]
    check = REGISTRY.get("C1")
    assert check.fn(_view(s, "r1", status="WAITING_FOR_REMOTE_KVS"), _ctx(execution))
    assert check.fn(_with(s, loads=("r0",)), _ctx(execution))
    assert check.fn(_with(_view(s, "r3", status="FINISHED_ABORTED", tables=((6,),)),
                          loads=("r3",)), _ctx(execution)) is None


def test_i7_wants_a_freed_table_released_tail_first():
    """r0's two cached blocks must reach the queue tail deepest first, not in table order."""
    execution, snaps = _run(FULL, [
        {"op": "add_request", "request_id": "r0", "prompt": PROMPT},
        {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 9},
        {"op": "free", "request_id": "r0"},
    ])
    before, after = snaps[-2], snaps[-1]
    first, second = before.requests["r0"].tables[0][:2]
    assert after.free_queue[-2:] == (second, first)
    head_first = _with(after, free_queue=after.free_queue[:-2] + (first, second))
    ctx = _ctx(execution, op=execution.trace.ops[-1])
    i7 = REGISTRY.get("I7").fn
    assert i7(before, after, ctx) is None
    assert f"expected [{second}, {first}]" in i7(before, head_first, ctx)


def test_state_checks_report_a_negative_computed_count_instead_of_raising():
    """vLLM accepts negative external token counts (docs/findings/002): a running request with
    -4 computed tokens. S1 names it, and S2 reads no table position with it (S1 once
    raised IndexError on such a state, a crash of ours instead of a finding)."""
    execution, snaps = _run(MAMBA, [
        {"op": "add_request", "request_id": "m", "prompt": list(range(8))},
        {"op": "allocate_slots", "request_id": "m", "num_new_tokens": 6},
    ])
    s = _view(snaps[-1], "m", num_computed_tokens=-4)
    assert "-4 computed tokens" in REGISTRY.get("S1").fn(s, _ctx(execution, config=MAMBA))
    align_run, align_snaps = _run(ALIGN, [
        {"op": "add_request", "request_id": "a", "prompt": list(range(8))},
        {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 6},
    ])
    table = align_snaps[-1].requests["a"].tables
    passes = [ForwardPass("a", -4, 2, table)]
    ctx = _ctx(align_run, op={"op": "allocate_slots"}, observations=Observations(forward=passes),
               config=ALIGN)
    message = REGISTRY.get("S2").fn(align_snaps[-2], align_snaps[-1], ctx)
    assert "holds no block" in message
