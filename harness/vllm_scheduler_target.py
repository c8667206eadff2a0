"""Target `vllm-scheduler`: vLLM's own v1 `Scheduler` runs scheduler-level traces.

Target `vllm` drives vLLM's KVCacheManager through kvfuzz's driver (`kvcache/scheduler.py`,
a copy of vLLM's scheduling rules). This one hands the trace's requests and steps to vLLM's
`Scheduler` itself (`AsyncScheduler` for `vllm-async-scheduler`): `add_request`, `schedule`,
`update_from_output` with the sampled tokens, `finish_requests`, `reset_prefix_cache`; with
KV events on, the events it publishes (harness/vllm_scheduler_events.py). The manager it reads
and checks is the one that Scheduler built, so the executor compares, per step, what vLLM's
scheduler scheduled, preempted and finished, the block tables and computed-token counts, with
the reference model (and with kvfuzz's driver on kvcache when it runs beside it), and runs every
registered check on that manager after every op.

vLLM's Scheduler needs a `VllmConfig`; the adapter builds one without a model (no weights, no
tokenizer, no network): a stand-in for `ModelConfig` carries the few attributes the Scheduler
reads, and the KV cache config is built by hand as target `vllm` builds it. What the config
file says the scheduler does (budget, running limit, policy, chunked prefill, watermark, the
full-sequence gate, Mamba "align" chunking) becomes vLLM's own settings; a config whose
knobs vLLM's Scheduler cannot take from settings alone (docs/vllm.md, "vLLM's own
scheduler") is refused with the reason, and a campaign leaves it out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.core.errors import InvalidTrace
from kvfuzz.core.sides import Observations
from kvfuzz.core.snapshot import Snapshot
from kvfuzz.core.sync_load_failures import SEVERAL_GROUP_FAILURES, several_groups
from kvfuzz.core.trace import Op
from kvfuzz.harness.manager_side import publishes_after_output
from kvfuzz.harness.scheduler_driver import SchedulerDriver
from kvfuzz.harness.vllm_api import VllmUnsupported, load_vllm, vllm_source
from kvfuzz.harness.vllm_encoder_budget import encoder_input, encoder_release_rule, size_encoder
from kvfuzz.harness.vllm_encoder_decoder_flight import defer_cross_frees
from kvfuzz.harness.vllm_encoder_decoder_slots import SLOTS_CREDITED_TWICE, credit_once
from kvfuzz.harness.vllm_failed_blocks import RECOMPUTED_KEYED, evict_rewritten_blocks
from kvfuzz.harness.vllm_sync_failure_groups import SEVERAL_GROUPS
from kvfuzz.harness.vllm_scheduler_events import PublishedEvents, count_outputs, kv_events_config
from kvfuzz.harness.vllm_target import (
    KNOWN_DEVIATIONS,
    KnownDeviation,
    VllmSide,
    _no_snapshot_change,
    _partial_hits_forced,
    build_kv_cache_config,
)
from kvfuzz.harness.vllm_worker_tables import WorkerTables
from kvfuzz.kvcache.scheduler import StepOutput, cut_per_group

_DRAFT_PLACEHOLDER = -1
"""The token id of a draft vLLM's Scheduler schedules for its worker to fill in (async
scheduling, spec-decode padding: `async_scheduler.py:22`, `scheduler.py:1644-1646` in 0.34.0);
kept, it is sampled as the token at its place is, as in kvfuzz's driver."""

_IN_FLIGHT = ("in_flight", "complete_step")
"""Driven where vLLM's Scheduler defers frees behind steps in flight (`defer_block_free`)."""


def in_flight_sampling_rule(async_scheduling: bool) -> str:
    """The `scheduler.in_flight_sampling` rule vLLM's scheduler follows: AsyncScheduler counts
    output placeholders (`async_scheduler.py:36`); the synchronous Scheduler has none, so a
    request whose sampling step is in flight is given `num_tokens_with_spec −
    num_computed_tokens = 0` tokens until its output is taken (`scheduler.py:855-859`,
    `:907-925` in 0.34.0)."""
    return "placeholders" if async_scheduling else "wait"


_LOADS = ("load_remote", "finish_load")
"""Driven only on a config with `kv_connector` (vLLM's Scheduler loads through its connector)."""


def _trim_stopped_drafts(snapshot: Snapshot, config: Config,
                         sampled: Collection[str] = ()) -> tuple[Snapshot, list[str]]:
    """A finished request that took a sampled token (`sampled`: only such a request stops on
    its output) reads as computed up to its last token: vLLM 0.32's Scheduler leaves the
    accepted drafts after a stop counted (docs/findings/025). A request that ends while a KV
    load covering its whole prompt is in flight keeps every token computed, as in kvfuzz."""
    changed = {rid: dataclasses.replace(view, num_computed_tokens=view.num_tokens - 1)
               for rid, view in snapshot.requests.items()
               if rid in sampled and view.status.startswith("FINISHED")
               and view.num_computed_tokens >= view.num_tokens}
    if not changed:
        return snapshot, []
    return dataclasses.replace(snapshot, requests={**snapshot.requests, **changed}), list(changed)


@functools.cache
def _stop_keeps_drafts_computed() -> bool:
    """Whether the Scheduler's `_update_request_with_output` drops the tokens after a stop
    without uncomputing them (read from its source; unreadable: nothing to tolerate)."""
    source = vllm_source("vllm.v1.core.sched.scheduler", "Scheduler._update_request_with_output")
    return source is not None and "num_computed_tokens" not in source


def _drained_in_drain(snapshot: Snapshot, config: Config) -> tuple[Snapshot, list[str]]:
    """Nothing to undo in a snapshot: the side drains deferred frees group after group
    (`VllmSchedulerDriver.drain_in_group_order`) and names the requests it did so for."""
    return snapshot, []


def _publishes_after_output(async_scheduling: bool, mamba: bool) -> bool:
    """Whether this vLLM's `update_from_output` caches a request's blocks after its output
    (`cache_blocks`): under async scheduling (0.33+), and on a Mamba hybrid without it (0.34,
    `has_mamba_layers`); read from its source (unreadable: no)."""
    source = vllm_source("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output")
    return source is not None and "cache_blocks" in source and (
        async_scheduling or mamba and "has_mamba_layers" in source)


