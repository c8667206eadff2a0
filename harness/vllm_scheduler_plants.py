"""Bugs planted in vLLM's own Scheduler: targets `vllm-scheduler-bug:NAME`.

Each is one method of the live `Scheduler` patched on the instance target `vllm-scheduler`
builds (vLLM's code on disk is untouched), so a campaign at the scheduler level shows which
check catches it (tests/vllm/test_vllm_scheduler.py; bench/bench_vllm_scheduler.py times it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from unittest import mock

from kvfuzz.core.config import Config
from kvfuzz.core.configs import BUILTIN, builtin_config
from kvfuzz.core.sides import Side
from kvfuzz.harness.targets import VLLM_REQUIRED, get_target, register_target
from kvfuzz.harness.vllm_api import VllmUnsupported, check_vllm


def _preempt_keeps_blocks(scheduler: Any) -> None:
    """A preempted request's blocks are not freed (it re-prefills into new ones)."""
    preempt = scheduler._preempt_request

    def preempt_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        free = scheduler._free_request_blocks
        scheduler._free_request_blocks = lambda request: None
        try:
            return preempt(request, *args, **kwargs)
        finally:
            scheduler._free_request_blocks = free

    scheduler._preempt_request = preempt_request


def _finish_keeps_blocks(scheduler: Any) -> None:
    """A request that finishes is forgotten, its blocks never freed."""
    scheduler._free_blocks = lambda request: scheduler.requests.pop(request.request_id)


def _mamba_split_unaligned(scheduler: Any) -> None:
    """Prefill chunks of a Mamba "align" hybrid ignore the block alignment."""
    scheduler._mamba_block_aligned_split = lambda request, num_new_tokens, *args: num_new_tokens


def _hit_not_adopted(scheduler: Any) -> None:
    """Admission drops the prefix-cache hit and recomputes the whole prompt."""
    lookup = scheduler._get_local_prefix_cache_hit

    def get_local_prefix_cache_hit(request: Any, *args: Any) -> Any:
        blocks, _, boundary, diverged = lookup(request, *args)
        return scheduler.kv_cache_manager.empty_kv_cache_blocks, 0, boundary, diverged

    scheduler._get_local_prefix_cache_hit = get_local_prefix_cache_hit


def _rejection_keeps_computed(scheduler: Any) -> None:
    """Rejected drafts stay computed: `update_from_output` never sees which drafts the step
    verified, so it does not roll `num_computed_tokens` back."""
    update = scheduler.update_from_output

    def update_from_output(scheduler_output: Any, model_runner_output: Any) -> Any:
        spec = scheduler_output.scheduled_spec_decode_tokens
        scheduler_output.scheduled_spec_decode_tokens = {}
        try:
            return update(scheduler_output, model_runner_output)
        finally:
            scheduler_output.scheduled_spec_decode_tokens = spec

    scheduler.update_from_output = update_from_output


def _failed_load_kept(scheduler: Any) -> None:
    """A connector's short or failed load is not rolled back: the request keeps every token
    the load promised (its invalid blocks and failed requests are ignored)."""
    scheduler._handle_invalid_blocks = lambda *args, **kwargs: set()
    scheduler._handle_failed_recving = lambda *args, **kwargs: set()


def _in_flight_free_not_deferred(scheduler: Any) -> None:
    """A request freed while a step in flight still reads its blocks returns them at once
    (the `defer_block_free` fence ignored)."""
    scheduler._request_blocks_can_be_freed = lambda request: True


def _in_flight_sample_rescheduled(scheduler: Any) -> None:
    """The synchronous Scheduler counts an output placeholder for each request whose step
    samples, until its output is taken (AsyncScheduler's rule): a request whose sampling step
    is in flight is scheduled the position of its token still to come, not skipped."""
    after_schedule = scheduler._update_after_schedule
    update = scheduler.update_from_output

    def update_after_schedule(scheduler_output: Any) -> None:
        after_schedule(scheduler_output)
        for request_id in scheduler_output.num_scheduled_tokens:
            request = scheduler.requests[request_id]
            if not request.is_prefill_chunk:
                request.num_output_placeholders += 1

    def update_from_output(scheduler_output: Any, model_runner_output: Any) -> Any:
        for request_id in scheduler_output.num_scheduled_tokens:
            request = scheduler.requests.get(request_id)
            if request is not None and request.num_output_placeholders:
                request.num_output_placeholders -= 1
        return update(scheduler_output, model_runner_output)

    scheduler._update_after_schedule = update_after_schedule
    scheduler.update_from_output = update_from_output


