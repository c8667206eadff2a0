"""Mamba prefill checkpoint blocks (docs/spec.md §11.6): a worked example in kvcache, and the
predictor equal to what allocation takes when a step reserves a checkpoint block."""

from __future__ import annotations

import pytest

from kvfuzz.kvcache import FullAttentionSpec, MambaSpec
from kvfuzz.kvcache.scheduler import Scheduler
from kvfuzz.kvcache.single_type_kv_cache_manager import MambaManager

from kvcache_testkit import make_manager, make_request, record_predictions, table_ids

def _checkpointed(block_size: int, alignment: int, speculative: int = 0) -> MambaSpec:
    return MambaSpec(block_size=block_size, mamba_cache_mode="align",
                     num_speculative_blocks=speculative, num_prefill_checkpoint_blocks=1,
                     prefill_checkpoint_alignment=alignment)


def _ids(blocks) -> list[list[int]]:
    return [list(g) for g in blocks.get_block_ids()]


def test_a_last_chunk_keeps_its_checkpoint_and_a_second_request_resumes_there():
    """Full attention and a state group of bs 8, hash blocks of 2 (sub-block hits: the
    checkpoint unit is 2), checkpoint alignment 2. A's prompt has 13 tokens, computed in one
    chunk [0, 13): the prompt's checkpoint is (13 − 1) // 2 · 2 = 12, valid (the chunk starts
    on a hash boundary, 0 + 2 ≤ 12 < 13, 12 − 0 is even, and its column cdiv(13, 8) − 2 = 0
    lies past the start state's column −1), so the chunk is not split at 12.

    Count, state group: R = cdiv(13, 8) = 2, new = 2, cap 1 + 1 (checkpoint) = 2; full
    attention 2: 4 in all. Allocation: the null padding would end at R − 1 = 1 but stops one
    short, at 0, so both positions get fresh blocks: full [1, 2], state [3, 4]; block 3
    (position 0) receives the state after 12 tokens, block 4 the state after 13.

    Caching 13 tokens: block 3 is first registered as position 0's full block (8 tokens), then
    re-keyed to the checkpoint: its key is the hash of the first 12 tokens and nothing else.
    B (the same 13 tokens and 3 more) hits 12 tokens: full [1, 2], state [null, 3] (12 lies in
    position 1); not in the step that wrote it. Next step the hit ends inside a block, so both
    shared tail blocks are copied on write: B's tables are [1, 5] and [0, 6]."""
    manager = make_manager(20, FullAttentionSpec(block_size=8), _checkpointed(8, 2),
                           hash_block_size=2)
    state = manager.coordinator.single_type_managers[1]
    pool = manager.block_pool
    prompt = list(range(13))
    a = make_request("a", prompt, 2)
    predictions = record_predictions(manager)
    assert _ids(manager.allocate_slots(a, 13)) == [[1, 2], [3, 4]]
    assert predictions == [4]
    assert state._checkpoints == {"a": (12, 0)}
    a.num_computed_tokens = 13
    checkpoint_block = pool.blocks[3]
    assert checkpoint_block.block_hash == a.block_hashes[5] + b"\x00\x00\x00\x01"
    assert checkpoint_block.block_hash_num_tokens == 12
    assert 3 not in pool.cached_block_hashes_by_block  # the 8-token key is gone
    b = make_request("b", prompt + [7, 7, 7], 2)
    hit, num_hit, _ = manager.get_computed_blocks(b)
    assert num_hit == 12 and _ids(hit) == [[1, 2], [0, 3]]
    assert manager.allocate_slots(b, 4, num_hit, hit) is None  # written this step
    manager.new_step_starts()
    hit, num_hit, _ = manager.get_computed_blocks(b)
    assert _ids(manager.allocate_slots(b, 4, num_hit, hit)) == [[5], [6]]
    assert table_ids(manager, "b") == [[1, 5], [0, 6]]
    copies, _ = manager.take_kv_cache_block_copies()
    assert [(c.src_block_id, c.dst_block_id) for c in copies] == [(2, 5), (3, 6)]
    manager.free(a)
    assert "a" not in state._checkpoints


