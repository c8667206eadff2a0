"""Mamba prefill checkpoint blocks in the reference model (docs/spec.md §11.6): the count,
allocation, caching and free of the reserved checkpoint block, and the driver's split that
leaves a checkpointed last chunk whole."""

from __future__ import annotations

from typing import Any

from rm_support import Runner, config, full

from kvfuzz.core.config import GroupConfig
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace

PROMPT = list(range(23))


def state(checkpoint_alignment: int | None = 1, blocks: int = 1) -> GroupConfig:
    """A Mamba "align" state group, bs 8, with `blocks` prefill checkpoint blocks."""
    return GroupConfig("mamba", 8, mamba_cache_mode="align", num_prefill_checkpoint_blocks=blocks,
                       prefill_checkpoint_alignment=checkpoint_alignment)


def runner(level: str, num_blocks: int = 16, **fields: Any) -> Runner:
    """Full attention bs 8 beside one state group, hash blocks of 4 (sub-block hits on, so
    the hit alignment is 4)."""
    group = state(**fields)
    return Runner(config(num_blocks, full(8), group, max_model_len=64, hash_block_size=4,
                         scheduler={"token_budget": 64}), level)


def test_checkpoint_block_counted_allocated_keyed_and_freed():
    """A 23-token prompt allocated whole: `allocate_slots(r, 23)`.

    Full attention takes cdiv(23, 8) = 3 blocks: [1, 2, 3].
    The state group: R = cdiv(23, 8) = 3; the checkpoint of the chunk end, (23 − 1) // 4 · 4
    = 20, can be exported (start 0 on a hash boundary; its slot cdiv(23, 8) − 2 = 1 is past
    the start state's slot (0 − 1) // 8 = −1; 0 + 4 <= 20 < 23; 20 − 0 on alignment 1), so
    slot 1 gets a block instead of a null: [null, 4, 5], 2 blocks (without the checkpoint:
    [null, null, 4], 1 block). The count is 3 + 2 = 5, what the allocation takes.

    cache_blocks(23): full attention keys 8 → 1, 16 → 2 and its prompt tail 20 → 3. The state
    group first keys its full block 1 (block 4) at 16, then the checkpoint (20, slot 1) is the
    prompt's checkpoint (the checkpoint position of (23, 4) is 20): block 4's keys are
    replaced by the key of 20. Block 5, the state after 23 tokens, gets none.
    """
    m = runner("api")
    m.add("r", PROMPT)
    assert m.run("allocate_slots", request_id="r", num_new_tokens=23) == {
        "block_ids": [[1, 2, 3], [0, 4, 5]]}
    probe = m.probes[-1]
    assert (probe.outcome, probe.prediction, probe.group_taken) == ("blocks", 5, (3, 2))
    snap = m.snap
    assert snap.requests["r"].tables == ((1, 2, 3), (0, 4, 5))
    assert snap.block_key_tokens[4] == 20 and snap.block_keys[4] == (1, None, tuple(PROMPT[:20]))
    assert snap.block_keys[5] is None
    assert [snap.block_key_tokens[b] for b in (1, 2, 3)] == [8, 16, 20]

    # A later request with the same prompt hits 20 in both groups; the state hit is block 4,
    # at the position of 20, (20 − 1) // 8 = 2.
    m.run("new_step_starts")
    m.add("s", PROMPT)
    assert m.run("get_computed_blocks", request_id="s") == {
        "block_ids": [[1, 2, 3], [0, 0, 4]], "num_computed_tokens": 20}

    # free releases the table without its leading null, tail first; the record goes with it.
    m.run("free", request_id="r")
    assert m.model.manager.state.checkpoints[1] == {}
    assert m.snap.free_queue[:1] == (5,)


def test_no_checkpoint_when_the_kernel_cannot_export_it():
    """Alignment 8: 20 − 0 is not a multiple of 8, so no block is reserved: the state group
    takes one block, [null, null, 4], and keys nothing (23 is not the prompt's boundary 20)."""
    m = runner("api", checkpoint_alignment=8)
    m.add("r", PROMPT)
    assert m.run("allocate_slots", request_id="r", num_new_tokens=23) == {
        "block_ids": [[1, 2, 3], [0, 0, 4]]}
    assert m.probes[-1].prediction == 4
    assert m.snap.block_keys[4] is None


