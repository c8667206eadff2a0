"""A minimal synchronous scheduler driving a KV cache manager (docs/traces.md, "The driver").

It uses only the manager's public API, `manager.block_pool.free_blocks` and vLLM's request
attribute names, so the same driver runs vLLM 0.34.0's KVCacheManager with vLLM requests.

Steps may stay in flight (vLLM's async scheduling, docs/spec.md §7.1): a request freed while a
step that read its blocks is in flight has them popped (`pop_blocks_for_free`) and released
only once the newest step launched by then completes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvfuzz.kvcache.block_math import (
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)
from kvfuzz.kvcache.dynamic_drafts import dense_drafts
from kvfuzz.kvcache.encoder_cache import (
    EncoderCache,
    schedule_encoder_decoder_input,
    schedule_encoder_inputs,
)
from kvfuzz.kvcache.request import RequestStatus

Policy = Literal["fcfs", "priority"]
InFlightStep = tuple[int, tuple[int, ...], tuple[tuple[str, int], ...]]
"""A step in flight: its number, the block ids it reads, (request id, tokens) it scheduled."""


@dataclass
class _HeldOutput:
    """A step in flight's output, taken when it completes: the requests that sample in it
    (with the drafts it verified for each) and how the step samples, verifies and drafts."""

    samples: list[tuple[Any, list[int]]]
    sample_token: Callable[[Any], int]
    accept: int | None
    propose: Callable[[Any], list[int]] | None


@dataclass
class StepOutput:
    """What one step did, in the order it happened."""

    scheduled: list[tuple[str, int, int]] = field(default_factory=list)
    """(request id, tokens scheduled, prefix hit adopted at admission, else 0; a synchronous
    KV load's tokens are not in it)."""
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) block ids of the copy-on-write copies executed."""


PLACEHOLDER = -1
"""A draft whose token the drafter fills in (vLLM's async scheduling): kept, it is sampled as
the token at its place is."""
UNFILLED = -2
"""A placeholder draft the drafter left unfilled (it proposed fewer): always rejected."""


def _priority_key(request: Any) -> tuple[int, float]:
    """Larger is less important: the victim under the priority policy."""
    return (request.priority, request.arrival_time)


class Scheduler:
    """Token budget per step, a running list (admission order) and a waiting queue."""

    def __init__(
        self,
        kv_cache_manager: Any,
        *,
        max_model_len: int,
        token_budget: int,
        max_running: int,
        policy: Policy = "fcfs",
        chunked_prefill: bool = True,
        full_sequence_must_fit: bool = False,
        num_lookahead_tokens: int = 0,
        reserved_blocks: int = 0,
        mamba_block_aligned_split: bool = False,
        prefill_checkpoint_alignment: int | None = None,
        use_eagle: bool = False,
        state_groups: bool = False,
        num_prefill_lookahead: int = 0,
        fail_short_loads: bool = False,
        publish_after_output: bool = False,
        output_placeholders: bool = True,
        num_speculative_tokens: int = 0,
        drafts_per_batch_size: Sequence[tuple[int, int, int]] | None = None,
        encoder_budget: int | None = None,
        encoder_cache_size: int | None = None,
        async_scheduling: bool = False,
        stop_at_self_preemption: bool = False,
        stop_at_blocked_waiting: bool = False,
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        for name, value in (
            ("max_model_len", max_model_len),
            ("token_budget", token_budget),
            ("max_running", max_running),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (
            ("num_lookahead_tokens", num_lookahead_tokens),
            ("reserved_blocks", reserved_blocks),
            ("num_speculative_tokens", num_speculative_tokens),
        ):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self.manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.token_budget = token_budget
        self.max_running = max_running
        self.policy = policy
        self.chunked_prefill = chunked_prefill
        self.full_sequence_must_fit = full_sequence_must_fit
        self.num_lookahead_tokens = num_lookahead_tokens
        self.reserved_blocks = reserved_blocks
        # Mamba "align" groups: prefill chunks end where a state can be cached.
        self.mamba_block_aligned_split = mamba_block_aligned_split
        # ... except a prompt's last chunk, when the state layers export its checkpoint
        # mid-chunk (Mamba prefill checkpoint blocks, docs/spec.md §11.6).
        self.prefill_checkpoint_alignment = prefill_checkpoint_alignment
        # ... which with EAGLE move to its replay boundary.
        self.use_eagle = use_eagle
        # Recurrent-state groups: the connector leaves the last token to compute (NIXL's
        # backoff), and a load that ends short fails whole (docs/spec.md §13.2).
        self.state_groups = state_groups
        # Multi-module MTP: no prefill chunk ends within this many tokens of the end (§5.7).
        self.num_prefill_lookahead = num_prefill_lookahead
        # vLLM's "fail" kv_load_failure_policy: a short load fails its request (§13.2).
        self.fail_short_loads = fail_short_loads
        # vLLM's `update_from_output` caches what a request's output finalized (under async
        # scheduling, 0.33+; on a Mamba hybrid with prefix caching, 0.34): under hash
        # lookahead, the block whose lookahead the sampled token completes (docs/spec.md §5.7).
        self.publish_after_output = publish_after_output
        # vLLM's AsyncScheduler schedules a request whose sampling step is in flight past the
        # token still to come (output placeholders); its Scheduler under pipeline parallelism
        # has none and skips the request until the output is taken (docs/spec.md §7.1).
        self.output_placeholders = output_placeholders
        # vLLM's async scheduling with a SpeculativeConfig: every request that samples gets
        # this many placeholder drafts, a one-token admission is padded to them, and each
        # output publishes the request's settled tokens (docs/traces.md, "Fixed drafts").
        self.num_speculative_tokens = num_speculative_tokens
        # Dynamic speculative decoding (vLLM's `num_speculative_tokens_per_batch_size`): a
        # step's placeholders are the K its batch size (requests scheduled) looks up, and no
        # admission is padded (docs/spec.md §7.3).
        self._drafts_by_batch = (None if drafts_per_batch_size is None else dense_drafts(
            list(drafts_per_batch_size), max_running, num_speculative_tokens))
        self._step_drafts = num_speculative_tokens
        # vLLM 0.32's loops: under priority a request that preempted itself ends the running
        # loop, and a waiting request cut to no token ends the waiting loop (0.33+ go on).
        self.stop_at_self_preemption = stop_at_self_preemption
        self.stop_at_blocked_waiting = stop_at_blocked_waiting
        self._prefilling: set[str] = set()
        """Requests whose last scheduled chunk did not sample (vLLM's `is_prefill_chunk`)."""
        # Multimodal inputs: an encoder budget per step and an encoder cache (§7.2); with
        # neither bounded, encoder inputs never cut a chunk and are not tracked.
        self.encoder_budget = encoder_budget
        self.encoder_cache = (None if encoder_budget is None and encoder_cache_size is None
                              else EncoderCache(encoder_cache_size))
        self._encoder_left = encoder_budget
        """The step's encoder budget left."""
        # vLLM's AsyncScheduler: a step's own samples stay placeholders until its output is
        # taken, after its encoder inputs are released (§7.2).
        self.async_scheduling = async_scheduling
        self._encoded: dict[str, int] = {}
        """Request id -> the encoder embeddings this step computes for it."""
        # A chunk stops at the junction itself where the manager registers the state there
        # (vLLM's Scheduler reads the same predicate off its manager, under sub-block hits).
        coordinator = kv_cache_manager.coordinator
        self._exact_junction = bool(
            getattr(kv_cache_manager, "mamba_shared_prefix_checkpoint", False)
            and getattr(coordinator, "enable_partial_hash_hits", False)
            and kv_cache_manager.block_pool.hash_block_size < coordinator.scheduler_block_size
        )
        self._running: list[Any] = []
        self._waiting: deque[Any] = deque()
        self._requests: dict[str, Any] = {}
        self._loads: dict[str, int] = {}
        """KV connector loads in flight: request id -> its local prefix hit (docs/spec.md §13.2)."""
        self._landed: set[str] = set()
        """Requests a load left holding blocks: never offered another load."""
        self._sync_offers: dict[str, int] = {}
        """Synchronous loads offered: request id -> tokens, loaded at its next admission."""
        self.sync_loaded: dict[str, int] = {}
        """The synchronous loads admitted this step: request id -> external tokens."""
        self._sync_valid: dict[str, int] = {}
        """Synchronous offers that fail: request id -> the external tokens that load."""
        self._sync_failing: dict[str, tuple[int, int]] = {}
        """The failing synchronous loads admitted this step: request id -> (the end of what
        loaded, the end of the load), in tokens."""
        self._holders: dict[str, int] = {}
        """Waiting requests a KV load started for -> its start number: they wait ahead of the
        others, in that order (priority: in priority order), as in vLLM's `kv_holding_waiting`
        (docs/spec.md §13.2)."""
        self._loads_started = 0
        self._launched = 0
        """Steps launched that scheduled tokens (vLLM's `sched_step_seq`)."""
        self._completed = 0
        """The last of them completed (vLLM's `processed_step_seq`)."""
        self._last_read: dict[str, int] = {}
        """Request id -> the last step that scheduled it (read its blocks)."""
        self._in_flight: deque[InFlightStep] = deque()
        """Steps launched and not completed, oldest first."""
        self._outputs: deque[_HeldOutput] = deque()
        """Per step in flight: what its output appends when it completes (docs/spec.md §7.1)."""
        self._placeholders: dict[str, int] = {}
        """Request id -> tokens its steps in flight will append (vLLM's
        `num_output_placeholders`)."""
        self._deferred: deque[tuple[int, list[list[Any]]]] = deque()
        """Frees waiting for a step: (the step they wait for, the blocks, one run per group)."""

    @property
    def running(self) -> tuple[Any, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Any, ...]:
        return tuple(self._waiting)

    @property
    def loads(self) -> tuple[str, ...]:
        """Requests whose KV connector load is in flight (aborted ones too), sorted."""
        return tuple(sorted(self._loads))

    @property
    def in_flight(self) -> tuple[InFlightStep, ...]:
        """Steps launched and not completed, oldest first: (step, the block ids it reads,
        (request id, tokens) it scheduled)."""
        return tuple(self._in_flight)

    @property
    def deferred_frees(self) -> tuple[tuple[int, ...], ...]:
        """The block ids of the frees waiting for a step: one run per (free, group), in
        release order (each run is released tail first)."""
        return tuple(tuple(b.block_id for b in run) for _, runs in self._deferred for run in runs)

    def add_request(self, request: Any) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} was already added")
        self._requests[request.request_id] = request
        self._waiting.append(request)
        self._sort_waiting()

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Abort or finish: leaves its queue (a running request is freed); no-op if finished."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_request needs a finished status, got {status!r}")
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown request {request_id!r}")
        if RequestStatus.is_finished(request.status):
            return
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
            self._free(request)
        elif request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            # A waiting request holds blocks only when a KV load landed for it.
            self._waiting.remove(request)
            self._holders.pop(request_id, None)
            self._free(request)
        # else: the load may still write its blocks; `finish_load` frees them.
        request.status = status

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's `Scheduler.reset_prefix_cache`: with `reset_running_requests` every running
        request is preempted, the last first (they wait in their running order), then the
        manager resets its prefix cache (False while a block is held)."""
        if reset_running_requests:
            while self._running:
                self._preempt(self._running.pop())
        return self.manager.reset_prefix_cache()

    # ----- KV connector (docs/spec.md §13.2): the driver plays the connector -----

    def pending_tokens(self, request_id: str) -> int:
        """Tokens the request's steps in flight will append when they complete (vLLM's
        `num_output_placeholders`)."""
        return self._placeholders.get(request_id, 0)

    def start_load(
        self, request_id: str, num_external_tokens: int, sync: bool = False,
        num_loaded_tokens: int | None = None,
    ) -> tuple[int, int, bool] | bool | None:
        """A connector offers `num_external_tokens` tokens of a waiting request that holds
        nothing, never kept a landed load and has no offer standing. Asynchronous: after its
        connector lookup (whose junction it keeps, as at admission), the request takes blocks
        for the hit and at most its remaining tokens (but the last, with state groups),
        uncached, and waits for remote KV; (hit, external tokens, whether the lookup's hits
        diverged), or None when nothing is loaded (not such a request, nothing left to offer,
        or no room). `sync`: the offer stands until the request's next admission, which loads
        the tokens synchronously (`_lookup`); True, or None when refused. With
        `num_loaded_tokens` only that many of them load: the step that admits it reports
        the blocks not filled in its output (`_fail_sync_loads`)."""
        request = self._known(request_id, "start_load")
        if type(num_external_tokens) is not int or num_external_tokens < 0:
            raise ValueError(
                f"start_load({request_id!r}): num_external_tokens={num_external_tokens!r} is "
                "not an int >= 0"
            )
        if (request not in self._waiting or request.num_computed_tokens
                or request_id in self._landed or request_id in self._sync_offers):
            return None
        if sync:
            self._sync_offers[request_id] = num_external_tokens
            if num_loaded_tokens is not None:
                self._sync_valid[request_id] = num_loaded_tokens
            return True
        hit_blocks, num_hit_tokens, external, diverged = self._connector_hit(
            request, num_external_tokens, self.state_groups)
        if not external:
            return None
        new_blocks = self.manager.allocate_slots(
            request,
            0,
            num_hit_tokens,
            hit_blocks,
            num_external_computed_tokens=external,
            delay_cache_blocks=True,
            full_sequence_must_fit=self.full_sequence_must_fit,
            has_scheduled_reqs=bool(self._running),
        )
        if new_blocks is None:
            return None
        self._waiting.remove(request)
        self._loads_started += 1
        self._holders[request_id] = self._loads_started
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens + external
        self._loads[request_id] = num_hit_tokens
        return num_hit_tokens, external, diverged

    def _connector_hit(self, request: Any, offered: int, backoff: int
                       ) -> tuple[Any, int, int, bool]:
        """The connector lookup of a request offered `offered` tokens that leaves `backoff`
        tokens to compute: (hit blocks, hit, external tokens, whether the per-group hits
        diverged). The request keeps the lookup's junction. The connector counts from the hit's
        last block boundary: a longer load supersedes a sub-block tail (cut from the hit), a
        shorter one loads nothing (0 external tokens)."""
        manager = self.manager
        hit_blocks, num_hit_tokens, request.shared_prefix_boundary, diverged = (
            manager.get_computed_blocks_for_connector(request)
        )
        partial_tail = num_hit_tokens % manager.coordinator.scheduler_block_size
        external = min(offered, request.num_tokens - backoff - (num_hit_tokens - partial_tail))
        # A request whose hits are bounded (a hit limit, or no cache reads) reads no external
        # KV: the bound does not limit a connector's hits (vLLM 0.34 `skip_reading_external_kv`;
        # a 0.32-0.33 Request keeps the flag itself, with no hit limit).
        if getattr(request, "prefix_cache_hit_limit", None) is not None or getattr(
                request, "skip_reading_prefix_cache", False) or external <= partial_tail:
            return hit_blocks, num_hit_tokens, 0, diverged
        if partial_tail:
            num_hit_tokens -= partial_tail
            hit_blocks = manager.truncate_computed_blocks(hit_blocks, num_hit_tokens)
        return hit_blocks, num_hit_tokens, external, diverged

    def _lookup(self, request: Any) -> tuple[Any, int, int]:
        """An admission's lookup: (hit blocks, hit, external tokens). With a synchronous offer
        standing, the connector's (`_connector_hit`; at least the last token is left to
        compute, as vLLM schedules one); without external tokens, the manager's own."""
        offered = self._sync_offers.get(request.request_id)
        if offered is not None:
            hit_blocks, num_hit_tokens, external, _ = self._connector_hit(
                request, offered, max(self.state_groups, 1))
            if external:
                return hit_blocks, num_hit_tokens, external
        hit_blocks, num_hit_tokens, request.shared_prefix_boundary = (
            self.manager.get_computed_blocks(request))
        return hit_blocks, num_hit_tokens, 0

    def finish_load(self, request_id: str, num_loaded_tokens: int | None = None) -> int:
        """The load of `request_id` ends with `num_loaded_tokens` of its external tokens
        (None: all; fewer, with state groups: none valid). An aborted request's blocks are
        freed; otherwise the valid prefix is cached (nothing valid: the blocks are freed) and
        the request waits again, among the requests a load started for, in load start order
        (priority: in priority order), ahead of the others. Returns its computed tokens.
        ValueError when no load is in flight for it."""
        if request_id not in self._loads:
            raise ValueError(f"finish_load({request_id!r}): no KV load in flight for it")
        if num_loaded_tokens is not None and (
            type(num_loaded_tokens) is not int or num_loaded_tokens < 0
        ):
            raise ValueError(
                f"finish_load({request_id!r}): num_loaded_tokens={num_loaded_tokens!r} is not "
                "an int >= 0"
            )
        request = self._requests[request_id]
        num_hit_tokens = self._loads.pop(request_id)
        if RequestStatus.is_finished(request.status):
            del self._holders[request_id]
            self._free(request)
            return 0
        promised = request.num_computed_tokens - num_hit_tokens
        if num_loaded_tokens is not None and num_loaded_tokens < promised:
            if self.fail_short_loads:
                del self._holders[request_id]
                return self._fail_load(request, num_hit_tokens + num_loaded_tokens)
            # With state groups no state holds a short load's end: all of it is lost.
            request.num_computed_tokens = 0 if self.state_groups else self._valid_prefix(
                request_id, num_hit_tokens + num_loaded_tokens)
        if request.num_computed_tokens:
            self.manager.cache_blocks(request, request.num_computed_tokens)
            self._landed.add(request_id)
        else:
            self._free(request)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens -= 1  # the last token is computed again, for logits
        request.status = (
            RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        )
        start = self._holders[request_id]
        self._waiting.insert(next(
            (i for i, other in enumerate(self._waiting)
             if self._holders.get(other.request_id, start + 1) > start), len(self._waiting)),
            request)
        self._sort_waiting()
        return request.num_computed_tokens

    # ----- steps in flight (docs/spec.md §7.1) -----

    def _free(self, request: Any) -> None:
        """Free the request's blocks, or, while a step that read them is in flight, pop them
        and keep them held until the newest step launched so far completes. Its encoder cache
        entries are released at once (§7.2)."""
        self._release_encoder_inputs(request)
        if self._last_read.get(request.request_id, 0) <= self._completed:
            self.manager.free(request)
            return
        runs = pop_blocks_per_group(self.manager, request)
        if runs:
            self._deferred.append((self._launched, runs))

    def _release(self, runs: list[list[Any]]) -> None:
        """Release a deferred free as `free` would have (`release_blocks_per_group`)."""
        release_blocks_per_group(self.manager, runs)

    def complete_step(self) -> list[int]:
        """The oldest step in flight completes: every free waiting for it (or an earlier step)
        is released, oldest first. Returns the released block ids in that order. ValueError
        when no step is in flight."""
        if not self._in_flight:
            raise ValueError("complete_step(): no step is in flight")
        self._completed, _, scheduled = self._in_flight.popleft()
        held = self._outputs.popleft()
        for request_id, num_tokens in scheduled:
            self._requests[request_id].num_in_flight_tokens -= num_tokens
        released: list[int] = []
        while self._deferred and self._deferred[0][0] <= self._completed:
            runs = self._deferred.popleft()[1]
            self._release(runs)
            released += [b.block_id for run in runs for b in run]
        samples = {request.request_id: drafts for request, drafts in held.samples}
        for request_id, _ in scheduled:
            request = self._requests[request_id]
            if RequestStatus.is_finished(request.status):
                continue
            self._release_encoded(request)
            if request_id in samples:
                self._take_output(request, samples[request_id], held)
        return released

    def _release_encoder_inputs(self, request: Any) -> None:
        """Every encoder cache reference the request holds goes (§7.2)."""
        if self.encoder_cache is not None:
            self.encoder_cache.release_all(request)

    def _release_encoded(self, request: Any, unresolved: int = 0) -> None:
        """After a step's output: the request's encoder inputs that end by its computed tokens
        less those its steps in flight will still append and the `unresolved` tokens the
        output itself brings (§7.2)."""
        if self.encoder_cache is not None:
            self.encoder_cache.release_computed(
                request, request.num_computed_tokens - unresolved
                - self._placeholders.get(request.request_id, 0))

    def _take_output(self, request: Any, drafts: list[int], held: _HeldOutput) -> None:
        """A step in flight's output for `request` arrives (vLLM's `update_from_output` under
        async scheduling): the rejected drafts are uncomputed, the kept ones and the sampled
        token appended up to the first that ends it, its placeholders resolved, its blocks
        cached up to its settled tokens (with placeholders, or where every output publishes),
        and an ended request freed. (It cannot have been
        preempted meanwhile: no step preempts a request a step in flight reads.)"""
        self._placeholders[request.request_id] -= len(drafts) + 1
        ended = self._append_verified(request, drafts, held.accept, held.sample_token)
        if self.output_placeholders or self.publish_after_output:
            self.manager.cache_blocks(
                request, request.num_computed_tokens - request.num_in_flight_tokens)
        if ended:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            self._running.remove(request)
            self._free(request)
        elif held.propose is not None:
            request.spec_token_ids = list(held.propose(request))

    def _launch(self, scheduled: list[tuple[Any, int, int]], in_flight: bool) -> bool:
        """Number the step (if it scheduled anything) and record what it reads; True when it
        stays in flight."""
        if not scheduled:
            return False
        self._launched += 1
        for request, _, _ in scheduled:
            self._last_read[request.request_id] = self._launched
        if not in_flight:
            self._completed = self._launched
            return False
        reads = sorted({b for request, _, _ in scheduled for b in self._reads(request)})
        self._in_flight.append((self._launched, tuple(reads),
                                tuple((request.request_id, n) for request, n, _ in scheduled)))
        # The manager frees out-of-window blocks only below the settled tokens.
        for request, n, _ in scheduled:
            request.num_in_flight_tokens += n
        return True

    def _reads(self, request: Any) -> set[int]:
        """The block ids a step starting at the request's computed tokens reads: each group's
        table from the first block a token from there attends to."""
        start = request.num_computed_tokens
        reads: set[int] = set()
        for single, blocks in zip(self.manager.coordinator.single_type_managers,
                                  self.manager.get_blocks(request.request_id).blocks):
            # Mamba skips `computed - 1`: -1 at 0 computed reads from block 0 (never index
            # the table from its end).
            skip = max(single.get_num_skipped_tokens(start), 0) // single.block_size
            reads.update(b.block_id for b in blocks[skip:] if not b.is_null)
        return reads

    def _fail_load(self, request: Any, num_loaded_tokens: int) -> int:
        """The "fail" policy: a short load fails its request (FINISHED_ERROR) and frees its
        blocks, the local hit included; nothing is cached. On one attention group its computed
        tokens stop at the first block the load did not fill (vLLM finds the failure by its
        blocks); otherwise they stay as the load promised. Returns 0."""
        if len(self.manager.coordinator.single_type_managers) == 1 and not self.state_groups:
            request.num_computed_tokens = self._unfilled_start(
                request.request_id, num_loaded_tokens)
        self._free(request)
        request.status = RequestStatus.FINISHED_ERROR
        return 0

    def _valid_prefix(self, request_id: str, num_loaded_tokens: int) -> int:
        """The computed tokens a short or failed load leaves (docs/spec.md §13.2): with several
        groups the load failed as a whole (0); with one, the start of the first block it did
        not fill (`_unfilled_start`), or 0 when the window of that point would read a null
        block."""
        singles = self.manager.coordinator.single_type_managers
        if len(singles) > 1:
            return 0
        single = singles[0]
        table = single.req_to_blocks[request_id]
        nulls = next((i for i, block in enumerate(table) if not block.is_null), len(table))
        valid = self._unfilled_start(request_id, num_loaded_tokens)
        if valid and single.get_num_skipped_tokens(valid) < nulls * single.block_size:
            return 0
        return valid

    def _window_unloaded(self, request: Any) -> bool:
        """Whether the window of a request's computed tokens, on a group, reaches its table's
        leading nulls, which nothing loaded (finding 016's shape): a failing synchronous
        load under "recompute" then preempts it (docs/spec.md §13.3, step 5)."""
        computed = request.num_computed_tokens
        for single in self.manager.coordinator.single_type_managers:
            table = single.req_to_blocks.get(request.request_id, [])
            nulls = len(table) - len(_without_leading_nulls(table))
            if nulls and computed and (
                    single.get_num_skipped_tokens(computed) < nulls * single.block_size):
                return True
        return False

    def _unfilled_start(self, request_id: str, num_loaded_tokens: int) -> int:
        """On the lone group: the start of the first block a load valid up to
        `num_loaded_tokens` did not fill (window nulls were never loaded, never wanted)."""
        single = self.manager.coordinator.single_type_managers[0]
        table = single.req_to_blocks[request_id]
        nulls = len(table) - len(_without_leading_nulls(table))
        return max(num_loaded_tokens // single.block_size, nulls) * single.block_size

    def _known(self, request_id: str, operation: str) -> Any:
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"{operation}: unknown request {request_id!r}")
        return request

    def step(
        self,
        sample_token: Callable[[Any], int],
        run_model: Callable[[list[tuple[Any, int, int]], list[tuple[int, int]]], None] | None = None,
        *,
        in_flight: bool = False,
        accept: int | None = None,
        propose: Callable[[Any], list[int]] | None = None,
        drafted: Mapping[str, int] | None = None,
    ) -> StepOutput:
        """Schedule running requests (preempting on shortage), then admit waiting ones, then
        play the model: `run_model(scheduled, copies)` (if given) sees the step's requests and
        pending copies after the copies are taken and before any request advances; requests
        whose tokens are then all computed get `sample_token(request)`.

        Spec decode: a running request's drafts (`spec_token_ids`) are scheduled with it as far
        as the budget lets; the step keeps the first `accept` of those (None: all), appended
        before the sampled token, and rejects the rest, whose tokens are computed no more (the
        blocks allocated for them stay). Each request that sampled and still runs then proposes
        `propose(request)` as its drafts for the next step. With fixed drafts each gets their
        placeholders, the drafter filling the first `drafted[request_id]` of them (all when not
        named); a step keeps no draft past the first unfilled one.

        `in_flight`: the step's bookkeeping is done at once, but it stays in flight (reading
        its requests' blocks, running its copies) until `complete_step`. A step that does not
        stay in flight first completes every step still in flight (steps complete in order).
        """
        if not in_flight:
            while self._in_flight:
                self.complete_step()
        manager = self.manager
        manager.new_step_starts()
        self.sync_loaded = {}
        budget = self.token_budget
        self._encoder_left = self.encoder_budget
        self._encoded = {}
        scheduled: list[tuple[Any, int, int]] = []
        verified: dict[str, list[int]] = {}
        """Request id -> the drafts this step scheduled for it."""
        out = StepOutput()

        i = 0
        while i < len(self._running) and budget > 0:
            request = self._running[i]
            pending = self._placeholders.get(request.request_id, 0)
            if pending and not self.output_placeholders:
                # Without placeholders it waits for its output (vLLM's Scheduler: 0 tokens).
                i += 1
                continue
            if pending and (request.num_computed_tokens + 2 - pending
                            >= request.num_prompt_tokens + request.max_tokens):
                # A step in flight already ends it (vLLM's async-scheduling skip).
                i += 1
                continue
            num_new_tokens = min(
                request.num_tokens_with_spec + pending - request.num_computed_tokens,
                budget,
                self.max_model_len - request.num_computed_tokens - 1,
            )
            if num_new_tokens > 0 and self.mamba_block_aligned_split:
                num_new_tokens = self._mamba_aligned(request, num_new_tokens, 0)
            encoder = None
            if num_new_tokens > 0:
                num_new_tokens, encoder = self._encoder_inputs(
                    request, request.num_computed_tokens, num_new_tokens)
            if self.num_prefill_lookahead:
                num_new_tokens = reserve_prefill_lookahead(
                    request.num_tokens, request.num_computed_tokens, num_new_tokens,
                    self.num_prefill_lookahead)
            if num_new_tokens <= 0:
                i += 1
                continue
            preempted_self = False
            while True:
                new_blocks = manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
                )
                if new_blocks is not None:
                    break
                victim = (
                    self._running[-1]
                    if self.policy == "fcfs"
                    else max(self._running, key=_priority_key)
                )
                if self._last_read.get(victim.request_id, 0) > self._completed:
                    break  # its free would wait for a step in flight: it frees nothing now
                victim_index = self._running.index(victim)
                del self._running[victim_index]
                if self.policy == "priority":
                    if victim_index < i:
                        i -= 1
                    for entry in scheduled:
                        if entry[0] is victim:
                            scheduled.remove(entry)
                            budget += entry[1]
                            if self._encoder_left is not None:
                                self._encoder_left += self._encoded.pop(victim.request_id, 0)
                            break
                verified.pop(victim.request_id, None)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    preempted_self = True
                    break
            if new_blocks is None:
                if (self.policy == "priority" and preempted_self
                        and not self.stop_at_self_preemption):
                    continue
                break
            scheduled.append((request, num_new_tokens, 0))
            self._take_encoder_inputs(request, encoder)
            if request.spec_token_ids:
                verified[request.request_id] = request.spec_token_ids[
                    :max(request.num_computed_tokens + num_new_tokens - request.num_tokens
                         - pending, 0)]
                request.spec_token_ids = []
            budget -= num_new_tokens
            i += 1

        # One preemption cancels every admission of this step.
        if not out.preempted:
            self._admit_waiting(budget, scheduled, verified)
        self._step_drafts = (self._drafts_by_batch[len(scheduled)]
                             if self._drafts_by_batch is not None and scheduled
                             else self.num_speculative_tokens)

        copies, retained = manager.take_kv_cache_block_copies()
        manager.take_new_block_ids()
        out.copies = [(copy[0], copy[1]) for copy in copies]
        if run_model is not None:
            run_model(scheduled, out.copies)
        held = None
        if self._launch(scheduled, in_flight):
            held = _HeldOutput([], sample_token, accept, propose)
            self._outputs.append(held)
            if retained:
                # The copies run with the step: their endpoints wait for it, released in order.
                self._deferred.append((self._launched, [list(retained)[::-1]]))
        else:
            manager.block_pool.free_blocks(retained)

        failing, self._sync_failing = self._sync_failing, {}
        if failing and held is not None:
            raise ValueError(f"a step left in flight admits failing synchronous loads "
                             f"{sorted(failing)}: not modeled (docs/spec.md §13.3)")
        failed = self._fail_sync_loads(scheduled, failing) if failing else []
        if not self.fail_short_loads:
            for request in failed:
                if self._window_unloaded(request):
                    self._running.remove(request)
                    self._preempt(request)
                    out.preempted.append(request.request_id)
        sampled = []
        for request, num_new_tokens, num_cached_tokens in scheduled:
            out.scheduled.append((request.request_id, num_new_tokens, num_cached_tokens))
            if request in failed:  # no output; under "fail" it ends below
                if self.fail_short_loads:
                    out.finished.append(request.request_id)
                continue
            request.num_computed_tokens += num_new_tokens
            pending = self._placeholders.get(request.request_id, 0)
            samples = request.num_computed_tokens >= request.num_tokens + pending
            if held is None:
                # Under async scheduling the output's own tokens (a sample and its drafts)
                # are still placeholders when vLLM releases encoder inputs.
                self._release_encoded(request, 1 + len(verified.get(request.request_id, []))
                                      if samples and self.async_scheduling else 0)
            if not samples:
                self._prefilling.add(request.request_id)
                continue
            self._prefilling.discard(request.request_id)
            if held is not None:
                # Its tokens are appended when the step's output is taken (complete_step).
                drafts = verified.pop(request.request_id, [])
                self._placeholders[request.request_id] = pending + len(drafts) + 1
                held.samples.append((request, drafts))
                request.spec_token_ids = self._placeholder_drafts(request, drafted)
            else:
                sampled.append(request)
                ended = self._append_verified(request, verified.pop(request.request_id, []),
                                              accept, sample_token)
                if self.publish_after_output or self.num_speculative_tokens:
                    manager.cache_blocks(request, request.num_computed_tokens
                                         - getattr(request, "num_in_flight_tokens", 0))
                if ended:
                    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    self._running.remove(request)
                    self._free(request)
                    out.finished.append(request.request_id)
        for request in failed if self.fail_short_loads else ():
            request.status = RequestStatus.FINISHED_ERROR
            self._running.remove(request)
            self._free(request)
        for request in sampled:
            if not RequestStatus.is_finished(request.status):
                request.spec_token_ids = (list(propose(request)) if propose is not None
                                          else self._placeholder_drafts(request, drafted))
        return out

    def _fail_sync_loads(self, scheduled: list[tuple[Any, int, int]],
                         failing: dict[str, tuple[int, int]]) -> list[Any]:
        """The step's output reports, in each group, the blocks the failing synchronous loads
        did not fill (vLLM's `_handle_invalid_blocks` over its running requests, on one group;
        on several vLLM takes no such report: docs/findings/031). Each scheduled request whose
        blocks computed before the step hold one is affected: in each group, at the first such
        block no earlier request marked, its computed tokens drop to the block's start (the
        earliest over the groups; if none, they stay as before the step), and its blocks from
        its computed tokens on are evicted from the cache, under either policy: what it
        computed from there read invalid KV, and under "recompute" it writes them again (vLLM
        keeps them keyed under "recompute", and a sharer's under "fail": docs/findings/029).
        Returns the affected requests, in order."""
        singles = self.manager.coordinator.single_type_managers
        # Block ids are unique across groups in one pool: one set holds every group's.
        invalid = {b.block_id for single in singles for rid, (valid, end) in failing.items()
                   for b in single.req_to_blocks[rid][valid // single.block_size:
                                                      -(-end // single.block_size)]
                   if not b.is_null}
        marked: set[int] = set()
        evict: set[int] = set()
        affected = []
        for request, _, _ in scheduled:
            computed = request.num_computed_tokens
            for single in singles:
                size = single.block_size
                own = False
                table = single.req_to_blocks.get(request.request_id, [])
                for idx, block in enumerate(table[:-(-computed // size)]):
                    if block.block_id not in invalid:
                        continue
                    if request not in affected:
                        affected.append(request)
                    if block.block_id in marked:
                        continue
                    marked.add(block.block_id)
                    if not own:
                        own = True
                        request.num_computed_tokens = min(request.num_computed_tokens,
                                                          idx * size)
            if request in affected:
                evict.update(b.block_id for single in singles
                             for b in single.req_to_blocks.get(request.request_id, [])[
                                 request.num_computed_tokens // single.block_size:])
        self.manager.evict_blocks(evict)
        return affected

    def _append_verified(self, request: Any, drafts: list[int], accept: int | None,
                         sample_token: Callable[[Any], int]) -> bool:
        """Roll back the rejected drafts, then append the kept ones and the sampled token up to
        the first that ends the request (its successors dropped and uncomputed). True when it
        ended (max_tokens or max_model_len)."""
        kept = drafts if accept is None else drafts[:accept]
        if UNFILLED in kept:
            kept = kept[:kept.index(UNFILLED)]
        request.num_computed_tokens -= len(drafts) - len(kept)
        # A placeholder draft kept is sampled as the token at its place is.
        new: list[int | None] = [None if token == PLACEHOLDER else token for token in kept]
        new.append(None)
        for j, token in enumerate(new, 1):
            request.append_output_token_ids(sample_token(request) if token is None else token)
            if (request.num_output_tokens >= request.max_tokens
                    or request.num_tokens >= self.max_model_len):
                request.num_computed_tokens -= len(new) - j
                return True
        return False

    def _placeholder_drafts(self, request: Any, drafted: Mapping[str, int] | None) -> list[int]:
        """A request's fixed drafts for its next step: the placeholders the drafter fills (as
        many as `drafted` names for it, all when not named), then the unfilled rest."""
        k = self._step_drafts
        filled = min(k, (drafted or {}).get(request.request_id, k))
        return [PLACEHOLDER] * filled + [UNFILLED] * (k - filled)

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Any, int, int]],
                       verified: dict[str, list[int]]) -> None:
        manager = self.manager
        # Padding (`_pads`) needs no running request's prefill chunk in the step.
        ran = bool(scheduled)
        no_prefill = not any(r.request_id in self._prefilling for r, _, _ in scheduled)
        i = 0
        while budget > 0 and i < len(self._waiting) and len(self._running) < self.max_running:
            request = self._waiting[i]
            if request.num_computed_tokens == 0:
                # As vLLM's scheduler, the request keeps the lookup's junction (§6.3): its
                # chunks stop there, and the retention masks keep the blocks ending there.
                hit_blocks, num_local_tokens, external = self._lookup(request)
            else:
                hit_blocks, num_local_tokens, external = None, 0, 0
            # A synchronous load's tokens count as computed at once, as a hit's do.
            num_hit_tokens = num_local_tokens + external
            num_new_tokens = request.num_tokens - request.num_computed_tokens - num_hit_tokens
            start = request.num_computed_tokens + num_hit_tokens
            padded = self._pads(start, num_new_tokens, no_prefill and (ran or start > 0))
            if padded > budget:
                break  # vLLM prefers not scheduling to scheduling it unpadded
            num_new_tokens = padded or num_new_tokens
            if num_new_tokens > budget:
                if not self.chunked_prefill:
                    break
                num_new_tokens = budget
            if self.mamba_block_aligned_split:
                num_new_tokens = self._mamba_aligned(request, num_new_tokens, num_hit_tokens)
                if num_new_tokens == 0:
                    break
                if padded and num_new_tokens != padded:
                    num_new_tokens, padded = 1, 0  # the padding is dropped, not shortened
            start = request.num_computed_tokens + num_hit_tokens
            num_new_tokens, encoder = self._encoder_inputs(request, start, num_new_tokens)
            if self.num_prefill_lookahead:
                num_new_tokens = reserve_prefill_lookahead(
                    request.num_tokens, start, num_new_tokens, self.num_prefill_lookahead)
            if encoder is not None and not self.chunked_prefill and (
                    0 < num_new_tokens < request.num_tokens - start):
                # Without chunked prefill the encoder may not split the prompt (§7.2).
                self._release_encoder_inputs(request)
                num_new_tokens = 0
            if num_new_tokens == 0:
                if self.stop_at_blocked_waiting:
                    break
                i += 1  # it keeps its place; the requests behind it may be admitted
                continue
            new_blocks = manager.allocate_slots(
                request,
                num_new_tokens,
                num_local_tokens,
                hit_blocks,
                num_lookahead_tokens=self.num_lookahead_tokens,
                # Passed only with a synchronous load: a manager without connectors lacks it.
                **({"num_external_computed_tokens": external} if external else {}),
                num_encoder_tokens=getattr(request, "num_encoder_tokens", 0),
                full_sequence_must_fit=self.full_sequence_must_fit,
                reserved_blocks=self.reserved_blocks,
                has_scheduled_reqs=bool(self._running),
            )
            if new_blocks is None:
                self._release_encoder_inputs(request)
                break
            del self._waiting[i]
            self._holders.pop(request.request_id, None)
            self._running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens += num_hit_tokens
            manager.record_prefix_cache_stats(request, num_local_tokens)
            if self._sync_offers.pop(request.request_id, None) is not None and external:
                self.sync_loaded[request.request_id] = external
            valid = self._sync_valid.pop(request.request_id, None)
            if valid is not None and valid < external:
                self._sync_failing[request.request_id] = (num_local_tokens + valid,
                                                          num_local_tokens + external)
            scheduled.append((request, num_new_tokens, num_local_tokens))
            if padded:
                verified[request.request_id] = [PLACEHOLDER] * self.num_speculative_tokens
            self._take_encoder_inputs(request, encoder)
            budget -= num_new_tokens

    def _pads(self, start: int, num_new_tokens: int, may: bool) -> int:
        """vLLM's uniform spec-decode padding: an admission with one token left, computed
        from `start`, is scheduled with the step's placeholder drafts when `may` and there is
        room for them and the sampled token; the tokens then, else 0."""
        padded = 1 + self.num_speculative_tokens
        if (self.num_speculative_tokens and self._drafts_by_batch is None
                and num_new_tokens == 1 and may
                and start + padded + 1 <= self.max_model_len):
            return padded
        return 0

    def _encoder_inputs(self, request: Any, start: int, num_new_tokens: int
                        ) -> tuple[int, tuple[list[int], list[int], int] | None]:
        """A chunk from `start` cut where the step's encoder budget or the encoder cache
        cannot take a multimodal input (§7.2): (its tokens, (the inputs to compute, repeated
        identifiers, embeddings) to take if it is scheduled; None without encoder inputs)."""
        if self.encoder_cache is None:
            return num_new_tokens, None
        if not request.mm_features:  # an encoder-decoder request's input, if any (§7.2)
            num_new_tokens, spent = schedule_encoder_decoder_input(
                getattr(request, "num_encoder_tokens", 0), start, num_new_tokens,
                self._encoder_left, self.encoder_cache.free_slots)
            return num_new_tokens, ([], [], spent) if spent else None
        num_new_tokens, compute, repeats, spent = schedule_encoder_inputs(
            self.encoder_cache, request, start, num_new_tokens, self._encoder_left,
            self.num_prefill_lookahead)
        return num_new_tokens, (compute, repeats, spent)

    def _take_encoder_inputs(self, request: Any,
                             encoder: tuple[list[int], list[int], int] | None) -> None:
        """A scheduled chunk's encoder inputs: computed ones take the budget and their cache
        room, repeated identifiers reference them."""
        if encoder is None:
            return
        compute, repeats, spent = encoder
        if spent and self._encoder_left is not None:
            self._encoder_left -= spent
            self._encoded[request.request_id] = spent
        cache = self.encoder_cache
        assert cache is not None  # `encoder` comes from `_encoder_inputs`, which needs it
        if spent and not request.mm_features:  # an encoder-decoder input (§7.2)
            cache.store_encoder_decoder(request.request_id, spent)
        for index in compute:
            cache.store(request, index)
        for index in repeats:
            cache.hit(request, index)

    def _mamba_aligned(self, request: Any, num_new_tokens: int, num_hit_tokens: int) -> int:
        """`mamba_block_aligned_split` with this manager's block sizes and this budget."""
        coordinator = self.manager.coordinator
        return mamba_block_aligned_split(
            request.num_computed_tokens + num_hit_tokens,
            num_new_tokens,
            request.num_prompt_tokens,
            request.num_tokens,
            coordinator.scheduler_block_size,
            self.manager.block_pool.hash_block_size,
            bool(getattr(coordinator, "enable_partial_hash_hits", False)),
            self.token_budget,
            self.use_eagle,
            self.prefill_checkpoint_alignment,
            request.shared_prefix_boundary,
            # A pool that does not hash ahead (vLLM 0.32's) has no such attribute.
            getattr(self.manager.block_pool, "num_hash_lookahead_tokens", 0),
            self._exact_junction,
        )

    def _preempt(self, request: Any) -> None:
        """Free everything; the request re-prefills (after a fresh lookup) when readmitted."""
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        # First among the requests no load started for (vLLM's `waiting`).
        self._waiting.insert(sum(r.request_id in self._holders for r in self._waiting), request)
        self._sort_waiting()

    def _sort_waiting(self) -> None:
        """Priority order, smallest (priority, arrival) first, the requests a load started for
        ahead of the others; stable, so FCFS among equals."""
        if self.policy == "priority":
            self._waiting = deque(sorted(self._waiting, key=lambda r: (
                r.request_id not in self._holders, *_priority_key(r))))


def reserve_prefill_lookahead(
    num_tokens: int, num_computed_tokens: int, num_new_tokens: int, num_prefill_lookahead: int
) -> int:
    """vLLM 0.34's `Scheduler._reserve_prefill_lookahead` (sched/scheduler.py:695-714): a chunk
    that would stop fewer than `num_prefill_lookahead` tokens short of the end stops that much
    earlier, so a multi-module MTP drafter has its known next tokens (docs/spec.md §5.7)."""
    remaining = num_tokens - num_computed_tokens - num_new_tokens
    if 0 < remaining < num_prefill_lookahead:
        num_new_tokens -= num_prefill_lookahead - remaining
    return max(num_new_tokens, 0)


def mamba_block_aligned_split(
    start: int,
    num_new_tokens: int,
    num_prompt_tokens: int,
    num_tokens: int,
    block_size: int,
    hash_block_size: int,
    partial_hits: bool,
    max_prefill_tokens: int,
    drop_eagle_block: bool = False,
    checkpoint_alignment: int | None = None,
    junction: int = 0,
    num_hash_lookahead_tokens: int = 0,
    exact_junction: bool = False,
) -> int:
    """vLLM's chunk clip for Mamba "align" (docs/spec.md §11.3): a prefill chunk from `start`
    ends on a block boundary (a state is written only at a chunk's end), stops at the next
    boundary when it starts inside a block, never passes the last cacheable block end, and
    stops at the prompt's last hash boundary under sub-block hits. With EAGLE both boundaries
    step down as the checkpoint does (`get_mamba_prefill_checkpoint_position`). The prefill's
    last chunk is exempt; decode is not clipped. A chunk reaching the prefill's end that can
    export the prefill checkpoint mid-chunk (`checkpoint_alignment` set: every state group has
    checkpoint blocks, §11.6) is exempt from all of these. Every prefill chunk stops at the
    request's shared-prefix `junction` (§6.3), floored to a whole number of blocks from
    `start`, when it lies inside the chunk; at the junction itself with `exact_junction` (the
    manager registers the state there) when it lies within the prompt. The checkpoints leave a
    hash lookahead's tokens to come (§5.7). May return 0 (nothing fits this step)."""
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return num_new_tokens
    end = start + num_new_tokens
    exported = False
    if checkpoint_alignment is not None and end >= prefill_end:
        checkpoint_unit = hash_block_size if partial_hits else block_size
        checkpoint = get_mamba_prefill_checkpoint_position(
            prefill_end, checkpoint_unit, drop_eagle_block, num_hash_lookahead_tokens)
        exported = is_mamba_prefill_checkpoint_valid(
            start, end, checkpoint, hash_block_size, block_size, checkpoint_alignment)
    last_cache_position = 0 if exported else get_mamba_prefill_checkpoint_position(
        num_tokens, block_size, drop_eagle_block, num_hash_lookahead_tokens)
    if end < prefill_end:
        aligned_end = end // block_size * block_size
        if aligned_end > start or block_size <= max_prefill_tokens:
            end = aligned_end
    next_block_boundary = (start // block_size + 1) * block_size
    tail_boundary = (
        get_mamba_prefill_checkpoint_position(num_prompt_tokens, hash_block_size,
                                              drop_eagle_block, num_hash_lookahead_tokens)
        if partial_hits and not exported else 0
    )
    stops = (
        next_block_boundary if start % block_size and not exported else 0,
        last_cache_position,
        tail_boundary if last_cache_position < tail_boundary < num_prompt_tokens else 0,
        (junction if exact_junction and junction <= num_prompt_tokens
         else start + (junction - start) // block_size * block_size)
        if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def pop_blocks_per_group(manager: Any, request: Any) -> list[list[Any]]:
    """`pop_blocks_for_free`, cut into one run per group (leading nulls trimmed, empty runs
    left out). A manager without kvcache's `pop_blocks_for_free_per_group` has its
    concatenated list cut by the group tables read just before (vLLM 0.33+ trims each table's
    leading nulls; 0.32 hands the whole tables)."""
    per_group = getattr(manager, "pop_blocks_for_free_per_group", None)
    if per_group is not None:
        return [run for run in per_group(request) if run]
    tables = [list(blocks) for blocks in manager.get_blocks(request.request_id).blocks]
    return cut_per_group(tables, manager.pop_blocks_for_free(request))


def cut_per_group(tables: list[list[Any]], popped: list[Any]) -> list[list[Any]]:
    """`pop_blocks_for_free`'s concatenated list cut into one run per group by the group
    tables read just before it (leading nulls trimmed, empty runs left out)."""
    whole = len(popped) == sum(map(len, tables))
    runs, start = [], 0
    for table in tables:
        n = len(table) if whole else len(_without_leading_nulls(table))
        runs.append(_without_leading_nulls(popped[start:start + n]))
        start += n
    return [run for run in runs if run]


def release_blocks_per_group(manager: Any, runs: list[list[Any]], **option: bool) -> None:
    """Release popped runs as `free` would have: group after group, each tail first (kvcache:
    `free_deferred_blocks`); `option` (`evict_first`) goes on to `BlockPool.free_blocks`."""
    release = getattr(manager, "free_deferred_blocks", None)
    if release is not None:
        release(runs, **option)
        return
    for run in runs:
        manager.block_pool.free_blocks(run[::-1], **option)


def _without_leading_nulls(blocks: list[Any]) -> list[Any]:
    """The blocks from the first that is not the null block."""
    return blocks[next((i for i, b in enumerate(blocks) if not b.is_null), len(blocks)):]
