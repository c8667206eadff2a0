"""What a scheduler tells its worker (checks W1, W2): the worker builds its block tables only
from the scheduler's outputs, so they must read as the manager's tables do. A target whose
scheduler hands outputs to a worker replays them (harness/vllm_worker_tables.py) and reports
each difference in the op's observations (W1). Every target's probes read, on each allocation,
the new block ids the manager's result gives a scheduler for its worker (W2), so the manager
targets judge that word without a scheduler.
"""

from __future__ import annotations

from kvfuzz.core.snapshot import Snapshot
from kvfuzz.properties.registry import CheckContext, invariant, transition


@invariant(
    "W1",
    "worker tables: the block tables a worker builds from the scheduler's outputs alone (new "
    "and resumed requests' block ids, running requests' new block ids) equal the manager's "
    "tables of every request a step schedules, wherever the manager holds no null block",
    covers=("spec §7",),
)
def worker_tables(s: Snapshot, ctx: CheckContext) -> str | None:
    if not ctx.observations.worker_mismatches:
        return None
    first, *more = ctx.observations.worker_mismatches
    return f"{first} (and {len(more)} more)" if more else first


@transition(
    "W2",
    "new block ids: on every allocate_slots that returns blocks, get_block_ids(allow_none=True) "
    "of the result (a running request's new_block_ids for the worker) names, per group, the "
    "blocks the call allocated there, in order, and is None exactly when no group got one",
    covers=("spec §2.8", "spec §6.4"),
)
def new_block_ids(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    for probe in ctx.observations.allocations:
        allocated = probe.new_block_ids
        if allocated is None:
            continue
        told = probe.reported_new_block_ids
        owed = allocated if any(allocated) else None
        if told != owed:
            said = "None" if told is None else [list(ids) for ids in told]
            got = [list(ids) for ids in allocated]
            return (f"allocate_slots({probe.request_id!r}) allocated {got} per group, but "
                    f"get_block_ids(allow_none=True) of its result reads {said}: the worker "
                    f"would be told {'no new block' if told is None else 'other blocks'}")
    return None