def test_refused_allocation_records_no_checkpoint():
    """Four free blocks cannot hold the 5 the chunk needs: nothing is allocated and no
    checkpoint is recorded (a later cache_blocks reads only a successful step's)."""
    m = runner("api", num_blocks=5)
    m.add("r", PROMPT)
    assert m.run("allocate_slots", request_id="r", num_new_tokens=23) is None
    assert m.probes[-1].prediction == 5
    assert m.model.manager.state.checkpoints[1] == {}


def test_split_leaves_a_checkpointed_last_chunk_whole():
    """With a budget of 64, a 23-token prompt: without checkpoint blocks the chunk stops at
    the last block end below the prompt, 16 (the checkpoint position of (23, 8)); with them,
    the prefill's checkpoint (the position of (23, 4), 20) is exportable from 0, so the chunk
    runs whole to 23."""
    m = runner("scheduler")
    m.add("r", PROMPT)
    assert m.run("step", sample=0)["scheduled"] == [["r", 23, 0]]

    m = runner("scheduler", blocks=0, checkpoint_alignment=None)
    m.add("r", PROMPT)
    assert m.run("step", sample=0)["scheduled"] == [["r", 16, 0]]


def test_split_without_an_exportable_checkpoint():
    """Alignment 8 cannot export 20 from 0 (20 − 0 is not a multiple of 8), so the split is
    as without checkpoints: 16. From 16 the checkpoint's slot cdiv(23, 8) − 2 = 1 is the start
    state's, (16 − 1) // 8 = 1, so again no export: the chunk stops at the prompt's tail
    boundary 20 (past the last block end 16), then the prompt's last 3 tokens."""
    m = runner("scheduler", checkpoint_alignment=8)
    m.add("r", PROMPT)
    assert m.run("step", sample=0)["scheduled"] == [["r", 16, 0]]
    assert m.run("step", sample=0)["scheduled"] == [["r", 4, 0]]
    assert m.run("step", sample=0)["scheduled"] == [["r", 3, 0]]


def test_an_earlier_chunk_reserves_a_transient_checkpoint_unless_retention_is_zero():
    """`allocate_slots(r, 16)` of the 23-token prompt: the chunk [0, 16) has the checkpoint
    (16 − 1) // 4 · 4 = 12 at slot cdiv(16, 8) − 2 = 0, exportable from 0.

    Without a retention interval vLLM passes the managers a prefill end of 0, so every chunk
    reserves its checkpoint: full attention takes [1, 2], the state group [3, 4] (2 blocks;
    the count is 4). Caching 16 first keys block 3 at 8 (a full block), then the checkpoint 12
    is neither the prompt's (20) nor a block end: block 3's state is transient, its keys are
    dropped. Block 4 (the state after 16) keeps its key at 16.

    With a retention interval of 0 only the chunk reaching the prefill's end, max(23, 22) = 23,
    reserves one: [null, 3], 1 block (the count is 3)."""
    m = runner("api")
    m.add("r", PROMPT)
    assert m.run("allocate_slots", request_id="r", num_new_tokens=16) == {
        "block_ids": [[1, 2], [3, 4]]}
    snap = m.snap
    assert snap.requests["r"].tables[1] == (3, 4)
    assert snap.block_keys[3] is None and snap.block_key_tokens[4] == 16
    assert m.probes[-1].prediction == 4

    group = state()
    m = Runner(config(16, full(8), group, max_model_len=64, hash_block_size=4,
                      prefix_cache_retention_interval=0), "api")
    m.add("r", PROMPT)
    m.run("allocate_slots", request_id="r", num_new_tokens=16)
    assert m.snap.requests["r"].tables[1] == (0, 3)
    assert m.probes[-1].prediction == 3


