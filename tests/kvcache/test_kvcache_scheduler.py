"""kvcache.scheduler against docs/traces.md "The driver (step)" (docs/spec.md §7).

Expected values are worked out by hand in the comments: block size 4 unless noted, caching off
unless the test is about hits, so a readmitted request never hits and block counts stay simple.
"""

from __future__ import annotations

import pytest

from kvfuzz.kvcache import (
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    Request,
    RequestStatus,
    Scheduler,
    SlidingWindowSpec,
)
from kvcache_testkit import make_manager, make_request, table_ids
from kvfuzz.harness.spot_check import assert_invariants

BS = 4


def setup(
    num_blocks: int,
    *,
    max_model_len: int = 64,
    caching: bool = False,
    watermark: float = 0.0,
    **scheduler: object,
) -> tuple[KVCacheManager, Scheduler]:
    m = make_manager(
        num_blocks,
        FullAttentionSpec(block_size=BS),
        max_model_len=max_model_len,
        enable_caching=caching,
        watermark=watermark,
    )
    options = {"token_budget": 32, "max_running": 4, **scheduler}
    return m, Scheduler(m, max_model_len=max_model_len, **options)  # type: ignore[arg-type]


def add(s: Scheduler, rid: str, prompt_len: int, base: int = 0, **kwargs: object) -> Request:
    """A request whose prompt is `prompt_len` tokens from `base` (distinct bases never hit)."""
    request = make_request(rid, list(range(base, base + prompt_len)), BS, **kwargs)
    s.add_request(request)
    return request


def sample(request: Request) -> int:
    return 1000 + request.num_tokens


def rids(requests: tuple[Request, ...]) -> list[str]:
    return [r.request_id for r in requests]


def free(m: KVCacheManager) -> int:
    return m.block_pool.get_num_free_blocks()


def test_fcfs_preempts_the_last_running_request_to_the_front_of_waiting():
    m, s = setup(8, max_running=3)  # 7 usable blocks
    r0, r1 = add(s, "r0", 8), add(s, "r1", 8, 100)
    r2, r3 = add(s, "r2", 12, 200), add(s, "r3", 4, 300)
    # Step 1: 2 + 2 + 3 blocks; r3 stays out (max_running 3). All three get a sampled token.
    out = s.step(sample)
    assert out.scheduled == [("r0", 8, 0), ("r1", 8, 0), ("r2", 12, 0)]
    assert out.preempted == [] and out.finished == []
    assert rids(s.running) == ["r0", "r1", "r2"] and rids(s.waiting) == ["r3"]
    assert (free(m), r0.num_tokens, r2.num_tokens) == (0, 9, 13)

    # Step 2: r0's 9th slot needs a block, none free -> victim running[-1] = r2 (3 blocks back);
    # r0 and r1 take one each. r3 would fit (1 block free) but a preempting step admits nothing.
    out = s.step(sample)
    assert out.scheduled == [("r0", 1, 0), ("r1", 1, 0)]
    assert out.preempted == ["r2"]
    assert rids(s.running) == ["r0", "r1"] and rids(s.waiting) == ["r2", "r3"]
    assert free(m) == 1
    assert r2.status == RequestStatus.PREEMPTED
    assert (r2.num_computed_tokens, r2.num_preemptions, r2.num_tokens) == (0, 1, 13)
    assert table_ids(m, "r2") == [[]]
    assert r3.status == RequestStatus.WAITING

    # Step 3: decodes need no block (10 slots in 3 blocks). r2 re-prefills all 13 tokens
    # (4 blocks > 1 free): refused, and the waiting loop stops before r3.
    out = s.step(sample)
    assert out.scheduled == [("r0", 1, 0), ("r1", 1, 0)]
    assert out.preempted == []
    assert rids(s.waiting) == ["r2", "r3"]
    assert (r0.num_tokens, r1.num_tokens) == (11, 11)
    assert_invariants(m, requests=[r0, r1, r2, r3])


