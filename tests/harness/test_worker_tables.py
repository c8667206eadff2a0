"""The worker's block tables replayed from scheduler outputs (harness/vllm_worker_tables.py,
check W1), on stand-ins for vLLM's SchedulerOutput and manager: no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvfuzz.harness.vllm_worker_tables import WorkerTables

NULL = 0


class Manager:
    """The manager's tables: request id -> one list of block ids per group (0: null)."""

    def __init__(self, tables: dict[str, list[list[int]]]) -> None:
        self.tables = tables

    def get_blocks(self, rid: str) -> Any:
        return SimpleNamespace(blocks=[
            [SimpleNamespace(block_id=b, is_null=b == NULL) for b in group]
            for group in self.tables[rid]])


def output(new: dict[str, Any] | None = None, cached: dict[str, Any] | None = None,
           finished: tuple = (), preempted: tuple = (), **extra: Any) -> Any:
    """A SchedulerOutput scheduling every request it names."""
    new, cached = new or {}, cached or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=ids) for r, ids in new.items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached),
                                              new_block_ids=list(cached.values()), **extra),
        num_scheduled_tokens={r: 1 for r in [*new, *cached]},
        finished_req_ids=set(finished), preempted_req_ids=set(preempted))


def test_appended_blocks_match_and_none_adds_nothing():
    manager = Manager({"a": [[1, 2], [3]]})
    worker = WorkerTables(manager)
    assert worker.see(output(new={"a": ([1], [3])})) == [
        "a's worker table in group 0 has 1 blocks [1], the manager's 2 [1, 2] (the "
        "SchedulerOutputs sent other block ids than it allocated)"]
    assert worker.see(output(cached={"a": ([2], [])})) == []
    assert worker.see(output(cached={"a": None})) == []


def test_a_block_left_out_is_named():
    manager = Manager({"a": [[1, 2, 4]]})
    worker = WorkerTables(manager)
    worker.see(output(new={"a": ([1, 2],)}))
    assert "has 2 blocks [1, 2], the manager's 3" in worker.see(output(cached={"a": None}))[0]
    assert worker.see(output(cached={"a": ([5],)})) == [
        "a's worker table in group 0 reads block 5 at position 2, the manager holds 4 there"]


def test_positions_the_manager_nulled_keep_the_id_the_worker_was_sent():
    manager = Manager({"a": [[NULL, 2, 3]]})
    worker = WorkerTables(manager)
    assert worker.see(output(new={"a": ([1, 2, 3],)})) == []


def test_a_finished_or_preempted_request_is_dropped_and_unknown_when_cached():
    manager = Manager({"a": [[1]], "b": [[2]]})
    worker = WorkerTables(manager)
    worker.see(output(new={"a": ([1],), "b": ([2],)}))
    problems = worker.see(output(cached={"a": None, "b": None}, finished=("a",),
                                 preempted=("b",)))
    assert [p.split(" ", 1)[0] for p in problems] == ["a", "b"]
    assert "holds no table" in problems[0]


def test_a_resumed_request_gets_its_whole_table_by_either_field():
    manager = Manager({"a": [[7, 8]]})
    for extra in ({"resumed_req_ids": {"a"}}, {"resumed_from_preemption": [True]}):
        worker = WorkerTables(manager)
        worker.see(output(new={"a": ([1],)}))
        assert worker.see(output(cached={"a": ([7, 8],)}, **extra)) == []


def test_an_output_without_preempted_req_ids_drops_only_the_finished():
    """Releases whose SchedulerOutput has no `preempted_req_ids` keep a preempted request's
    table until it is resumed."""
    worker = WorkerTables(Manager({"a": [[1]]}))
    worker.see(output(new={"a": ([1],)}))
    bare = output(cached={"a": None})
    del bare.preempted_req_ids
    assert worker.see(bare) == []
