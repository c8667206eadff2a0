"""The fixes that findings 016, 018, 022-025, 028-031 and 035 propose, applied while their vLLM
tests run.

A pytest plugin (`-p proposed_fixes`, this folder on the path) for the subprocess of
tests/vllm/test_finding_vllm_tests.py that shows each test of `PROPOSED_FIXES`
(kvfuzz.fuzz.finding_tests) passing once its bug is fixed. The tests drive vLLM's own Scheduler,
which kvcache dropped in cannot stand under, so the fix is patched into vLLM's manager (022, the
rule 0.33 added), its Scheduler (016, 023, 031; 025, the rule 0.33 added), its coordinator (018),
its Mamba manager (035), its encoder cache manager (030) or the test module's stand-in for
vLLM's worker copy (024), never into the generated file's text.
"""

from __future__ import annotations

from typing import Any

import pytest


def _keyed(manager: Any, request_id: str) -> set[int]:
    """The ids of the blocks in the request's tables that carry a cache key."""
    return {block.block_id for group in manager.coordinator.single_type_managers
            for block in group.req_to_blocks.get(request_id, ()) if block.block_hash is not None}


def _keep_block_below_junction(single: Any) -> None:
    """Under EAGLE the group's retention mask also keeps the block ending one block below the
    caching request's shared-prefix junction (`cache_blocks` lends the mask its request)."""
    cache, mask = single.cache_blocks, single.reachable_block_mask
    caching: list[Any] = []

    def cache_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
        caching.append(request)
        try:
            return cache(request, *args, **kwargs)
        finally:
            caching.pop()

    def reachable_block_mask(*args: Any, **kwargs: Any) -> Any:
        boundaries = kwargs.get("reachable_boundaries")
        if caching and boundaries is not None and caching[-1].shared_prefix_boundary:
            below = caching[-1].shared_prefix_boundary - single.block_size
            kwargs["reachable_boundaries"] = [*boundaries, below]
        return mask(*args, **kwargs)

    single.cache_blocks = cache_blocks
    single.reachable_block_mask = reachable_block_mask