def test_a_running_request_exports_its_checkpoint_into_its_draft_block():
    """bs 4, one draft block, alignment 1. The first chunk [0, 4) takes [state 1, draft 2];
    the last chunk [4, 11) has the checkpoint 8 in column cdiv(11, 4) − 2 = 1, the draft
    block's: predicted min(R − H, 1 + 1) = min(4 − 2, 2) = 2. The draft block is not moved to
    the end (it stays where the checkpoint is exported), and two fresh blocks follow: the
    state after 11 (3) and the new draft block (4)."""
    manager = make_manager(16, _checkpointed(4, 1, speculative=1))
    request = make_request("r", list(range(11)), 4)
    predictions = record_predictions(manager)
    assert _ids(manager.allocate_slots(request, 4)) == [[1, 2]]
    request.num_computed_tokens = 4
    assert _ids(manager.allocate_slots(request, 7)) == [[3, 4]]
    assert predictions == [2, 2]
    assert table_ids(manager, "r") == [[1, 2, 3, 4]]
    state = manager.coordinator.single_type_managers[0]
    assert state._checkpoints == {"r": (8, 1)} and state._step_starts == {"r": 4}


def _steps_taking_what_they_predict(manager, steps) -> list[int]:
    """Run `(request, num_new_tokens)` steps, a new step before each (a same-step hit would
    wait), each computed at once; every prediction must equal the blocks its allocation takes
    from the pool (no hit here is a free cached block). The steps' checkpoint records (1 or 0)
    come back."""
    predictions = record_predictions(manager)
    pool = manager.block_pool
    taken = []
    get_new_blocks = pool.get_new_blocks
    pool.get_new_blocks = lambda n: taken.append(n) or get_new_blocks(n)
    states = [m for m in manager.coordinator.single_type_managers if isinstance(m, MambaManager)]
    reserved = []
    for request, num_new_tokens in steps:
        manager.new_step_starts()
        hit, num_hit = None, 0
        if request.request_id not in manager.coordinator.single_type_managers[0].req_to_blocks:
            hit, num_hit, _ = manager.get_computed_blocks(request)
        taken.clear()
        assert manager.allocate_slots(request, num_new_tokens, num_hit, hit) is not None
        assert sum(taken) == predictions[-1]
        request.num_computed_tokens += num_hit + num_new_tokens
        reserved.append(int(request.request_id in states[0]._checkpoints))
    return reserved


def test_the_predictor_equals_what_allocation_takes_with_checkpoints():
    """First allocations, running requests with draft slots, and a sub-block hit's copy, each
    in a step that reserves a checkpoint block (nothing cached is evicted: the pools are big)."""
    plain = make_manager(64, _checkpointed(4, 1))
    a = make_request("a", list(range(23)), 4)
    assert _steps_taking_what_they_predict(plain, [(a, 8), (a, 15)]) == [1, 1]
    drafts = make_manager(64, _checkpointed(4, 1, speculative=2))
    b = make_request("b", list(range(19)), 4)
    assert _steps_taking_what_they_predict(drafts, [(b, 4), (b, 15)]) == [0, 1]
    hybrid = make_manager(64, FullAttentionSpec(block_size=8), _checkpointed(8, 2),
                          hash_block_size=2)
    c = make_request("c", list(range(13)), 2)
    d = make_request("d", list(range(13)) + [9] * 17, 2)
    assert _steps_taking_what_they_predict(hybrid, [(c, 13), (d, 18)]) == [1, 1]


@pytest.mark.parametrize("fields, needle", [
    ({"num_prefill_checkpoint_blocks": -1}, "num_prefill_checkpoint_blocks must be"),
    ({"num_prefill_checkpoint_blocks": True}, "num_prefill_checkpoint_blocks must be"),
    ({"prefill_checkpoint_alignment": 0}, "prefill_checkpoint_alignment must be"),
    ({"prefill_checkpoint_alignment": 1.0}, "prefill_checkpoint_alignment must be"),
])
def test_spec_refuses_bad_checkpoint_fields(fields, needle):
    with pytest.raises(ValueError, match=needle):
        MambaSpec(block_size=4, mamba_cache_mode="align", **fields)


