"""What a scheduler tells its worker (check W1): the worker builds its block tables only from
the scheduler's outputs, so they must read as the manager's tables do. A target whose
scheduler hands outputs to a worker replays them (harness/vllm_worker_tables.py) and reports
each difference in the op's observations.
"""

from __future__ import annotations

from kvfuzz.core.snapshot import Snapshot
from kvfuzz.properties.registry import CheckContext, invariant


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
