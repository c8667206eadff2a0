"""API misuse (docs/traces.md "API misuse", docs/spec.md §3-§6 preconditions): a clear exception naming
the bad value, and every structure (pool, managers, requests) exactly as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from kvfuzz.kvcache import (
    CrossAttentionSpec,
    FullAttentionSpec,
    HybridKVCacheCoordinator,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheCoordinatorNoPrefixCache,
    KVCacheManager,
    MambaSpec,
    Request,
    RequestStatus,
    SlidingWindowSpec,
    UnitaryKVCacheCoordinator,
)
from kvfuzz.kvcache import kv_cache_manager
from kvfuzz.kvcache.block_pool import BlockPool
from kvcache_testkit import dump_state, make_config, make_manager, make_request, table_ids
from kvfuzz.harness.spot_check import assert_invariants


@dataclass
class World:
    """A manager mid-run: running requests sharing blocks, cached blocks in the queue."""

    manager: KVCacheManager
    hbs: int
    running: Request
    """Tracked; in the `cow` world a valid allocate_slots would free its out-of-window blocks."""
    freed: Request
    shared_prompt: list[int]
    """A prompt whose lookup hits blocks the running request holds."""
    slots: int
    """The fewest token slots the running request holds in a group."""
    requests: dict[str, Request] = field(default_factory=dict)

    def add(self, request: Request) -> Request:
        self.requests[request.request_id] = request
        return request

    def new_request(self, request_id: str, tokens: list[int]) -> Request:
        return self.add(make_request(request_id, tokens, self.hbs))

    def admit(self, request: Request) -> None:
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        assert self.manager.allocate_slots(request, request.num_tokens - hit, hit, blocks)
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.RUNNING
        request.append_output_token_ids(1)

    def dump(self) -> dict:
        return dump_state(self.manager, *self.requests.values())


def _full_world() -> World:
    """FA bs 4, N 16: A [1, 2, 3] and B [1, 2, 4] share 1, 2; C was freed (6 head, 5 tail)."""
    m = make_manager(16, FullAttentionSpec(block_size=4), max_model_len=64)
    prompt = list(range(100, 110))
    w = World(m, 4, running=None, freed=None, shared_prompt=prompt, slots=12)  # type: ignore
    a, b = w.new_request("A", prompt), w.new_request("B", prompt)
    c = w.new_request("C", list(range(200, 206)))
    for r in (a, b, c):
        w.admit(r)
    m.free(c)
    c.status = RequestStatus.FINISHED_STOPPED
    assert table_ids(m, "A") == [[1, 2, 3]] and table_ids(m, "B") == [[1, 2, 4]]
    assert [blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()] == [
        6, *range(7, 16), 5
    ]
    w.running, w.freed = a, c
    return w


def _cow_world() -> World:
    """docs/spec.md E9 (FA 32 + SWA 16, w 16, partial hits, N 200) with Q's copy pending, undrained."""
    m = make_manager(
        200,
        FullAttentionSpec(block_size=32),
        SlidingWindowSpec(block_size=16, sliding_window=16),
        enable_partial_hash_hits=True,
    )
    prompt = list(range(90))
    w = World(m, 16, running=None, freed=None, shared_prompt=prompt, slots=96)  # type: ignore
    p, q = w.new_request("P", prompt), w.new_request("Q", prompt)
    r = w.new_request("R", list(range(500, 540)))
    for req in (p, q, r):
        w.admit(req)
    m.free(r)
    r.status = RequestStatus.FINISHED_STOPPED
    assert table_ids(m, "P") == [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert table_ids(m, "Q") == [[1, 2, 10], [0, 0, 0, 0, 8, 11]]
    fa = m.coordinator.single_type_managers[0]
    assert [(s.block_id, d.block_id) for s, d in fa._pending_cow_copies] == [(3, 10)]
    assert fa.new_block_ids == [10]
    w.running, w.freed = p, r
    return w


@pytest.fixture(params=["full", "cow"])
def world(request: pytest.FixtureRequest) -> World:
    return _full_world() if request.param == "full" else _cow_world()


def assert_rejected(
    w: World, call: Callable[[], object], pattern: str, exc: type[Exception] = ValueError
) -> None:
    """`call` raises `exc` with a message matching `pattern` and changes nothing."""
    before = w.dump()
    with pytest.raises(exc, match=pattern):
        call()
    assert w.dump() == before


def test_worlds_are_consistent(world: World) -> None:
    assert_invariants(world.manager, requests=world.requests.values())


def test_valid_decode_in_the_cow_world_frees_window_blocks() -> None:
    """What the allocate_slots misuse below must not do: step 4 frees P's SWA blocks 4-7."""
    w = _cow_world()
    assert w.manager.allocate_slots(w.running, 1) is not None
    assert table_ids(w.manager, "P")[1] == [0, 0, 0, 0, 8, 9]


# ----- free -----


def assert_no_op(w: World, call: Callable[[], object]) -> None:
    before = w.dump()
    assert call() is None
    assert w.dump() == before


def test_free_of_a_never_allocated_request_is_a_no_op(world: World) -> None:
    """As in vLLM, whose scheduler frees requests aborted while waiting (findings/004)."""
    x = world.new_request("X", [7, 7, 7, 7, 7])
    assert_no_op(world, lambda: world.manager.free(x))


def test_free_twice_is_a_no_op(world: World) -> None:
    assert_no_op(world, lambda: world.manager.free(world.freed))


@pytest.mark.parametrize("bad", [None, "A", 1.5, 7])
def test_free_of_something_else_than_a_request(world: World, bad: object) -> None:
    assert_rejected(world, lambda: world.manager.free(bad), rf"free\(\): {re.escape(repr(bad))} "
                    "is not a Request")


# ----- allocate_slots -----


def test_allocate_zero_tokens_with_nothing_to_adopt_new_request(world: World) -> None:
    x = world.new_request("X", [7] * 40)
    blocks, hit, _ = world.manager.get_computed_blocks(x)
    assert hit == 0
    assert_rejected(
        world,
        lambda: world.manager.allocate_slots(x, 0, hit, blocks),
        r"allocate_slots\('X'\): num_new_tokens=0 with no computed tokens to adopt",
    )


def test_allocate_zero_tokens_with_nothing_to_adopt_running_request(world: World) -> None:
    rid = world.running.request_id
    assert_rejected(
        world,
        lambda: world.manager.allocate_slots(world.running, 0),
        rf"allocate_slots\('{rid}'\): num_new_tokens=0",
    )


NEGATIVE_FIELDS = (
    "num_new_tokens",
    "num_lookahead_tokens",
    "reserved_blocks",
    "num_encoder_tokens",
    "num_new_computed_tokens",
)


@pytest.mark.parametrize("name", NEGATIVE_FIELDS)
def test_allocate_negative_count_running_request(world: World, name: str) -> None:
    kwargs = {"num_new_tokens": 1, name: -3}
    rid = world.running.request_id
    assert_rejected(
        world,
        lambda: world.manager.allocate_slots(world.running, **kwargs),
        rf"allocate_slots\('{rid}'\): negative or non-integer count {name}=-3$",
    )


@pytest.mark.parametrize("name", NEGATIVE_FIELDS)
def test_allocate_negative_count_admission_with_hits(world: World, name: str) -> None:
    x = world.new_request("X", world.shared_prompt)
    blocks, hit, _ = world.manager.get_computed_blocks(x)
    assert hit > 0
    kwargs = {
        "num_new_tokens": x.num_tokens - hit,
        "num_new_computed_tokens": hit,
        "new_computed_blocks": blocks,
        name: -3,
    }
    assert_rejected(
        world,
        lambda: world.manager.allocate_slots(x, **kwargs),
        rf"negative or non-integer count {name}=-3$",
    )


def test_allocate_reports_every_negative_count(world: World) -> None:
    assert_rejected(
        world,
        lambda: world.manager.allocate_slots(
            world.running, -1, num_lookahead_tokens=-2, reserved_blocks=-4
        ),
        r"negative or non-integer count num_new_tokens=-1, num_lookahead_tokens=-2, "
        r"reserved_blocks=-4$",
    )


@pytest.mark.parametrize("bad", [1.5, 2.0, True, "1"])
def test_allocate_non_integer_count(world: World, bad: object) -> None:
    """Rejected before step 4: in the `cow` world a valid call would free window blocks."""
    rid = world.running.request_id
    assert_rejected(
        world,
        lambda: world.manager.allocate_slots(world.running, bad),
        rf"allocate_slots\('{rid}'\): negative or non-integer count "
        rf"num_new_tokens={re.escape(repr(bad))}$",
    )


@pytest.mark.parametrize("bad", [-1, 2.5, None])
def test_remove_skipped_blocks_bad_count(world: World, bad: object) -> None:
    rid = world.running.request_id
    assert_rejected(
        world,
        lambda: world.manager.remove_skipped_blocks(rid, bad),
        rf"remove_skipped_blocks\('{rid}'\): negative or non-integer count "
        rf"processed_computed_tokens={re.escape(repr(bad))}$",
    )


def test_lookup_negative_ceiling(world: World) -> None:
    x = world.new_request("X", world.shared_prompt)
    assert_rejected(
        world,
        lambda: world.manager.get_computed_blocks(x, -1),
        r"max_cache_hit_length must be >= 0, got -1",
    )


def test_skip_zeroing_group_ids_accepted_and_checked(world: World) -> None:
    m = world.manager
    assert m.allocate_slots(world.running, 1, skip_zeroing_group_ids=(0,)) is not None
    rid = world.running.request_id
    groups = m.num_kv_cache_groups
    for bad in ((groups,), (-1,), ("0",), 0):
        assert_rejected(
            world,
            lambda b=bad: m.allocate_slots(world.running, 1, skip_zeroing_group_ids=b),
            rf"allocate_slots\('{rid}'\): skip_zeroing_group_ids {re.escape(repr(bad))} names",
        )


def test_running_request_passed_prefix_hits(world: World) -> None:
    x = world.new_request("X", world.shared_prompt)
    blocks, hit, _ = world.manager.get_computed_blocks(x)
    assert hit > 0
    ids = re.escape(str(blocks.get_block_ids()))
    rid = world.running.request_id
    for num_computed in (0, hit):
        assert_rejected(
            world,
            lambda n=num_computed: world.manager.allocate_slots(world.running, 1, n, blocks),
            rf"allocate_slots\('{rid}'\): a running request cannot adopt prefix hits {ids}",
        )


def test_hits_with_the_wrong_number_of_groups(world: World) -> None:
    x = world.new_request("X", world.shared_prompt)
    blocks, hit, _ = world.manager.get_computed_blocks(x)
    wrong = KVCacheBlocks(blocks.blocks + ([],))
    groups = len(blocks.blocks)
    assert_rejected(
        world,
        lambda: world.manager.allocate_slots(x, x.num_tokens - hit, hit, wrong),
        rf"new_computed_blocks has {groups + 1} block lists for {groups} groups",
    )


def test_hits_with_caching_disabled() -> None:
    m = make_manager(16, FullAttentionSpec(block_size=4), enable_caching=False)
    w = World(m, 4, running=None, freed=None, shared_prompt=[], slots=0)  # type: ignore
    x = w.new_request("X", list(range(12)))
    fake = KVCacheBlocks(([m.block_pool.blocks[3]],))
    assert_rejected(
        w,
        lambda: m.allocate_slots(x, 8, 4, fake),
        r"allocate_slots\('X'\): prefix hits \(\[3\],\) with prefix caching disabled",
    )


def test_external_tokens_for_a_running_request_are_rejected(world: World) -> None:
    assert_rejected(
        world,
        lambda: world.manager.allocate_slots(world.running, 1, num_external_computed_tokens=5),
        r"num_external_computed_tokens=5 for a request that already holds blocks",
    )


def test_negative_external_tokens_are_rejected(world: World) -> None:
    """vLLM PR #52707: a negative count must not shrink the allocation (and free blocks)."""
    x = world.new_request("X", world.shared_prompt)
    assert_rejected(
        world,
        lambda: world.manager.allocate_slots(x, 4, num_external_computed_tokens=-3),
        r"num_external_computed_tokens=-3",
    )


# ----- cache_blocks -----


def test_cache_blocks_of_a_never_allocated_request(world: World) -> None:
    x = world.new_request("X", world.shared_prompt)
    assert_rejected(
        world, lambda: world.manager.cache_blocks(x, 4), r"cache_blocks: request 'X' is not tracked"
    )


def test_cache_blocks_of_a_freed_request(world: World) -> None:
    rid = world.freed.request_id
    assert_rejected(
        world,
        lambda: world.manager.cache_blocks(world.freed, 4),
        rf"cache_blocks: request '{rid}' is not tracked",
    )


def test_cache_blocks_negative_count(world: World) -> None:
    rid = world.running.request_id
    assert_rejected(
        world,
        lambda: world.manager.cache_blocks(world.running, -3),
        rf"cache_blocks\('{rid}'\): num_computed_tokens=-3 is not an int >= 0",
    )


def test_cache_blocks_beyond_the_held_slots(world: World) -> None:
    n = world.slots + 1
    assert world.manager.cache_blocks(world.running, world.slots) is None
    assert_rejected(
        world,
        lambda: world.manager.cache_blocks(world.running, n),
        rf"{n} tokens exceed the {world.slots} slots of group 0",
    )


# ----- evict_blocks -----


@pytest.mark.parametrize("bad", [-1, "N", "3", 2.0, None, True])
def test_evict_blocks_bad_id(world: World, bad: object) -> None:
    pool = world.manager.block_pool
    if bad == "N":
        bad = pool.num_gpu_blocks
    assert pool.blocks[1].block_hash is not None
    # The valid id comes first: nothing may be evicted before the bad one is seen.
    assert_rejected(
        world,
        lambda: world.manager.evict_blocks([1, bad]),
        rf"evict_blocks\(\): block id {re.escape(repr(bad))} is outside \[0, "
        rf"{pool.num_gpu_blocks}\)",
    )


# ----- BlockPool -----


@pytest.mark.parametrize("bad", [-1, 1.0, True])
def test_get_new_blocks_bad_count(world: World, bad: object) -> None:
    assert_rejected(
        world,
        lambda: world.manager.block_pool.get_new_blocks(bad),
        rf"Cannot get {bad!r} blocks: the count must be an int >= 0",
    )


def test_get_new_blocks_over_count(world: World) -> None:
    pool = world.manager.block_pool
    free = pool.get_num_free_blocks()
    assert_rejected(
        world,
        lambda: pool.get_new_blocks(free + 1),
        rf"Cannot get {free + 1} free blocks from the pool \({free} free\)",
    )


@pytest.mark.parametrize("first", [None, "free", "held"])
def test_touch_of_an_unqueued_zero_ref_block(world: World, first: str | None) -> None:
    pool = world.manager.block_pool
    queued = pool.free_block_queue.get_all_free_blocks()
    bad = queued[-1]
    pool.free_block_queue.remove(bad)  # corrupt: ref_cnt 0 but not in the queue
    blocks = [bad]
    if first == "free":
        blocks.insert(0, queued[0])
    elif first == "held":
        blocks.insert(0, next(b for b in pool.blocks if b.ref_cnt > 0))
    assert_rejected(
        world,
        lambda: pool.touch(blocks),
        rf"touch\(\): block {bad.block_id} has ref_cnt 0 but is not in the free queue",
        RuntimeError,
    )


@pytest.mark.parametrize("evict_first", [False, True])
@pytest.mark.parametrize("case", ["free", "held then free", "held once, twice"])
def test_free_blocks_of_a_block_not_held(world: World, case: str, evict_first: bool) -> None:
    """With `evict_first` the release takes the loop that caching off takes too."""
    pool = world.manager.block_pool
    free_block = pool.free_block_queue.get_all_free_blocks()[0]
    once = next(b for b in pool.blocks if b.ref_cnt == 1)
    twice = next(b for b in pool.blocks if b.ref_cnt == 2)
    blocks, bad = {
        "free": ([free_block], free_block),
        "held then free": ([pool.null_block, twice, once, free_block], free_block),
        "held once, twice": ([twice, once, once], once),
    }[case]
    assert_rejected(
        world,
        lambda: pool.free_blocks(blocks, evict_first),
        rf"free_blocks\(\): block {bad.block_id} is not held",
    )


@pytest.mark.parametrize("bad", [5, None, "x", 1.5])
def test_free_blocks_with_a_non_block_after_a_held_one(world: World, bad: object) -> None:
    """The held block before the bad entry keeps its reference (no leak, no half release)."""
    pool = world.manager.block_pool
    held = next(b for b in pool.blocks if b.ref_cnt == 1)
    assert_rejected(world, lambda: pool.free_blocks([held, bad]),
                    rf"free_blocks\(\): {re.escape(repr(bad))} is not a block of this pool")


@pytest.mark.parametrize("bad", [7, None, "x", 1.5])
def test_touch_with_a_non_block_after_a_free_one(world: World, bad: object) -> None:
    pool = world.manager.block_pool
    free_block = pool.free_block_queue.get_all_free_blocks()[0]
    assert_rejected(world, lambda: pool.touch([free_block, bad]),
                    rf"touch\(\): {re.escape(repr(bad))} is not a block of this pool")


@pytest.mark.parametrize("bad", [None, 5, "blocks"])
def test_block_lists_that_are_not_lists(world: World, bad: object) -> None:
    pool = world.manager.block_pool
    for call, name in ((pool.free_blocks, "free_blocks"), (pool.touch, "touch")):
        assert_rejected(world, lambda: call(bad),
                        rf"{name}\(\): {re.escape(repr(bad))} is not a sequence of blocks")


def _foreign_block(world: World, held: bool) -> object:
    pool = BlockPool(len(world.manager.block_pool.blocks), True, 4)
    if held:
        return pool.get_new_blocks(1)[0]
    return pool.free_block_queue.get_all_free_blocks()[0]


@pytest.mark.parametrize("held", [True, False])
def test_blocks_of_another_pool_are_refused(world: World, held: bool) -> None:
    pool = world.manager.block_pool
    foreign = _foreign_block(world, held)
    ours = next(b for b in pool.blocks if b.ref_cnt == 1)
    pattern = rf"block {foreign.block_id} belongs to another pool"
    assert_rejected(world, lambda: pool.free_blocks([ours, foreign]), pattern)
    assert_rejected(world, lambda: pool.touch([ours, foreign]), pattern)


def test_hits_of_another_pool_are_refused(world: World) -> None:
    x = world.new_request("X", [7] * 40)
    hits = KVCacheBlocks(tuple([_foreign_block(world, held=False)] for _ in
                               world.manager.coordinator.single_type_managers))
    assert_rejected(world, lambda: world.manager.allocate_slots(x, 4, 4, hits),
                    r"new_computed_blocks: block \d+ belongs to another pool")


def test_an_issued_lookup_result_holds_what_the_lookup_found(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """allocate_slots adopts the last result issued without checking its blocks again, so
    nothing may be put into that result: its groups are tuples."""
    monkeypatch.setattr(kv_cache_manager, "_MIN_ISSUED_HITS", 1)
    x = world.new_request("X", world.shared_prompt)
    hits, num_hit_tokens, _ = world.manager.get_computed_blocks(x)
    assert num_hit_tokens > 0
    assert [type(group) for group in hits.blocks] == [tuple] * len(hits.blocks)


def test_hits_in_tuples_are_checked_unless_the_lookup_issued_them(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the identity of the last result issued spares the check, not its form."""
    monkeypatch.setattr(kv_cache_manager, "_MIN_ISSUED_HITS", 1)
    x = world.new_request("X", world.shared_prompt)
    hits, num_hit_tokens, _ = world.manager.get_computed_blocks(x)
    foreign = _foreign_block(world, held=False)
    forged = KVCacheBlocks(tuple((*group, foreign) for group in hits.blocks))
    assert_rejected(world, lambda: world.manager.allocate_slots(x, 4, num_hit_tokens, forged),
                    rf"new_computed_blocks: block {foreign.block_id} belongs to another pool")


def test_a_short_lookup_result_is_checked_when_adopted(world: World) -> None:
    """A short result is not issued: its lists are the caller's, and what is put into them
    is checked."""
    x = world.new_request("X", world.shared_prompt)
    hits, num_hit_tokens, _ = world.manager.get_computed_blocks(x)
    assert 0 < len(hits.blocks[0]) < kv_cache_manager._MIN_ISSUED_HITS
    foreign = _foreign_block(world, held=False)
    for group in hits.blocks:
        group.append(foreign)  # type: ignore[attr-defined]
    assert_rejected(world, lambda: world.manager.allocate_slots(x, 4, num_hit_tokens, hits),
                    rf"new_computed_blocks: block {foreign.block_id} belongs to another pool")


@pytest.mark.parametrize("bad", ["x", 1.5, [1]])
def test_hits_that_are_not_kv_cache_blocks(world: World, bad: object) -> None:
    x = world.new_request("X", [7] * 40)
    assert_rejected(world, lambda: world.manager.allocate_slots(x, 4, 0, bad),
                    rf"new_computed_blocks={re.escape(repr(bad))} is not a KVCacheBlocks")


@pytest.mark.parametrize("bad", [None, 1.5, "8", True])
def test_cache_blocks_count_of_the_wrong_type(world: World, bad: object) -> None:
    rid = world.running.request_id
    assert_rejected(world, lambda: world.manager.cache_blocks(world.running, bad),
                    rf"cache_blocks\('{rid}'\): num_computed_tokens={re.escape(repr(bad))} is "
                    "not an int >= 0")


@pytest.mark.parametrize("method", ["allocate_slots", "cache_blocks", "get_computed_blocks"])
@pytest.mark.parametrize("bad", [None, "A", 1.5])
def test_request_of_the_wrong_type(world: World, method: str, bad: object) -> None:
    args = {"allocate_slots": (4,), "cache_blocks": (4,), "get_computed_blocks": ()}[method]
    assert_rejected(world, lambda: getattr(world.manager, method)(bad, *args),
                    rf"{method}\(\): {re.escape(repr(bad))} is not a Request")


@pytest.mark.parametrize("bad", [1.5, "3", None])
def test_cache_full_blocks_counts_of_the_wrong_type(world: World, bad: object) -> None:
    pool, request = world.manager.block_pool, world.running
    blocks = world.manager.coordinator.single_type_managers[0].req_to_blocks[request.request_id]
    assert_rejected(world, lambda: pool.cache_full_blocks(request, blocks, 0, bad, 4, 0),
                    rf"num_full_blocks={re.escape(repr(bad))} is not an int >= 0")


# ----- construction -----


def _fa_swa(bs_fa: int = 32, bs_swa: int = 16) -> KVCacheConfig:
    return make_config(
        64,
        FullAttentionSpec(block_size=bs_fa),
        SlidingWindowSpec(block_size=bs_swa, sliding_window=bs_swa),
    )


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (
            lambda: KVCacheManager(
                make_config(16, FullAttentionSpec(block_size=16)), 64, 16, 32,
                enable_caching=False,
            ),
            r"scheduler_block_size 16 is not a multiple of hash_block_size 32",
        ),
        (
            lambda: KVCacheCoordinatorNoPrefixCache(_fa_swa(), 64, 64, False, 32, 64),
            r"scheduler_block_size 32 is not a multiple of hash_block_size 64",
        ),
        (
            lambda: KVCacheManager(_fa_swa(), 64, 32, 64),
            r"scheduler_block_size 32 is not a multiple of hash_block_size 64",
        ),
    ],
)
def test_scheduler_block_size_not_a_multiple_of_hash_block_size(build, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        build()


@pytest.mark.parametrize("caching", [True, False])
def test_scheduler_block_size_not_a_multiple_of_a_group_block_size(caching: bool) -> None:
    with pytest.raises(
        ValueError, match=r"scheduler_block_size 16 is not a multiple of group 0's block_size 32"
    ):
        KVCacheManager(_fa_swa(), 64, 16, 16, enable_caching=caching)


@pytest.mark.parametrize(
    "build",
    [
        lambda: KVCacheManager(_fa_swa(32, 48), 256, 96, 48),
        lambda: HybridKVCacheCoordinator(_fa_swa(32, 48), 256, 256, False, True, 96, 48),
    ],
)
def test_hybrid_block_size_not_a_multiple_of_hash_block_size(build) -> None:
    with pytest.raises(
        ValueError, match=r"group 0's block_size 32 is not a multiple of hash_block_size 48"
    ):
        build()


@pytest.mark.parametrize(
    "build",
    [
        lambda: KVCacheManager(make_config(16, FullAttentionSpec(block_size=16)), 64, 16, 8),
        lambda: UnitaryKVCacheCoordinator(
            make_config(16, FullAttentionSpec(block_size=16)), 64, 64, False, True, 16, 8
        ),
    ],
)
def test_unitary_hash_block_size_differs_from_block_size_with_caching(build) -> None:
    with pytest.raises(
        ValueError, match=r"hash_block_size 8 must equal the block_size 16 of a single-group"
    ):
        build()


def test_unitary_hash_block_size_may_differ_without_caching() -> None:
    config = make_config(16, FullAttentionSpec(block_size=16))
    assert KVCacheManager(config, 64, 16, 8, enable_caching=False).block_pool.hash_block_size == 8


@pytest.mark.parametrize(
    ("specs", "group"),
    [
        ((CrossAttentionSpec(block_size=16),), 0),
        ((FullAttentionSpec(block_size=16), CrossAttentionSpec(block_size=16)), 1),
    ],
)
def test_cross_attention_with_caching(specs, group: int) -> None:
    with pytest.raises(
        ValueError, match=rf"group {group} is cross attention, which needs enable_caching=False"
    ):
        KVCacheManager(make_config(16, *specs), 64, 16, 16)
    assert KVCacheManager(make_config(16, *specs), 64, 16, 16, enable_caching=False)


def test_zero_groups_with_caching() -> None:
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[])
    with pytest.raises(ValueError, match=r"no KV cache groups needs enable_caching=False"):
        KVCacheManager(config, 64, 16, 16)
    m = KVCacheManager(config, 64, 16, 16, enable_caching=False)
    assert m.allocate_slots(make_request("X", [1, 2, 3], 16), 3) is m.empty_kv_cache_blocks


@pytest.mark.parametrize("watermark", [-0.01, -1, "0.1", None, True, float("nan"), float("inf")])
def test_bad_watermark(watermark: object) -> None:
    with pytest.raises(
        ValueError,
        match=rf"watermark must be a finite number >= 0, got {re.escape(repr(watermark))}",
    ):
        make_manager(16, FullAttentionSpec(block_size=4), watermark=watermark)


@pytest.mark.parametrize("name", ["max_model_len", "max_in_flight_tokens"])
@pytest.mark.parametrize("value", [0, -64, 64.0, "64", True])
def test_bad_model_lengths(name: str, value: object) -> None:
    with pytest.raises(
        ValueError, match=rf"{name} must be a positive int, got {re.escape(repr(value))}"
    ):
        make_manager(16, FullAttentionSpec(block_size=4), **{name: value})


@pytest.mark.parametrize("num_blocks", [0, -1, 16.0])
def test_bad_pool_size(num_blocks: object) -> None:
    with pytest.raises(
        ValueError, match=rf"num_gpu_blocks must be a positive int, got {num_blocks!r}"
    ):
        make_manager(num_blocks, FullAttentionSpec(block_size=4))
    with pytest.raises(ValueError, match=r"hash_block_size must be a positive int, got 0"):
        BlockPool(16, True, 0)


@pytest.mark.parametrize("mamba", [False, True], ids=["full+swa", "full+mamba-align"])
def test_a_request_longer_than_max_model_len_caches_only_its_table(mamba: bool) -> None:
    """The table stops at max_model_len, so only the blocks it has are cached, as vLLM does
    (tests/vllm checks the two agree). This used to raise ValueError after allocating."""
    second = (MambaSpec(block_size=4, mamba_cache_mode="align") if mamba
              else SlidingWindowSpec(block_size=4, sliding_window=8))
    m = make_manager(64, FullAttentionSpec(block_size=4), second, max_model_len=32)
    request = make_request("long", list(range(100)), 4)
    blocks = m.get_computed_blocks(request)[0]
    assert m.allocate_slots(request, 100, 0, blocks) is not None
    request.status = RequestStatus.RUNNING
    tables = table_ids(m, "long")
    assert len(tables[0]) == 8  # cdiv(max_model_len, block_size)
    cached = [b for b in m.block_pool.blocks if b.block_hash is not None]
    assert sorted(b.block_id for b in cached if b.block_id in tables[0]) == sorted(tables[0])
    assert_invariants(m, requests=[request])


def _hash_kwargs(value: object, where: str) -> dict[str, object]:
    """A Request's block hashes all `value`: from its hasher, or given by a frontend."""
    def hasher(request: Request) -> list[object]:
        return [value] * (request.num_tokens // 4 - len(request.block_hashes))

    return {"block_hasher": hasher} if where == "hasher" else {"block_hashes": [value] * 2}


@pytest.mark.parametrize("bad", ["0" * 32, b"", None, True], ids=["str", "empty", "None", "bool"])
@pytest.mark.parametrize("where", ["hasher", "given"])
def test_a_block_hash_that_is_neither_bytes_nor_an_int_is_refused(bad: object, where: str) -> None:
    with pytest.raises(ValueError, match=re.escape(
            f"request 'r': block hash {bad!r} is neither non-empty bytes nor an int")):
        Request("r", list(range(9)), **_hash_kwargs(bad, where))


@pytest.mark.parametrize("where", ["hasher", "given"])
@pytest.mark.parametrize("call", ["allocate_slots", "cache_blocks", "get_computed_blocks",
                                  "get_num_cached_tokens"])
def test_an_int_block_hash_is_kept_but_never_cached(where: str, call: str) -> None:
    """vLLM's Request keeps what its hasher returns (its tests hash with Python's `hash`), so
    kvcache's does; but a key is the hash's bytes and a group id, and vLLM's
    `make_block_hash_with_group_id` raises TypeError on an int (kv_cache_utils.py:73), so the
    manager refuses to cache or look up under one, changing nothing."""
    other = -8549660974541118228
    request = Request("r", list(range(9)), **_hash_kwargs(other, where))
    assert request.block_hashes == [other, other]
    m = make_manager(16, FullAttentionSpec(block_size=4))
    if call == "cache_blocks":  # a KV connector's load: cached once it lands
        assert m.allocate_slots(request, 9, delay_cache_blocks=True) is not None
    before = dump_state(m, request)
    message = f"request 'r': block hash {other!r} is not bytes"
    with pytest.raises(ValueError, match=re.escape(message)):
        if call == "allocate_slots":
            m.allocate_slots(request, 9)
        elif call == "cache_blocks":
            m.cache_blocks(request, 8)
        else:
            getattr(m, call)(request)
    assert dump_state(m, request) == before