def test_checkpoint_blocks_change_nothing_without_align():
    """Mode "none" reads neither field (vLLM's Mamba2 layers declare them in every mode)."""
    manager = make_manager(16, MambaSpec(block_size=4, num_prefill_checkpoint_blocks=1,
                                         prefill_checkpoint_alignment=1), enable_caching=False)
    request = make_request("r", list(range(11)), 4)
    assert _ids(manager.allocate_slots(request, 11)) == [[1, 2, 3]]


def test_a_checkpointed_chunk_leaves_the_block_it_resumed_inside_unkeyed():
    """Full attention and a state group of bs 8, hash blocks of 2, alignment 2. A's 3-token
    prompt stops at its tail boundary 2, which keys the state after 2 in block 2. B (17 tokens) hits 2: its
    chunk [2, 17) keeps the checkpoint 16 in column 1 and is not cut at 8, so the copy of
    block 2 in column 0 still holds the state after 2 when the step caches 16 tokens: it gets
    no key (vLLM keys it at 8, docs/findings/020), and C (B's first 9 tokens) hits only 2."""
    manager = make_manager(26, FullAttentionSpec(block_size=8), _checkpointed(8, 2),
                           hash_block_size=2)
    pool = manager.block_pool
    a = make_request("a", [2, 0, 1], 2)
    assert _ids(manager.allocate_slots(a, 2)) == [[1], [2]]  # cut at its tail boundary
    a.num_computed_tokens = 2
    manager.new_step_starts()
    b = make_request("b", [2, 0, 1, 2, 1, 3, 3, 1, 0, 0, 3, 0, 0, 1, 0, 3, 0], 2)
    hit, num_hit, _ = manager.get_computed_blocks(b)
    assert num_hit == 2
    assert _ids(manager.allocate_slots(b, 15, num_hit, hit)) == [[3, 4, 5], [6, 7, 8]]
    assert table_ids(manager, "b") == [[3, 4, 5], [6, 7, 8]]
    assert pool.blocks[6].block_hash is None  # the state after 2, not after 8
    assert pool.blocks[7].block_hash_num_tokens == 16  # the checkpoint
    manager.new_step_starts()
    c = make_request("c", b.all_token_ids[:9], 2)
    assert manager.get_computed_blocks(c)[1] == 2


def test_a_chunk_cut_at_its_junction_leaves_the_block_it_resumed_inside_unkeyed():
    """The same groups. A (20 tokens) keeps full-attention blocks up to 16 and states at 18
    and 20; B's 3-token prompt keys the state after 2. C shares A's first 16 tokens: it hits 2
    with junction 16. Its prefill [2, 24) could export the checkpoint 22, so the driver does not
    cut it at 8, but cuts it at the junction floored from 2, at 10 (§11.3). The chunk reserves
    no checkpoint, yet the copy of B's state block in column 0 still holds the state after 2
    when the step caches 10 tokens: it gets no key (vLLM keys it at 8, docs/findings/021)."""
    manager = make_manager(26, FullAttentionSpec(block_size=8), _checkpointed(8, 2),
                           hash_block_size=2)
    scheduler = Scheduler(manager, max_model_len=64, token_budget=32, max_running=4,
                          mamba_block_aligned_split=True, prefill_checkpoint_alignment=2)
    prompt_a = [2, 0, 1, 3, 1, 1, 0, 2, 3, 3, 0, 1, 2, 2, 1, 0, 3, 1, 0, 2]

    def run(rid: str, prompt: list[int], steps: int) -> list[list[tuple[str, int, int]]]:
        scheduler.add_request(make_request(rid, prompt, 2, max_tokens=1))
        return [scheduler.step(lambda request: 0).scheduled for _ in range(steps)]

    assert run("a", prompt_a, 1) == [[("a", 20, 0)]]
    assert run("b", [2, 0, 1], 2) == [[("b", 2, 0)], [("b", 1, 0)]]
    assert run("c", prompt_a[:16] + [0] * 8, 1) == [[("c", 8, 2)]]
    assert scheduler.running[0].shared_prefix_boundary == 16
    start_block = manager.coordinator.single_type_managers[1].req_to_blocks["c"][0]
    assert start_block.block_hash is None  # the state after 2, not after 8
