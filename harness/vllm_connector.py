"""kvfuzz's KV connector on vLLM's own Scheduler: the trace's `load_remote` / `finish_load`.

`TraceConnector` is a scheduler-side connector written against vLLM's connector base class
(`KVConnectorBase_V1`); target `vllm-scheduler` sets it up through vLLM's `KVTransferConfig`
(`kv_connector_module_path` names this module) as a user sets up an external connector. It
offers a request the external tokens the trace names, as an asynchronous load or (`load_remote
{sync: true}`) a synchronous one taken at the request's next admission, and keeps nothing
else: vLLM's Scheduler does the lookup, the allocation, the caching and the rollback.

`ConnectorLoads` plays the two ops on that Scheduler (docs/vllm.md, "KV connectors on vLLM's
own scheduler"):

- `load_remote`: one `schedule()` in which the request is the only one vLLM's Scheduler sees
  and the connector offers it the tokens; an allocation that is not the load's own is refused,
  so the call schedules nothing (as kvfuzz's driver, whose `start_load` is not a step).
- `finish_load`: the load's end reaches the Scheduler as a worker reports it, in the
  `KVConnectorOutput` of a model output with nothing scheduled: `finished_recving`, and for a
  short load the blocks it did not fill (`invalid_block_ids`, one KV cache group) or the
  request (`failed_recving`, several groups or recurrent state: vLLM refuses block ids
  there; a failing synchronous load on several groups is reported the same way, and vLLM
  passes over it: docs/findings/031).
  The Scheduler promotes the request back to waiting in the next `schedule()`, which
  runs with the request alone, refusing its allocation, so the op schedules nothing either.

This module imports vLLM; only target `vllm-scheduler` loads it, on a config with a connector.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.outputs import KVConnectorOutput

_QUEUES = ("waiting", "kv_holding_waiting", "async_kv_waiting")
"""vLLM's waiting queues (a release may lack the last)."""

DEVIATIONS = {
    "load-reservation": "an async load is admitted only if it fits beside the blocks other "
                        "loads' prefills still need (`reserved_blocks`); kvfuzz's driver "
                        "reserves nothing",
    "loaded-blocks-zeroed": "a load's new blocks in the groups the connector restores are not "
                            "recorded for zeroing (`skip_zeroing_group_ids`); kvfuzz's driver "
                            "records every new block",
    "finish-drops-window-first": "a finishing request's out-of-window blocks are freed before "
                                 "the rest (`_connector_finished` calls "
                                 "`remove_skipped_blocks`), so they enter the free queue head "
                                 "first; kvfuzz's driver frees the table tail first",
    "error-finish-order": "the requests one output fails (FINISHED_ERROR) are finished in the "
                          "order of a set (`finish_requests(error_req_ids)`, hash-seed "
                          "dependent), so their blocks enter the free queue in that order; "
                          "kvfuzz's driver frees them in running order",
    "bounded-load": "releases without `Request.skip_reading_external_kv` load external KV for "
                    "a request whose hits are bounded; kvfuzz's driver (as vLLM 0.34) loads "
                    "none",
}
"""Where vLLM's Scheduler with a connector differs from kvfuzz's driver on purpose: target
`vllm-scheduler` plays the driver's rule, `vllm-scheduler-strict` vLLM's (docs/vllm.md)."""


