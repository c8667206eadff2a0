"""The block tables vLLM's worker builds from the SchedulerOutputs alone (check W1).

The worker never reads the KVCacheManager: it keeps, per request and KV cache group, the
block ids each `SchedulerOutput` hands it (vLLM 0.34.0 `v1/worker/gpu/model_runner.py`):
it drops the requests in `finished_req_ids` and `preempted_req_ids` (`:1255-1269`), writes a
`NewRequestData.block_ids` over the request's table (a new or resumed request, `:1321-1323`)
and appends a running request's `CachedRequestData.new_block_ids` (`:1340-1352`; None: no
new block in any group). Releases that resumed a preempted request as cached data mark it
(`resumed_req_ids`, or the older `resumed_from_preemption` list): its `new_block_ids` is then
the whole table. `WorkerTables` replays that after every `schedule()` and compares each
scheduled request's mirror with the manager's table: equal length in every group and the same
id at every position the manager does not hold a null block at (a window's or a Mamba
group's released position reads as null there, while the worker keeps the id it was sent and
no longer reads it).
"""

from __future__ import annotations

from typing import Any

Tables = list[list[int]]


def _resumed(cached: Any) -> set[str]:
    """The cached requests this SchedulerOutput resumes from preemption (probed: 0.34 sends
    them as new requests and has neither field)."""
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is not None:
        return set(resumed)
    flags = getattr(cached, "resumed_from_preemption", None) or ()
    return {rid for rid, flag in zip(cached.req_ids, flags) if flag}


class WorkerTables:
    """A mirror of the worker's block tables, fed every SchedulerOutput in order."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.tables: dict[str, Tables] = {}

    def see(self, output: Any) -> list[str]:
        """Apply one SchedulerOutput as the worker does; the mismatches it leaves between the
        worker's tables and the manager's for the requests it schedules, one message each."""
        preempted = getattr(output, "preempted_req_ids", None) or ()  # probed: 0.34 has it
        for rid in set(output.finished_req_ids) | set(preempted):
            self.tables.pop(rid, None)
        for new in output.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = output.scheduled_cached_reqs
        resumed = _resumed(cached)
        problems = []
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids):
            if rid in resumed:
                self.tables[rid] = [list(ids) for ids in block_ids or ()]
            elif rid not in self.tables:
                problems.append(f"{rid} is scheduled as a running request, but the worker "
                                "holds no table for it (never sent as a new request)")
            elif block_ids is not None:
                for table, ids in zip(self.tables[rid], block_ids):
                    table.extend(ids)
        problems.extend(problem for rid in output.num_scheduled_tokens
                        if rid in self.tables for problem in self._compare(rid))
        return problems

    def _compare(self, rid: str) -> list[str]:
        """The first position, per group, where the worker's table of `rid` leaves the
        manager's."""
        problems = []
        real = self.manager.get_blocks(rid).blocks
        for group, (blocks, mirror) in enumerate(zip(real, self.tables[rid])):
            ids = [None if b.is_null else b.block_id for b in blocks]
            if len(ids) != len(mirror):
                problems.append(f"{rid}'s worker table in group {group} has {len(mirror)} "
                                f"blocks {mirror}, the manager's {len(ids)} {ids} (the "
                                "SchedulerOutputs sent other block ids than it allocated)")
                continue
            wrong = next((j for j, (b, w) in enumerate(zip(ids, mirror))
                          if b is not None and b != w), None)
            if wrong is not None:
                problems.append(f"{rid}'s worker table in group {group} reads block "
                                f"{mirror[wrong]} at position {wrong}, the manager holds "
                                f"{ids[wrong]} there")
        return problems