def test_fcfs_request_that_preempts_itself_stops_the_running_loop():
    m, s = setup(9)  # 8 usable blocks
    a, b, c = add(s, "A", 4), add(s, "B", 24, 100), add(s, "C", 4, 200)
    out = s.step(sample)
    assert out.scheduled == [("A", 4, 0), ("B", 24, 0), ("C", 4, 0)]
    assert free(m) == 0
    # Step 2: A needs a block -> victim C; B needs one (25 slots) -> victim is B itself: the
    # running loop stops, C and B go to the front of waiting in that order (B first).
    out = s.step(sample)
    assert out.scheduled == [("A", 1, 0)]
    assert out.preempted == ["C", "B"]
    assert rids(s.running) == ["A"] and rids(s.waiting) == ["B", "C"]
    assert free(m) == 6 and b.num_preemptions == 1 and c.num_preemptions == 1
    assert a.num_tokens == 6 and a.output_token_ids == [1004, 1005]
    # Step 3: B's re-prefill of 25 tokens needs 7 blocks > 6 free.
    out = s.step(sample)
    assert out.scheduled == [("A", 1, 0)] and out.preempted == []
    assert rids(s.waiting) == ["B", "C"]


def test_priority_victim_gives_back_the_budget_of_an_already_scheduled_victim():
    m, s = setup(10, policy="priority", token_budget=16)  # 9 usable blocks
    b = add(s, "B", 15, 100, priority=2, arrival_time=0.0)
    assert s.step(sample).scheduled == [("B", 15, 0)]  # 4 blocks, B now 16 tokens
    a = add(s, "A", 8, 200, priority=0, arrival_time=1.0)
    c = add(s, "C", 40, 300, priority=1, arrival_time=2.0)
    assert rids(s.waiting) == ["A", "C"]
    # Step 2: B decodes in its 4 blocks (budget 15); A 8 tokens (2 blocks, budget 7);
    # C chunk of 7 (2 blocks). 8 blocks held, 1 free.
    out = s.step(sample)
    assert out.scheduled == [("B", 1, 0), ("A", 8, 0), ("C", 7, 0)]
    assert rids(s.running) == ["B", "A", "C"] and free(m) == 1
    # Step 3: B takes the free block (17 slots -> 5 blocks), budget 15. A needs one: victim =
    # largest (priority, arrival) = B, already scheduled -> its entry goes, budget back to 16,
    # its 5 blocks are freed. A takes 1 (budget 15), C gets min(33, 15) = 15 tokens: 22 slots,
    # 6 blocks, 4 new = exactly what is left.
    out = s.step(sample)
    assert out.scheduled == [("A", 1, 0), ("C", 15, 0)]
    assert out.preempted == ["B"]
    assert rids(s.running) == ["A", "C"] and rids(s.waiting) == ["B"]
    assert free(m) == 0
    assert (b.status, b.num_computed_tokens, b.num_tokens) == (RequestStatus.PREEMPTED, 0, 17)
    assert (a.num_tokens, c.num_computed_tokens) == (10, 22)
    assert_invariants(m, requests=[a, b, c])


def test_priority_request_that_preempts_itself_lets_the_loop_go_on():
    m, s = setup(6, policy="priority")  # 5 usable blocks
    a = add(s, "A", 4, priority=0, arrival_time=0.0)
    x = add(s, "X", 7, 100, priority=5, arrival_time=1.0)
    assert s.step(sample).scheduled == [("A", 4, 0), ("X", 7, 0)]
    c = add(s, "C", 3, 200, priority=1, arrival_time=2.0)
    # Step 2: A (5 slots) takes a block, X (8 slots) does not, C takes 1: 5 held, 0 free.
    assert s.step(sample).scheduled == [("A", 1, 0), ("X", 1, 0), ("C", 3, 0)]
    assert free(m) == 0
    w = add(s, "W", 4, 300, priority=3, arrival_time=3.0)
    # Step 3: X (9 slots) needs a block; the victim is X itself (priority 5): the loop goes on
    # with C at the same index. Waiting stays sorted: W (3) before X (5).
    out = s.step(sample)
    assert out.scheduled == [("A", 1, 0), ("C", 1, 0)]
    assert out.preempted == ["X"]
    assert rids(s.running) == ["A", "C"] and rids(s.waiting) == ["W", "X"]
    assert free(m) == 2
    assert (a.num_tokens, c.num_tokens, x.num_computed_tokens) == (7, 5, 0)
    assert w.status == RequestStatus.WAITING