def fix_016(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """016's fix (the doc's proposal): in `_update_requests_with_invalid_blocks`, a request of a
    window group whose rollback point's window reaches back into null blocks (nothing loaded
    them) rolls back to 0, a failed load, as multi-group models already are."""
    from vllm.v1.core.sched.scheduler import Scheduler

    update = Scheduler._update_requests_with_invalid_blocks

    def update_and_check_window(self: Any, requests: Any, *args: Any, **kwargs: Any) -> Any:
        requests = list(requests)
        out = update(self, requests, *args, **kwargs)
        (single,) = self.kv_cache_manager.coordinator.single_type_managers
        for request in requests:
            if request.request_id not in out[0] or not request.num_computed_tokens:
                continue
            (blocks,) = self.kv_cache_manager.get_blocks(request.request_id).blocks
            nulls = next((i for i, b in enumerate(blocks) if not b.is_null), len(blocks))
            skipped = single.get_num_skipped_tokens(request.num_computed_tokens)
            if skipped < nulls * single.block_size:
                request.num_computed_tokens = 0
        return out

    monkeypatch.setattr(Scheduler, "_update_requests_with_invalid_blocks",
                        update_and_check_window)


def fix_018(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """018's fix (the doc's proposal, "store the already-ordered list when deferring"): the
    coordinator pops a request's blocks last group first, so that the deferred drain, which
    frees the list reversed, frees group after group, each tail first, as `free` does."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    def pop_blocks_for_free(self: Any, request_id: str) -> list[Any]:
        return [block for single in reversed(self.single_type_managers)
                for block in single.pop_blocks_for_free(request_id)]

    monkeypatch.setattr(KVCacheCoordinator, "pop_blocks_for_free", pop_blocks_for_free)


def fix_022(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """022's fix, 0.33's rule (`single_type_kv_cache_manager.py:514-520` there): a group whose
    manager has `use_eagle` also keeps `shared_prefix_boundary - block_size` (a duplicate
    boundary where the release already keeps it)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    init = KVCacheManager.__init__

    def init_and_keep(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for single in self.coordinator.single_type_managers:
            if single.use_eagle:
                _keep_block_below_junction(single)

    monkeypatch.setattr(KVCacheManager, "__init__", init_and_keep)


def fix_023(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """023's fix (PR #43569's rollback): a request preempted in the `schedule()` that keyed
    blocks for it loses those keys before its blocks are freed."""
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule, preempt = Scheduler.schedule, Scheduler._preempt_request

    def schedule_and_record(self: Any, *args: Any, **kwargs: Any) -> Any:
        manager, self.keyed_this_pass = self.kv_cache_manager, {}
        allocate = manager.allocate_slots

        def allocate_and_record(request: Any, *a: Any, **kw: Any) -> Any:
            before = _keyed(manager, request.request_id)
            out = allocate(request, *a, **kw)
            fresh = _keyed(manager, request.request_id) - before
            self.keyed_this_pass.setdefault(request.request_id, set()).update(fresh)
            return out

        manager.allocate_slots = allocate_and_record
        try:
            return schedule(self, *args, **kwargs)
        finally:
            del manager.allocate_slots

    def preempt_and_roll_back(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        fresh = getattr(self, "keyed_this_pass", {}).pop(request.request_id, set())
        if fresh:
            self.kv_cache_manager.evict_blocks(fresh)
        return preempt(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "schedule", schedule_and_record)
    monkeypatch.setattr(Scheduler, "_preempt_request", preempt_and_roll_back)


def fix_024(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """024's fix in vLLM's worker (the doc's diff): when a copy's source is an earlier copy's
    destination, the step's copies are applied in order."""
    gather_scatter = module.apply_copies

    def apply_copies(kv: Any, copies: Any) -> None:
        pairs = [(int(c[0]), int(c[1])) for c in copies or ()]
        if {d for _, d in pairs} & {s for s, _ in pairs}:
            for src, dst in pairs:
                kv[dst] = kv[src]
        else:
            gather_scatter(kv, pairs)

    monkeypatch.setattr(module, "apply_copies", apply_copies)


def fix_025(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """025's fix, 0.33's rule (`scheduler.py:2759-2762` there): the tokens
    `_update_request_with_output` drops after a stop are taken off `num_computed_tokens` too
    (nothing more where the release already takes them off)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    update = Scheduler._update_request_with_output

    def update_and_uncompute(self: Any, request: Any, new_token_ids: list[int], *args: Any,
                             **kwargs: Any) -> Any:
        offered, before = len(new_token_ids), request.num_computed_tokens
        out = update(self, request, new_token_ids, *args, **kwargs)
        if request.num_computed_tokens == before:
            request.num_computed_tokens -= offered - len(out[0])
        return out

    monkeypatch.setattr(Scheduler, "_update_request_with_output", update_and_uncompute)


def fix_028(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """028's fix: the Mamba manager's count of new blocks floored at 0, as the base class floors
    its own (`single_type_kv_cache_manager.py:241` in 0.34.0; the doc's fix floors the new
    blocks before adding the hits it evicts, which the trace has none of)."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    count = MambaManager.get_num_blocks_to_allocate

    def floored(self: Any, *args: Any, **kwargs: Any) -> int:
        return max(count(self, *args, **kwargs), 0)

    monkeypatch.setattr(MambaManager, "get_num_blocks_to_allocate", floored)


def fix_029(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """029's fix under "recompute": the blocks a failed synchronous load left invalid, with the
    rest of the marking request's table, are evicted as under "fail"
    (`_handle_invalid_blocks` evicts them only `if ... not self.recompute_kv_load_failures`,
    `scheduler.py:3910-3911` in 0.34.0)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    update = Scheduler._update_requests_with_invalid_blocks

    def update_and_evict(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = update(self, *args, **kwargs)
        if kwargs.get("evict_blocks") and self.recompute_kv_load_failures and out[2]:
            self.kv_cache_manager.evict_blocks(out[2])
        return out

    monkeypatch.setattr(Scheduler, "_update_requests_with_invalid_blocks", update_and_evict)


def fix_030(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """030's fix, vllm-project/vllm#51228's idea: `EncoderDecoderCacheManager` gives an input's
    room back once per allocation (`free_encoder_input` credits only an input `allocate` took;
    `encoder_cache_manager.py:415-420`, `:439-441` in 0.34.0)."""
    from vllm.v1.core.encoder_cache_manager import EncoderDecoderCacheManager

    allocate = EncoderDecoderCacheManager.allocate
    credit = EncoderDecoderCacheManager.free_encoder_input

    def allocate_and_hold(self: Any, request: Any, input_id: int) -> None:
        allocate(self, request, input_id)
        self.__dict__.setdefault("held", set()).add((request.request_id, input_id))

    def credit_once(self: Any, request: Any, input_id: int) -> None:
        held = self.__dict__.setdefault("held", set())
        if (request.request_id, input_id) in held:
            held.discard((request.request_id, input_id))
            credit(self, request, input_id)

    monkeypatch.setattr(EncoderDecoderCacheManager, "allocate", allocate_and_hold)
    monkeypatch.setattr(EncoderDecoderCacheManager, "free_encoder_input", credit_once)


def fix_031(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """031's fix under "fail": `_handle_failed_recving` takes a running request the connector
    names (its synchronous load failed) as it takes one waiting for remote KV, so the step
    fails it (`scheduler.py:3839-3852` in 0.34.0 takes only `WAITING_FOR_REMOTE_KVS`)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    handle = Scheduler._handle_failed_recving

    def handle_running_too(self: Any, failed_req_ids: set[str]) -> set[str]:
        affected = handle(self, failed_req_ids)
        if self.recompute_kv_load_failures:
            return affected
        return affected | {req_id for req_id in failed_req_ids
                           if (request := self.requests.get(req_id)) is not None
                           and request.status == RequestStatus.RUNNING}

    monkeypatch.setattr(Scheduler, "_handle_failed_recving", handle_running_too)


def fix_035(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """035's fix: the Mamba manager reserves no prefill checkpoint for a step whose main-model
    tokens reach past the request's (its drafts). The manager is passed the prefill end
    `max(P, T - 1)` (`kv_cache_manager.py:550` in 0.34.0), so such a step is one past
    `prefill_end + 1`."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    needs = MambaManager._needs_internal_checkpoint

    def needs_outside_drafts(self: Any, request_id: str, query_start: int, query_end: int,
                             checkpoint_position: int, prefill_end: int) -> bool:
        return query_end <= prefill_end + 1 and needs(
            self, request_id, query_start, query_end, checkpoint_position, prefill_end)

    monkeypatch.setattr(MambaManager, "_needs_internal_checkpoint", needs_outside_drafts)


FIXES = {"016": fix_016, "018": fix_018, "022": fix_022, "023": fix_023, "024": fix_024,
         "025": fix_025, "028": fix_028, "029": fix_029, "030": fix_030, "031": fix_031,
         "035": fix_035}
"""Finding number -> its proposed fix."""


@pytest.fixture(autouse=True)
def proposed_fix(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Apply the fix of the finding the test module is named for (test_NNN_...)."""
    fix = FIXES.get(request.module.__name__.removeprefix("test_")[:3])
    if fix is None:
        raise LookupError(f"{request.module.__name__}: no proposed fix for its finding")
    fix(request.module, monkeypatch)
