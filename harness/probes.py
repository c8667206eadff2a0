"""Probes around a vLLM-shaped KVCacheManager: what P1 and P4 need to see from outside layer 1.

They wrap instance methods (so the same code probes kvcache and every vLLM release): layer 1's
allocate_slots, layer 2's and every layer-3 manager's get_num_blocks_to_allocate, layer 3's
add_local_computed_blocks, allocate_external_computed_blocks and allocate_new_blocks, and
layer 4's get_new_blocks. What the returned KVCacheBlocks tells a scheduler's worker
(`get_block_ids(allow_none=True)`) is read beside the blocks layer 3 allocated (W2). Both
implementations pass `apply_admission_cap` by keyword, which is how the gate's call is told from
the per-step one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from kvfuzz.core.sides import AllocationProbe, CachedReport, Observations
from kvfuzz.harness.reading import packed_key


class _Call:
    """What one allocate_slots call did, filled in by the inner wrappers."""

    __slots__ = ("request_id", "prediction", "free_before", "group_predictions", "group_taken",
                 "reserved_blocks", "admission", "new_blocks")

    def __init__(self, request_id: str, num_groups: int, reserved_blocks: int,
                 admission: bool) -> None:
        self.request_id = request_id
        self.reserved_blocks = reserved_blocks
        self.admission = admission
        self.prediction: int | None = None
        self.free_before: int | None = None
        self.group_predictions: list[int] = [0] * num_groups
        self.group_taken: list[int] = [0] * num_groups
        self.new_blocks: list[list[int]] = [[] for _ in range(num_groups)]


class ManagerProbes:
    """Installs the wrappers on one manager and collects `Observations` per op."""

    def __init__(self, manager: Any, request_status: Any) -> None:
        self.observations = Observations()
        self._waiting = int(request_status.WAITING)
        self._preempted = int(request_status.PREEMPTED)
        self._call: _Call | None = None
        self._pool = manager.block_pool
        managers = manager.coordinator.single_type_managers
        self._num_groups = len(managers)
        _wrap(manager, "allocate_slots", self._around_allocate_slots)
        _wrap(manager.coordinator, "get_num_blocks_to_allocate", self._around_prediction)
        _wrap(self._pool, "get_new_blocks", self._around_get_new_blocks)
        self._block_sizes = [single.block_size for single in managers]
        if getattr(manager, "enable_kv_cache_events", False):
            _wrap(manager, "get_computed_blocks", self._around_lookup)
            _wrap(self._pool.cached_block_hash_to_block, "pop", self._around_pop)
        for group_id, single in enumerate(managers):
            _wrap(single, "get_num_blocks_to_allocate", self._group_prediction(group_id))
            for name in ("add_local_computed_blocks", "allocate_external_computed_blocks",
                         "allocate_new_blocks"):
                if hasattr(single, name):
                    _wrap(single, name, self._group_taking(group_id, name == "allocate_new_blocks"))

    def take(self) -> Observations:
        """The observations since the last take."""
        obs, self.observations = self.observations, Observations()
        return obs

    def _around_allocate_slots(self, original: Callable[..., Any], request: Any, *args: Any,
                               **kwargs: Any) -> Any:
        # Read defensively: a misuse driver passes things that are not requests.
        status = getattr(request, "status", None)
        admission = kwargs.get("has_scheduled_reqs", True) and status in (
            self._waiting, self._preempted
        )
        call = self._call = _Call(
            getattr(request, "request_id", None), self._num_groups,
            kwargs.get("reserved_blocks", 0), admission,
        )
        try:
            result = original(request, *args, **kwargs)
        except Exception:
            self._record(call, "error")
            raise
        finally:
            self._call = None
        if result is None:
            self._record(call, "gate" if call.prediction is None else "capacity")
        else:
            self._record(call, "blocks", free_after=self._pool.get_num_free_blocks(),
                         result=result)
        return result

    def _record(self, call: _Call, outcome: str, free_after: int | None = None,
                result: Any = None) -> None:
        step_five = call.prediction is not None and outcome != "error"
        # What vLLM's Scheduler tells the worker of a running request's new blocks
        # (`new_block_ids`, 0.34.0 sched/scheduler.py:2011-2013); probed, not assumed.
        probed = hasattr(result, "get_block_ids")
        reported = result.get_block_ids(allow_none=True) if probed else None
        self.observations.allocations.append(
            AllocationProbe(
                request_id=call.request_id,
                outcome=outcome,  # type: ignore[arg-type]
                prediction=call.prediction if step_five else None,
                free_before=call.free_before,
                free_after=free_after,
                group_predictions=tuple(call.group_predictions) if step_five else None,
                group_taken=tuple(call.group_taken) if outcome == "blocks" else None,
                reserved_blocks=call.reserved_blocks,
                admission=call.admission,
                new_block_ids=tuple(map(tuple, call.new_blocks)) if probed else None,
                reported_new_block_ids=None if reported is None else tuple(map(tuple, reported)),
            )
        )

    def _around_prediction(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        value = original(*args, **kwargs)
        call = self._call
        if call is not None and not kwargs.get("apply_admission_cap", False):
            call.prediction = value
            call.free_before = self._pool.get_num_free_blocks()
        return value

    def _group_prediction(self, group_id: int) -> Callable[..., Any]:
        def around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            value = original(*args, **kwargs)
            call = self._call
            if call is not None and not kwargs.get("apply_admission_cap", False):
                call.group_predictions[group_id] = value
            return value

        return around

    def _group_taking(self, group_id: int, returns_new: bool) -> Callable[..., Any]:
        """Counts the free blocks a group's call takes; with `returns_new` (allocate_new_blocks)
        the call's result is the group's new blocks, whose ids W2 reads."""
        def around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            before = self._pool.get_num_free_blocks()
            blocks = None
            try:
                blocks = original(*args, **kwargs)
                return blocks
            finally:
                call = self._call
                if call is not None:
                    call.group_taken[group_id] += before - self._pool.get_num_free_blocks()
                    if returns_new and blocks is not None:
                        call.new_blocks[group_id].extend(b.block_id for b in blocks)

        return around

    def _around_lookup(self, original: Callable[..., Any], request: Any, *args: Any,
                       **kwargs: Any) -> Any:
        result = original(request, *args, **kwargs)
        hit = result[1]
        if getattr(request, "kv_cache_report_mode", "incremental") == "full" and hit > 0:
            tokens = request.all_token_ids
            for group, blocks in enumerate(result[0].blocks):
                bs = self._block_sizes[group]
                full = min(len(blocks), hit // bs)
                tail = self._tail_report(request, blocks, group, full, hit)
                if tail is not None and tail.block_size == bs:
                    full, tail = full + 1, None
                for first, end in real_runs(blocks[:full]):
                    hashes = tuple(b.block_hash for b in blocks[first:end])
                    self.observations.cached_reports.append(CachedReport(
                        request.request_id, group, end - first, bs,
                        tuple(tokens[first * bs:end * bs]), None if None in hashes else hashes,
                        first))
                if tail is not None:
                    self.observations.cached_reports.append(tail)
        return result

    def _tail_report(self, request: Any, blocks: Sequence[Any], group: int, full: int,
                     hit: int) -> CachedReport | None:
        """What a hit of `hit` tokens owes for a block it ends inside (the one after its
        `full` blocks): the BlockStored of the key the block holds for the request (finding
        036), its full key (a report of the whole block) else the partial entry the hit ends
        at (its last hash block, chained on the one before); nothing if it holds neither."""
        if full >= len(blocks) or blocks[full].is_null:
            return None
        hbs, bs = self._pool.hash_block_size, self._block_sizes[group]
        held = self._pool.cached_block_hash_to_block.contain
        tokens, hashes = request.all_token_ids, request.block_hashes
        last = (full + 1) * bs // hbs
        if last <= len(hashes) and held(packed_key(hashes[last - 1], group),
                                        blocks[full].block_id):
            return CachedReport(request.request_id, group, 1, bs,
                                tuple(tokens[full * bs:(full + 1) * bs]),
                                (packed_key(hashes[last - 1], group),), full)
        n = hit // hbs
        key = packed_key(hashes[n - 1], group)
        if not held(key, blocks[full].block_id):
            return None
        return CachedReport(request.request_id, group, 1, hbs,
                            tuple(tokens[(n - 1) * hbs:n * hbs]), (key,), n - 1)

    def _around_pop(self, original: Callable[..., Any], key: Any, block_id: int) -> Any:
        block = original(key, block_id)
        if block is not None and self._pool.cached_block_hash_to_block.get_one_block(key):
            self.observations.lost_copies.append(bytes(key))
        return block

    def _around_get_new_blocks(self, original: Callable[..., Any], *args: Any,
                               **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except ValueError as exc:
            self.observations.pool_shortages.append(str(exc))
            raise


def real_runs(blocks: Sequence[Any]) -> list[tuple[int, int]]:
    """[first, end) of each run of consecutive non-null blocks of a hit list."""
    runs: list[tuple[int, int]] = []
    for i, block in enumerate(blocks):
        if block.is_null:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _wrap(obj: Any, name: str, around: Callable[..., Any]) -> None:
    """Shadow obj.name with an instance attribute that calls around(original, ...)."""
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return around(original, *args, **kwargs)

    setattr(obj, name, wrapper)