def publishing_rule(async_scheduling: bool) -> bool:
    """The `scheduler.async_scheduling` by which this vLLM's scheduler (AsyncScheduler with
    `async_scheduling`) publishes a request's settled tokens after each output, which under
    hash lookahead caches the hash block the sampled token completes: true where its
    `update_from_output` caches the blocks of a request that had output placeholders, every
    request that sampled under async scheduling (`scheduler.py:2449-2471` in 0.34.0,
    `:2402-2415` in 0.33.0; `async_scheduler.py:36-38` in 0.34.0, `:44-46` in 0.33.0); false
    on the synchronous Scheduler, and on 0.32's AsyncScheduler (no `cache_blocks` there)."""
    return async_scheduling and _publishes_after_output(True, False)


def _hashes_ahead(config: Config) -> bool:
    """Whether publishing after an output can cache anything on `config` that the step's
    allocation did not: MTP hash lookahead with prefix caching (docs/spec.md §5.7)."""
    return bool(config.num_hash_lookahead_tokens) and config.enable_caching


def settled_blocks_rule() -> str:
    """The `scheduler.settled_blocks` rule this vLLM's synchronous Scheduler follows on a
    Mamba hybrid with prefix caching: "at_output" where `update_from_output` caches the
    request's blocks (0.34, `scheduler.py:2453-2470` in 0.34.0), "next_step" where it leaves
    them to the next step's allocation (0.33 caches there only with output placeholders or a
    SpeculativeConfig, `scheduler.py:2403-2414` in 0.33.0; 0.32 not at all)."""
    return "at_output" if _publishes_after_output(False, True) else "next_step"


def _settles_outputs(config: Config) -> bool:
    """Whether `scheduler.settled_blocks` decides anything on `config`: a Mamba hybrid with
    prefix caching."""
    return config.enable_caching and any(g.kind == "mamba" for g in config.groups)


@functools.cache
def _passes_over_encoder_blocked() -> bool:
    """Whether this vLLM's waiting loop passes over a request whose encoder inputs its encoder
    budget or cache cannot take (0.33+: `skip_request`) rather than stopping there (0.32:
    `break`, `scheduler.py:1217-1219` in 0.32.0); read from its source (without vLLM, as an
    exported test assumes: yes)."""
    source = vllm_source("vllm.v1.core.sched.scheduler", "Scheduler.schedule")
    if source is None or "_try_schedule_encoder_inputs(" not in source:
        return source is None
    waiting = source.rsplit("_try_schedule_encoder_inputs(", 1)[1]
    stop = waiting.split("if num_new_tokens == 0:", 1)
    return len(stop) == 2 and "skip_request" in stop[1].split("\n\n", 1)[0]


@functools.cache
def _goes_on_past_self_preemption() -> bool:
    """Whether this vLLM's running loop, under the priority policy, goes on to the requests
    after one that preempted itself (0.33+: `continue`, `scheduler.py:982-993` in 0.33.0)
    rather than stopping there (0.32: `break`, `scheduler.py:846-848` in 0.32.0); read from
    its source (without vLLM, as an exported test assumes: yes)."""
    source = vllm_source("vllm.v1.core.sched.scheduler", "Scheduler.schedule")
    return source is None or any(
        "RequestStatus.PREEMPTED" in block.split("\n\n", 1)[0]
        for block in source.split("if new_blocks is None:")[1:])


def loop_rules() -> dict[str, str]:
    """The running and waiting loop rules this vLLM's Scheduler follows, as the
    `scheduler.self_preemption` and `scheduler.blocked_waiting` a config names (probed from
    its source: `_goes_on_past_self_preemption`, `_passes_over_encoder_blocked`)."""
    return {"self_preemption": "continue" if _goes_on_past_self_preemption() else "stop",
            "blocked_waiting": "skip" if _passes_over_encoder_blocked() else "stop"}


def _loop_rules_differ(config: Config) -> list[str]:
    """The loop rules `config` names that this vLLM's Scheduler does not follow, where they
    can decide a step: the self-preemption rule under priority, the blocked-waiting rule with
    an encoder bound or a prefill lookahead (docs/spec.md §7, §7.2)."""
    s, rules = config.scheduler, loop_rules()
    return [f"scheduler.{name} {getattr(s, name)!r} (this vLLM's Scheduler follows "
            f"{rules[name]!r})"
            for name, matters in (("self_preemption", s.policy == "priority"),
                                  ("blocked_waiting",
                                   _encoder_bound(config) or config.num_prefill_lookahead > 0))
            if matters and getattr(s, name) != rules[name]]


def _encoder_bound(config: Config) -> bool:
    """Whether `config` bounds the encoder budget or the encoder cache (docs/spec.md §7.2)."""
    return (config.scheduler.encoder_budget is not None
            or config.scheduler.encoder_cache_size is not None)


SCHEDULER_DEVIATIONS = (
    KnownDeviation(
        "stopped-drafts-stay-computed",
        "docs/findings/025-stopped-drafts-stay-computed.md",
        _trim_stopped_drafts,
        releases="0.32",
        applies=lambda api: _stop_keeps_drafts_computed(),
    ),
    KnownDeviation(
        "deferred-drain-group-order",
        "docs/findings/018-deferred-drain-group-order.md",
        _drained_in_drain,
    ),
    # Blocks, not a snapshot: `harness/vllm_failed_blocks.py` undoes it (see there).
    KnownDeviation(
        RECOMPUTED_KEYED,
        "docs/findings/029-recompute-failed-blocks-keyed.md",
        _no_snapshot_change,
        applies=lambda api: api.has("kv_connector"),
    ),
    # A shape left out, not a snapshot: `harness/vllm_sync_failure_groups.py`.
    KnownDeviation(
        SEVERAL_GROUPS,
        "docs/findings/031-sync-failure-several-groups.md",
        _no_snapshot_change,
        applies=lambda api: api.has("kv_connector"),
    ),
    # The encoder cache's count, not a snapshot: `harness/vllm_encoder_decoder_slots.py`.
    KnownDeviation(
        SLOTS_CREDITED_TWICE,
        "docs/findings/030-encoder-decoder-slots-credited-twice.md",
        _no_snapshot_change,
    ),
)
"""Deviations only vLLM's own Scheduler shows (kvfuzz's driver plays its part for `vllm`)."""