def test_chunked_prefill_caps_the_admission_by_the_budget():
    m, s = setup(32, token_budget=10)
    r0, r1 = add(s, "r0", 6), add(s, "r1", 20, 100)
    assert s.step(sample).scheduled == [("r0", 6, 0), ("r1", 4, 0)]
    assert (r0.num_tokens, r1.num_tokens, r1.num_computed_tokens) == (7, 20, 4)
    assert s.step(sample).scheduled == [("r0", 1, 0), ("r1", 9, 0)]
    # r1's last 7 prompt tokens complete it: sampled now.
    assert s.step(sample).scheduled == [("r0", 1, 0), ("r1", 7, 0)]
    assert r1.output_token_ids == [1020]
    assert s.step(sample).scheduled == [("r0", 1, 0), ("r1", 1, 0)]


def test_without_chunked_prefill_a_prompt_over_budget_stops_the_waiting_loop():
    m, s = setup(32, token_budget=10, chunked_prefill=False)
    add(s, "r0", 6)
    add(s, "r1", 20, 100)
    add(s, "r2", 2, 200)  # would fit, but sits behind r1
    assert s.step(sample).scheduled == [("r0", 6, 0)]
    assert rids(s.waiting) == ["r1", "r2"]
    assert s.step(sample).scheduled == [("r0", 1, 0)]
    assert rids(s.waiting) == ["r1", "r2"]


def test_max_running_limits_admission():
    m, s = setup(32, max_running=2)
    for i in range(3):
        add(s, f"r{i}", 4, 100 * i)
    assert s.step(sample).scheduled == [("r0", 4, 0), ("r1", 4, 0)]
    assert rids(s.waiting) == ["r2"]
    s.finish_request("r0", RequestStatus.FINISHED_STOPPED)
    assert s.step(sample).scheduled == [("r1", 1, 0), ("r2", 4, 0)]


def test_watermark_ignored_for_the_first_admission_into_an_idle_engine():
    # N 20, watermark 0.5 -> 10 blocks. r0 (10 blocks, 10 + 10 > 19 free) enters: nothing is
    # running yet. r1 (1 block) then faces 1 + 10 > 9 free: refused although it fits.
    m, s = setup(20, watermark=0.5, token_budget=64)
    add(s, "r0", 40)
    add(s, "r1", 4, 100)
    assert s.step(sample).scheduled == [("r0", 40, 0)]
    assert rids(s.waiting) == ["r1"] and free(m) == 9


def test_finish_by_max_tokens_frees_the_blocks():
    m, s = setup(16)
    r = add(s, "r", 4, max_tokens=2)
    out = s.step(sample)
    assert out.scheduled == [("r", 4, 0)] and out.finished == []
    out = s.step(sample)
    assert out.scheduled == [("r", 1, 0)] and out.finished == ["r"]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.output_token_ids == [1004, 1005]
    assert s.running == () and free(m) == 15
    assert not m.coordinator.tracks("r")


