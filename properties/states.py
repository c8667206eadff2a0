"""Checks of recurrent-state groups in Mamba "align" mode (docs/spec.md §11.3, §8 S2-S3).

A state block holds one state: the one after the prefix whose last token was computed into it.
S2 follows that with a ghost, per target (in `ctx.memory`), from what each op did:

1. copies first (at the API level the pairs new in `pending_copies`, run right after the
   allocate_slots that queued them; at the scheduler level a step's `copies`): the
   destination now holds the source's state;
2. every forward pass of the op reads the state it resumes from, at position
   `(start − 1) // bs` of each align group's table, before any pass of the op writes (a step
   is one batch: its state kernels read every initial state first);
3. then each pass writes the state after `end` at position `(end − 1) // bs`, and, in a
   group with prefill checkpoint blocks, the state at the pass's checkpoint at position
   `cdiv(end, bs) − 2` when the pass can export it (docs/spec.md §11.6: the worker writes it
   whatever the manager reserved); a KV connector's load (`load`) reads nothing and writes
   before every read of the op.

A read of a block that holds no state, or another prefix's, is a resumed request computing on
the wrong state (vLLM #55600 read one out of bounds). The reference model reports no forward
passes, so it is not followed.

A pass over spec-decode drafts (past the request's tokens before the op) writes one state per
draft position into the speculative blocks, and the worker resumes from the one its accepted
drafts reached; S2 does not model those, so the blocks such a pass writes hold a state it does
not judge (`DRAFTED`), reads of them (hits included) are not checked, and neither is the
request's next read (docs/traces.md).
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.extra_keys import prefix_identity
from kvfuzz.core.snapshot import Snapshot
from kvfuzz.properties.registry import CheckContext, invariant, transition

_MEMORY_KEY = "S2"

StateId = tuple[int, Any, tuple[int, ...]]
"""(number of tokens, what besides the tokens the prefix stands for, the tokens)."""

DRAFTED = "drafted"
"""The ghost of a block a pass over drafts wrote: a state S2 does not judge."""


def _state_id(ctx: CheckContext, after: Snapshot, rid: str, num_tokens: int) -> StateId:
    meta = ctx.requests[rid]
    hbs = ctx.config.resolved_hash_block_size
    tokens = after.requests[rid].tokens[:num_tokens]
    return (num_tokens, prefix_identity(meta.cache_salt, meta.extras, num_tokens, hbs), tokens)


def _copies(before: Snapshot, after: Snapshot, ctx: CheckContext) -> list[tuple[int, int]]:
    if ctx.op["op"] == "step":
        return [(src, dst) for src, dst in (ctx.result or {}).get("copies", ())]
    new = set(after.pending_copies) - set(before.pending_copies)
    return [pair for pair in after.pending_copies if pair in new]


@transition(
    "S2",
    "state reads: a request resumes from a state block that holds the state after exactly "
    "its computed prefix (align-mode hits included), spec §11.3",
    covers=("bugs #28", "spec §11.3"),
)
def state_read_holds_its_boundary(before: Snapshot, after: Snapshot,
                                  ctx: CheckContext) -> str | None:
    groups = [(g, group) for g, group in enumerate(ctx.config.groups)
              if group.mamba_cache_mode == "align"]
    passes = ctx.observations.forward
    if not groups or not (passes or after.pending_copies or ctx.op["op"] == "step"):
        return None
    ghost: dict[int, StateId | str] = ctx.memory.setdefault(_MEMORY_KEY, {})
    drafted = {p.request_id for p in passes if ctx.op["op"] == "step"
               and p.request_id in before.requests
               and p.end > before.requests[p.request_id].num_tokens}
    # Requests whose last pass ran over drafts: they resume from a speculative block.
    resumes: set[str] = ctx.memory.setdefault(_MEMORY_KEY + "-drafted", set())
    for src, dst in _copies(before, after, ctx):
        if src in ghost:
            ghost[dst] = ghost[src]
        else:
            ghost.pop(dst, None)
    # A KV connector's load reads no state: it writes the state after its end, before the
    # passes that resume from it read (docs/spec.md §13).
    _write_states(ctx, after, [p for p in passes if p.load], groups, ghost, drafted)
    # An earlier step's passes, seen now, run as their own batch before the op's.
    judged = [p for p in passes if p.request_id not in resumes]
    problem = _read_states(ctx, after, [p for p in judged if p.earlier], groups, ghost)
    _write_states(ctx, after, [p for p in passes if p.earlier], groups, ghost, drafted)
    own = [p for p in passes if not p.earlier]
    problem = problem or _read_states(ctx, after, [p for p in judged if not p.earlier], groups,
                                      ghost)
    _write_states(ctx, after, [p for p in own if not p.load], groups, ghost, drafted)
    resumes.difference_update(p.request_id for p in passes)
    resumes.update(drafted)
    return problem


def _read_states(ctx: CheckContext, after: Snapshot, passes: list[Any],
                 groups: list[tuple[int, GroupConfig]],
                 ghost: dict[int, StateId | str]) -> str | None:
    """What is wrong with the state each pass (of one batch) resumes from, or None."""
    problem = None
    for p in passes:
        if p.start == 0 or p.load or problem:
            continue
        expected = _state_id(ctx, after, p.request_id, p.start)
        for g, group in groups:
            table = p.tables[g]
            index = (p.start - 1) // group.block_size
            block = table[index] if 0 <= index < len(table) else 0
            if block == 0:
                problem = (f"{p.request_id} group {g} resumes at {p.start} from position "
                           f"{index}, which holds no block")
            elif ghost.get(block) == DRAFTED:
                continue
            elif ghost.get(block) != expected:
                problem = (f"{p.request_id} group {g} resumes at {p.start} from block {block}, "
                           f"which holds {_describe(ghost.get(block), expected)}")
            if problem:
                break
    return problem


def _write_states(ctx: CheckContext, after: Snapshot, passes: list[Any],
                  groups: list[tuple[int, GroupConfig]], ghost: dict[int, StateId | str],
                  drafted: set[str]) -> None:
    """Each pass leaves the state after its end at position `(end − 1) // bs` (a pass of a
    request in `drafted`: `DRAFTED`), and its prefill checkpoint's where it exports one."""
    for p in passes:
        state = DRAFTED if p.request_id in drafted else _state_id(ctx, after, p.request_id,
                                                                  p.end)
        for g, group in groups:
            table = p.tables[g]
            index = (p.end - 1) // group.block_size
            if 0 <= index < len(table) and table[index] != 0:
                ghost[table[index]] = state
            checkpoint = None if p.load else checkpoint_write(ctx.config, group, p.start, p.end)
            if checkpoint is not None and 0 <= checkpoint[1] < len(table) and table[checkpoint[1]]:
                ghost[table[checkpoint[1]]] = _state_id(ctx, after, p.request_id, checkpoint[0])


