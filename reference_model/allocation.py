"""allocate_slots (docs/spec.md §6.4) and the per-group operations it is made of: the full-sequence
gate's block count (§4.3, §5.2), adopting prefix hits (§4.4, §5.2), allocating new blocks with
copy-on-write (§4.5), freeing out-of-window blocks (§4.7) and freeing a request (§4.7, §5.2).

The per-step prediction (step 5) is *defined* as the number of blocks that steps 7-8 take from
the free queue when run on a trial copy of the state; the copy is adopted when the capacity
check passes, so a None leaves only step 4's effects and success takes exactly the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfuzz.reference_model.caching import cache_request, checkpoint_exportable, state_checkpoint
from kvfuzz.reference_model.layout import Group, Layout, cdiv
from kvfuzz.reference_model.lookup import Lists
from kvfuzz.reference_model.requests import WAITING_STATES, Request
from kvfuzz.reference_model.state import NULL, State


@dataclass(frozen=True)
class Allocation:
    """What one allocate_slots call did, for the op result and the probe."""

    outcome: str
    """"blocks" (success), "gate" (full-sequence gate refused) or "capacity" (step 6 refused)."""
    new_blocks: Lists | None = None
    prediction: int | None = None
    free_before: int | None = None
    free_after: int | None = None
    group_taken: tuple[int, ...] | None = None
    shortage: str | None = None


def gate_block_count(
    layout: Layout,
    state: State,
    req: Request,
    num_tokens: int,
    hits: Lists,
    num_encoder_tokens: int,
    total_computed: int,
    local_computed: int,
) -> int:
    """get_num_blocks_to_allocate with apply_admission_cap=True, as docs/spec.md §4.3's formula
    (summed over groups, §5.2); used only by the full-sequence gate."""
    rid = req.request_id
    need = 0
    for g in layout.groups:
        if g.kind == "cross":
            T, group_hits, total, local = num_encoder_tokens, [], 0, 0
        else:
            T, group_hits, total, local = num_tokens, hits[g.gid], total_computed, local_computed
        if g.kind == "circular_buffer":  # one ring block, claimed once (§12.3)
            need += 0 if state.tables[g.gid].get(rid) else 1
            continue
        if g.kind == "encoder_only":  # takes no KV cache (§12.4)
            continue
        if defers_hit(state, g, group_hits):
            need += layout.num_blocks + 1
            continue
        if g.align:
            checkpoint = checkpoint_position(layout, state, g, req, total, T) > 0
            need += align_block_count(state, g, rid, T, group_hits, local, total, checkpoint)
            continue
        R = cdiv(T + g.speculative, g.bs)
        if g.cap is not None:
            R = min(R, g.cap)
        table = state.tables[g.gid].get(rid)
        H = len(table) if table is not None else 0
        if rid in state.num_cached[g.gid]:
            need += max(R - H, 0)
            continue
        S = g.skipped(total) // g.bs
        L = len(group_hits) + H
        new = max(R - max(S, L), 0)
        skip_new = max(0, S - H)
        E = sum(1 for b in group_hits[skip_new:] if b != NULL and state.ref_count(b) == 0)
        P = 1 if group_hits and local % g.bs != 0 else 0
        need += new + P + E
    return need


def defers_hit(state: State, g: Group, hits: list[int]) -> bool:
    """docs/spec.md §11.3: a state group's hit whose last block got its key in this step is
    refused for this step (its state is written by this step's forward pass)."""
    return g.kind == "mamba" and bool(hits) and hits[-1] != NULL and (
        state.primary[hits[-1]] in state.cached_this_step[g.gid]
    )


def align_block_count(
    state: State, g: Group, rid: str, T: int, hits: list[int], local: int, total: int,
    checkpoint: bool = False,
) -> int:
    """docs/spec.md §11.3's formula for a mamba "align" group (used by the full-sequence gate;
    the per-step count is what the trial takes); a `checkpoint` block (§11.6) raises the cap
    by one."""
    table = state.tables[g.gid].get(rid)
    if table is None and total > local:
        return external_align_block_count(state, g, T, hits, local, total, checkpoint)
    new = cdiv(T, g.bs) + g.spec_blocks - len(hits) - (len(table) if table else 0)
    partial = bool(hits) and local % g.bs != 0 or rid in state.partial_hits[g.gid]
    if partial:
        new = max(new, 0) + 1
    if new > 0:
        new = min(new, 1 + partial + checkpoint
                  + (0 if rid in state.allocated[g.gid] else g.spec_blocks))
    return max(new, 0) + sum(1 for b in hits if b != NULL and state.ref_count(b) == 0)


def external_align_block_count(
    state: State, g: Group, T: int, hits: list[int], local: int, total: int,
    checkpoint: bool = False,
) -> int:
    """A first allocation with external tokens (docs/spec.md §13.1) on a mamba "align" group,
    step by step: the hits the prefix passes turn null, the prefix's state takes its block,
    then the step's own state block (and a partial hit's copy, and a checkpoint block just
    below the state, §11.6) after nulls."""
    passed = (total - 1) // g.bs
    kept = hits[passed:]
    length = max(passed, len(hits))
    external = max(0, cdiv(total, g.bs) - length)
    length = max(length, cdiv(total, g.bs))
    required = cdiv(T, g.bs) + g.spec_blocks
    partial = bool(kept) and local % g.bs != 0
    new = 0
    if required > length or partial:
        new = max(required - max(length, required - g.spec_blocks - 1 - checkpoint), 0) + partial
    return external + new + sum(1 for b in kept if b != NULL and state.ref_count(b) == 0)


def checkpoint_position(
    layout: Layout, state: State, g: Group, req: Request, start: int, end: int
) -> int:
    """docs/spec.md §11.6 (vLLM's _needs_internal_checkpoint): the position whose state a
    chunk [start, end) writes into a reserved block of group g, or 0 for none. The candidate
    is the checkpoint position of (end, alignment); it is taken when the group has checkpoint
    blocks, the chunk reaches the prefill's end (max(P, T − 1), or 0, that is any chunk,
    unless the retention interval is 0), the chunk can export it, and its slot
    `cdiv(end, bs) − 2` is >= 0 and free to hold it: past the table, a null, or, for a request
    allocated before, one of its last s (draft) positions. A chunk that verifies drafts
    (`end > T`) is a decode row, which the worker never checkpoints: none (docs/findings/035)."""
    if not g.checkpoints or end > req.num_tokens:
        return 0
    prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1) if layout.retention == 0 else 0
    position = state_checkpoint(end, layout.alignment, layout.replay_eagle,
                                layout.lookahead)
    index = cdiv(end, g.bs) - 2
    if end < prefill_end or index < 0 or not checkpoint_exportable(
            start, end, position, layout.hbs, g.bs, g.checkpoint_alignment):
        return 0
    table = state.tables[g.gid].get(req.request_id, [])
    allocated = req.request_id in state.allocated[g.gid]
    if (index >= len(table) or table[index] == NULL
            or (allocated and index >= len(table) - g.spec_blocks)):
        return position
    return 0