class SchedulerCannotTake(VllmUnsupported):
    """A config vLLM's Scheduler cannot be set up for from its settings alone: a campaign
    leaves that config out and says why; naming it (`--config`) is a usage error (exit 2)."""


@functools.cache
def _dynamic_drafts() -> bool:
    """Whether this vLLM's SpeculativeConfig takes a batch-size schedule of drafts (its
    Scheduler then looks the step's K up: `dynamic_sd_lookup`, 0.34.0 `scheduler.py:322-329`,
    `:1765-1770`)."""
    return "num_speculative_tokens_per_batch_size" in {
        f.name for f in dataclasses.fields(_vllm_scheduler_api().SpeculativeConfig)}


def unsupported_reason(config: Config, async_scheduling: bool = False) -> str | None:
    """Why vLLM's own Scheduler (`AsyncScheduler` with `async_scheduling`) cannot run `config`
    as kvfuzz's driver would, or None."""
    s = config.scheduler
    release = encoder_release_rule(async_scheduling) if _encoder_bound(config) else (
        s.async_scheduling)
    type_name = "AsyncScheduler" if async_scheduling else "Scheduler"
    reasons = (
        (s.reserved_blocks > 0, "reserved_blocks (vLLM's Scheduler reserves only for async "
                                "KV loads)"),
        (any(g.kind == "encoder_only" for g in config.groups),
         "encoder-only layers (vLLM schedules a pooling model's encoder inputs from multimodal "
         "features)"),
        (config.has_cross_attention and (config.kv_connector or config.extra_keys),
         "cross attention beside a KV connector or multimodal inputs (vLLM schedules an "
         "encoder-decoder request's encoder input only at 0 computed tokens, from its one "
         "multimodal feature)"),
        (s.async_scheduling != release,
         f"scheduler.async_scheduling {str(s.async_scheduling).lower()} beside an encoder "
         f"budget or cache (this vLLM's {type_name} releases encoder inputs by the rule "
         f"scheduler.async_scheduling {str(release).lower()} names: docs/spec.md §7.2)"),
        (bool(config.scheduler.num_speculative_tokens) and not async_scheduling,
         "scheduler.num_speculative_tokens on the synchronous Scheduler (its placeholder "
         "drafts are async scheduling's; the synchronous one takes a drafter's through "
         "update_draft_token_ids: the trace's draft)"),
        (s.num_speculative_tokens_per_batch_size is not None and not _dynamic_drafts(),
         "scheduler.num_speculative_tokens_per_batch_size where vLLM's SpeculativeConfig has "
         "no such field (no dynamic speculative decoding)"),
        (bool(config.scheduler.num_speculative_tokens) and async_scheduling
         and not _publishes_after_output(True, False),
         "scheduler.num_speculative_tokens where vLLM's update_from_output does not cache a "
         "request's settled tokens after its output (0.32: the blocks its kept drafts fill "
         "wait for its next step; kvfuzz's driver publishes them, as 0.33+)"),
        (_hashes_ahead(config)
         and _publishes_after_output(async_scheduling,
                                     any(g.kind == "mamba" for g in config.groups))
         != publishes_after_output(config),
         "MTP hash lookahead where vLLM's Scheduler and kvfuzz's driver differ on publishing "
         "states after each output, which caches the hash block the sampled token completes "
         "(vLLM publishes under async scheduling from 0.33, and on a Mamba hybrid from 0.34; "
         "the driver under scheduler.async_scheduling true, and on a Mamba hybrid with "
         "scheduler.settled_blocks \"at_output\")"),
    )
    named = [why for on, why in reasons if on] + _loop_rules_differ(config)
    return "; ".join(named) if named else None


