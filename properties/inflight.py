"""Steps in flight (docs/spec.md §7.1, checks IF1-IF2): a block a launched step still reads stays
its readers' until the step completes, and what waited for the steps is released once they
have all completed.

Judged from the snapshots alone: `in_flight` lists each step still in flight with the blocks
its requests held at launch; `deferred_frees` the blocks popped for frees not yet released.
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.snapshot import CacheKey, Snapshot
from kvfuzz.properties.registry import CheckContext, invariant, transition


@transition(
    "IF1",
    "in-flight reads: every block a step still in flight reads stays held (never back in the "
    "free queue, so never handed to another request) and keeps the cache key it had (or one "
    "its own request grew over more of the same tokens, or hands it to a copy of the block "
    "the step makes), until the step completes",
    covers=("spec §7.1",),
)
def in_flight_reads_held(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    steps_before = {step for step, _, _ in before.in_flight}
    free = after.free_set()
    for step, reads, _ in after.in_flight:
        for b in reads:
            if after.ref_cnt[b] <= 0 or b in free:
                return (f"block {b}, read by step {step} still in flight, was released (ref_cnt "
                        f"{after.ref_cnt[b]}{', in the free queue' if b in free else ''}) "
                        f"after {ctx.op['op']}")
            key = before.block_keys[b]
            if step in steps_before and not _same_or_grown(key, after.block_keys[b]) \
                    and not _moved_to_copy(key, b, after, ctx):
                return (f"block {b}, read by step {step} still in flight, was re-keyed by "
                        f"{ctx.op['op']}")
    return None


def _same_or_grown(before: CacheKey | None, after: CacheKey | None) -> bool:
    """Whether a block kept its key: unkeyed before, the same key, or a partial entry promoted
    (spec §7.1, §10.13): the key of the same group and extra keys over more of the same
    tokens, its own request having filled the block further."""
    if before is None or after == before:
        return True
    return (after is not None and after[0] == before[0] and _identity_grown(before[1], after[1])
            and after[2][:len(before[2])] == before[2])


def _identity_grown(before: Any, after: Any) -> bool:
    """Whether a key's identity (core/extra_keys.py `key_identity`) over a longer prefix of the
    same request extends `before`: more hash blocks' extra keys, or extra keys appearing
    beyond a prefix that had none (a plain or salted prefix)."""
    if before == after:
        return True
    if not isinstance(after, tuple):
        return False
    if before is None or isinstance(before, str):
        return after[0] in ("extras", "ahead")
    if before[0] == "ahead":
        return after[0] == "ahead" and _identity_grown(before[1], after[1])
    return after[0] == "extras" and after[:len(before)] == before


def _moved_to_copy(key: CacheKey | None, block: int, after: Snapshot,
                   ctx: CheckContext) -> bool:
    """Whether the op moved the block's key to a copy of the block it made: a running Mamba
    'align' request that keeps writing into its partial-hit block leaves the cached state to
    the copy (vLLM 0.34 `move_block_hashes`, spec §7.1)."""
    copies = ctx.result.get("copies") or () if isinstance(ctx.result, dict) else ()
    return any(src == block and after.block_keys[dst] == key for src, dst in copies)


@invariant(
    "IF2",
    "in-flight drain: once no step is in flight, no free waits any more (every deferred "
    "block was released: none leaks)",
    covers=("spec §7.1",),
)
def in_flight_drained(s: Snapshot, ctx: CheckContext) -> str | None:
    if ctx.level != "scheduler" or s.in_flight or not s.deferred_frees:
        return None
    held = sorted({b for run in s.deferred_frees for b in run})
    return f"no step is in flight, yet blocks {held} still wait for a deferred free"