def record_checkpoints(
    layout: Layout, state: State, req: Request, start: int, end: int
) -> None:
    """docs/spec.md §11.6: each checkpointing group records the chunk's start, and its
    checkpoint (position, slot `cdiv(end, bs) − 2`, the chunk's start) or forgets the request's
    last one. Done on the trial: a refused allocation leaves the last successful allocation's
    records (vLLM records the checkpoint in the count, before the capacity check:
    docs/findings/019)."""
    for g in layout.groups:
        if not g.checkpoints:
            continue
        state.step_starts[g.gid][req.request_id] = start
        position = checkpoint_position(layout, state, g, req, start, end)
        if position:
            state.checkpoints[g.gid][req.request_id] = (position, cdiv(end, g.bs) - 2, start)
        else:
            state.checkpoints[g.gid].pop(req.request_id, None)


def adopt_hits(layout: Layout, state: State, req: Request, hits: Lists, local: int,
               external: int = 0) -> list[int]:
    """Coordinator allocate_new_computed_blocks (docs/spec.md §5.2) = every group's
    add_local_computed_blocks (§4.4), all touches before any pop. Only untracked requests get
    here (API misuse 3 rejects hits for a tracked one). Returns per-group blocks taken from the
    free queue (touched free hits)."""
    rid = req.request_id
    taken = [0] * len(layout.groups)
    for g in layout.groups:
        if g.kind in ("cross", "circular_buffer", "encoder_only"):
            assert not hits[g.gid], f"{g.kind} hits"
            continue
        assert not state.tables[g.gid].get(rid), "adopting into a non-empty table"
        before = len(state.free)
        S = g.skipped(local + external) // g.bs
        remaining = hits[g.gid][S:]
        assert layout.caching or not remaining
        for b in remaining:
            state.touch(b)
        table = [NULL] * S + remaining
        state.tables[g.gid][rid] = table
        state.num_cached[g.gid][rid] = len(table)
        if remaining and local % g.bs != 0:
            state.partial_hits[g.gid][rid] = (local // g.bs, remaining[-1])
            state.num_cached[g.gid][rid] = local // g.bs
        taken[g.gid] = before - len(state.free)
    return taken


def external_blocks(layout: Layout, state: State, req: Request, local: int, external: int
                    ) -> list[int]:
    """docs/spec.md §13.1: after every group adopted its hits, each group's table grows to
    cover the prefix of local + external tokens, unless all the external tokens left the
    window. Returns per-group blocks taken."""
    taken = []
    for g in layout.groups:
        if g.kind in ("cross", "encoder_only"):  # no KV to load (§13.1)
            taken.append(0)
            continue
        table = state.tables[g.gid].setdefault(req.request_id, [])
        if g.kind == "circular_buffer":  # the load claims the ring (§12.3)
            blocks = [] if table else state.get_new_blocks(1)
            table.extend(blocks)
            taken.append(len(blocks))
            continue
        prefix = local + external
        inside = min(external, prefix - g.skipped(prefix))
        blocks = state.get_new_blocks(max(0, cdiv(prefix, g.bs) - len(table))) if inside > 0 \
            else []
        table.extend(blocks)
        if layout.zeroing and g.kind != "mamba":  # state blocks are never zeroed
            state.new_block_ids[g.gid].extend(blocks)
        taken.append(len(blocks))
    return taken


def allocate_new_blocks(
    layout: Layout, state: State, req: Request, slots: int, main: int, num_encoder_tokens: int
) -> tuple[Lists, list[int]]:
    """Coordinator allocate_new_blocks (docs/spec.md §5.2, §4.5): per group in order, the CoW block
    (if a partial hit is pending) then enough blocks to cover the slots. Returns the new ids
    per group and the number of blocks each group took."""
    rid = req.request_id
    new: Lists = []
    taken: list[int] = []
    for g in layout.groups:
        if g.align:
            result, k = allocate_align(state, g, rid, main)
            new.append(result)
            taken.append(k)
            continue
        T = num_encoder_tokens if g.kind == "cross" else slots + g.speculative
        result: list[int] = []
        table = state.tables[g.gid].setdefault(rid, [])
        if g.kind == "encoder_only":  # an empty table, never a block (§12.4)
            new.append(result)
            taken.append(0)
            continue
        if g.kind == "circular_buffer":
            if not table:
                result = state.get_new_blocks(1)
                table.extend(result)
            new.append(result)
            taken.append(len(result))
            continue
        if rid in state.partial_hits[g.gid]:
            index, src = state.partial_hits[g.gid].pop(rid)
            cow = state.get_new_blocks(1)[0]
            assert table[index] == src and src != NULL
            table[index] = cow
            state.pending_copies[g.gid].append((src, cow))
            state.new_block_ids[g.gid].append(cow)
            result.append(cow)
        k = cdiv(T, g.bs) - len(table)
        if k > 0:
            blocks = state.get_new_blocks(k)
            table.extend(blocks)
            if layout.zeroing and g.kind != "mamba":  # (rings never get here)
                state.new_block_ids[g.gid].extend(blocks)
            result.extend(blocks)
        new.append(result)
        taken.append(len(result))
    return new, taken


def allocate_align(state: State, g: Group, rid: str, main: int) -> tuple[list[int], int]:
    """docs/spec.md §11.3, a mamba "align" group for `main` main-model tokens: the table's new
    entries (nulls and moved draft blocks included) and the number of blocks taken. With a
    recorded checkpoint (§11.6) the slot below the new state position is not padded with a
    null nor left by a draft block: it holds a block too."""
    table = state.tables[g.gid].setdefault(rid, [])
    s = g.spec_blocks
    required = cdiv(main, g.bs) + s
    partial = state.partial_hits[g.gid].get(rid)
    allocated = rid in state.allocated[g.gid]
    state.allocated[g.gid].add(rid)
    checkpoint = 1 if rid in state.checkpoints[g.gid] else 0
    prev = len(table)
    if required <= prev and partial is None and not checkpoint:
        return [], 0
    if allocated:
        state.last_state[g.gid][rid] = prev - 1 - s
    elif prev:
        state.last_state[g.gid][rid] = prev - 1
    state_index = required - s - 1
    # A checkpoint's slot, just below the new state position, gets a block, not a null.
    table.extend([NULL] * (state_index - checkpoint - prev))
    if allocated:
        for i in range(prev - s, min(prev, state_index - checkpoint)):
            block = table[i]
            assert state.ref_count(block) == 1 and state.primary[block] is None, (
                f"draft block {block} is shared or cached"
            )
            table.append(block)
            table[i] = NULL
    k = max(required - len(table), 0) + (partial is not None)
    blocks = state.get_new_blocks(k)
    result = table[prev:]
    if partial is not None:
        index, src = state.partial_hits[g.gid].pop(rid)
        cow = blocks.pop(0)
        assert table[index] == src and src != NULL
        state.pending_copies[g.gid].append((src, cow))
        if allocated:
            if cow >= state.num_blocks:  # a phantom: this trial is never adopted
                return result, k
            state.move_keys(src, cow)
            if state.primary[cow] is not None:
                state.cached_this_step[g.gid].add(state.primary[cow])
        else:
            table[index] = cow
            result.insert(0, cow)
    table.extend(blocks)
    result.extend(blocks)
    return result, k


def remove_skipped_blocks(layout: Layout, state: State, req: Request, processed: int) -> None:
    """docs/spec.md §4.7, every group: entries wholly before the window become null (walking back from
    the last skipped block, stopping at the first null) and are freed, highest index first.
    Reads the table without creating one (§10.1)."""
    rid = req.request_id
    for g in layout.groups:
        skipped = g.skipped(processed)
        table = state.tables[g.gid].get(rid)
        if g.align:
            if table:
                release_passed_states(state, g, rid, table, processed)
            continue
        if g.rswa and table is not None:
            release_rswa_gap(g.rswa, g.bs, state, table, req.num_prompt_tokens, processed)
        if skipped <= 0 or table is None:
            continue
        replaced = []
        for i in range(min(skipped // g.bs, len(table)) - 1, -1, -1):
            if table[i] == NULL:
                break
            replaced.append(table[i])
            table[i] = NULL
        state.release(replaced)


def release_passed_states(
    state: State, g: Group, rid: str, table: list[int], processed: int
) -> None:
    """docs/spec.md §11.3: positions below `(n − 1) // bs` not yet retired become null (nulls
    between states are skipped, not a stop), highest first; then the previous step's state
    block once n has passed it."""
    last = min((processed - 1) // g.bs, len(table))
    first = state.retired[g.gid].get(rid, 0)
    if processed > 1 and first < last:
        released = []
        for i in range(last - 1, first - 1, -1):
            if table[i] != NULL:
                released.append(table[i])
                table[i] = NULL
        state.release(released)
        state.retired[g.gid][rid] = last
    index = state.last_state[g.gid].get(rid)
    if index is not None and index < cdiv(processed, g.bs) - 1 and table[index] != NULL:
        block = table[index]
        table[index] = NULL
        state.release([block])


def release_rswa_gap(
    window: int, bs: int, state: State, table: list[int], prompt: int, processed: int
) -> None:
    """docs/spec.md §12.2: the positions wholly after the prompt's last block and before the
    decode window, [cdiv(prompt, bs), (processed − window) // bs), become null walking back
    from the end and stopping at the first null; freed in that order."""
    if processed - window <= prompt:
        return
    replaced = []
    for i in range(min((processed - window) // bs, len(table)) - 1, cdiv(prompt, bs) - 1, -1):
        if table[i] == NULL:
            break
        replaced.append(table[i])
        table[i] = NULL
    state.release(replaced)


def free_request(layout: Layout, state: State, rid: str) -> None:
    """Coordinator free (docs/spec.md §5.2, §4.7): per group in order, drop the table, num_cached_block
    and partial-hit record, then release the table without its leading nulls, tail first."""
    for g in layout.groups:
        state.release(list(reversed(_pop_table(state, g.gid, rid))))


def pop_request_blocks(layout: Layout, state: State, rid: str) -> list[list[int]]:
    """pop_blocks_for_free (docs/spec.md §4.7): every group's table as `free_request` drops it,
    one list per group, still held."""
    return [_pop_table(state, g.gid, rid) for g in layout.groups]


def _pop_table(state: State, gid: int, rid: str) -> list[int]:
    table = state.tables[gid].pop(rid, [])
    state.num_cached[gid].pop(rid, None)
    state.partial_hits[gid].pop(rid, None)
    state.allocated[gid].discard(rid)
    state.last_state[gid].pop(rid, None)
    state.retired[gid].pop(rid, None)
    state.checkpoints[gid].pop(rid, None)
    state.step_starts[gid].pop(rid, None)
    while table and table[0] == NULL:
        table.pop(0)
    return table


def allocate_slots(
    layout: Layout,
    state: State,
    req: Request,
    num_new_tokens: int,
    hit: int,
    hits: Lists | None,
    num_lookahead_tokens: int,
    num_encoder_tokens: int,
    full_sequence_must_fit: bool,
    reserved_blocks: int,
    has_scheduled_reqs: bool,
    external: int = 0,
    delay_cache: bool = False,
) -> tuple[State, Allocation]:
    """docs/spec.md §6.4 steps 1-11 (step 0's ValueError is checked by the caller). `hits` is None when
    no lookup is passed; a lookup whose lists are all empty is the shared empty instance, so
    hits are adopted only when some list is non-empty (§2.8 create, §6.4 step 7).

    Returns the state to continue from (the adopted trial copy on success) and what happened.
    """
    lists = hits if hits is not None else [[] for _ in layout.groups]
    adopt = any(lists) or external > 0
    local = req.num_computed_tokens + hit
    total = min(local + external, layout.max_model_len)
    wm = layout.watermark_blocks if has_scheduled_reqs and req.status in WAITING_STATES else 0
    if full_sequence_must_fit:
        full = min(req.num_tokens, layout.max_model_len)
        need = gate_block_count(layout, state, req, full, lists, num_encoder_tokens, total, local)
        if need + wm > len(state.free):
            return state, Allocation("gate")
    main = total + num_new_tokens
    slots = min(main + num_lookahead_tokens, layout.max_model_len)
    # Only settled tokens: a step in flight still reads the window before its tokens.
    remove_skipped_blocks(layout, state, req, max(0, total - req.num_in_flight_tokens))

    free_before = len(state.free)
    trial = state.trial_copy()
    record_checkpoints(layout, trial, req, local + external, main)
    adopted = adopt_hits(layout, trial, req, lists, local, external) if adopt else (
        [0] * len(layout.groups))
    if external:
        adopted = [a + b for a, b in zip(adopted, external_blocks(layout, trial, req, local,
                                                                    external))]
    new_blocks, allocated = allocate_new_blocks(layout, trial, req, slots, main,
                                                num_encoder_tokens)
    group_taken = tuple(a + b for a, b in zip(adopted, allocated))
    prediction = trial.blocks_taken_since(free_before)
    assert prediction == sum(group_taken)
    deferring = [g.gid for g in layout.groups if defers_hit(state, g, lists[g.gid])]
    if deferring:  # each such group counts N + 1: never fits
        prediction += sum(layout.num_blocks + 1 - group_taken[gid] for gid in deferring)
        return state, Allocation("capacity", prediction=prediction, free_before=free_before)
    if prediction + wm > free_before - reserved_blocks:
        return state, Allocation("capacity", prediction=prediction, free_before=free_before)
    if trial.phantoms_used:
        shortage = f"allocation of {prediction} blocks with {free_before} free"
        return state, Allocation(
            "capacity", prediction=prediction, free_before=free_before, shortage=shortage
        )
    if not delay_cache:
        cache_request(layout, trial, req, min(total + num_new_tokens, req.num_tokens))
    return trial, Allocation(
        "blocks",
        new_blocks=new_blocks,
        prediction=prediction,
        free_before=free_before,
        free_after=len(trial.free),
        group_taken=group_taken,
    )