@functools.cache
def _vllm_scheduler_api() -> SimpleNamespace:
    """vLLM's scheduler classes, found where the installed release keeps them."""
    v = load_vllm()

    def find(module: str, name: str) -> Any:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise VllmUnsupported(
                f"target vllm-scheduler needs {module}.{name}, which vLLM {v.version} lacks "
                f"({type(exc).__name__})") from None

    return SimpleNamespace(
        VllmConfig=find("vllm.config", "VllmConfig"),
        SchedulerConfig=find("vllm.config", "SchedulerConfig"),
        CacheConfig=find("vllm.config", "CacheConfig"),
        DeviceConfig=find("vllm.config", "DeviceConfig"),
        KVEventsConfig=find("vllm.config", "KVEventsConfig"),
        SpeculativeConfig=find("vllm.config", "SpeculativeConfig"),
        ParallelConfig=find("vllm.config", "ParallelConfig"),
        Scheduler=find("vllm.v1.core.sched.scheduler", "Scheduler"),
        AsyncScheduler=find("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),
        StructuredOutputManager=find("vllm.v1.structured_output", "StructuredOutputManager"),
        ModelRunnerOutput=_model_runner_output(find("vllm.v1.outputs", "ModelRunnerOutput")),
        DraftTokenIds=getattr(importlib.import_module("vllm.v1.outputs"), "DraftTokenIds", None),
    )


def drafts_driven(scheduler_cls: type) -> bool:
    """Whether this vLLM takes a drafter's proposals (`Scheduler.update_draft_token_ids` with
    `vllm.v1.outputs.DraftTokenIds`), as its engine hands them over after each step."""
    return (_vllm_scheduler_api().DraftTokenIds is not None
            and hasattr(scheduler_cls, "update_draft_token_ids"))


def _model_runner_output(cls: Any) -> Callable[..., Any]:
    """`ModelRunnerOutput(req_ids=, sampled_token_ids=)`; releases before 0.34 also take
    the index of each request id (`req_id_to_index`)."""
    if "req_id_to_index" not in inspect.signature(cls).parameters:
        return cls

    def output(req_ids: list[str], sampled_token_ids: list[list[int]]) -> Any:
        return cls(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                   sampled_token_ids=sampled_token_ids)

    return output


def _model_stand_in(config: Config) -> SimpleNamespace:
    """What vLLM's Scheduler reads of a `ModelConfig`: a decoder-only text model that samples
    one token per step (building a real one inspects the model's code)."""
    return SimpleNamespace(
        max_model_len=config.max_model_len, uses_mrope=False, is_encoder_decoder=False,
        runner_type="generate", is_diffusion=False, supports_multimodal_inputs=False,
        is_multimodal_model=False, multimodal_config=None, return_sampling_mask=False,
        skip_tokenizer_init=True,
    )


@contextlib.contextmanager
def _derived_settings(vllm_config_cls: Any, scheduler_module: Any, config: Config
                      ) -> Iterator[None]:
    """What vLLM's Scheduler derives from settings kvfuzz does not model, set while it is
    built: `VllmConfig.max_in_flight_tokens` (concurrent batches × budget) becomes the
    config's reserve (None: max_model_len, the manager's own default);
    `VllmConfig.num_lookahead_tokens` (a drafter's KV slots past the scheduled tokens) the
    config's lookahead; MTP's `num_hash_lookahead_tokens` and `num_prefill_lookahead_tokens`
    (0.33+; a release without them never gets here, `VllmSide.build_manager` refuses) the
    config's; and the manager it builds gets the config's EAGLE last-block drop (vLLM reads
    them from a draft model's SpeculativeConfig, which needs the model)."""
    derived = {"max_in_flight_tokens": config.max_in_flight_tokens or config.max_model_len,
               "num_lookahead_tokens": config.scheduler.num_lookahead_tokens}
    for name, value in (("num_hash_lookahead_tokens", config.num_hash_lookahead_tokens),
                        ("num_prefill_lookahead_tokens", config.num_prefill_lookahead)):
        if value:
            derived[name] = value
    originals = {name: vllm_config_cls.__dict__[name] for name in derived}
    manager_cls = scheduler_module.KVCacheManager
    for name, value in derived.items():
        setattr(vllm_config_cls, name, property(lambda self, value=value: value))
    scheduler_module.KVCacheManager = lambda *args, **kwargs: manager_cls(
        *args, **{**kwargs, "use_eagle": config.use_eagle})
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(vllm_config_cls, name, original)
        scheduler_module.KVCacheManager = manager_cls


def build_vllm_scheduler(config: Config, async_scheduling: bool = False,
                         scheduler_cls: type | None = None,
                         kv_load_failure_policy: str = "recompute") -> Any:
    """vLLM's own Scheduler (or AsyncScheduler) for a harness config, on the CPU, offline
    (with a KV connector: kvfuzz's, under `kv_load_failure_policy`)."""
    reason = unsupported_reason(config, async_scheduling)
    if reason is not None:
        raise SchedulerCannotTake(f"vLLM's Scheduler is not driven with {reason}")
    api = _vllm_scheduler_api()
    s = config.scheduler
    align = any(g.mamba_cache_mode == "align" for g in config.groups)
    scheduler_config = api.SchedulerConfig(
        max_num_seqs=s.max_running,
        max_num_batched_tokens=s.token_budget,
        max_model_len=config.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy=s.policy,
        watermark=config.watermark,
        async_scheduling=async_scheduling,
        scheduler_reserve_full_isl=s.full_sequence_must_fit,
    )
    # vLLM's validation refuses chunked prefill off with a budget below max_model_len (its
    # frontend then refuses the longer prompts); the Scheduler's own rule for it (such a
    # prompt is never admitted) is what runs here.
    scheduler_config.enable_chunked_prefill = s.chunked_prefill
    cache_config = api.CacheConfig(
        block_size=config.scheduler_block_size,
        enable_prefix_caching=config.enable_caching,
        **({"mamba_cache_mode": "align"} if align else {}),
        **({"enable_mamba_shared_prefix_checkpoint": True}
           if config.enable_mamba_shared_prefix_checkpoint else {}),
    )
    cache_config.num_gpu_blocks = config.num_blocks
    settings: dict[str, Any] = {}
    if config.kv_connector:
        from kvfuzz.harness.vllm_connector import kv_transfer_config

        settings["kv_transfer_config"] = kv_transfer_config(kv_load_failure_policy)
    if s.num_speculative_tokens:
        # A drafter that needs no model (vLLM's own tests use n-gram lookup): vLLM then
        # schedules that many placeholder drafts per decoding request (`async_scheduler.py:20-41`
        # in 0.34.0).
        dynamic = ({} if s.num_speculative_tokens_per_batch_size is None else
                   {"num_speculative_tokens_per_batch_size":
                    [list(r) for r in s.num_speculative_tokens_per_batch_size]})
        settings["speculative_config"] = api.SpeculativeConfig(
            model="ngram", num_speculative_tokens=s.num_speculative_tokens, **dynamic)
    if config.deferred_frees and not async_scheduling:
        # Two pipeline stages: the synchronous Scheduler has two batches in flight (and,
        # with a consumer connector, defers frees behind them).
        settings["parallel_config"] = api.ParallelConfig(pipeline_parallel_size=2)
    if config.kv_events:
        settings["kv_events_config"] = kv_events_config(api.KVEventsConfig)
    vllm_config = api.VllmConfig(scheduler_config=scheduler_config, cache_config=cache_config,
                                 device_config=api.DeviceConfig(device="cpu"), **settings)
    object.__setattr__(vllm_config, "model_config", _model_stand_in(config))
    cls = scheduler_cls or (api.AsyncScheduler if async_scheduling else api.Scheduler)
    with _partial_hits_forced(load_vllm(), config.partial_hits), _derived_settings(
            type(vllm_config), importlib.import_module(api.Scheduler.__module__), config):
        scheduler = cls(
            vllm_config=vllm_config,
            kv_cache_config=build_kv_cache_config(config),
            structured_output_manager=api.StructuredOutputManager(vllm_config),
            block_size=config.scheduler_block_size,
            hash_block_size=config.resolved_hash_block_size,
            log_stats=False,
        )
    # The Mamba chunk split steps its stops down by a block with EAGLE, as the manager does.
    scheduler.use_eagle_block_drop = config.use_eagle
    size_encoder(scheduler, config)  # multimodal inputs (harness/vllm_encoder_budget.py)
    defer_cross_frees(scheduler, config)  # harness/vllm_encoder_decoder_flight.py
    if config.kv_events:  # what it publishes is kept (harness/vllm_scheduler_events.py)
        scheduler.kv_event_publisher = PublishedEvents()
    return scheduler


class _At:
    """A request as a forward pass sees it: its id and the computed tokens the step starts at
    (vLLM's `schedule` has already advanced the request's count)."""

    def __init__(self, request: Any, start: int) -> None:
        self.request_id = request.request_id
        self.num_computed_tokens = start


class VllmSchedulerDriver(SchedulerDriver):
    """kvfuzz's driver interface (`kvcache.scheduler.Scheduler`), played by vLLM's Scheduler:
    a trace's `step` is one `schedule()` and the `update_from_output()` of its model output;
    a `step {in_flight: true}` holds its output until `complete_step` (docs/vllm.md)."""

    loads: tuple[str, ...] = ()

    def __init__(self, scheduler: Any, model_runner_output: Callable[..., Any],
                 draft_token_ids: Callable[..., Any] | None = None) -> None:
        self.vllm = scheduler
        self._output = model_runner_output
        self._drafts = draft_token_ids
        self._requests: dict[str, Any] = {}
        self._held: deque[tuple[tuple[Any, ...], Any, Callable[[], Any]]] = deque()
        """Steps in flight, oldest first: (the driver's in-flight entry, the SchedulerOutput,
        what makes the model output `update_from_output` takes at `complete_step`: the tokens
        are sampled then, as kvfuzz's driver samples them)."""
        self._popped: dict[int, tuple[list[Any], str, list[list[Any]]]] = {}
        """id of a request's deferred free (its block list) -> (the list, kept so that the id
        stays its own; the request id; the group tables it was popped from)."""
        self.drain_in_group_order = False
        """Release each deferred free group after group (finding 018 tolerated)."""
        self.reordered: list[str] = []
        """Requests whose deferred free vLLM's drain would have released in 018's order."""
        self.preempted: list[str] = []
        """Request ids vLLM's Scheduler preempted this step, in order (`_preempt_request`)."""
        self.sampled: set[str] = set()
        """Request ids that took a sampled token (finding 025's shape needs one)."""
        self._filled: dict[str, int] = {}
        """Request id -> how many of its placeholder drafts its drafter filled, where fewer
        than all (the trace's `drafted`): the worker leaves the rest -1, which its rejection
        sampler always rejects (`model_runner.py:2393-2394`, `rejection_sampler.py:111-131`
        in 0.34.0)."""
        self.in_flight_sampling = "placeholders"
        """The trace's rule for a request whose sampling step is in flight (its config's)."""
        self.outputs_taken = 0
        """`update_from_output` calls so far (each publishes the events queued before it)."""
        self.worker = WorkerTables(scheduler.kv_cache_manager)
        self.worker_mismatches: list[str] = []
        """Where the worker's block tables left the manager's since the side last read them
        (check W1, harness/vllm_worker_tables.py)."""
        count_outputs(self, scheduler)
        preempt = scheduler._preempt_request

        def preempt_request(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.preempted.append(request.request_id)
            return preempt(request, *args, **kwargs)

        scheduler._preempt_request = preempt_request
        free = scheduler._free_request_blocks

        def free_request_blocks(request: Any) -> Any:
            tables = [] if scheduler._request_blocks_can_be_freed(request) else [
                list(b) for b in scheduler.kv_cache_manager.get_blocks(request.request_id).blocks]
            deferred = len(scheduler.deferred_frees)
            result = free(request)
            if len(scheduler.deferred_frees) > deferred:
                blocks = scheduler.deferred_frees[-1][1]
                self._popped[id(blocks)] = (blocks, request.request_id, tables)
            return result

        scheduler._free_request_blocks = free_request_blocks
        drain = scheduler._drain_deferred_frees

        def drain_deferred_frees() -> None:
            if not self.drain_in_group_order:
                return drain()
            while scheduler.deferred_frees and (
                    scheduler.deferred_frees[0][0] <= scheduler.processed_step_seq):
                blocks = scheduler.deferred_frees.popleft()[1]
                runs = self._runs(blocks)
                if len(runs) > 1:
                    self.reordered.append(self._popped[id(blocks)][1])
                for run in runs:
                    scheduler.kv_cache_manager.block_pool.free_blocks(run[::-1])
            return None

        scheduler._drain_deferred_frees = drain_deferred_frees

    def schedule(self) -> Any:
        """vLLM's `schedule()`, its SchedulerOutput replayed on the worker's tables."""
        scheduler_output = self.vllm.schedule()
        self.worker_mismatches.extend(self.worker.see(scheduler_output))
        return scheduler_output

    def _runs(self, blocks: list[Any]) -> list[list[Any]]:
        """A deferred free's blocks, one run per group (a copy's retained blocks: one run)."""
        popped = self._popped.get(id(blocks))
        return [list(blocks)] if popped is None else cut_per_group(popped[2], list(blocks))

    @property
    def in_flight(self) -> tuple[tuple[Any, ...], ...]:
        """Steps scheduled whose output is not taken yet, oldest first: (step, the block ids
        it reads, (request id, tokens) it scheduled), as kvfuzz's driver reports them."""
        return tuple(entry for entry, _, _ in self._held)

    @property
    def deferred_frees(self) -> tuple[tuple[int, ...], ...]:
        """vLLM's deferred frees (`Scheduler.deferred_frees`), one run of block ids per group."""
        return tuple(tuple(b.block_id for b in run) for _, blocks in self.vllm.deferred_frees
                     for run in self._runs(blocks))

    def complete_step(self) -> list[int]:
        """The oldest step in flight completes: `update_from_output` takes its output, which
        drains the deferred frees it fenced. Returns the block ids of the frees drained."""
        if not self._held:
            raise ValueError("complete_step(): no step is in flight")
        _, scheduler_output, output = self._held.popleft()
        before = list(self.vllm.deferred_frees)
        self.vllm.update_from_output(scheduler_output, output())
        left = {id(entry) for entry in self.vllm.deferred_frees}
        return [b.block_id for entry in before if id(entry) not in left
                for run in self._runs(entry[1]) for b in run]

    def load_failures(self, scheduled: dict[str, int]) -> Any:
        """The connector's report of the failing synchronous loads a step admitted (none
        without a connector, `ConnectorLoads.load_failures`)."""
        return None

    def _check_in_flight_sampling(self, samples: list[tuple[Any, list[int] | None]],
                                  spec: dict[str, Any]) -> None:
        """InvalidTrace where a step left in flight samples under a rule this Scheduler does
        not follow (`scheduler.in_flight_sampling`: AsyncScheduler counts output placeholders,
        the synchronous Scheduler waits), or verifies drafts on the synchronous Scheduler
        (without placeholders the drafts it computed would leave the request's next count
        negative, `scheduler.py:855-859` in 0.34.0)."""
        sampling = [r.request_id for r, kept in samples if kept is not None]
        if not sampling:
            return
        engine = in_flight_sampling_rule(self.vllm.scheduler_config.async_scheduling)
        if self.in_flight_sampling != engine:
            raise InvalidTrace(
                f"step {{in_flight: true}} samples {sampling} under scheduler.in_flight_sampling "
                f"{self.in_flight_sampling!r}; vLLM's {type(self.vllm).__name__} follows "
                f"{engine!r} (docs/vllm.md, \"Steps in flight\")")
        drafted = [rid for rid in sampling if spec.get(rid)]
        if engine == "wait" and drafted:
            raise InvalidTrace(
                f"step {{in_flight: true}} verifies drafts of {drafted} on vLLM's synchronous "
                "Scheduler, which has no output placeholders to count them (docs/vllm.md, "
                "\"Steps in flight\")")

    def _reads(self, request: Any, start: int) -> tuple[int, ...]:
        """The block ids a step starting at `start` computed tokens reads: each group's table
        from the first block a token from there attends to (as kvfuzz's driver records)."""
        manager = self.vllm.kv_cache_manager
        reads: set[int] = set()
        for single, blocks in zip(manager.coordinator.single_type_managers,
                                  manager.get_blocks(request.request_id).blocks):
            skip = max(single.get_num_skipped_tokens(start), 0) // single.block_size
            reads.update(b.block_id for b in blocks[skip:] if not b.is_null)
        return tuple(reads)

    @property
    def running(self) -> tuple[Any, ...]:
        return tuple(self.vllm.running)

    @property
    def waiting(self) -> tuple[Any, ...]:
        return tuple(self.vllm.waiting)

    @property
    def sync_loaded(self) -> dict[str, int]:
        """None without a connector (`ConnectorLoads.sync_loaded`)."""
        return {}

    def pending_tokens(self, request_id: str) -> int:
        """0: the side sees this driver's forward passes at once (vLLM's output placeholders
        are not read)."""
        return 0

    def add_request(self, request: Any) -> None:
        self._requests[request.request_id] = request
        self.vllm.add_request(request)

    def finish_request(self, request_id: str, status: Any) -> None:
        # Ended here, not stopped by its output (finding 025's shape): an abort while a KV load
        # or a sampling step is in flight leaves it computed to its last token, as in kvfuzz.
        self.sampled.discard(request_id)
        self.vllm.finish_requests(request_id, status)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's `Scheduler.reset_prefix_cache` (0.32-0.34: preempts every running request,
        the last first, with `reset_running_requests`; raises if the reset then fails)."""
        return self.vllm.reset_prefix_cache(reset_running_requests=reset_running_requests)

    def step(self, sample_token: Callable[..., int],
             run_model: Callable[[list[tuple[Any, int, int]], list[tuple[int, int]]], None]
             | None = None, *, in_flight: bool = False, accept: int | None = None,
             propose: Callable[[Any], list[int]] | None = None,
             drafted: Mapping[str, int] | None = None) -> StepOutput:
        """One `schedule()`; the model plays the step; the requests whose tokens are then all
        computed return the first `accept` (None: all) of the drafts vLLM scheduled for them
        (`scheduled_spec_decode_tokens`) and the token `sample_token(request, accepted)`;
        `update_from_output()` takes them (and rolls back the rejected drafts). With `propose`,
        the drafter then proposes `propose(request)` for every request of the batch
        (`update_draft_token_ids`, which keeps those of requests that sampled and run).
        `drafted`, with placeholder drafts: how many of the placeholders a request that
        samples gets its drafter fills (all when not named); its next step keeps none past
        them."""
        if not in_flight:
            while self._held:
                self.complete_step()
        elif not self.vllm.defer_block_free:
            raise ValueError("vLLM's Scheduler leaves steps in flight only where it defers "
                             "frees (defer_block_free)")
        self.preempted = []
        # Waiting requests that hold nothing (a landed KV load holds its tokens: no lookup).
        fresh = {r.request_id for r in self.waiting if not r.num_computed_tokens}
        admitted = {r.request_id for r in self.waiting}  # padded placeholders are not drafted
        scheduler_output = self.schedule()
        ids = list(scheduler_output.num_scheduled_tokens)
        kv_output = self.load_failures(scheduler_output.num_scheduled_tokens)
        if kv_output is not None and in_flight:
            raise InvalidTrace("a step left in flight admits a failing synchronous load: not "
                               "modeled (docs/spec.md §13.3)")
        # An admitted request's hit: what it had computed before its first chunk (vLLM 0.32
        # sends a resumed request as cached data, without its computed tokens), less what a
        # synchronous KV load gave it.
        loaded = self.sync_loaded
        scheduled = [(request, n, request.num_computed_tokens - n - loaded.get(rid, 0)
                      if rid in fresh else 0)
                     for rid, n in scheduler_output.num_scheduled_tokens.items()
                     for request in (self._requests[rid],)]
        copies = [(int(c[0]), int(c[1])) for c in scheduler_output.kv_cache_block_copies or ()]
        if run_model is not None:
            run_model([(_At(r, r.num_computed_tokens - n), n, hit) for r, n, hit in scheduled],
                      copies)
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        # Who samples is known at launch; what, only when the output is taken.
        samples: list[tuple[Any, list[int] | None]] = []
        for r, _, _ in scheduled:
            drafts = list(spec.get(r.request_id, ()))
            kept = drafts if accept is None else drafts[:accept]
            filled = self._filled.pop(r.request_id, None)
            if filled is not None and r.request_id not in admitted:
                kept = kept[:filled]
            samples.append((r, kept if r.num_computed_tokens >= r.num_tokens else None))
        if propose is None:  # the placeholders each request that samples now gets
            self._filled.update((r.request_id, (drafted or {})[r.request_id])
                                for r, kept in samples
                                if kept is not None and r.request_id in (drafted or {}))

        def output() -> Any:
            # A request aborted meanwhile takes no token (finding 025's shape needs one).
            self.sampled.update(r.request_id for r, kept in samples
                                if kept is not None and not r.is_finished())
            output = self._output(req_ids=ids, sampled_token_ids=[
                [] if kept is None else [
                    sample_token(r, j) if token == _DRAFT_PLACEHOLDER else token
                    for j, token in enumerate([*kept, _DRAFT_PLACEHOLDER])]
                for r, kept in samples])
            if kv_output is not None:  # the failing synchronous loads it admitted
                output.kv_connector_output = kv_output
            return output

        if in_flight and ids:
            self._check_in_flight_sampling(samples, spec)
            reads = sorted({b for r, n, _ in scheduled
                            for b in self._reads(r, r.num_computed_tokens - n)})
            self._held.append(((self.vllm.sched_step_seq, tuple(reads),
                                tuple((r.request_id, n) for r, n, _ in scheduled)),
                               scheduler_output, output))
        else:
            self.vllm.update_from_output(scheduler_output, output())
        if propose is not None and ids:
            if self._drafts is None:
                raise ValueError("this vLLM's Scheduler takes no drafts")
            self.vllm.update_draft_token_ids(self._drafts(
                req_ids=ids, draft_token_ids=[propose(self._requests[rid]) for rid in ids]))
        return StepOutput(
            scheduled=[(r.request_id, n, hit) for r, n, hit in scheduled],
            preempted=list(self.preempted),
            finished=[r.request_id for r, _, _ in scheduled if r.is_finished()],
            copies=copies,
        )


class VllmSchedulerSide(VllmSide):
    """vLLM's own Scheduler and the KVCacheManager it built, tolerating target `vllm`'s known
    deviations that apply (and nothing else). At the API level its manager is driven directly."""

    name = "vllm-scheduler"
    async_scheduling = False
    known_deviations = KNOWN_DEVIATIONS + SCHEDULER_DEVIATIONS

    @staticmethod
    def deviation_catalogue() -> tuple[KnownDeviation, ...]:
        return KNOWN_DEVIATIONS + SCHEDULER_DEVIATIONS

    def new_manager(self, config: Config) -> Any:
        self.vllm_scheduler = build_vllm_scheduler(
            config, self.async_scheduling,
            kv_load_failure_policy=config.scheduler.kv_load_failure_policy)
        return self.vllm_scheduler.kv_cache_manager

    def build_scheduler(self, config: Config) -> SchedulerDriver:
        api = _vllm_scheduler_api()
        drafts = api.DraftTokenIds if self._takes_drafts() else None
        if not config.kv_connector:
            driver = VllmSchedulerDriver(self.vllm_scheduler, api.ModelRunnerOutput, drafts)
        else:
            from kvfuzz.harness.vllm_connector import ConnectorLoads

            class Driver(ConnectorLoads, VllmSchedulerDriver):
                """vLLM's Scheduler with kvfuzz's connector (harness/vllm_connector.py)."""

            driver = Driver(self.vllm_scheduler, api.ModelRunnerOutput, drafts)
            driver._init_loads(any(g.kind == "mamba" for g in config.groups),
                               len(self.group_ids) == 1, bool(self.known_deviations))
            if RECOMPUTED_KEYED in self.tolerated:
                evict_rewritten_blocks(self.vllm_scheduler, self.tolerated[RECOMPUTED_KEYED])
            if self.known_deviations:
                driver.preempt_window_unloaded()
        driver.drain_in_group_order = "deferred-drain-group-order" in self.tolerated
        if SLOTS_CREDITED_TWICE in self.tolerated and config.has_cross_attention:
            credit_once(self.vllm_scheduler.encoder_cache_manager,
                        self.tolerated[SLOTS_CREDITED_TWICE])
        driver.in_flight_sampling = config.scheduler.in_flight_sampling
        self.deviations = tuple(
            dataclasses.replace(d, tolerate=functools.partial(_trim_stopped_drafts,
                                                              sampled=driver.sampled))
            if d.name == "stopped-drafts-stay-computed" else d for d in self.deviations)
        return driver

    def observations(self) -> Observations:
        """The probes' and, at the scheduler level, where the worker's tables left the
        manager's during the op (W1)."""
        obs = super().observations()
        if isinstance(self.scheduler, VllmSchedulerDriver):
            obs.worker_mismatches = self.scheduler.worker_mismatches
            self.scheduler.worker_mismatches = []
        return obs

    def queued_events(self) -> list[Any]:
        """What vLLM's Scheduler published in the op (a batch per `update_from_output`). An
        op that took no output (an abort, a reset, a step left in flight, the API level)
        publishes nothing: the events its manager queued, which vLLM publishes with the next
        output, are read from the queue at once, so that each op's events are its own."""
        published = self.vllm_scheduler.kv_event_publisher.take()
        driver = self.scheduler
        if driver is not None and driver.outputs_taken:
            driver.outputs_taken = 0
            return published
        return published + self.manager.take_events()

    def _defers_frees(self) -> bool:
        """Whether vLLM's Scheduler defers frees behind steps in flight: a KV-consumer
        connector and more than one batch in flight (`scheduler.py:191-193` in 0.34.0)."""
        return bool(getattr(self.vllm_scheduler, "defer_block_free", False))

    def _may_draft(self) -> bool:
        """Whether this Scheduler takes drafts and the config has a drafter (EAGLE or
        lookahead slots), so that the generators may give its requests drafts."""
        c = self.config
        return self._takes_drafts() and bool(c.use_eagle or c.scheduler.num_lookahead_tokens)

    @classmethod
    def engine_config(cls, config: Config) -> Config:
        """`config` with the in-flight sampling rule this Scheduler follows, where steps stay
        in flight (`deferred_frees`), the loop rules it follows (`loop_rules`), the encoder
        release rule it follows with a bound encoder (`scheduler.async_scheduling`), when the
        synchronous one caches an output's settled blocks on a Mamba hybrid
        (`settled_blocks_rule`), and whether it publishes after each output under hash
        lookahead (`scheduler.async_scheduling`, `publishing_rule`; a bound encoder's release
        rule decides it there): what a campaign runs its built-in and generated configs with
        (`harness.targets.TargetInfo.engine_config`)."""
        rule = in_flight_sampling_rule(cls.async_scheduling)
        if config.deferred_frees and config.scheduler.in_flight_sampling != rule:
            config = config.replace(scheduler=dataclasses.replace(config.scheduler,
                                                                  in_flight_sampling=rule))
        rules = loop_rules()
        if any(getattr(config.scheduler, name) != rule for name, rule in rules.items()):
            config = config.replace(scheduler=dataclasses.replace(config.scheduler, **rules))
        if (not cls.async_scheduling and _settles_outputs(config)
                and config.scheduler.settled_blocks != settled_blocks_rule()):
            config = config.replace(scheduler=dataclasses.replace(
                config.scheduler, settled_blocks=settled_blocks_rule()))
        release = encoder_release_rule(cls.async_scheduling)
        if _encoder_bound(config) and config.scheduler.async_scheduling != release:
            config = config.replace(scheduler=dataclasses.replace(
                config.scheduler, async_scheduling=release))
        publish = publishing_rule(cls.async_scheduling)
        if (_hashes_ahead(config) and not _encoder_bound(config)
                and config.scheduler.async_scheduling != publish):
            config = config.replace(scheduler=dataclasses.replace(
                config.scheduler, async_scheduling=publish))
        return config

    def _takes_drafts(self) -> bool:
        return (not self.async_scheduling and drafts_driven(type(self.vllm_scheduler))
                and super().offers("draft") and not self._drafts_settle_later())

    def _drafts_settle_later(self) -> bool:
        """Whether the config's `scheduler.settled_blocks` is not the rule this vLLM's
        Scheduler follows on a Mamba hybrid with prefix caching (`settled_blocks_rule`), so
        that kvfuzz's driver and vLLM would cache the blocks accepted drafts fill at
        different times."""
        return (_settles_outputs(self.config)
                and self.config.scheduler.settled_blocks != settled_blocks_rule())

    def tolerated_labels(self) -> list[str]:
        """Target `vllm`'s, and finding 016 where kvfuzz's connector reported a short load
        whose rollback window reads nulls as failed (harness/vllm_connector.py)."""
        unloaded = getattr(self.scheduler, "window_unloaded", ())
        reordered = getattr(self.scheduler, "reordered", ())
        return super().tolerated_labels() + (
            ["016 short-load-window-unloaded"] if unloaded else []) + (
            ["018 deferred-drain-group-order"] if reordered else [])

    def offers(self, name: str) -> bool:
        if name == "draft":
            return self._takes_drafts()
        if name in _IN_FLIGHT:
            return self._defers_frees()
        if name == "in_flight_sampling":
            return self._defers_frees() and self.config.scheduler.in_flight_sampling == (
                in_flight_sampling_rule(self.async_scheduling)) and (
                self.async_scheduling or not self._may_draft())
        if name in _LOADS and not self.config.kv_connector:
            return False
        if name == SEVERAL_GROUP_FAILURES:
            return SEVERAL_GROUPS not in self.tolerated
        if name == "recomputed_sync_failures":
            # AsyncScheduler keeps a rolled-back request's output placeholders (vLLM issue
            # #45138, docs/vllm.md "KV connectors on vLLM's own Scheduler").
            return not self.async_scheduling
        return super().offers(name)

    def require(self, name: str) -> None:
        if name == "draft" and self._drafts_settle_later():
            raise VllmUnsupported(
                f"the trace uses spec-decode drafts (step draft/accept) on a Mamba hybrid with "
                f"scheduler.settled_blocks {self.config.scheduler.settled_blocks!r}, where "
                f"vLLM's Scheduler follows {settled_blocks_rule()!r}: target {self.name} does "
                f"not drive them there (docs/vllm.md, \"Drafts on Mamba 'align' configs\")")
        if name == "draft" and not self._takes_drafts():
            raise VllmUnsupported(
                f"the trace uses spec-decode drafts (step draft/accept), which target "
                f"{self.name} does not drive (docs/vllm.md, \"vLLM's own scheduler\")")
        if name in _IN_FLIGHT and not self._defers_frees():
            raise VllmUnsupported(
                f"the trace uses {name}, which target {self.name} drives only where vLLM's "
                "Scheduler defers frees: a KV-consumer connector with async scheduling, or with "
                "two pipeline stages on a config with deferred_frees; cross attention with "
                "deferred_frees under async scheduling (docs/vllm.md, \"Steps in flight\")")
        if name == SEVERAL_GROUP_FAILURES and not self.offers(name):
            raise VllmUnsupported(
                f"the trace has a synchronous KV load that fails on several KV cache groups, "
                f"which vLLM's Scheduler cannot take (docs/findings/031): target {self.name} "
                "tolerates 031 by not driving it; vllm-scheduler-strict or --no-tolerate 031 "
                "does")
        if name in _LOADS and not self.config.kv_connector:  # invalid for this config
            raise InvalidTrace(
                f"the trace uses {name} on a config without kv_connector: target {self.name} "
                "loads KV only through a connector (docs/vllm.md, \"KV connectors on vLLM's "
                "own Scheduler\")")
        super().require(name)

    def router_chain(self, config: Config) -> Any:
        """Not audited with cross attention: vLLM hashes an encoder-decoder request's blocks
        with its encoder input's key, which no trace op names (caching is off there, so the
        hashes are never looked up)."""
        return None if config.has_cross_attention else super().router_chain(config)

    def make_request(self, op: Op, arrival_time: float) -> Any:
        """On a config with cross attention, a request's encoder tokens become the encoder
        input vLLM's Scheduler schedules for an encoder-decoder model (`encoder_input`)."""
        request = super().make_request(op, arrival_time)
        if self.config.has_cross_attention:
            request.mm_features.extend(encoder_input(op))
        return request

    def _sampling_params(self, op: Op) -> tuple[dict[str, Any], bool]:
        """A bounded request asks for prompt logprobs (`harness/vllm_prompt_logprobs.py`)."""
        from kvfuzz.harness.vllm_prompt_logprobs import prompt_logprobs_params

        params = prompt_logprobs_params(op, self.api["SamplingParams"])
        return (params, True) if params is not None else super()._sampling_params(op)

    def _step(self, op: Op) -> Any:
        if op["in_flight"]:
            self.require("in_flight")
        return super()._step(op)

    def _load_remote(self, op: Op) -> Any:
        if op["num_loaded_tokens"] is not None and several_groups(self.config):
            self.require(SEVERAL_GROUP_FAILURES)
        return super()._load_remote(op)


class VllmSchedulerStrictSide(VllmSchedulerSide):
    """vLLM's own Scheduler with no tolerated deviation."""

    name = "vllm-scheduler-strict"
    known_deviations = ()


class VllmAsyncSchedulerSide(VllmSchedulerSide):
    """vLLM's `AsyncScheduler` (async scheduling on), each step's output taken before the next
    step is scheduled."""

    name = "vllm-async-scheduler"
    async_scheduling = True