def test_finish_by_max_model_len_frees_the_blocks():
    m, s = setup(16, max_model_len=8)
    r = add(s, "r", 6)
    assert s.step(sample).finished == []
    out = s.step(sample)
    # n = min(7 - 6, 32, 8 - 6 - 1) = 1; then 8 tokens >= max_model_len.
    assert out.scheduled == [("r", 1, 0)] and out.finished == ["r"]
    assert (r.status, r.num_tokens, r.num_output_tokens) == (
        RequestStatus.FINISHED_LENGTH_CAPPED, 8, 2
    )
    assert free(m) == 15 and not m.coordinator.tracks("r")


def test_running_tokens_are_capped_below_max_model_len():
    m, s = setup(16, max_model_len=16)
    r = add(s, "r", 12)
    s.step(sample)
    r.spec_token_ids = [1, 1, 1, 1, 1]
    # n = min(18 - 12, 32, 16 - 12 - 1) = 3: 1 + 2 of the drafts, both kept, then the sampled
    # token: 16 tokens reach max_model_len.
    out = s.step(sample)
    assert out.scheduled == [("r", 3, 0)] and out.finished == ["r"]
    assert (r.num_computed_tokens, r.num_tokens) == (15, 16)


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ABORTED),
        (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_STOPPED),
    ],
)
def test_abort_or_finish_of_waiting_preempted_and_running_requests(status, expected):
    m, s = setup(6, max_running=2)  # 5 usable blocks
    run, victim = add(s, "run", 8), add(s, "victim", 12, 100)
    waiting = add(s, "wait", 4, 200)
    s.step(sample)
    # run needs a 3rd block: victim (3 blocks) is preempted to the front of waiting.
    assert s.step(sample).preempted == ["victim"]
    assert rids(s.waiting) == ["victim", "wait"]
    s.finish_request("wait", status)
    s.finish_request("victim", status)
    assert s.waiting == () and free(m) == 2
    assert (waiting.status, victim.status) == (expected, expected)
    s.finish_request("run", status)
    assert s.running == () and free(m) == 5 and run.status == expected
    assert not m.coordinator.tracks("run")
    # Already finished: no-op (no second free).
    s.finish_request("run", RequestStatus.FINISHED_ABORTED)
    assert run.status == expected
    assert s.step(sample).scheduled == []


def test_finish_request_rejects_bad_arguments():
    m, s = setup(6)
    add(s, "r", 4)
    with pytest.raises(ValueError, match="needs a finished status, got <RequestStatus.RUNNING"):
        s.finish_request("r", RequestStatus.RUNNING)
    with pytest.raises(ValueError, match="unknown request 'nope'"):
        s.finish_request("nope", RequestStatus.FINISHED_ABORTED)
    with pytest.raises(ValueError, match="request 'r' was already added"):
        s.add_request(make_request("r", [1], BS))


def test_sampled_token_only_when_every_token_is_computed():
    m, s = setup(16, token_budget=4)
    calls: list[tuple[str, int]] = []

    def recording(request: Request) -> int:
        calls.append((request.request_id, request.num_computed_tokens))
        return 7

    r = add(s, "r", 10)
    assert s.step(recording).scheduled == [("r", 4, 0)]
    assert s.step(recording).scheduled == [("r", 4, 0)]
    assert calls == [] and r.num_tokens == 10
    assert s.step(recording).scheduled == [("r", 2, 0)]
    assert calls == [("r", 10)]
    assert list(r.all_token_ids)[-1] == 7 and r.num_tokens == 11


def test_prefix_hits_are_reported_and_counted_as_computed():
    m, s = setup(16, caching=True)
    add(s, "a", 10)
    assert s.step(sample).scheduled == [("a", 10, 0)]  # caches blocks 1, 2
    b = add(s, "b", 10)
    # b hits 8 tokens (blocks 1, 2) and computes the last 2.
    assert s.step(sample).scheduled == [("a", 1, 0), ("b", 2, 8)]
    assert table_ids(m, "b") == [[1, 2, 4]] and b.num_tokens == 11


