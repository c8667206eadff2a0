"""The harness half of a target: plays docs/traces.md against any vLLM-shaped KVCacheManager.

A concrete target (kvcache, the installed vLLM, a broken variant) only says how to build its manager
and its Request objects from a config; everything else — validity, the lookup a request
carries into allocate_slots, the copies a caller holds, the scheduler driver, probes and
snapshots — is shared here, so every target is driven identically.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvfuzz.core.config import Config
from kvfuzz.core.errors import InvalidTrace, KvfuzzError
from kvfuzz.core.extra_keys import Extras, extras_problem
from kvfuzz.harness.build import BuildFailure, library_fault
from kvfuzz.harness.events import EventReplay, read_event
from kvfuzz.harness.router_hash import BlockChain, HashAudit
from kvfuzz.harness.probes import ManagerProbes
from kvfuzz.harness.reading import KeyTranslator, read_snapshot
from kvfuzz.harness.scheduler_driver import SchedulerDriver
from kvfuzz.core.sides import (
    CachedTokensProbe, ForwardPass, KvEvent, Observations, take_events_result,
)
from kvfuzz.core.snapshot import Snapshot
from kvfuzz.core.sync_load_failures import sync_failure_refusal
from kvfuzz.core.trace import Op

T = TypeVar("T")

_KEEPS_LOOKUPS = frozenset({"get_computed_blocks", "add_request", "get_num_cached_tokens"})


def publishes_after_output(config: Config) -> bool:
    """Whether the driver caches a request's blocks after each output it samples, as vLLM's
    `update_from_output` does with prefix caching (`sched/scheduler.py:2449-2471` in 0.34.0,
    `:2402-2415` in 0.33.0) for a request that had output placeholders, which under async
    scheduling is every request that samples (`scheduler.async_scheduling`), and, in 0.34, on
    a model with Mamba layers (`scheduler.settled_blocks` "at_output"; docs/spec.md §7)."""
    s = config.scheduler
    return config.enable_caching and (s.async_scheduling or (
        any(g.kind == "mamba" for g in config.groups) and s.settled_blocks == "at_output"))


class ManagerSide:
    """A `Side` over a vLLM-shaped KVCacheManager; subclasses build the manager and requests."""

    name = "manager"
    request_status: Any
    """The RequestStatus enum of the implementation (vLLM's values; IntEnum)."""
    build_errors_are_findings = False
    """An exception the library raises while `build_manager` runs is a finding (check BUILD,
    `kvfuzz.harness.build`) rather than a fault of the adapter (exit 3)."""

    def __init__(self, config: Config, level: str) -> None:
        self.config = config
        self.level = level
        self.group_ids = self.manager_group_ids(config)
        """The config group each of the manager's groups stands for, in order."""
        self._groups_missing = len(self.group_ids) != len(config.groups)
        self.manager = self._build(config)
        self.probes = ManagerProbes(self.manager, self.request_status)
        self.keys = KeyTranslator(config.resolved_hash_block_size,
                                  lookahead=config.num_hash_lookahead_tokens)
        self._mm_lengths: dict[int, int] = {}
        self.requests: dict[str, Any] = {}
        self.lookups: dict[str, tuple[Any, int]] = {}
        self._live_lookups: dict[str, tuple[Any, int]] = {}
        self.retained_pairs: list[tuple[int, int]] = []
        self.retained_blocks: list[Any] = []
        self.unsampled_passes: list[ForwardPass] = []
        """Forward passes of steps in flight over a token not delivered yet, oldest first."""
        self.deferred_blocks: list[list[Any]] = []
        """Batches popped by free_deferred and not yet released."""
        self._loading: dict[str, tuple[int, int]] = {}
        """KV loads in flight: request id -> (hit, external tokens)."""
        self._sync_filled: dict[str, int | None] = {}
        """Synchronous offers standing: request id -> how many tokens the load fills (None:
        all)."""
        self.scheduler: SchedulerDriver | None = (
            self.build_scheduler(config) if level == "scheduler" else None)
        self._handlers: dict[str, Callable[[Op], Any]] = {
            "add_request": self._add_request,
            "get_computed_blocks": self._get_computed_blocks,
            "get_num_cached_tokens": self._get_num_cached_tokens,
            "allocate_slots": self._allocate_slots,
            "free": self._free,
            "append_tokens": self._append_tokens,
            "cache_blocks": self._cache_blocks,
            "evict_blocks": self._evict_blocks,
            "reset_prefix_cache": self._reset_prefix_cache,
            "take_new_block_ids": self._take_new_block_ids,
            "take_kv_cache_block_copies": self._take_copies,
            "release_copies": self._release_copies,
            "new_step_starts": self._new_step_starts,
            "step": self._step,
            "abort": self._end_request,
            "finish": self._end_request,
            "take_events": self._take_events,
            "free_deferred": self._free_deferred,
            "release_deferred": self._release_deferred,
            "load_remote": self._load_remote,
            "finish_load": self._finish_load,
            "complete_step": self._complete_step,
        }
        self._event_replay = EventReplay()
        self._op_events: list[KvEvent] = []
        chain = self.router_chain(config)
        self.hash_audit = None if chain is None else HashAudit(
            chain, config.resolved_hash_block_size, config.num_hash_lookahead_tokens)
        """H2's router view of the hashes, where the target documents its hash function."""

    def _build(self, config: Config) -> Any:
        """`build_manager`, a library's exception turned into a `BuildFailure` where this
        target says so (`build_errors_are_findings`)."""
        if not self.build_errors_are_findings:
            return self.build_manager(config)
        try:
            return self.build_manager(config)
        except KvfuzzError:
            raise
        except Exception as exc:  # noqa: BLE001 - the library's or the adapter's: sorted here
            if not library_fault(exc):
                raise
            raise BuildFailure(exc, self.tolerated_build(exc)) from exc

    def tolerated_build(self, exc: Exception) -> str | None:
        """The label of the known deviation this side tolerates `exc` as (None: a finding)."""
        return None

    # ----- what a concrete target provides -----

    def build_manager(self, config: Config) -> Any:
        raise NotImplementedError

    def make_request(self, op: Op, arrival_time: float) -> Any:
        raise NotImplementedError

    def router_chain(self, config: Config) -> BlockChain | None:
        """The target's documented block-hash chain (harness/router_hash.py), which H2 holds
        every request's hashes to; None: undocumented, not audited."""
        return None

    def manager_group_ids(self, config: Config) -> tuple[int, ...]:
        """The config groups the manager builds a group for: all of them, unless the target
        leaves some out (vLLM: encoder-only layers, docs/spec.md §12.4)."""
        return tuple(range(len(config.groups)))

    def per_config_group(self, values: Sequence[T], empty: T) -> Sequence[T]:
        """The manager's per-group `values` spread over the config's groups; a group the
        manager has none for gets `empty` (it holds nothing, docs/spec.md §12.4)."""
        if not self._groups_missing:
            return values
        spread = [empty] * len(self.config.groups)
        for g, value in zip(self.group_ids, values):
            spread[g] = value
        return spread

    def build_scheduler(self, config: Config) -> SchedulerDriver:
        from kvfuzz.kvcache.scheduler import Scheduler  # kvcache loads late (atheris instruments it)

        s = config.scheduler
        return Scheduler(
            self.manager,
            max_model_len=config.max_model_len,
            token_budget=s.token_budget,
            max_running=s.max_running,
            policy=s.policy,
            chunked_prefill=s.chunked_prefill,
            full_sequence_must_fit=s.full_sequence_must_fit,
            num_lookahead_tokens=s.num_lookahead_tokens,
            reserved_blocks=s.reserved_blocks,
            mamba_block_aligned_split=any(g.mamba_cache_mode == "align" for g in config.groups),
            prefill_checkpoint_alignment=config.prefill_checkpoint_alignment,
            use_eagle=config.use_eagle,
            state_groups=any(g.kind == "mamba" for g in config.groups),
            num_prefill_lookahead=config.num_prefill_lookahead,
            fail_short_loads=s.kv_load_failure_policy == "fail",
            num_speculative_tokens=s.num_speculative_tokens,
            drafts_per_batch_size=s.num_speculative_tokens_per_batch_size,
            publish_after_output=publishes_after_output(config),
            output_placeholders=s.in_flight_sampling == "placeholders",
            encoder_budget=s.encoder_budget,
            encoder_cache_size=s.encoder_cache_size,
            async_scheduling=s.async_scheduling,
            stop_at_self_preemption=s.self_preemption == "stop",
            stop_at_blocked_waiting=s.blocked_waiting == "stop",
        )

    # ----- Side -----

    def apply(self, op: Op) -> Any:
        self._live_lookups = self.lookups
        if op["op"] not in _KEEPS_LOOKUPS:
            self.lookups = {}
        try:
            return self._handlers[op["op"]](op)
        finally:
            if self.config.kv_events:
                self._drain_events()

    def snapshot(self) -> Snapshot:
        self.keys.learn_all(self.requests.values())
        scheduler = self.scheduler
        snapshot = read_snapshot(
            self.manager,
            self.requests.values(),
            self.keys,
            self.retained_pairs,
            waiting=scheduler.waiting if scheduler else (),
            running=scheduler.running if scheduler else (),
        )
        if self._groups_missing:
            snapshot = self._spread_snapshot(snapshot)
        if scheduler is not None and (scheduler.loads or scheduler.in_flight
                                      or scheduler.deferred_frees):
            snapshot = dataclasses.replace(
                snapshot, loads=scheduler.loads, in_flight=scheduler.in_flight,
                deferred_frees=scheduler.deferred_frees, _derived={})
        if not self.deferred_blocks:
            return snapshot
        deferred = tuple(tuple(b.block_id for b in run) for runs in self.deferred_blocks
                         for run in runs)
        return dataclasses.replace(snapshot, deferred_frees=deferred, _derived={})

    def _spread_snapshot(self, snapshot: Snapshot) -> Snapshot:
        """Every request view over the config's groups: a group the manager has none for reads
        as an empty table while the request runs (what holding nothing there means), else as
        untracked."""
        views = {}
        for rid, view in snapshot.requests.items():
            running = view.status == "RUNNING"
            views[rid] = dataclasses.replace(
                view,
                tables=tuple(self.per_config_group(view.tables, () if running else None)),
                num_cached_blocks=tuple(self.per_config_group(view.num_cached_blocks, None)),
                partial_hit=tuple(self.per_config_group(view.partial_hit, None)),
            )
        return dataclasses.replace(snapshot, requests=views, _derived={})

    def observations(self) -> Observations:
        obs = self.probes.take()
        if self._groups_missing:
            obs.allocations = [dataclasses.replace(
                a,
                group_predictions=a.group_predictions and tuple(
                    self.per_config_group(a.group_predictions, 0)),
                group_taken=a.group_taken and tuple(self.per_config_group(a.group_taken, 0)),
            ) for a in obs.allocations]
        obs.kv_events, self._op_events = self._op_events, []
        obs.events_reported = self.config.kv_events
        if obs.cached_reports:
            self.keys.learn_all(self.requests.values())
            obs.cached_reports = [r if r.keys is None else r._replace(
                keys=tuple(self.keys.key(h) for h in r.keys)) for r in obs.cached_reports]
        if obs.lost_copies:
            self.keys.learn_all(self.requests.values())
            obs.lost_copies = [self.keys.key(k) for k in obs.lost_copies]
        if self.hash_audit is not None:
            obs.hash_mismatches = self._audit_hashes(self.hash_audit)
        return obs

    def _audit_hashes(self, audit: HashAudit) -> list[str]:
        problems = []
        for rid, request in self.requests.items():
            if audit.audited(rid) == len(request.block_hashes):
                continue
            problem = audit.audit(rid, request.block_hashes, self.keys.tokens(request),
                                  request.cache_salt or None, self.keys.extras.get(rid))
            if problem:
                problems.append(problem)
        return problems

    def _drain_events(self) -> None:
        """Read the events this op made the manager queue (as a router polling after every
        step would) into the op's observations and the replay."""
        events = self.queued_events()
        if not events:
            return
        self.keys.learn_all(self.requests.values())
        for event in self.tolerate_events(events):
            read = read_event(event, self.keys)
            self._op_events.append(read)
            self._event_replay.apply(read)

    def queued_events(self) -> list[Any]:
        """The events the op made the target queue, in order."""
        return self.manager.take_events()

    def tolerate_events(self, events: list[Any]) -> list[Any]:
        """The events as compared and checked (a target may undo a documented deviation)."""
        return events

    def _take_events(self, op: Op) -> Any:
        if not self.config.kv_events:
            raise InvalidTrace("take_events needs a config with kv_events on")
        return take_events_result(self._event_replay.cached)

    # ----- validity (docs/traces.md), checked before anything reaches the manager -----

    def _live_request(self, op: Op) -> Any:
        request = self._known_request(op)
        if self._is_finished(request):
            raise InvalidTrace(f"{op['op']}: request {op['request_id']!r} has finished")
        return request

    def _known_request(self, op: Op) -> Any:
        request = self.requests.get(op["request_id"])
        if request is None:
            raise InvalidTrace(f"{op['op']}: request {op['request_id']!r} was never added")
        return request

    def _is_finished(self, request: Any) -> bool:
        return int(request.status) > int(self.request_status.PREEMPTED)

    @staticmethod
    def _call(fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run a manager call; an exception becomes the op's error result."""
        try:
            return True, fn()
        except KvfuzzError:  # the harness's own (a usage error), not the implementation's
            raise
        except Exception as exc:  # noqa: BLE001 - every implementation error is a result
            return False, {"error": type(exc).__name__}

    # ----- ops -----

    def _add_request(self, op: Op) -> None:
        rid, prompt = op["request_id"], op["prompt"]
        if rid in self.requests:
            raise InvalidTrace(f"add_request: request {rid!r} was already added")
        if not 1 <= len(prompt) < self.config.max_model_len:
            raise InvalidTrace(
                f"add_request {rid!r}: prompt of {len(prompt)} tokens, need 1 to "
                f"{self.config.max_model_len - 1} (max_model_len - 1)"
            )
        if any(t < 0 for t in prompt):
            raise InvalidTrace(f"add_request {rid!r}: negative token id in the prompt")
        if op["max_tokens"] < 1 or op["num_encoder_tokens"] < 0 or (
            op["prefix_cache_hit_limit"] or 0
        ) < 0:
            raise InvalidTrace(
                f"add_request {rid!r}: max_tokens {op['max_tokens']} must be >= 1, "
                f"num_encoder_tokens {op['num_encoder_tokens']} >= 0 and "
                f"prefix_cache_hit_limit {op['prefix_cache_hit_limit']} None or >= 0"
            )
        extras = Extras.of_op(op)
        problem = extras_problem(extras, prompt, self._mm_lengths)
        if problem:
            raise InvalidTrace(f"add_request {rid!r}: {problem}")
        if extras is not None:
            self.keys.extras[rid] = extras
        request = self.make_request(op, float(len(self.requests)))
        self.requests[rid] = request
        if self.scheduler is not None:
            self.scheduler.add_request(request)

    def offers(self, name: str) -> bool:
        """Whether this target implements an optional op or field (every one, by default)."""
        return True

    def require(self, name: str) -> None:
        """A usage error (exit 2) naming `name` and the target unless it `offers` it."""

    def lookup(self, request: Any, bound: int | None) -> Any:
        """The manager's get_computed_blocks (a target may pass the bound its own way)."""
        if bound is None:
            return self.manager.get_computed_blocks(request)
        return self.manager.get_computed_blocks(request, bound)

    def num_cached_tokens(self, request: Any) -> int:
        """The manager's get_num_cached_tokens probe."""
        return self.manager.get_num_cached_tokens(request)

    def _get_num_cached_tokens(self, op: Op) -> Any:
        request = self._live_request(op)
        ok, out = self._call(lambda: self.num_cached_tokens(request))
        if not ok:
            return out
        # What it predicts, asked right after in the same state (both are read-only).
        ok, lookup = self._call(lambda: self.lookup(request, None))
        if ok:
            self.probes.observations.cached_token_probes.append(
                CachedTokensProbe(request.request_id, out, lookup[1])
            )
        return {"num_cached_tokens": out}

    def _get_computed_blocks(self, op: Op) -> Any:
        request = self._live_request(op)
        bound = op["max_cache_hit_length"]
        if bound is not None and bound < 0:
            raise InvalidTrace(f"get_computed_blocks: max_cache_hit_length {bound} < 0")
        ok, out = self._call(lambda: self.lookup(request, bound))
        if not ok:
            return out
        blocks, hit, boundary = out
        self.lookups[request.request_id] = (blocks, hit)
        self.probes.observations.lookups.append((request.request_id, hit, boundary))
        return {"block_ids": self.per_config_group([list(g) for g in blocks.get_block_ids()], []),
                "num_computed_tokens": hit}

    def _allocate_slots(self, op: Op) -> Any:
        request = self._live_request(op)
        blocks, hit = None, 0
        live = self._live_lookups
        if op["use_lookup"]:
            if request.request_id not in live:
                raise InvalidTrace(
                    f"allocate_slots {request.request_id!r}: use_lookup without a live lookup "
                    "(get_computed_blocks must come right before, with only get_computed_blocks "
                    "or add_request ops between)"
                )
            blocks, hit = live[request.request_id]
        new_tokens, external = op["num_new_tokens"], op["num_external_computed_tokens"]
        if request.num_computed_tokens + hit + max(external, 0) + new_tokens > request.num_tokens:
            raise InvalidTrace(
                f"allocate_slots {request.request_id!r}: {request.num_computed_tokens} computed "
                f"+ {hit} hit + {external} external + {new_tokens} new tokens exceed its "
                f"{request.num_tokens} tokens"
            )
        connector = ({"num_external_computed_tokens": external,
                      "delay_cache_blocks": op["delay_cache_blocks"]}
                     if external or op["delay_cache_blocks"] else {})
        ok, out = self._call(
            lambda: self.manager.allocate_slots(
                request,
                new_tokens,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks,
                num_lookahead_tokens=op["num_lookahead_tokens"],
                num_encoder_tokens=op["num_encoder_tokens"],
                full_sequence_must_fit=op["full_sequence_must_fit"],
                reserved_blocks=op["reserved_blocks"],
                has_scheduled_reqs=op["has_scheduled_reqs"],
                **connector,
            )
        )
        if not ok or out is None:
            return out
        start = request.num_computed_tokens + hit
        if external:  # the connector's KV of the external tokens (data checks: a write)
            self._forward(request, start, start + external, load=True)
        start += external
        self._forward(request, start, start + new_tokens)
        request.num_computed_tokens = start + new_tokens
        request.status = self.request_status.RUNNING
        return {"block_ids": self.per_config_group([list(g) for g in out.get_block_ids()], [])}

    def _forward(self, request: Any, start: int, end: int, load: bool = False) -> None:
        self.probes.observations.forward.append(self._pass(request, start, end, load))

    def _pass(self, request: Any, start: int, end: int, load: bool = False) -> ForwardPass:
        """A forward pass over `[start, end)` through the request's tables now."""
        tables = tuple(self.per_config_group(
            [tuple(ids) for ids in self.manager.get_block_ids(request.request_id)], ()))
        return ForwardPass(request.request_id, start, end, tables, load)

    def _free(self, op: Op) -> Any:
        request = self._live_request(op)
        ok, out = self._call(lambda: self.manager.free(request))
        if not ok:
            return out
        if op["preempt"]:
            request.status = self.request_status.PREEMPTED
            request.num_computed_tokens = 0
            request.num_preemptions += 1
        else:
            request.status = self.request_status.FINISHED_STOPPED
        return None

    def _append_tokens(self, op: Op) -> Any:
        request = self._live_request(op)
        tokens = op["tokens"]
        if not tokens or any(t < 0 for t in tokens):
            raise InvalidTrace(f"append_tokens {request.request_id!r}: tokens {tokens!r}")
        if request.num_tokens + len(tokens) > self.config.max_model_len:
            raise InvalidTrace(
                f"append_tokens {request.request_id!r}: {request.num_tokens} + {len(tokens)} "
                f"tokens exceed max_model_len {self.config.max_model_len}"
            )
        ok, out = self._call(lambda: request.append_output_token_ids(list(tokens)))
        return None if ok else out

    def _cache_blocks(self, op: Op) -> Any:
        request = self._live_request(op)
        n = op["num_computed_tokens"]
        n = request.num_computed_tokens if n is None else n
        ok, out = self._call(lambda: self.manager.cache_blocks(request, n))
        return None if ok else out

    def _evict_blocks(self, op: Op) -> Any:
        ok, out = self._call(lambda: self.manager.evict_blocks(set(op["block_ids"])))
        return None if ok else out

    def _reset_prefix_cache(self, op: Op) -> Any:
        if self.scheduler is None:
            return self._call(self.manager.reset_prefix_cache)[1]
        if self.config.kv_connector or self.scheduler.in_flight:
            raise InvalidTrace("reset_prefix_cache at the scheduler level needs no step in "
                               "flight and a config without kv_connector")
        return self._call(lambda: self.scheduler.reset_prefix_cache(
            op["reset_running_requests"]))[1]

    def _take_new_block_ids(self, op: Op) -> Any:
        ok, out = self._call(self.manager.take_new_block_ids)
        return list(out) if ok else out

    def _take_copies(self, op: Op) -> Any:
        ok, out = self._call(self.manager.take_kv_cache_block_copies)
        if not ok:
            return out
        copies, retained = out
        pairs = [(int(c[0]), int(c[1])) for c in copies]
        self.retained_pairs.extend(pairs)
        self.retained_blocks.extend(retained)
        return [list(p) for p in pairs]

    def _free_deferred(self, op: Op) -> Any:
        """The scheduler's deferred free: forget the request now, keep its blocks held, one
        run per group (kvcache pops them so; for another manager the runs are cut from the
        concatenated list by the group tables read just before)."""
        from kvfuzz.kvcache.scheduler import pop_blocks_per_group

        request = self._live_request(op)
        ok, runs = self._call(lambda: pop_blocks_per_group(self.manager, request))
        if not ok:
            return runs
        if runs:
            self.deferred_blocks.append(runs)
        request.status = self.request_status.FINISHED_STOPPED
        return [block.block_id for run in runs for block in run]

    def _release_deferred(self, op: Op) -> Any:
        """Release every deferred batch, oldest first, as `free` would have: each group's run
        tail first, group after group (`evict_first` passed on to `BlockPool.free_blocks`)."""
        option = {"evict_first": True} if op["evict_first"] else {}
        if option:
            self.require("evict_first")
        from kvfuzz.kvcache.scheduler import release_blocks_per_group

        batches, self.deferred_blocks = self.deferred_blocks, []
        for runs in batches:
            ok, out = self._call(lambda: release_blocks_per_group(self.manager, runs, **option))
            if not ok:
                return out
        return None

    def _new_step_starts(self, op: Op) -> Any:
        ok, out = self._call(self.manager.new_step_starts)
        return None if ok else out

    def _release_copies(self, op: Op) -> Any:
        blocks, self.retained_blocks, self.retained_pairs = self.retained_blocks, [], []
        ok, out = self._call(lambda: self.manager.block_pool.free_blocks(blocks))
        return None if ok else out

    def _step(self, op: Op) -> Any:
        sample, vocab = op["sample"], self.config.scheduler.vocab_size
        draft, accept = op["draft"], op["accept"]
        def run_model(scheduled: list[tuple[Any, int, int]], copies: Any) -> None:
            self._see_sampled_passes()
            loaded, pending = self.scheduler.sync_loaded, self.scheduler.pending_tokens
            for request, n, _ in scheduled:
                start = request.num_computed_tokens
                external = loaded.pop(request.request_id, 0)
                if external:  # a synchronous load writes its tokens before the step's
                    self._sync_load(request, start - external, start)
                if (pending(request.request_id)
                        and start + n > self.requests[request.request_id].num_tokens):
                    # It computes a token a step in flight has yet to deliver: its pass is
                    # seen once the token is known (`_complete_step`).
                    self.unsampled_passes.append(self._pass(request, start, start + n))
                else:
                    self._forward(request, start, start + n)

        if op["in_flight"]:
            self.require("in_flight")
        if not 0 <= draft <= self.config.max_model_len or (accept or 0) < 0:
            raise InvalidTrace(f"step: draft {draft} must be 0 to max_model_len "
                               f"({self.config.max_model_len}), accept {accept} null or >= 0")
        most = self.config.max_drafts
        if most is not None and draft > most:
            raise InvalidTrace(f"step: draft {draft} on a config whose state groups keep "
                               f"{most} speculative blocks (vLLM sizes num_speculative_blocks "
                               "to num_speculative_tokens, the most a drafter proposes)")
        fixed = self.config.scheduler.num_speculative_tokens
        if draft and fixed:
            raise InvalidTrace(f"step: draft {draft} on a config with "
                               f"scheduler.num_speculative_tokens {fixed}, whose drafts are "
                               "placed every step: draft must be 0")
        drafted = op["drafted"]
        if drafted and min(drafted.values()) < 0:
            raise InvalidTrace(f"step: drafted {drafted} must name counts >= 0")
        if draft or (accept is not None or drafted is not None) and not fixed:
            self.require("draft")
        spec = {"accept": accept, "drafted": drafted} if fixed else {
            "accept": accept, "propose": lambda request: [
                (sample + 1 + request.num_tokens + j) % vocab
                for j in range(min(draft, (drafted or {}).get(request.request_id, draft)))]} if (
            draft or accept is not None or drafted is not None) else {}
        ok, out = self._call(
            lambda: self.scheduler.step(
                lambda request, ahead=0: (sample + request.num_tokens + ahead) % vocab,
                run_model, in_flight=op["in_flight"], **spec,
            )
        )
        if not ok:
            return out
        return {
            "scheduled": [[rid, n, hit] for rid, n, hit in out.scheduled],
            "preempted": list(out.preempted),
            "finished": list(out.finished),
            "copies": [[int(s), int(d)] for s, d in out.copies],
        }

    def _sync_load(self, request: Any, start: int, end: int) -> None:
        """The passes of a synchronous load of positions start..end-1: those it fills, then
        those a failing one leaves unfilled (docs/spec.md §13.3, step 5)."""
        filled = self._sync_filled.pop(request.request_id, None)
        middle = end if filled is None else min(start + filled, end)
        if middle > start:
            self._forward(request, start, middle, load=True)
        if end > middle:
            self.probes.observations.forward.append(
                dataclasses.replace(self._pass(request, middle, end, True), unfilled=True))

    def _complete_step(self, op: Op) -> Any:
        """The oldest step in flight completes (docs/spec.md §7.1): the released block ids."""
        self.require("complete_step")
        out = self._call(self.scheduler.complete_step)[1]
        self._see_sampled_passes()
        return out

    def _see_sampled_passes(self) -> None:
        """The held passes whose tokens are now all known are seen (as an earlier batch);
        those of a request that no longer computes that far are dropped."""
        waiting = []
        for p in self.unsampled_passes:
            request = self.requests[p.request_id]
            if request.num_tokens >= p.end:
                self.probes.observations.forward.append(dataclasses.replace(p, earlier=True))
            elif request.num_computed_tokens >= p.end:
                waiting.append(p)
        self.unsampled_passes = waiting

    def _load_remote(self, op: Op) -> Any:
        """The driver's connector offers the request's tokens (docs/spec.md §13.2; `sync`:
        loaded at its next admission, §13.3)."""
        request = self._known_request(op)
        refusal = sync_failure_refusal(self.config, op)
        if refusal is not None:
            raise InvalidTrace(refusal)
        loaded = {} if op["num_loaded_tokens"] is None else {
            "num_loaded_tokens": op["num_loaded_tokens"]}
        ok, out = self._call(lambda: self.scheduler.start_load(
            request.request_id, op["num_external_tokens"], op["sync"], **loaded))
        if ok and out is True:
            self._sync_filled[request.request_id] = op["num_loaded_tokens"]
        if not ok or out is None or out is True:
            return out
        self._loading[request.request_id] = out[:2]
        return {"hit": out[0], "external": out[1], "diverged": out[2]}

    def _finish_load(self, op: Op) -> Any:
        """The load ends; the KV of the prefix it leaves valid counts as written (for the data
        checks): all of it when whole, else up to the computed tokens kept (docs/spec.md §13.2)."""
        request = self._known_request(op)
        loaded = op["num_loaded_tokens"]
        ok, out = self._call(lambda: self.scheduler.finish_load(request.request_id, loaded))
        if ok:
            hit, external = self._loading.pop(request.request_id)
            if not self._is_finished(request):
                end = hit + external if loaded is None or loaded >= external else out
                if end > hit:
                    self._forward(request, hit, end, load=True)
        return out

    def _end_request(self, op: Op) -> Any:
        request = self._known_request(op)
        if self._is_finished(request):
            return None
        status = (
            self.request_status.FINISHED_ABORTED
            if op["op"] == "abort"
            else self.request_status.FINISHED_STOPPED
        )
        ok, out = self._call(lambda: self.scheduler.finish_request(request.request_id, status))
        return None if ok else out