def _failed_load_recomputed(scheduler: Any) -> None:
    """Under the "fail" `kv_load_failure_policy` a short load is rolled back and recomputed
    as under "recompute": the request is not failed."""
    scheduler.recompute_kv_load_failures = True


def _recomputed_sync_load_sampled(scheduler: Any) -> None:
    """Under the "recompute" policy the running requests a failing synchronous load rolled
    back are not skipped in `update_from_output`: they take the step's output as if it had
    computed their tokens (`_handle_invalid_blocks` returns none of them)."""
    handle = scheduler._handle_invalid_blocks

    def handle_invalid_blocks(*args: Any, **kwargs: Any) -> set[str]:
        affected = handle(*args, **kwargs)
        return set() if scheduler.recompute_kv_load_failures else affected

    scheduler._handle_invalid_blocks = handle_invalid_blocks


def _window_nulls_skipped(scheduler: Any) -> None:
    """A failing synchronous load's rollback point is counted among a request's real blocks:
    `_update_requests_with_invalid_blocks` over the running requests reads each table without
    a window's leading null blocks, so the point falls that many blocks too early."""
    update = scheduler._update_requests_with_invalid_blocks
    manager = scheduler.kv_cache_manager

    def update_requests(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("evict_blocks", True):  # an asynchronous load's: unchanged
            return update(*args, **kwargs)
        null = manager.block_pool.null_block.block_id
        get = manager.get_block_ids
        with mock.patch.object(manager, "get_block_ids", lambda request_id: tuple(
                [b for b in ids if b != null] for ids in get(request_id))):
            return update(*args, **kwargs)

    scheduler._update_requests_with_invalid_blocks = update_requests


def _encoder_never_fits(scheduler: Any) -> None:
    """The encoder cache never has room: every chunk stops before a multimodal input it would
    reach (`_try_schedule_encoder_inputs`), and one that starts inside an input waits."""
    scheduler.encoder_cache_manager.can_allocate = lambda *args, **kwargs: False


def _removals_unpublished(scheduler: Any) -> None:
    """The events each output publishes leave out every BlockRemoved: `update_from_output`
    takes the manager's queue whole and drops the removals (a consumer keeps evicted keys)."""
    manager = scheduler.kv_cache_manager
    update = scheduler.update_from_output

    def update_from_output(*args: Any, **kwargs: Any) -> Any:
        take = manager.take_events
        manager.take_events = lambda: [e for e in take() if type(e).__name__ != "BlockRemoved"]
        try:
            return update(*args, **kwargs)
        finally:
            manager.take_events = take

    scheduler.update_from_output = update_from_output


def _drafts_not_published(scheduler: Any) -> None:
    """Under spec decode `update_from_output` does not cache what a request's output settled
    (its accepted drafts' blocks wait for its next step's `allocate_slots`)."""
    update = scheduler.update_from_output

    def update_from_output(*args: Any) -> Any:
        with mock.patch.object(scheduler.kv_cache_manager, "cache_blocks",
                               lambda *_, **__: None):
            return update(*args)

    scheduler.update_from_output = update_from_output


def _drafts_cut_to_first(scheduler: Any) -> None:
    """`update_draft_token_ids` keeps of each request's proposals only as many as the batch's
    first request proposed (one count for the batch): seen only where a step's drafters
    propose different numbers of drafts (the trace's `drafted`)."""
    update = scheduler.update_draft_token_ids

    def update_draft_token_ids(draft_token_ids: Any) -> None:
        lists = draft_token_ids.draft_token_ids
        if lists:
            draft_token_ids.draft_token_ids = [list(d[:len(lists[0])]) for d in lists]
        update(draft_token_ids)

    scheduler.update_draft_token_ids = update_draft_token_ids


def _reset_keeps_running(scheduler: Any) -> None:
    """`reset_prefix_cache` ignores `reset_running_requests`: nothing is preempted, and the
    reset fails (False) while a request runs."""
    scheduler.reset_prefix_cache = lambda *args, **kwargs: (
        scheduler.kv_cache_manager.reset_prefix_cache())


def _padding_unverified(scheduler: Any) -> None:
    """An admission padded with placeholder drafts does not list them among the step's drafts
    (`scheduled_spec_decode_tokens`): its rejected ones stay computed."""
    schedule = scheduler.schedule

    def schedule_() -> Any:
        output = schedule()
        for new in output.scheduled_new_reqs:
            output.scheduled_spec_decode_tokens.pop(new.req_id, None)
        return output

    scheduler.schedule = schedule_


def _dynamic_drafts_zero_indexed(scheduler: Any) -> None:
    """Dynamic speculative decoding reads its dense batch-size table 0-indexed: a step of
    `b` requests drafts the count of `b - 1` (one request: slot 0, none)."""

    class ZeroIndexed(list):  # type: ignore[type-arg]
        def __getitem__(self, batch_size: Any) -> Any:
            return super().__getitem__(batch_size - 1)

    if scheduler.dynamic_sd_lookup is not None:  # a shrunk config may drop the schedule
        scheduler.dynamic_sd_lookup = ZeroIndexed(scheduler.dynamic_sd_lookup)


def _encoder_budget_per_request(scheduler: Any) -> None:
    """The encoder budget is not shared by a step's requests: `_try_schedule_encoder_inputs`
    gives each request's multimodal inputs the whole budget."""
    try_schedule = scheduler._try_schedule_encoder_inputs

    def try_schedule_encoder_inputs(request: Any, num_computed_tokens: int,
                                    num_new_tokens: int, budget: int, *args: Any,
                                    **kwargs: Any) -> Any:
        return try_schedule(request, num_computed_tokens, num_new_tokens,
                            scheduler.max_num_encoder_input_tokens, *args, **kwargs)

    scheduler._try_schedule_encoder_inputs = try_schedule_encoder_inputs


def _encoder_input_skipped(scheduler: Any) -> None:
    """An encoder-decoder request's encoder input is never scheduled, so its first chunk
    allocates no cross-attention blocks (`num_encoder_tokens` 0)."""
    scheduler._try_schedule_encoder_inputs = (
        lambda request, computed, num_new_tokens, budget, *args, **kwargs:
        ([], num_new_tokens, budget, [], []))


def _encoder_released_unsettled(scheduler: Any) -> None:
    """`_free_encoder_inputs` ignores output placeholders: under async scheduling an output
    releases the encoder inputs its own sampled tokens cover (the rule before
    vllm-project/vllm#45347)."""
    free = scheduler._free_encoder_inputs

    def free_encoder_inputs(request: Any) -> None:
        pending = request.num_output_placeholders
        request.num_output_placeholders = 0
        try:
            free(request)
        finally:
            request.num_output_placeholders = pending

    scheduler._free_encoder_inputs = free_encoder_inputs


def _cross_encoder_unbudgeted(scheduler: Any) -> None:
    """An encoder-decoder request's encoder input ignores the step's encoder budget:
    `EncoderDecoderCacheManager.can_allocate` checks the cache's room alone."""
    manager = scheduler.encoder_cache_manager
    can_allocate = manager.can_allocate
    manager.can_allocate = lambda request, input_id, budget, pending: can_allocate(
        request, input_id, scheduler.max_num_encoder_input_tokens * len(scheduler.requests),
        pending)


def _cross_encoder_room_kept(scheduler: Any) -> None:
    """An encoder-decoder request's encoder input never gives its room in the encoder cache
    back: `EncoderDecoderCacheManager.free_encoder_input` credits nothing (vLLM's repeated
    credit, finding 030, is the opposite error; target `vllm-scheduler` tolerates only that)."""
    scheduler.encoder_cache_manager.free_encoder_input = lambda request, input_id: None


def _cross_encoder_freed_at_launch(scheduler: Any) -> None:
    """An encoder-decoder request's encoder input gives its room in the encoder cache back
    when its step is scheduled, not when the step's output is taken: the step's inputs no
    longer hold room while it is in flight (on the synchronous path the output comes before
    the next schedule, so only a step in flight shows it)."""
    schedule = scheduler.schedule

    def schedule_and_release(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        for request_id, input_ids in output.scheduled_encoder_inputs.items():
            for input_id in input_ids:
                scheduler.encoder_cache_manager.free_encoder_input(
                    scheduler.requests[request_id], input_id)
        return output

    scheduler.schedule = schedule_and_release


def _align_surplus_freed(scheduler: Any) -> None:
    """Once rejected drafts leave a request's Mamba "align" table longer than its step needs,
    the allocation hands the blocks past that need back to the pool (the table shrinks, though
    the worker's table is append-only and the speculative blocks hold the draft states)."""
    for single in scheduler.kv_cache_manager.coordinator.single_type_managers:
        if getattr(single, "mamba_cache_mode", None) != "align":
            continue

        def allocate_new_blocks(request_id: str, num_tokens: int, num_tokens_main_model: int,
                                *args: Any, single: Any = single,
                                allocate: Callable[..., Any] = single.allocate_new_blocks,
                                **kwargs: Any) -> Any:
            blocks = single.req_to_blocks[request_id]
            need = -(-num_tokens_main_model // single.block_size) + single.num_speculative_blocks
            if need < len(blocks):
                surplus = [b for b in blocks[need:] if not b.is_null]
                del blocks[need:]
                single.block_pool.free_blocks(reversed(surplus))
            return allocate(request_id, num_tokens, num_tokens_main_model, *args, **kwargs)

        single.allocate_new_blocks = allocate_new_blocks


def _scoring_reads_cache(scheduler: Any) -> None:
    """A request scoring its whole prompt (prompt logprobs, `skip_reading_prefix_cache`
    derived) reads the prefix cache: `add_request` takes its hit limit from
    `prompt_logprob_start` alone (None from row 0, the `or 0` of vLLM 0.34
    `request.py:374-376` dropped); a bounded request (a start row) is unchanged."""
    add = scheduler.add_request

    def add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        params = request.sampling_params
        if params is not None and params.prompt_logprobs is not None:
            start = getattr(params, "prompt_logprob_start", None)
            if hasattr(request, "prefix_cache_hit_limit"):
                request.prefix_cache_hit_limit = start
            if hasattr(request, "skip_reading_prefix_cache"):  # 0.32-0.33
                request.skip_reading_prefix_cache = False
        return add(request, *args, **kwargs)

    scheduler.add_request = add_request


def _one_new_block_unsent(scheduler: Any) -> None:
    """A running request given exactly one new block in every group is told of none: its
    `CachedRequestData.new_block_ids` entry reads None (the effect of the mutant `len == 0` ->
    `len == 1` in `KVCacheBlocks.get_block_ids(allow_none=True)`, `kv_cache_manager.py:105` in
    0.34.0, on its one caller, `scheduler.py:2011-2013`)."""
    make = scheduler._make_cached_request_data

    def make_cached_request_data(*args: Any, **kwargs: Any) -> Any:
        cached = make(*args, **kwargs)
        cached.new_block_ids = [None if ids is not None and all(len(g) == 1 for g in ids)
                                else ids for ids in cached.new_block_ids]
        return cached

    scheduler._make_cached_request_data = make_cached_request_data


PLANTS: dict[str, tuple[str, Callable[[Any], None], tuple[str, ...]]] = {
    "preempt-keeps-blocks": ("a preempted request's blocks are not freed",
                             _preempt_keeps_blocks, ("full",)),
    "finish-keeps-blocks": ("a finished request's blocks are never freed",
                            _finish_keeps_blocks, ("full",)),
    "mamba-split-unaligned": ("Mamba 'align' prefill chunks ignore the block alignment",
                              _mamba_split_unaligned, ("mamba_align",)),
    "hit-not-adopted": ("admission drops the prefix-cache hit", _hit_not_adopted,
                        ("full",)),
    "rejection-keeps-computed": ("rejected spec-decode drafts are not rolled back",
                                 _rejection_keeps_computed, ("eagle",)),
    "failed-load-kept": ("a connector's short or failed KV load is not rolled back",
                         _failed_load_kept, ("connector",)),
    "free-not-deferred": ("a free while a step in flight reads the blocks is not "
                                    "deferred", _in_flight_free_not_deferred,
                                    ("deferred_connector",)),
    "in-flight-sample-rescheduled": ("a request whose sampling step is in flight is "
                                     "scheduled again on the synchronous Scheduler",
                                     _in_flight_sample_rescheduled, ("deferred_connector",)),
    "failed-load-recomputed": ("under the 'fail' policy a short KV load is recomputed, its "
                               "request not failed", _failed_load_recomputed,
                               ("nemotron_h_connector",)),
    "recomputed-sync-load-sampled": ("under the 'recompute' policy a request whose "
                                     "synchronous KV load failed takes the step's output",
                                     _recomputed_sync_load_sampled, ("connector",)),
    "sync-failure-window-nulls-skipped": ("a failing synchronous load's rollback point is "
                                          "counted without a window's null blocks",
                                          _window_nulls_skipped, ("mistral_connector_fail",)),
    "encoder-never-fits": ("the encoder cache never has room for a multimodal input",
                           _encoder_never_fits, ("tenants",)),
    "removals-unpublished": ("the KV events a step publishes leave out its BlockRemoved",
                             _removals_unpublished, ("events",)),
    "reset-keeps-running": ("reset_prefix_cache preempts no running request",
                            _reset_keeps_running, ("events",)),
    "drafts-not-published": ("under spec decode an output's settled blocks are not cached",
                             _drafts_not_published, ("fixed_drafts",)),
    "padding-unverified": ("a padded admission's placeholder drafts are not verified",
                           _padding_unverified, ("fixed_drafts",)),
    "dynamic-drafts-zero-indexed": ("dynamic speculative decoding reads its batch-size table "
                                    "0-indexed: a step drafts the count of one request fewer",
                                    _dynamic_drafts_zero_indexed, ("dynamic_drafts",)),
    "drafts-cut-to-first": ("each request keeps as many proposed drafts as the batch's first "
                            "request", _drafts_cut_to_first, ("eagle",)),
    "encoder-budget-per-request": ("each request's multimodal inputs get the whole encoder "
                                   "budget of the step", _encoder_budget_per_request,
                                   ("tenants",)),
    "encoder-input-skipped": ("an encoder-decoder request's encoder input is never scheduled: "
                              "no cross-attention blocks", _encoder_input_skipped, ("cross",)),
    "encoder-released-unsettled": ("under async scheduling an output releases the encoder "
                                   "inputs its own placeholders cover",
                                   _encoder_released_unsettled, ("tenants",)),
    "cross-encoder-unbudgeted": ("an encoder-decoder request's encoder input ignores the "
                                 "step's encoder budget", _cross_encoder_unbudgeted,
                                 ("cross",)),
    "cross-encoder-room-kept": ("an encoder-decoder request's encoder input never gives its "
                                "room in the encoder cache back", _cross_encoder_room_kept,
                                ("whisper_encoder_cache",)),
    "cross-encoder-freed-at-launch": ("an encoder-decoder request's encoder input gives its "
                                      "room in the encoder cache back when its step is "
                                      "scheduled, though the step is in flight",
                                      _cross_encoder_freed_at_launch,
                                      ("whisper_encoder_cache_async",)),
    "align-surplus-freed": ("after rejected drafts a Mamba 'align' table gives back the blocks "
                            "past the step's need", _align_surplus_freed, ("qwen3_next_eagle",)),
    "scoring-reads-cache": ("a request scoring its whole prompt (skip_reading_prefix_cache) "
                            "reads the prefix cache", _scoring_reads_cache, ("full",)),
    "one-new-block-unsent": ("a running request given one new block per group tells the "
                             "worker of none", _one_new_block_unsent, ("full",)),
}
"""name -> (what it breaks, the patch, the configs a campaign catches it on: built-ins, or
`PLANT_CONFIGS`)."""

_MISTRAL = BUILTIN["mistral_connector"][1]
_CROSS = BUILTIN["cross"][1]
PLANT_CONFIGS: dict[str, Config] = {
    "mistral_connector_fail": _MISTRAL.replace(
        name="mistral_connector_fail", scheduler=dataclasses.replace(
            _MISTRAL.scheduler, kv_load_failure_policy="fail")),
    # docs/configs/whisper-encoder-cache.json: an encoder cache of 12 under a budget of 24.
    "whisper_encoder_cache": _CROSS.replace(
        name="whisper_encoder_cache", num_blocks=40, scheduler=dataclasses.replace(
            _CROSS.scheduler, encoder_budget=24, encoder_cache_size=12)),
    # docs/configs/whisper-encoder-cache-async.json: the same with steps in flight.
    "whisper_encoder_cache_async": _CROSS.replace(
        name="whisper_encoder_cache_async", num_blocks=40, deferred_frees=True,
        scheduler=dataclasses.replace(_CROSS.scheduler, encoder_budget=24,
                                      encoder_cache_size=12, async_scheduling=True)),
}
"""Configs a plant needs that no built-in is (a campaign runs them as config files)."""

_ASYNC = frozenset({"free-not-deferred", "drafts-not-published", "padding-unverified",
                    "encoder-released-unsettled", "dynamic-drafts-zero-indexed",
                    "cross-encoder-freed-at-launch"})
"""Plants in vLLM's AsyncScheduler, where steps stay in flight (target vllm-async-scheduler)."""


def planted(name: str) -> Callable[[Config, str], Side]:
    """The side factory of `vllm-scheduler-bug:NAME` (the target module, and with it kvcache,
    loads only when a side is built: listing targets imports neither)."""
    patch = PLANTS[name][1]

    def base() -> type:
        from kvfuzz.harness.vllm_scheduler_target import (
            VllmAsyncSchedulerSide,
            VllmSchedulerSide,
        )

        return VllmAsyncSchedulerSide if name in _ASYNC else VllmSchedulerSide

    def build(config: Config, level: str) -> Side:
        class Planted(base()):  # type: ignore[misc]
            def build_scheduler(self, config: Config) -> Any:
                driver = super().build_scheduler(config)
                patch(self.vllm_scheduler)
                return driver

        Planted.name = f"vllm-scheduler-bug:{name}"
        return Planted(config, level)

    build.check_available = check_vllm  # type: ignore[attr-defined]
    build.engine_config = lambda config: base().engine_config(config)  # type: ignore[attr-defined]
    return build


def cannot_apply(name: str) -> str | None:
    """Why plant NAME cannot apply on the installed vLLM, or None: probed by building its
    side on each of its configs (under the engine's rules, as a campaign runs them), where the
    target cannot take the config or the Scheduler lacks a method the patch reads."""
    info = get_target(f"vllm-scheduler-bug:{name}")
    reasons = []
    for config_name in PLANTS[name][2]:
        try:
            config = PLANT_CONFIGS.get(config_name) or builtin_config(config_name)
            info.build(info.engine_config(config), "scheduler")
        except VllmUnsupported as exc:
            reasons.append(f"{config_name}: {exc}")
        except AttributeError as exc:
            reasons.append(f"{config_name}: vLLM's Scheduler has no {exc.name}")
        else:
            return None
    return "; ".join(reasons)


for _name, (_what, _, _) in PLANTS.items():
    register_target(f"vllm-scheduler-bug:{_name}",
                    f"planted bug in vLLM's own Scheduler: {_what}", planted(_name),
                    VLLM_REQUIRED)