def test_retained_copy_on_write_blocks_are_released_at_step_end():
    """docs/spec.md E9 through the driver: the CoW pair is copied and both retentions released."""
    m = make_manager(
        200,
        FullAttentionSpec(block_size=32),
        SlidingWindowSpec(block_size=16, sliding_window=16),
        enable_partial_hash_hits=True,
    )
    s = Scheduler(m, max_model_len=1024, token_budget=256, max_running=4)
    p = make_request("P", list(range(90)), 16)
    s.add_request(p)
    out = s.step(sample)
    assert out.scheduled == [("P", 90, 0)] and out.copies == []
    assert table_ids(m, "P") == [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    q = make_request("Q", list(range(90)), 16)
    s.add_request(q)
    # P's decode first frees SWA blocks 4-7 (skipped(90) = 75 -> 4 blocks). Q hits 80 tokens:
    # FA [1, 2, 3 (partial entry)], SWA [null x 4, 8]; CoW 3 -> 10, SWA new block 11.
    out = s.step(sample)
    assert out.scheduled == [("P", 1, 0), ("Q", 10, 80)]
    assert out.copies == [(3, 10)]
    assert table_ids(m, "P") == [[1, 2, 3], [0, 0, 0, 0, 8, 9]]
    assert table_ids(m, "Q") == [[1, 2, 10], [0, 0, 0, 0, 8, 11]]
    refs = {i: m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 8, 9, 10, 11)}
    assert refs == {1: 2, 2: 2, 3: 1, 8: 2, 9: 1, 10: 1, 11: 1}
    assert all(not g._pending_cow_copies for g in m.coordinator.single_type_managers)
    assert m.take_new_block_ids() == []
    assert (p.num_tokens, q.num_tokens) == (92, 91)
    assert_invariants(m, requests=[p, q])
    s.finish_request("P", RequestStatus.FINISHED_ABORTED)
    s.finish_request("Q", RequestStatus.FINISHED_ABORTED)
    assert free(m) == 199


# ----- steps in flight (docs/spec.md §7.1) -----

def test_a_free_during_a_step_in_flight_waits_for_it():
    """r (8 tokens, 2 blocks) is scheduled by a step left in flight, then aborted: its blocks
    stay held until the step completes, then go back to the pool, tail first."""
    m, s = setup(10)
    r = add(s, "r", 8)
    s.step(lambda request: 0, in_flight=True)
    (step, reads, scheduled), = s.in_flight
    assert step == 1 and scheduled == (("r", 8),) and r.num_in_flight_tokens == 8
    held = table_ids(m, "r")[0]
    assert sorted(reads) == sorted(held)
    free_before = m.block_pool.get_num_free_blocks()
    s.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert s.deferred_frees == (tuple(held),)
    assert m.block_pool.get_num_free_blocks() == free_before
    assert s.complete_step() == held
    assert r.num_in_flight_tokens == 0 and not s.in_flight and not s.deferred_frees
    assert m.block_pool.get_num_free_blocks() == free_before + len(held)
    assert_invariants(m)


def test_a_mamba_step_from_zero_computed_reads_the_whole_table():
    """A Mamba 'align' group skips `computed - 1` tokens: -1 at 0 computed, which must read
    from block 0, not index the table from its end. r (9 tokens, block 8, one checkpoint
    block) holds [1, 2]; its first step writes the checkpoint in 1 and the state in 2, so it
    reads both (found by a generated-config campaign, seed 2: kvcache read only [2])."""
    m = make_manager(4, MambaSpec(block_size=8, mamba_cache_mode="align",
                                  num_prefill_checkpoint_blocks=1,
                                  prefill_checkpoint_alignment=8), max_model_len=64)
    s = Scheduler(m, max_model_len=64, token_budget=64, max_running=4)
    s.add_request(make_request("r", [1, 2, 1, 2, 2, 1, 3, 1, 3], 8, max_tokens=1))
    s.step(lambda request: 0, in_flight=True)
    (_, reads, _), = s.in_flight
    assert reads == (1, 2)