def test_a_draft_block_at_the_checkpoint_slot_stays_and_holds_the_checkpoint():
    """One draft block (s = 1). `allocate_slots(r, 8)`: [0, 8) has no checkpoint slot
    (cdiv(8, 8) − 2 = −1); full [1], state [2, 3] (state, draft).

    `allocate_slots(r, 15)`: [8, 23) exports 20 at slot 1, which holds r's draft block 3: a
    slot among its last s positions, so it is taken. R = cdiv(23, 8) + 1 = 4, the state
    position 2; no null pads (the table is 2 long), and the draft block at 1 is not moved
    (only positions below 2 − 1 = 1 are): it stays as the checkpoint block. Then
    4 − 2 = 2 new blocks: [2, 3, 6, 7] (full attention took [4, 5] first); the count is
    2 + 2 = 4 (without the checkpoint 3: [2, null, 3, 6]).

    Caching 23 keys block 3 as the full block of 16, then re-keys it at the prompt's
    checkpoint 20."""
    m = Runner(config(32, full(8), GroupConfig(
        "mamba", 8, mamba_cache_mode="align", num_speculative_blocks=1,
        num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1),
        max_model_len=64, hash_block_size=4), "api")
    m.add("r", PROMPT)
    assert m.run("allocate_slots", request_id="r", num_new_tokens=8) == {"block_ids": [[1], [2, 3]]}
    assert m.run("allocate_slots", request_id="r", num_new_tokens=15) == {
        "block_ids": [[4, 5], [6, 7]]}
    assert m.probes[-1].prediction == 4
    snap = m.snap
    assert snap.requests["r"].tables == ((1, 4, 5), (2, 3, 6, 7))
    assert snap.block_key_tokens[3] == 20 and snap.block_key_tokens[2] == 8


def test_a_chunk_cut_at_its_junction_leaves_the_block_it_resumed_inside_unkeyed():
    """Full attention and a state group of bs 8, hash blocks of 2, alignment 2 (finding 021's
    trace). `c` hits B's state after 2 with junction 16; its prefill [2, 24) could export its
    checkpoint, so the driver does not cut it at 8, then cuts it at the junction floored from
    2, at 10. No checkpoint is reserved, and the block c resumed inside keeps no key (§11.3)."""
    m = Runner(config(26, full(8), state(2), max_model_len=64, hash_block_size=2), "scheduler")
    prompt_a = [2, 0, 1, 3, 1, 1, 0, 2, 3, 3, 0, 1, 2, 2, 1, 0, 3, 1, 0, 2]
    for rid, prompt, steps in (("a", prompt_a, 1), ("b", [2, 0, 1], 2)):
        m.add(rid, prompt, max_tokens=1)
        for _ in range(steps):
            m.run("step")
    m.add("c", prompt_a[:16] + [0] * 8, max_tokens=1)
    assert m.run("step")["scheduled"] == [["c", 8, 2]]
    view = m.snap.requests["c"]
    assert view.shared_prefix_boundary == 16
    assert m.snap.block_keys[view.tables[1][0]] is None  # the state after 2, not after 8


def test_a_step_verifying_drafts_reserves_no_checkpoint():
    """docs/findings/035: the worker checkpoints prefill rows only. r (8 tokens; full
    attention bs 4, a state group bs 2 with 4 draft blocks, hash blocks of 1) prefills, then
    decodes one token and proposes 3 drafts. The step verifying them schedules [9, 13): the
    checkpoint of 13 would be 12, among the drafts, whose hash does not exist. Neither the model
    (which asserted `block re-hashed` once the drafts were accepted) nor kvcache (which raised,
    as vLLM does) reserves one."""
    cfg = config(16, full(4), GroupConfig("mamba", 2, mamba_cache_mode="align",
                                          num_prefill_checkpoint_blocks=2,
                                          prefill_checkpoint_alignment=1,
                                          num_speculative_blocks=4),
                 max_model_len=64, hash_block_size=1)
    trace = Trace(cfg, "scheduler", [
        {"op": "add_request", "request_id": "r1", "prompt": [0] * 8},
        {"op": "step"},
        {"op": "step", "draft": 4, "drafted": {"r1": 3}},
        {"op": "step"},
    ])
    steps: list[Any] = []
    result = run_trace(trace, ["kvcache"], on_step=lambda i, op, res: steps.append(res))
    assert result.passed, result.finding or result.invalid
    assert steps[3]["scheduled"] == [["r1", 4, 0]]