def checkpoint_write(config: Config, group: GroupConfig, start: int,
                      end: int) -> tuple[int, int] | None:
    """(checkpoint position, table position) of the state a pass over `[start, end)` exports
    mid-chunk (vLLM's `compute_mamba_prefill_checkpoints`), or None: the last hit-aligned
    boundary below `end` (with EAGLE one unit lower), at least one hash block past a start on
    a hash boundary, on the group's alignment from the start, its block after the start
    state's and before the pass's last."""
    alignment = group.prefill_checkpoint_alignment
    if not group.num_prefill_checkpoint_blocks or alignment is None:
        return None
    unit, hbs, bs = config.alignment_tokens, config.resolved_hash_block_size, group.block_size
    if config.use_eagle:
        position = max(end // unit * unit - unit, 0)
    else:
        position = max((end - 1) // unit * unit, 0)
    column = -(-end // bs) - 2
    if (start % hbs or column <= (start - 1) // bs or start + hbs > position
            or not start < position < end or (position - start) % alignment):
        return None
    return position, column


def _describe(held: StateId | None, expected: StateId) -> str:
    if held is None:
        return "no state"
    same = held[1] == expected[1] and held[2] == expected[2][:held[0]]
    return f"the state after {held[0]} tokens" + ("" if same else " of another prefix")


@invariant(
    "S3",
    "copy sources alive: both ends of every copy not yet taken or released are held and out "
    "of the free queue, so no allocation can hand them out before the copy runs, spec §11.3",
    covers=("spec §4.5", "spec §11.3"),
)
def copy_ends_held(s: Snapshot, ctx: CheckContext) -> str | None:
    for pairs, what in ((s.pending_copies, "pending"), (s.retained_copies, "retained")):
        for src, dst in pairs:
            for role, block in (("source", src), ("destination", dst)):
                if s.ref_cnt[block] < 1 or block in s.linked:
                    return (f"the {what} copy {src} -> {dst}: its {role} block {block} is "
                            f"{'in the free queue' if block in s.linked else 'not held'}")
    return None