def test_a_plain_step_completes_the_steps_in_flight_first():
    """r samples its last token in a step left in flight: it ends when the plain step takes
    that step's output first, and nothing is left in flight or held."""
    m, s = setup(10)
    r = add(s, "r", 8, max_tokens=1)
    s.step(lambda request: 0, in_flight=True)
    assert r.status == RequestStatus.RUNNING and r.num_tokens == 8
    s.step(lambda request: 0)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_tokens == 9
    assert not s.in_flight and not s.deferred_frees
    assert m.block_pool.get_num_free_blocks() == 9


def test_a_step_in_flight_that_samples_appends_its_token_when_it_completes():
    """As vLLM's AsyncScheduler (output placeholders): r's prompt (7 tokens) completes in a
    step left in flight, whose token is appended only when it completes; the next step in
    flight schedules that token's position meanwhile (computed 8 of 7 tokens), and the block
    it completes is cached once the output of both is in, up to the settled tokens."""
    m, s = setup(10, caching=True)
    r = add(s, "r", 7, max_tokens=3)
    s.step(sample, in_flight=True)
    assert (r.num_computed_tokens, r.num_tokens) == (7, 7)
    out = s.step(sample, in_flight=True)
    assert out.scheduled == [("r", 1, 0)] and not out.finished
    assert (r.num_computed_tokens, r.num_tokens) == (8, 7)
    assert len(r.block_hashes) == 1  # the token at position 7 is not known yet
    s.complete_step()
    assert r.all_token_ids[7:] == [1007] and r.num_tokens == 8
    assert m.block_pool.blocks[table_ids(m, "r")[0][1]].block_hash is None  # 7 settled
    s.complete_step()
    assert r.all_token_ids[7:] == [1007, 1008] and r.num_computed_tokens == 8
    assert m.block_pool.blocks[table_ids(m, "r")[0][1]].block_hash is not None
    assert r.status == RequestStatus.RUNNING


def test_a_request_a_step_in_flight_ends_is_not_scheduled_again_and_freed_on_completion():
    """r (max_tokens 1) samples in a step in flight: the next step skips it (that step already
    ends it), and taking the first step's output finishes r and frees its blocks at once (no
    later step read them)."""
    m, s = setup(10)
    r = add(s, "r", 8, max_tokens=1)
    s.step(sample, in_flight=True)
    assert s.step(sample, in_flight=True).scheduled == []
    free_before = m.block_pool.get_num_free_blocks()
    assert s.complete_step() == []
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.all_token_ids[8:] == [1008]
    assert m.block_pool.get_num_free_blocks() == free_before + 2


def test_a_request_a_step_in_flight_reads_is_not_preempted():
    """As vLLM's Scheduler (a deferred free does not help an allocation now): r (7 tokens) and
    q (4) sample in step 1, left in flight, and step 2 (in flight) takes the last free block
    for q. In step 3 r's next token needs a block; the victim, q, is read by the steps in
    flight, so nothing is preempted and nothing scheduled; once they complete, a step
    preempts q for r."""
    m, s = setup(5, token_budget=16)
    r = add(s, "r", 7, max_tokens=4)
    q = add(s, "q", 4, base=100, max_tokens=4)
    s.step(sample, in_flight=True)
    s.step(sample, in_flight=True)
    out = s.step(sample, in_flight=True)
    assert (out.scheduled, out.preempted) == ([], [])
    assert r.status == q.status == RequestStatus.RUNNING and len(s.in_flight) == 2
    s.complete_step()
    s.complete_step()
    assert (r.all_token_ids[7:], q.all_token_ids[4:]) == ([1007, 1008], [1004, 1005])
    out = s.step(sample)
    assert (out.scheduled, out.preempted) == ([("r", 1, 0)], ["q"])

def test_complete_step_with_nothing_in_flight_raises():
    _, s = setup(10)
    with pytest.raises(ValueError, match="no step is in flight"):
        s.complete_step()
