"""Recording blocks in the prefix cache: the coordinator's cacheable tokens (docs/spec.md §5.2, §5.5),
layer-3 cache_blocks (§4.6) with the sliding-window sparse mask (§4.9.2) and the state
checkpoints kept under retention (§11.3), and the pool's
cache_full_blocks / cache_partial_block (§3.3, §3.11). Keys are content (group, salt, prefix)."""

from __future__ import annotations

from kvfuzz.core.snapshot import CacheKey
from kvfuzz.reference_model.layout import Group, Layout, cdiv
from kvfuzz.reference_model.requests import Request
from kvfuzz.reference_model.state import NULL, State


def cache_request(layout: Layout, state: State, req: Request, num_tokens: int) -> None:
    """Coordinator cache_blocks: every group (caching on; never cross attention, which needs
    caching off) caches up to its cacheable token count."""
    if not layout.caching:
        return
    for g in layout.groups:
        if g.kind != "circular_buffer":
            cache_group(layout, state, g, req, cacheable(layout, g, num_tokens))


def cacheable(layout: Layout, g: Group, n: int) -> int:
    """cacheable(n, g): the finalized tokens (all but the re-prefillable ones, §5.7), except in
    the hybrid coordinator (docs/spec.md §5.5): n rounded down to a multiple of sbs (not under
    partial hits), or, for a group whose manager has use_eagle set (vLLM reads the manager's
    flag, which only a dropping spec group sets) and a positive rounding, one block more than
    the finalized tokens' rounding, but no more than them."""
    finalized = max(n - layout.reprefillable, 0)
    if not layout.hybrid:
        return finalized
    rounded = n if layout.partial_hits else (n // layout.sbs) * layout.sbs
    if g.use_eagle and rounded > 0:
        base = finalized if layout.partial_hits else finalized // layout.sbs * layout.sbs
        return min(finalized, base + g.bs)
    return rounded


def cache_group(layout: Layout, state: State, g: Group, req: Request, num_tokens: int) -> None:
    """Layer-3 cache_blocks (docs/spec.md §4.6) for one group."""
    rid = req.request_id
    table = state.tables[g.gid][rid]
    c = state.num_cached[g.gid].get(rid, 0)
    full = min(num_tokens, req.hashed_tokens(layout.hbs)) // g.bs
    if c < full:
        start_state = _start_state_column(state, g, rid, num_tokens)
        for i in range(c, full):
            block = table[i]
            if block == NULL or i == start_state or not sparse_mask_keeps(layout, g, i, req):
                continue
            cache_full_block(state, req, g, i, block)
        state.num_cached[g.gid][rid] = full
    # Step 5 runs even when no full block is new: the prompt tail may just have been reached.
    if g.kind == "full" and g.bs != layout.hbs:
        _cache_prompt_tail(layout, state, g, req, num_tokens, table)
    if g.kind == "mamba":
        if g.align:
            if req.request_id in state.checkpoints[g.gid]:
                key = _cache_checkpoint(layout, state, g, req, table)
            else:
                key = _cache_state_tail(layout, state, g, req, num_tokens, table)
            if key is not None:
                state.cached_this_step[g.gid].add(key)
        for block in table[c:full]:
            key = state.primary[block]
            if block != NULL and key is not None:
                state.cached_this_step[g.gid].add(key)


def _start_state_column(state: State, g: Group, rid: str, num_tokens: int) -> int | None:
    """docs/spec.md §11.3, §11.6: the column a step started inside, when it ran past that
    block's end (to num_tokens) without stopping there (a checkpointed step, or a chunk cut
    at a junction): the block holds the state at the step's start, never its block end's, so
    it gets no full-block key (vLLM keys it: docs/findings/020, 021)."""
    start = state.step_starts[g.gid].get(rid) if g.kind == "mamba" else None
    if start is None or not start % g.bs or num_tokens <= cdiv(start, g.bs) * g.bs:
        return None
    return (start - 1) // g.bs


def _cache_state_tail(
    layout: Layout, state: State, g: Group, req: Request, num_tokens: int, table: list[int]
) -> CacheKey | None:
    """docs/spec.md §11.3: the state at the prompt's checkpoint, its last hash boundary
    `(P − 1) // hbs · hbs` (with EAGLE one hash block below `P // hbs · hbs`), or, with junction
    states, at the request's junction J when a prompt chunk ends there (computed < J ≤ P),
    registered when num_tokens is exactly there; inside a block, the owner must copy it on its
    next allocation (a partial-hit record on itself). Returns the key registered."""
    hbs = layout.hbs
    if num_tokens <= 0 or num_tokens % hbs:
        return None
    at_junction = (layout.junction_states and num_tokens == req.shared_prefix_boundary
                   and req.num_computed_tokens < num_tokens <= req.num_prompt_tokens)
    if not at_junction and num_tokens != state_checkpoint(
            req.num_prompt_tokens, hbs, layout.replay_eagle, layout.lookahead):
        return None
    index = cdiv(num_tokens, g.bs) - 1
    if index >= len(table) or table[index] == NULL:
        return None
    block = table[index]
    if state.primary_tokens[block] == num_tokens:
        return None
    cache_partial_block(state, req, block, num_tokens, g.gid)
    if num_tokens % g.bs:
        state.partial_hits[g.gid][req.request_id] = (index, block)
        state.num_cached[g.gid][req.request_id] = index
    return req.key(g.gid, num_tokens)


def _cache_checkpoint(
    layout: Layout, state: State, g: Group, req: Request, table: list[int]
) -> CacheKey | None:
    """docs/spec.md §11.6: the step's reserved checkpoint block (position p, table index i)
    holds the state after p tokens. It is keyed at p, its earlier keys dropped, when p is the
    prompt's checkpoint (the checkpoint position of (P, alignment)) or a block end kept under
    retention, or the request's junction; otherwise the block's keys are dropped (its state
    is transient) and nothing is keyed. Nothing happens when the block already has p's
    primary. Replaces the prompt-tail rule while the request has a checkpoint. Returns the key
    registered."""
    position, index, _ = state.checkpoints[g.gid][req.request_id]
    block = table[index]
    prompt_checkpoint = state_checkpoint(req.num_prompt_tokens, layout.alignment,
                                         layout.replay_eagle, layout.lookahead)
    retained = position % g.bs == 0 and segment_end_kept(layout, g, position // g.bs - 1)
    if position not in (prompt_checkpoint, req.shared_prefix_boundary) and not retained:
        if block != NULL:
            state.drop_keys(block)
        return None
    if block == NULL or state.primary_tokens[block] == position:
        return None
    state.drop_keys(block)
    key = req.key(g.gid, position)
    state.add_key(block, key, position)
    return key


def checkpoint_exportable(start: int, end: int, position: int, hbs: int, bs: int,
                          alignment: int | None) -> bool:
    """docs/spec.md §11.6 (vLLM's is_mamba_prefill_checkpoint_valid): a chunk [start, end)
    can write the state at `position` mid-chunk when the kernel exports at all (`alignment`
    set), the chunk starts on a hash boundary, the position is at least one hash block past
    the start, strictly inside the chunk and a multiple of the alignment from the start, and
    the checkpoint's slot `cdiv(end, bs) − 2` (the block before the chunk's last) lies past
    the slot of the state the chunk starts from, `(start − 1) // bs`."""
    if alignment is None:
        return False
    return (
        start % hbs == 0
        and cdiv(end, bs) - 2 > (start - 1) // bs
        and start + hbs <= position
        and start < position < end
        and (position - start) % alignment == 0
    )


def sparse_mask_keeps(layout: Layout, g: Group, i: int, req: Request) -> bool:
    """Whether block i of `req`'s table in group g gets a key: the window mask below, the
    state checkpoints of a Mamba "align" group under retention, every block otherwise."""
    if g.kind == "mamba":
        return state_checkpoint_kept(layout, g, i, req)
    return window_mask_keeps(layout, g, i, req)


def state_checkpoint_kept(layout: Layout, g: Group, i: int, req: Request) -> bool:
    """docs/spec.md §11.3 under a retention interval R: a state hit reads one block, the one
    ending at its boundary, so block i (ending at token (i+1)·bs) is kept when that end is a
    segment end (a multiple of (R // bs)·bs; any end when R // bs <= 1; none when R is 0), or
    when it is where a position `req` is resumed at (`kept_positions`), rounded down to the
    alignment, falls back to a block end. Every block without R."""
    if segment_end_kept(layout, g, i):
        return True
    end = (i + 1) * g.bs
    for position in kept_positions(layout, g, req):
        aligned = position - position % layout.alignment
        if end == aligned - aligned % g.bs:
            return True
    return False


def segment_end_kept(layout: Layout, g: Group, i: int) -> bool:
    """Block i of a state group ends a retention segment: always without a retention interval
    R or when a segment is at most one block (R // bs <= 1), never when R is 0, else when
    (i + 1) is a multiple of R // bs."""
    if layout.retention is None:
        return True
    segment_blocks = layout.retention // g.bs
    return layout.retention > 0 and (segment_blocks <= 1 or (i + 1) % segment_blocks == 0)


def window_mask_keeps(layout: Layout, g: Group, i: int, req: Request) -> bool:
    """The sliding-window caching mask (docs/spec.md §4.9.2), by absolute block index:
    a block gets a key only if it is one of the `need` blocks that end at a kept boundary
    (shifted one block right with EAGLE). Kept boundaries: every multiple of the segment (the
    alignment A; the retention interval R when set; none when R is 0) and, under retention,
    each position the caching request is resumed at (`kept_positions`) rounded down to A.
    Dense (always True) for other kinds, when A is not a multiple of bs, or when need covers a
    whole segment."""
    if g.kind != "sliding_window" or layout.alignment % g.bs != 0:
        return True
    need = cdiv(g.window - 1, g.bs) + (1 if g.use_eagle else 0)
    shift = 1 if g.use_eagle else 0
    segment = layout.alignment if layout.retention is None else layout.retention
    if segment and need >= segment // g.bs:
        return True
    ends: list[int] = []  # kept boundaries, in blocks
    if segment:
        ends += range(segment // g.bs, i + need + 1, segment // g.bs)
    if layout.retention is not None:
        ends += [b // layout.alignment * layout.alignment // g.bs
                 for b in kept_positions(layout, g, req)]
    return any(end + shift - need <= i < end + shift for end in ends)


def kept_positions(layout: Layout, g: Group, req: Request) -> list[int]:
    """Where a later request may resume `req`'s prefix, kept under retention: its replay
    positions and, when the driver's lookup found one, its junction J (§6.3), with
    J − bs too in a group whose manager has use_eagle set."""
    positions = replay_positions(req.num_prompt_tokens, layout.sbs, layout.replay_eagle)
    junction = req.shared_prefix_boundary
    if junction:
        positions += [junction, junction - g.bs] if g.use_eagle else [junction]
    return positions


def replay_positions(num_prompt_tokens: int, sbs: int, eagle: bool) -> list[int]:
    """Where a later request replaying this prompt can resume (§4.9.2): the resend's
    `P − 1`; with EAGLE one scheduler block below the resend's and the extension's aligned
    ends (never below 0)."""
    if not eagle:
        return [num_prompt_tokens - 1]
    resend = (num_prompt_tokens - 1) // sbs * sbs
    extension = num_prompt_tokens // sbs * sbs
    return [max(resend - sbs, 0), max(extension - sbs, 0)]


def cache_full_block(state: State, req: Request, g: Group, i: int, block: int) -> None:
    """cache_full_blocks (docs/spec.md §3.3) for the block at index i: key = prefix of (i+1)·bs tokens.
    A block that already has a primary key is being promoted from a partial entry."""
    num_tokens = (i + 1) * g.bs
    if state.primary[block] is not None:
        held = state.primary_tokens[block]
        assert held is not None and held < num_tokens, f"block {block} re-hashed"
        state.drop_keys(block)
    state.add_key(block, req.key(g.gid, num_tokens), num_tokens)


def state_checkpoint(num_tokens: int, unit: int, eagle: bool, lookahead: int = 0) -> int:
    """docs/spec.md §11.3: the last multiple of `unit` whose state a prefill of `num_tokens`
    caches: at most `num_tokens − max(1, lookahead)` (the hash lookahead must exist, §5.7), or
    with EAGLE one unit below `num_tokens`."""
    if eagle:
        return max(num_tokens // unit - 1, 0) * unit
    return max((num_tokens - max(1, lookahead)) // unit, 0) * unit


def _cache_prompt_tail(
    layout: Layout, state: State, g: Group, req: Request, num_tokens: int, table: list[int]
) -> None:
    """docs/spec.md §4.6 step 5: the prompt-tail partial entry of a full-attention group with bs != hbs."""
    limit = req.num_prompt_tokens if g.use_eagle else req.num_prompt_tokens - 1
    b = min(limit // layout.hbs, req.hashed_tokens(layout.hbs) // layout.hbs) * layout.hbs
    if b == 0 or b > num_tokens or b % g.bs == 0 or b // g.bs >= len(table):
        return
    cache_partial_block(state, req, table[b // g.bs], b, g.gid)


def cache_partial_block(state: State, req: Request, block: int, num_tokens: int, gid: int) -> None:
    """cache_partial_block (docs/spec.md §3.11, replace_existing=False): make the block reachable from
    the interior boundary num_tokens. A key new to the block whose primary covers fewer tokens
    first strips the block's existing keys."""
    if block == NULL:
        return
    key = req.key(gid, num_tokens)
    held = state.primary_tokens[block]
    if not state.carries(block, key) and held is not None and held < num_tokens:
        state.drop_keys(block)
    state.add_key(block, key, num_tokens)
