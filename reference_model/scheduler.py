"""The scheduler driver of docs/traces.md ("The driver (step)", docs/spec.md §7)."""

from __future__ import annotations

from typing import Any

from kvfuzz.core.errors import InvalidTrace
from kvfuzz.reference_model.caching import checkpoint_exportable, state_checkpoint
from kvfuzz.reference_model.encoder import (
    EncoderCache,
    cross_encoder_chunk,
    encoder_chunk,
    inputs_of,
)
from kvfuzz.reference_model.layout import cdiv
from kvfuzz.reference_model.manager import Manager
from kvfuzz.reference_model.requests import Request
from kvfuzz.reference_model.state import NULL


class Driver:
    """FCFS or priority driver with a waiting queue and a running list."""

    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        self.cfg = manager.layout.scheduler
        self.max_model_len = manager.layout.max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.loads: dict[str, int] = {}
        """KV loads in flight: request id -> its local hit (docs/spec.md §13.2)."""
        self.landed: set[str] = set()
        """Requests a load left holding blocks: offered no load again."""
        self.sync_offers: dict[str, int] = {}
        """Synchronous loads offered, taken at the request's next admission (§13.3)."""
        self.sync_valid: dict[str, int] = {}
        """Synchronous loads offered that fail: request id -> the external tokens valid."""
        self.holders: dict[str, int] = {}
        """§13.2: waiting requests a load started for -> its start number; they wait first."""
        self.loads_started = 0
        self.launched = 0
        """Steps launched that scheduled tokens."""
        self.completed = 0
        """The last of them completed."""
        self.last_read: dict[str, int] = {}
        """Request id -> the last step that scheduled it."""
        self.in_flight: list[tuple[int, tuple[int, ...], tuple[tuple[str, int], ...]]] = []
        """docs/spec.md §7.1: steps launched, not completed: (step, block ids it reads,
        (request id, tokens) it scheduled)."""
        self.in_flight_tokens: list[list[tuple[Request, int]]] = []
        """Per step in flight: the tokens it scheduled, per request."""
        self.outputs: list[tuple[int, int, int | None, dict[str, int],
                                 list[tuple[Request, list[int]]], list[Request]]] = []
        """Per step in flight: its sample, draft, accept and drafted, the requests it samples for
        (with the drafts it verified), whose tokens arrive when it completes, and every
        request it scheduled, in order."""
        self.placeholders: dict[str, int] = {}
        """Request id -> the tokens its steps in flight will append."""
        self.deferred: list[tuple[int, list[list[int]]]] = []
        """Frees waiting for a step: (that step, one run per group, each freed tail first)."""
        self.aligned = any(g.align for g in manager.layout.groups)
        """Mamba "align": prefill chunks end where a state can be cached (docs/spec.md §11.3)."""
        self.states = any(g.kind == "mamba" for g in manager.layout.groups)
        """State groups: loads leave the last token and fail whole when short (§13.2)."""
        self.publishes = manager.layout.caching and (
            self.cfg.async_scheduling or self.states and self.cfg.settled_blocks == "at_output")
        """§7: with caching on, a request that samples caches its settled tokens after the
        output (under hash lookahead, the block its new token completes) under async
        scheduling, and with state groups unless `settled_blocks` leaves them to its next
        step."""
        bounded = self.cfg.encoder_budget is not None or self.cfg.encoder_cache_size is not None
        self.encoder = EncoderCache(self.cfg.encoder_cache_size) if bounded else None
        """§7.2: multimodal inputs against an encoder budget and cache (None: neither bound)."""
        self.encoder_left = self.cfg.encoder_budget
        self.encoded: dict[str, int] = {}
        """Request id -> the embeddings this step encodes for it."""
        self.waits = self.cfg.in_flight_sampling == "wait"
        """§7.1: a request whose sampling step is in flight waits for its output (no
        placeholders): it is given no tokens meanwhile."""
        self.fixed = self.cfg.num_speculative_tokens
        """docs/traces.md, "Fixed drafts": each request that samples gets this many placeholder
        drafts (None until kept), a one-token admission is padded to them, and every output
        caches the request's settled tokens."""
        self.by_batch = self.cfg.num_speculative_tokens_per_batch_size
        """§7.3, dynamic drafts: (first batch size, last, k) ranges, or None (fixed)."""
        self.step_k = self.fixed
        """The placeholder drafts this step's requests that sample get."""
        self.prefilling: set[str] = set()
        """Requests whose last scheduled chunk did not sample."""

    def _short_of_lookahead(self, r: Request, computed: int, n: int) -> int:
        """docs/spec.md §5.7: a chunk that would end fewer than P (num_prefill_lookahead)
        tokens before the request's end ends P tokens before it (0 if that is no token)."""
        left = r.num_tokens - computed - n
        lookahead = self.manager.layout.prefill_lookahead
        if 0 < left < lookahead:
            return max(n - (lookahead - left), 0)
        return n

    def state_aligned(self, r: Request, n: int, hit: int) -> int:
        """docs/spec.md §11.3's chunk rule: the tokens of a chunk of at most n from
        `r.num_computed_tokens + hit` that ends where a state may be written, and not past
        the request's junction J (§6.3) floored to whole blocks from the start (with junction
        states, J itself when it lies within the prompt). A chunk that
        reaches the prefill's end and can export the prefill's checkpoint mid-chunk (every
        state group has checkpoint blocks, §11.6) is cut only at J."""
        layout = self.manager.layout
        start, P, T, bs = r.num_computed_tokens + hit, r.num_prompt_tokens, r.num_tokens, layout.sbs
        prefill_end = max(P, T - 1)
        if start >= prefill_end:
            return n
        end = start + n
        junction = r.shared_prefix_boundary
        # With junction states a prompt's junction is itself a stop (§11.3), under sub-block
        # hits only: the scheduler's own condition.
        exact = layout.junction_states and layout.hbs < bs and junction <= P
        if layout.checkpoint_alignment is not None and end >= prefill_end:
            unit = layout.hbs if layout.partial_hits else bs
            checkpoint = state_checkpoint(prefill_end, unit, layout.replay_eagle, layout.lookahead)
            if checkpoint_exportable(start, end, checkpoint, layout.hbs, bs,
                                     layout.checkpoint_alignment):
                return _stop_at_junction(start, end, junction, bs, exact) - start
        if end < prefill_end and (end // bs * bs > start or bs <= self.cfg.token_budget):
            end = end // bs * bs
        end = _stop_at_junction(start, end, junction, bs, exact)
        candidates = [state_checkpoint(T, bs, layout.replay_eagle, layout.lookahead)]
        if start % bs:
            candidates.append(cdiv(start, bs) * bs)
        tail = state_checkpoint(P, layout.hbs, layout.replay_eagle, layout.lookahead)
        if layout.partial_hits and candidates[0] < tail < P:
            candidates.append(tail)
        inside = [c for c in candidates if start < c < end]
        return (min(inside) if inside else max(end, start)) - start

    def _order_waiting(self) -> None:
        """Priority keeps waiting sorted by (priority, arrival_time); FCFS keeps insertion order."""
        if self.cfg.policy == "priority":
            self.waiting.sort(key=lambda r: (r.request_id not in self.holders, r.priority,
                                             r.arrival_time))

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self._order_waiting()

    def free(self, req: Request) -> None:
        """docs/spec.md §7.1: free now, unless a step that read the request's blocks is still
        in flight: then pop them, held, until the newest step launched so far completes.
        §7.2: its encoder cache references go at once."""
        self._drop_encoder_inputs(req)
        if self.last_read.get(req.request_id, 0) <= self.completed:
            self.manager.free(req.request_id)
            return
        runs = [run for run in self.manager.pop_blocks_for_free(req.request_id) if run]
        if runs:
            self.hold(runs)

    def hold(self, runs: list[list[int]]) -> None:
        """Keep these runs held until the newest step launched so far completes."""
        self.deferred.append((self.launched, runs))
        for run in runs:
            self.manager.state.deferred.extend(run)

    def complete(self) -> list[int]:
        """The oldest step in flight completes; each free waiting for it or before is
        released, oldest first, group after group, each run tail first."""
        self.completed = self.in_flight.pop(0)[0]
        for r, n in self.in_flight_tokens.pop(0):
            r.num_in_flight_tokens -= n
        released: list[int] = []
        while self.deferred and self.deferred[0][0] <= self.completed:
            for run in self.deferred.pop(0)[1]:
                for b in run:
                    self.manager.state.deferred.remove(b)
                self.manager.state.release(run[::-1])
                released += run
        sample, draft, accept, drafted, samples, order = self.outputs.pop(0)
        verdicts = {r.request_id: drafts for r, drafts in samples}
        for r in order:
            if r.is_finished:  # aborted meanwhile (never preempted: a step in flight reads it)
                continue
            self._encoded_done(r)
            if r.request_id not in verdicts:
                continue
            drafts = verdicts[r.request_id]
            self.placeholders[r.request_id] -= len(drafts) + 1
            self._sample(r, sample, drafts, accept)
            # Its blocks are cached up to its settled tokens once the output is in (without
            # placeholders only where every output publishes).
            if not self.waits or self.publishes:
                self.manager.cache_blocks(r, r.num_computed_tokens - r.num_in_flight_tokens)
            if self._ends(r):
                r.status = "FINISHED_LENGTH_CAPPED"
                self.running.remove(r)
                self.free(r)
            elif not self.fixed:  # fixed drafts were placed when the step launched
                self._propose(r, sample, draft, drafted)
        return released

    def stop(self, req: Request, status: str) -> None:
        """abort / finish: leave the queue it is in (freeing a running request)."""
        if req.is_finished:
            return
        if req.status == "WAITING_FOR_REMOTE_KVS":
            pass  # its blocks wait for the load's end (load_done)
        elif req in self.waiting:
            self.waiting.remove(req)
            self.holders.pop(req.request_id, None)
            self.free(req)  # holds blocks only if a load landed
        else:
            self.running.remove(req)
            self.free(req)
        req.status = status

    def load(self, req: Request, offered: int, sync: bool = False, valid: int | None = None
             ) -> dict[str, int] | bool | None:
        """docs/spec.md §13.2: a waiting request holding nothing takes blocks for its connector
        lookup's hit and min(offered, what is left, but the last token with state groups)
        external tokens, caches nothing, waits for remote KV. `sync`: the offer stands until
        the request's next admission, which counts the tokens computed at once (§13.3);
        `valid` (not None): only that many of them load, which that step's output reports."""
        if (req not in self.waiting or req.num_computed_tokens or req.request_id in self.landed
                or req.request_id in self.sync_offers):
            return None
        if sync:
            self.sync_offers[req.request_id] = offered
            if valid is not None:
                self.sync_valid[req.request_id] = valid
            return True
        hits, hit, external, diverged = self._connector_lookup(req, offered,
                                                               1 if self.states else 0)
        if not external:
            return None
        if self.manager.allocate_slots(req, 0, hit, hits, has_scheduled_reqs=bool(self.running),
                                       full_sequence_must_fit=self.cfg.full_sequence_must_fit,
                                       external=external, delay_cache=True) is None:
            return None
        self.waiting.remove(req)
        self.loads_started += 1
        self.holders[req.request_id] = self.loads_started
        req.status = "WAITING_FOR_REMOTE_KVS"
        req.num_computed_tokens = hit + external
        self.loads[req.request_id] = hit
        return {"hit": hit, "external": external, "diverged": diverged}

    def _connector_lookup(self, req: Request, offered: int, backoff: int
                          ) -> tuple[list[list[int]], int, int, bool]:
        """The connector's lookup for `offered` tokens, leaving `backoff` to compute: (hits,
        hit, external, diverged); external 0 when the load would not pass the hit's sub-block
        tail or the request's hits are bounded, else the tail is cut from the hit."""
        hits, hit, req.shared_prefix_boundary, diverged = (
            self.manager.get_computed_blocks_for_connector(req))
        layout = self.manager.layout
        tail = hit % layout.sbs  # counted from the hit's last block boundary
        external = min(offered, req.num_tokens - backoff - (hit - tail))
        if req.skip_reading_prefix_cache or req.prefix_cache_hit_limit is not None:
            external = 0  # bounded hits read no external KV
        if external <= tail:
            return hits, hit, 0, diverged
        if tail:  # the load covers the sub-block tail: the hits stop at the boundary
            hit -= tail
            hits = [lst[:hit // g.bs] for g, lst in zip(layout.groups, hits)]
        return hits, hit, external, diverged

    def _admission_lookup(self, r: Request) -> tuple[list[list[int]], int, int]:
        """(hits, hit, external) of a fresh admission: a standing synchronous offer loads
        through the connector's lookup, leaving at least the last token; else (or when it
        loads nothing) the manager's lookup."""
        if r.request_id in self.sync_offers:
            hits, hit, external, _ = self._connector_lookup(
                r, self.sync_offers[r.request_id], 1)
            if external:
                return hits, hit, external
        hits, hit, r.shared_prefix_boundary = self.manager.get_computed_blocks(r)
        return hits, hit, 0

    def load_done(self, req: Request, loaded: int | None) -> int:
        """docs/spec.md §13.2: the load ends. Aborted meanwhile: free. Else keep the valid
        prefix (hit + loaded tokens; none when short with state groups), cached, or free when
        there is none; wait again, first."""
        hit = self.loads.pop(req.request_id)
        if req.is_finished:
            del self.holders[req.request_id]
            self.free(req)
            return 0
        if loaded is not None and hit + loaded < req.num_computed_tokens:
            if self.cfg.kv_load_failure_policy == "fail":
                del self.holders[req.request_id]
                return self._fail(req, hit + loaded)
            req.num_computed_tokens = 0 if self.states else self._valid_prefix(
                req.request_id, hit + loaded)
        if req.num_computed_tokens > 0:
            self.manager.cache_blocks(req, req.num_computed_tokens)
            self.landed.add(req.request_id)
        else:
            self.free(req)
        if req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens -= 1
        req.status = "PREEMPTED" if req.num_preemptions else "WAITING"
        # Among the requests a load started for (at the front), in start order.
        start = self.holders[req.request_id]
        at = 0
        while at < len(self.waiting) and self.holders.get(self.waiting[at].request_id,
                                                          start + 1) < start:
            at += 1
        self.waiting.insert(at, req)
        self._order_waiting()
        return req.num_computed_tokens

    def _fail(self, req: Request, loaded: int) -> int:
        """docs/spec.md §13.2, policy "fail": the request fails (FINISHED_ERROR), its blocks
        freed. One attention group: its computed tokens drop to the first block not filled;
        else they stay."""
        groups = self.manager.layout.groups
        if len(groups) == 1 and not self.states:
            table = self.manager.state.tables[0][req.request_id]
            nulls = next((i for i, b in enumerate(table) if b != NULL), len(table))
            req.num_computed_tokens = max(loaded // groups[0].bs, nulls) * groups[0].bs
        self.free(req)
        req.status = "FINISHED_ERROR"
        return 0

    def _valid_prefix(self, rid: str, loaded: int) -> int:
        """docs/spec.md §13.2: what a short load leaves. Several groups: nothing. One group: the
        first block holding an unloaded position that is not a window null, unless the window
        of that point reaches a null (then nothing)."""
        groups = self.manager.layout.groups
        if len(groups) > 1:
            return 0
        group, table = groups[0], self.manager.state.tables[0][rid]
        nulls = next((i for i, b in enumerate(table) if b != NULL), len(table))
        valid = max(loaded // group.bs, nulls) * group.bs
        return 0 if valid and group.skipped(valid) < nulls * group.bs else valid

    def _window_unloaded(self, r: Request) -> bool:
        """docs/spec.md §13.3 step 5: whether the window of r's computed tokens reaches its
        table's leading nulls on a group (then, under "recompute", r is preempted)."""
        n = r.num_computed_tokens
        for group, by_rid in zip(self.manager.layout.groups, self.manager.state.tables):
            table = by_rid.get(r.request_id, [])
            nulls = next((i for i, b in enumerate(table) if b != NULL), len(table))
            if nulls and n and group.skipped(n) < nulls * group.bs:
                return True
        return False

    def _victim(self) -> Request:
        """FCFS: the last running request; priority: the first with the largest
        (priority, arrival_time)."""
        if self.cfg.policy == "fcfs":
            return self.running[-1]
        victim = self.running[0]
        for r in self.running[1:]:
            if (r.priority, r.arrival_time) > (victim.priority, victim.arrival_time):
                victim = r
        return victim

    def _preempt(self, victim: Request) -> None:
        self.free(victim)
        victim.status = "PREEMPTED"
        victim.num_computed_tokens = 0
        victim.spec = []
        victim.num_preemptions += 1
        # First after the requests a load started for.
        self.waiting.insert(sum(r.request_id in self.holders for r in self.waiting), victim)
        self._order_waiting()

    def reset(self, reset_running: bool) -> bool:
        """reset_prefix_cache: with `reset_running`, every running request is preempted
        first, the last first (so they wait in their running order); then the cache reset,
        which fails while any block is held."""
        if reset_running:
            while self.running:
                self._preempt(self.running.pop())
        return self.manager.reset_prefix_cache()

    def step(self, sample: int, in_flight: bool = False, draft: int = 0,
             accept: int | None = None, drafted: dict[str, int] | None = None
             ) -> dict[str, Any]:
        """One step; `in_flight`: it stays in flight until `complete` (docs/spec.md §7.1),
        else every step still in flight completes first. Spec decode: a request verifies the
        drafts the step scheduled and keeps the first `accept` (None: all); each request that
        sampled and still runs then proposes `draft` new ones, or as many as `drafted` names
        for it if fewer (fixed drafts: fills that many of its placeholders)."""
        drafted = drafted or {}
        while not in_flight and self.in_flight:
            self.complete()
        mgr, cfg, M = self.manager, self.cfg, self.max_model_len
        mgr.new_step_starts()
        la = cfg.num_lookahead_tokens
        budget = cfg.token_budget
        self.encoder_left = cfg.encoder_budget
        self.encoded = {}
        scheduled: list[tuple[Request, int, int]] = []
        preempted: list[str] = []
        failing: dict[str, tuple[int, int]] = {}
        """§13.3: synchronous loads admitted that fail -> (valid end, load end) in tokens."""
        verified: dict[str, list[int]] = {}
        """Request id -> the drafts this step scheduled for it."""

        # 2. Running loop.
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            pending = self.placeholders.get(r.request_id, 0)
            if pending and self.waits:  # §7.1: it waits for its output
                i += 1
                continue
            # A step in flight already ends it (its first pending token reaches max_tokens).
            if pending and r.num_computed_tokens + 2 - pending >= r.num_prompt_tokens + r.max_tokens:
                i += 1
                continue
            n = min(r.num_tokens + pending + len(r.spec) - r.num_computed_tokens, budget,
                    M - r.num_computed_tokens - 1)
            if n > 0 and self.aligned:
                n = self.state_aligned(r, n, 0)
            enc = None
            if n > 0:
                n, enc = self._encoder_cut(r, r.num_computed_tokens, n)
            n = self._short_of_lookahead(r, r.num_computed_tokens, n)
            if n <= 0:
                i += 1
                continue
            while True:
                blocks = mgr.allocate_slots(r, n, num_lookahead_tokens=la)
                if blocks is not None:
                    break
                victim = self._victim()
                if self.last_read.get(victim.request_id, 0) > self.completed:
                    break  # a step in flight reads it: preempting it frees nothing now
                index = self.running.index(victim)
                self.running.pop(index)
                if index < i:
                    i -= 1
                for entry in scheduled:
                    if entry[0] is victim:
                        scheduled.remove(entry)
                        budget += entry[1]
                        if self.encoder_left is not None:
                            self.encoder_left += self.encoded.pop(victim.request_id, 0)
                        break
                verified.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is r:
                    break
            if blocks is None:
                if (cfg.policy == "priority" and r.status == "PREEMPTED"
                        and cfg.self_preemption == "continue"):
                    continue  # r preempted itself: the next (at index i now) may fit
                break
            scheduled.append((r, n, 0))
            self._encode(r, enc)
            if r.spec:  # the drafts that fit are verified; new ones come after the step
                verified[r.request_id] = r.spec[
                    :max(r.num_computed_tokens + n - r.num_tokens - pending, 0)]
                r.spec = []
            budget -= n
            i += 1

        # 3. Waiting loop.
        if not preempted:
            ran = bool(scheduled)
            no_prefill = not any(r.request_id in self.prefilling for r, _, _ in scheduled)
            w = 0
            while budget > 0 and w < len(self.waiting) and len(self.running) < cfg.max_running:
                r = self.waiting[w]
                if r.num_computed_tokens == 0:  # the request keeps the lookup's junction
                    hits, local, external = self._admission_lookup(r)
                else:
                    hits, local, external = None, 0, 0
                hit = local + external  # a synchronous load's tokens are computed at once
                n = r.num_tokens - r.num_computed_tokens - hit
                start = r.num_computed_tokens + hit
                # Fixed drafts: one token left, no running prefill chunk this step, a running
                # request scheduled or tokens computed, room for the drafts and a sample.
                pad = (self.fixed and self.by_batch is None and n == 1 and no_prefill
                       and (ran or start > 0) and start + self.fixed + 2 <= M)
                if pad:
                    if 1 + self.fixed > budget:
                        break
                    n = 1 + self.fixed
                if n > budget:
                    if not cfg.chunked_prefill:
                        break
                    n = budget
                if self.aligned:
                    n = self.state_aligned(r, n, hit)
                    if n == 0:
                        break
                    if pad and n != 1 + self.fixed:
                        n, pad = 1, False
                n, enc = self._encoder_cut(r, start, n)
                n = self._short_of_lookahead(r, start, n)
                if enc is not None and not cfg.chunked_prefill and 0 < n < r.num_tokens - start:
                    self._drop_encoder_inputs(r)  # §7.2: no split
                    n = 0
                if n == 0:  # §5.7, §7.2: passed over, it keeps its place, or the loop ends
                    if cfg.blocked_waiting == "stop":
                        break
                    w += 1
                    continue
                blocks = mgr.allocate_slots(
                    r,
                    n,
                    local,
                    hits,
                    la,
                    r.num_encoder_tokens,
                    cfg.full_sequence_must_fit,
                    cfg.reserved_blocks,
                    bool(self.running),
                    external=external,
                )
                if blocks is None:
                    self._drop_encoder_inputs(r)
                    break
                self.sync_offers.pop(r.request_id, None)
                valid = self.sync_valid.pop(r.request_id, None)
                if valid is not None and valid < external:
                    failing[r.request_id] = (local + valid, local + external)
                self.waiting.pop(w)
                self.holders.pop(r.request_id, None)
                self.running.append(r)
                r.status = "RUNNING"
                r.num_computed_tokens += hit
                scheduled.append((r, n, local))
                if pad:
                    verified[r.request_id] = [None] * self.fixed
                self._encode(r, enc)
                budget -= n

        # 4. Step end.
        self.step_k = self._drafts_for(len(scheduled))
        copies = mgr.take_kv_cache_block_copies()
        mgr.take_new_block_ids()
        if scheduled:
            self.launched += 1
            for r, _, _ in scheduled:
                self.last_read[r.request_id] = self.launched
            if not in_flight:
                self.completed = self.launched
        if in_flight and scheduled:
            # Each group's table from the first block a token of the step attends to.
            reads = {b for r, _, _ in scheduled for g in mgr.layout.groups
                     for b in mgr.state.tables[g.gid].get(r.request_id, [])[
                         g.skipped(r.num_computed_tokens) // g.bs:]}
            reads.discard(0)
            self.in_flight.append((self.launched, tuple(sorted(reads)),
                                   tuple((r.request_id, n) for r, n, _ in scheduled)))
            self.in_flight_tokens.append([(r, n) for r, n, _ in scheduled])
            for r, n, _ in scheduled:
                r.num_in_flight_tokens += n
            ends = [b for pair in mgr.state.retained for b in pair]
            mgr.state.retained = []
            if ends:
                self.hold([ends[::-1]])
        else:
            mgr.release_copies()
        finished: list[str] = []
        sampled: list[Request] = []
        held: list[tuple[Request, list[int]]] = []
        if in_flight and scheduled:
            self.outputs.append((sample, draft, accept, drafted, held,
                                 [r for r, _, _ in scheduled]))
        if failing and in_flight:
            raise InvalidTrace("step {in_flight: true} admits a synchronous load that fails "
                               f"({sorted(failing)}): its report is modeled only in the output "
                               "of a step not left in flight (docs/spec.md §13.3)")
        failed = self._fail_sync_loads(scheduled, failing) if failing else set()
        if cfg.kv_load_failure_policy == "recompute":
            for r, _, _ in scheduled:
                if r.request_id in failed and self._window_unloaded(r):
                    self.running.remove(r)
                    self._preempt(r)
                    preempted.append(r.request_id)
        for r, n, _ in scheduled:
            if r.request_id in failed:  # §13.3: no output; under "fail" it ends below
                if cfg.kv_load_failure_policy == "fail":
                    finished.append(r.request_id)
                continue
            r.num_computed_tokens += n
            pending = self.placeholders.get(r.request_id, 0)
            samples = r.num_computed_tokens >= r.num_tokens + pending
            if not in_flight:  # §7.2: async scheduling counts the output's own tokens pending
                self._encoded_done(r, 1 + len(verified.get(r.request_id, []))
                                   if samples and cfg.async_scheduling else 0)
            if not samples:
                self.prefilling.add(r.request_id)
            else:
                self.prefilling.discard(r.request_id)
                drafts = verified.pop(r.request_id, [])
                if in_flight:  # the tokens arrive when the step completes
                    self.placeholders[r.request_id] = pending + len(drafts) + 1
                    held.append((r, drafts))
                    if self.fixed:  # fixed drafts are placed at once
                        self._propose(r, sample, draft, drafted)
                    continue
                self._sample(r, sample, drafts, accept)
                sampled.append(r)
                if self.publishes or self.fixed:
                    mgr.cache_blocks(r, r.num_computed_tokens - r.num_in_flight_tokens)
            if self._ends(r):
                r.status = "FINISHED_LENGTH_CAPPED"
                self.running.remove(r)
                self.free(r)
                finished.append(r.request_id)
        for r, _, _ in scheduled:
            if r.request_id in failed and cfg.kv_load_failure_policy == "fail":
                r.status = "FINISHED_ERROR"
                self.running.remove(r)
                self.free(r)
        for r in sampled:
            if not r.is_finished:
                self._propose(r, sample, draft, drafted)
        return {
            "scheduled": [[r.request_id, n, hit] for r, n, hit in scheduled],
            "preempted": preempted,
            "finished": finished,
            "copies": [[src, dst] for src, dst in copies],
        }


    def _fail_sync_loads(self, scheduled: list[tuple[Request, int, int]],
                         failing: dict[str, tuple[int, int]]) -> set[str]:
        """docs/spec.md §13.3: the step's output reports, in each group, the blocks the
        failing synchronous loads did not fill. Each scheduled request, in order, whose
        computed blocks before the step hold one is affected: in each group, at the first
        such block no earlier request marked, its computed tokens drop to that block's start
        (the earliest over the groups; else they stay as before the step), and its blocks from
        its computed tokens on lose their keys under either policy (what it computed there
        read invalid KV; under "recompute" it writes them again). Returns the affected
        request ids."""
        groups = self.manager.layout.groups
        tables = self.manager.state.tables
        invalid = {b for g, by_rid in zip(groups, tables) for rid, (valid, end) in failing.items()
                   for b in by_rid[rid][valid // g.bs:cdiv(end, g.bs)] if b != NULL}
        marked: set[int] = set()
        evict: set[int] = set()
        affected: set[str] = set()
        for r, _, _ in scheduled:
            computed = r.num_computed_tokens
            for g, by_rid in zip(groups, tables):
                own = False
                for idx, b in enumerate(by_rid.get(r.request_id, [])[:cdiv(computed, g.bs)]):
                    if b not in invalid:
                        continue
                    affected.add(r.request_id)
                    if b in marked:
                        continue
                    marked.add(b)
                    if not own:
                        own = True
                        r.num_computed_tokens = min(r.num_computed_tokens, idx * g.bs)
            if r.request_id in affected:
                for g, by_rid in zip(groups, tables):
                    evict.update(by_rid.get(r.request_id, [])[r.num_computed_tokens // g.bs:])
        self.manager.evict_blocks(evict)
        return affected

    def _encoder_cut(self, r: Request, start: int, n: int
                     ) -> tuple[int, tuple[list[int], list[int], int] | None]:
        """§7.2: n cut where the step's encoder budget or the cache refuses an input of r."""
        if self.encoder is None:
            return n, None
        if not inputs_of(r):  # an encoder-decoder request's input, if any
            n, spent = cross_encoder_chunk(r, start, n, self.encoder_left,
                                           self.encoder.cross_room())
            return n, ([], [], spent) if spent else None
        n, computed, riding, spent = encoder_chunk(
            self.encoder, r, start, n, self.encoder_left, self.manager.layout.prefill_lookahead)
        return n, (computed, riding, spent)

    def _encode(self, r: Request, enc: tuple[list[int], list[int], int] | None) -> None:
        """§7.2: r is scheduled: its inputs are encoded and cached, repeats referenced."""
        if enc is None:
            return
        computed, riding, spent = enc
        assert self.encoder is not None
        if spent and self.encoder_left is not None:
            self.encoder_left -= spent
            self.encoded[r.request_id] = spent
        if spent and not inputs_of(r):  # an encoder-decoder input holds its room (§7.2)
            self.encoder.cross[r.request_id] = spent
        for k in computed:
            self.encoder.add(r, k)
        for k in riding:
            self.encoder.lookup(r, k)

    def _drop_encoder_inputs(self, r: Request) -> None:
        """§7.2: r lets go of every encoder cache entry it references."""
        if self.encoder is not None:
            self.encoder.drop_all(r)

    def _encoded_done(self, r: Request, unresolved: int = 0) -> None:
        """§7.2: after a step's output, r's inputs that end by its settled tokens (less the
        `unresolved` ones the output brings) are let go."""
        if self.encoder is not None:
            self.encoder.drop_done(
                r, r.num_computed_tokens - unresolved - self.placeholders.get(r.request_id, 0))

    def _sample(self, r: Request, sample: int, drafts: list[int], accept: int | None) -> None:
        """The step's verdict on `r`: the first `accept` drafts (None: all) are kept, the rest
        rejected and uncomputed again; the kept ones and a sampled token are appended up to the
        first that ends the request (max_tokens or max_model_len), whose successors are dropped
        and uncomputed too."""
        kept = drafts if accept is None else drafts[:accept]
        if _UNFILLED in kept:  # an unfilled placeholder and every draft after it are rejected
            kept = kept[:kept.index(_UNFILLED)]
        r.num_computed_tokens -= len(drafts) - len(kept)
        new: list[int | None] = [*kept, None]
        for j, token in enumerate(new, 1):
            r.tokens.append((sample + r.num_tokens) % self.cfg.vocab_size if token is None
                            else token)
            if self._ends(r):
                r.num_computed_tokens -= len(new) - j
                return

    def _drafts_for(self, batch: int) -> int:
        """§7.3: the placeholder drafts of a step that schedules `batch` requests: the k of
        the last range starting at or below it, at most the fixed count (the fixed count
        without ranges or requests)."""
        if self.by_batch is None or batch == 0:
            return self.fixed
        return min(self.fixed, [k for first, _, k in sorted(self.by_batch) if first <= batch][-1])

    def _ends(self, r: Request) -> bool:
        """max_tokens or max_model_len reached."""
        return r.num_output_tokens >= r.max_tokens or r.num_tokens >= self.max_model_len

    def _propose(self, r: Request, sample: int, draft: int, drafted: dict[str, int]) -> None:
        """A request that sampled and still runs proposes `draft` new drafts, or the first
        `drafted[r]` of them (fixed drafts: that many placeholders, of which the drafter fills
        the first `drafted[r]`; the rest stay unfilled)."""
        if self.fixed:
            filled = min(self.step_k, drafted.get(r.request_id, self.step_k))
            r.spec = [None] * filled + [_UNFILLED] * (self.step_k - filled)
        else:
            r.spec = [(sample + 1 + r.num_tokens + j) % self.cfg.vocab_size
                      for j in range(min(draft, drafted.get(r.request_id, draft)))]


_UNFILLED = "unfilled"
"""A fixed draft the drafter did not fill (it proposed fewer): never kept."""


def _stop_at_junction(start: int, end: int, junction: int, bs: int, exact: bool) -> int:
    """The end of a chunk [start, end) cut at a `junction` strictly inside it: the junction
    itself when `exact`, else the last position a whole number of blocks (at least one) from
    the start not past it."""
    if not start < junction < end:
        return end
    if exact:
        return junction
    if junction - start >= bs:
        return start + (junction - start) // bs * bs
    return end