class TraceConnector(KVConnectorBase_V1, SupportsHMA):
    """A scheduler-side connector whose hits are what the trace offers (`offers`)."""

    supports_divergent_local_hybrid_hits = True
    """Loads pass the per-group hits (kvfuzz's driver looks up with
    `get_computed_blocks_for_connector`)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.offers: dict[str, int] = {}
        """Request id -> external tokens offered at its next lookup, loaded asynchronously."""
        self.sync_offers: dict[str, int] = {}
        """Request id -> external tokens offered at every lookup until it is admitted, loaded
        synchronously (counted computed at once, the rest scheduled in the same step)."""
        self.sync_loaded: dict[str, int] = {}
        """Request id -> external tokens of a synchronous load admitted, until read."""
        self.sync_valid: dict[str, int] = {}
        """Request id -> the external tokens a failing synchronous load offered fills."""
        self.sync_admitted: dict[str, int] = {}
        """Request id -> external tokens of a synchronous load admitted this step."""
        self.started: dict[str, int] = {}
        """Request id -> external tokens of the load vLLM started (`update_state_after_alloc`)."""
        self.backoff = 0
        """Tokens left to compute at a prompt's end (1 with recurrent state, as NIXL does)."""
        self.restores_groups = True
        """Whether the groups a load writes are named (`get_loaded_kv_cache_group_ids`, so
        vLLM skips zeroing their new blocks); False: none is, as kvfuzz's driver passes."""

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        if not self.restores_groups:  # DEVIATIONS["loaded-blocks-zeroed"]
            return ()
        return super().get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if request.request_id in self.sync_offers:
            # vLLM schedules at least one token of a synchronous load's request (it asserts
            # so): the last is left to compute, as a local hit leaves it.
            n = min(self.sync_offers[request.request_id],
                    request.num_tokens - max(self.backoff, 1) - num_computed_tokens)
            return max(n, 0), False
        offered = self.offers.pop(request.request_id, 0)
        n = min(offered, request.num_tokens - self.backoff - num_computed_tokens)
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if self.sync_offers.pop(request.request_id, None) is not None:
            if num_external_tokens:
                self.sync_loaded[request.request_id] = num_external_tokens
                self.sync_admitted[request.request_id] = num_external_tokens
        elif num_external_tokens:
            self.started[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # The worker side: loads are reported by the driver (ConnectorLoads), never run.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError("TraceConnector runs on the scheduler side only")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError("TraceConnector runs on the scheduler side only")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        raise NotImplementedError("TraceConnector runs on the scheduler side only")

    def wait_for_save(self) -> None:
        raise NotImplementedError("TraceConnector runs on the scheduler side only")


def kv_transfer_config(policy: str = "recompute") -> Any:
    """The `KVTransferConfig` a user writes for this connector: a consumer (it loads), with
    `kv_load_failure_policy` `policy` (kvfuzz's driver rolls short loads back, vLLM's
    "recompute")."""
    return KVTransferConfig(kv_connector=TraceConnector.__name__,
                            kv_connector_module_path=__name__, kv_role="kv_consumer",
                            kv_load_failure_policy=policy)


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """`obj.name` is `value` while it runs (what was set on the instance before is back after:
    probes and plants wrap methods there)."""
    own = vars(obj)
    had, before = name in own, own.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, before)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def _alone(scheduler: Any, request: Any, queue: str, unreserved: bool = False
           ) -> Iterator[None]:
    """While it runs, vLLM's Scheduler sees no running request and `request` alone, in its
    waiting queue `queue` (None: no request), and refuses every allocation but an async
    load's (`delay_cache_blocks`; `unreserved`: with no blocks reserved for other loads); the
    allocator is told whether requests run, as in a real step; the manager sees no new step
    (`new_step_starts`, `take_new_block_ids` wait for the next real one). Afterwards the real queues are back; the caller moves `request`
    where it went."""
    manager = scheduler.kv_cache_manager
    saved = {name: getattr(scheduler, name) for name in ("running", *_QUEUES)
             if hasattr(scheduler, name)}
    has_running = bool(scheduler.running)
    for name in saved:
        setattr(scheduler, name, [] if name == "running" else create_request_queue(
            scheduler.policy))
    if request is not None:
        getattr(scheduler, queue).add_request(request)
    allocate = manager.allocate_slots

    def allocate_slots(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("delay_cache_blocks"):
            return None
        kwargs["has_scheduled_reqs"] = has_running
        if unreserved:  # DEVIATIONS["load-reservation"]
            kwargs["reserved_blocks"] = 0
        return allocate(*args, **kwargs)

    try:
        # Not a step for the manager (as kvfuzz's driver's loads are not): its per-step state
        # goes on, and the blocks to zero stay pending for the next real step's worker.
        with _patched(manager, "allocate_slots", allocate_slots), _patched(
                manager, "take_new_block_ids", lambda: []), _patched(
                manager, "new_step_starts", lambda: None):
            yield
    finally:
        for name, value in saved.items():
            setattr(scheduler, name, value)


def _errors_in_running_order(scheduler: Any) -> None:
    """DEVIATIONS["error-finish-order"]: the request ids `update_from_output` finishes
    together (a set, which `finish_requests` iterates as a set, `scheduler.py:3116-3128` in
    0.34.0) are finished one by one in running order."""
    finish = scheduler.finish_requests

    def finish_requests(request_ids: Any, finished_status: Any) -> Any:
        if not isinstance(request_ids, (set, frozenset)):
            return finish(request_ids, finished_status)
        order = {r.request_id: i for i, r in enumerate(scheduler.running)}
        return [request for rid in sorted(request_ids, key=lambda r: order.get(r, len(order)))
                for request in finish(rid, finished_status)]

    scheduler.finish_requests = finish_requests


def _finish_without_window_release(scheduler: Any) -> None:
    """DEVIATIONS["finish-drops-window-first"]: the connector's finish hook runs without
    releasing out-of-window blocks first (`free` then releases the whole table)."""
    finished = scheduler._connector_finished
    manager = scheduler.kv_cache_manager

    def connector_finished(request: Any) -> Any:
        with _patched(manager, "remove_skipped_blocks", lambda *args, **kwargs: None):
            return finished(request)

    scheduler._connector_finished = connector_finished


class ConnectorLoads:
    """The trace's KV loads on vLLM's Scheduler (mixed into its driver)."""

    vllm: Any
    _requests: dict[str, Any]
    _output: Callable[..., Any]

    def _init_loads(self, state_groups: bool, single_group: bool, driver_rules: bool) -> None:
        self.connector: TraceConnector = self.vllm.connector
        self.connector.backoff = int(state_groups)
        self._driver_rules = driver_rules
        """Play kvfuzz's driver where vLLM's Scheduler documentedly differs (`DEVIATIONS`):
        target `vllm-scheduler`; `vllm-scheduler-strict` plays vLLM's rules throughout."""
        if driver_rules:
            self.connector.restores_groups = False
            _finish_without_window_release(self.vllm)
            _errors_in_running_order(self.vllm)
        self._block_failures = single_group and not state_groups
        """A short load is reported by its blocks (one group), else by the request."""
        self._loads: dict[str, int] = {}
        """Loads in flight: request id -> its local hit."""
        self._landed: set[str] = set()
        self.window_unloaded: set[str] = set()
        """Requests whose short load finding 016 was tolerated for (`_window_unloaded`)."""

    @property
    def loads(self) -> tuple[str, ...]:
        return tuple(sorted(self._loads))

    @property
    def waiting(self) -> tuple[Any, ...]:
        """Requests waiting to be scheduled, as kvfuzz's driver lists them: those holding
        KV (vLLM drains them first) ahead of the rest; loads in flight are in neither."""
        queues = self._queues()
        holding, rest = queues[1], [queues[0], *queues[2:]]
        ordered = list(holding) + [r for q in rest for r in q]
        return tuple(r for r in ordered if r.request_id not in self._loads)

    def _queues(self) -> list[Any]:
        return [getattr(self.vllm, name) for name in _QUEUES if hasattr(self.vllm, name)]

    def _quiet_step(self, request: Any, queue: str, kv_output: Any = None,
                    unreserved: bool = False) -> None:
        """One `schedule()` with `request` alone (`_alone`; `unreserved`: its load reserves
        nothing for other loads) and the `update_from_output` of a model output that computed
        nothing and carries `kv_output`."""
        with _alone(self.vllm, request, queue, unreserved):
            scheduler_output = self.schedule()
        assert not scheduler_output.num_scheduled_tokens, scheduler_output.num_scheduled_tokens
        output = self._output(req_ids=[], sampled_token_ids=[])
        output.kv_connector_output = kv_output
        self.vllm.update_from_output(scheduler_output, output)

    @property
    def sync_loaded(self) -> dict[str, int]:
        """The synchronous loads vLLM admitted and no forward pass read yet: request id ->
        external tokens (read by popping)."""
        return self.connector.sync_loaded

    def start_load(self, request_id: str, num_external_tokens: int, sync: bool = False,
                   num_loaded_tokens: int | None = None) -> tuple[int, int, bool] | bool | None:
        """The connector offers `num_external_tokens` to a waiting request that holds nothing,
        never kept a landed load and has no offer standing. Asynchronous: vLLM's Scheduler
        looks it up and starts the load; (hit, external tokens, whether the per-group hits
        diverged), or None. `sync`: the connector offers them at the request's lookups until
        vLLM admits it (True), or None when refused; `num_loaded_tokens`: only that many of
        them fill their blocks (`load_failures` reports the rest)."""
        request = self._requests[request_id]
        if (request not in self.waiting or request.num_computed_tokens
                or request_id in self._landed or request_id in self.connector.sync_offers):
            return None
        bounded = (getattr(request, "prefix_cache_hit_limit", None) is not None
                   or getattr(request, "skip_reading_prefix_cache", False))
        unbounded_loads = self._driver_rules and bounded and not hasattr(
            request, "skip_reading_external_kv")  # DEVIATIONS["bounded-load"]
        if sync:
            self.connector.sync_offers[request_id] = 0 if unbounded_loads else (
                num_external_tokens)
            if num_loaded_tokens is not None:
                self.connector.sync_valid[request_id] = num_loaded_tokens
            return True
        if unbounded_loads:
            return None
        first: list[Any] = []
        lookup = self.vllm._get_local_prefix_cache_hit

        def local_hit(*args: Any) -> Any:
            found = lookup(*args)
            first.append(found)
            return found

        self.connector.offers[request_id] = num_external_tokens
        try:
            with _patched(self.vllm, "_get_local_prefix_cache_hit", local_hit):
                self._quiet_step(request, "waiting", unreserved=self._driver_rules)
        finally:
            self.connector.offers.clear()
        external = self.connector.started.pop(request_id, 0)
        if not external:
            if first:
                # No load: the junction is the connector lookup's, as in kvfuzz's driver
                # (vLLM's reconciling lookup for a diverged hit with nothing external is
                # redone at the request's admission, which looks it up again).
                request.shared_prefix_boundary = first[0][2]
            return None
        next(q for q in self._queues() if request in q).remove_request(request)
        self.vllm.kv_holding_waiting.add_request(request)
        hit = request.num_computed_tokens - external
        self._loads[request_id] = hit
        return hit, external, bool(first[0][3])

    def finish_load(self, request_id: str, num_loaded_tokens: int | None = None) -> int:
        """The worker reports the load done, `num_loaded_tokens` of its external tokens
        valid (None: all); returns the request's computed tokens once vLLM promoted it."""
        if request_id not in self._loads:
            raise ValueError(f"finish_load({request_id!r}): no KV load in flight for it")
        request = self._requests[request_id]
        hit = self._loads.pop(request_id)
        promised = request.num_computed_tokens - hit
        report = KVConnectorOutput(finished_recving={request_id})
        if request.is_finished():
            self._quiet_step(None, "waiting", report)
            return 0
        if num_loaded_tokens is not None and num_loaded_tokens < promised:
            end = hit + num_loaded_tokens
            # Finding 016 matters only where the request lives on ("recompute").
            recomputed = getattr(self.vllm, "recompute_kv_load_failures", True)
            if self._block_failures and not (self._driver_rules and recomputed
                                             and self._window_unloaded(request, end)):
                report.invalid_block_ids = self._unfilled_blocks(request, end)
            else:
                report.failed_recving = {request_id}
        self._quiet_step(None, "waiting", report)
        if request.is_finished():  # the "fail" policy failed it (FINISHED_ERROR)
            return 0
        # The promotion, where vLLM's Scheduler does it; the request keeps its place in the
        # real queue (the one `_alone` shows is a copy holding it alone).
        boundary = request.shared_prefix_boundary
        self._quiet_step(request, "kv_holding_waiting")
        # The admission that follows a promotion in the same `schedule()` was refused; its
        # lookup's junction is redone when the request is admitted.
        request.shared_prefix_boundary = boundary
        if any(self.vllm.kv_cache_manager.get_block_ids(request_id)):
            # It kept the load's blocks: the connector offers it no other load, as NIXL
            # triggers one transfer a request (`do_remote_prefill`). Its count may be 0 here (a
            # 1-token prompt loaded whole computes its token again), where vLLM, whose WAITING
            # requests have computed tokens after a load, asks the connector again.
            self._landed.add(request_id)
        return request.num_computed_tokens

    def load_failures(self, scheduled: dict[str, int]) -> Any:
        """What the worker reports of the synchronous loads the step just scheduled admitted
        (`scheduled`: request id -> tokens): for each that fails, on one group the blocks
        from the one holding the end of what it filled to the end of the load
        (`invalid_block_ids`); on several the request (`failed_recving`, as vLLM's
        `_handle_invalid_blocks` asks: docs/findings/031); None when none fails."""
        admitted, self.connector.sync_admitted = self.connector.sync_admitted, {}
        invalid: set[int] = set()
        failed: set[str] = set()
        manager = self.vllm.kv_cache_manager
        for request_id, external in admitted.items():
            valid = self.connector.sync_valid.pop(request_id, None)
            if valid is None or valid >= external:
                continue
            failed.add(request_id)
            hit = self._requests[request_id].num_computed_tokens - scheduled[request_id] - external
            for single, blocks in zip(manager.coordinator.single_type_managers,
                                      manager.get_blocks(request_id).blocks):
                size = single.block_size
                invalid.update(b.block_id for b in blocks[(hit + valid) // size:
                                                          -(-(hit + external) // size)]
                               if not b.is_null)
        if not failed:
            return None
        if self._block_failures:
            return KVConnectorOutput(invalid_block_ids=invalid) if invalid else None
        return KVConnectorOutput(failed_recving=failed)

    def _window_unloaded(self, request: Any, end: int) -> bool:
        """Finding 016, tolerated: whether vLLM's rollback point for a load ending at `end`
        (the first real block it did not fill) would attend to null blocks nothing loaded. The
        connector then reports the request failed, as kvfuzz's driver rolls it back (0)."""
        single = self.vllm.kv_cache_manager.coordinator.single_type_managers[0]
        (blocks,) = self.vllm.kv_cache_manager.get_blocks(request.request_id).blocks
        nulls = next((i for i, b in enumerate(blocks) if not b.is_null), len(blocks))
        start = max(end // single.block_size, nulls) * single.block_size
        unloaded = start > 0 and single.get_num_skipped_tokens(start) < nulls * single.block_size
        if unloaded:
            self.window_unloaded.add(request.request_id)
        return unloaded

    def preempt_window_unloaded(self) -> None:
        """Finding 016 on a failing synchronous load, tolerated: after vLLM's Scheduler
        handled a step's invalid blocks under "recompute", each affected running request whose
        rolled-back window reaches its table's leading nulls is preempted, as kvfuzz's driver
        does (docs/spec.md §13.3, step 5), and named in `window_unloaded`. Install it after
        any other wrapper of `_handle_invalid_blocks` (029's eviction runs first)."""
        scheduler = self.vllm
        handle = scheduler._handle_invalid_blocks

        def handle_invalid_blocks(*args: Any, **kwargs: Any) -> set[str]:
            affected = handle(*args, **kwargs)
            if not getattr(scheduler, "recompute_kv_load_failures", True):
                return affected
            single = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
            for request in [r for r in scheduler.running if r.request_id in affected]:
                (blocks,) = scheduler.kv_cache_manager.get_blocks(request.request_id).blocks
                nulls = next((i for i, b in enumerate(blocks) if not b.is_null), len(blocks))
                computed = request.num_computed_tokens
                if nulls and computed and (single.get_num_skipped_tokens(computed)
                                           < nulls * single.block_size):
                    self.window_unloaded.add(request.request_id)
                    scheduler.running.remove(request)
                    scheduler._preempt_request(request, time.monotonic())
            return affected

        scheduler._handle_invalid_blocks = handle_invalid_blocks

    def _unfilled_blocks(self, request: Any, end: int) -> set[int]:
        """The blocks a worker reports invalid when a load ends at token `end`: those it was
        asked to fill from the block holding `end` on (never the null block)."""
        (blocks,) = self.vllm.kv_cache_manager.get_blocks(request.request_id).blocks
        block_size = self.vllm.kv_cache_manager.coordinator.single_type_managers[0].block_size
        return {b.block_id for b in blocks[end // block_size:] if not b.is_null}
