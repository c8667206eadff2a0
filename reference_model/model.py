"""ReferenceModel: the executable oracle, driven by normalized ops (docs/traces.md).

Validity violations raise InvalidTrace; API misuse returns {"error": "ValueError"} and changes
nothing (docs/traces.md "API misuse", checks in the documented order).
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.core.errors import InvalidTrace
from kvfuzz.core.sync_load_failures import sync_failure_refusal
from kvfuzz.core.extra_keys import Extras, extras_problem
from kvfuzz.core.sides import CachedTokensProbe, Observations, take_events_result
from kvfuzz.core.snapshot import CacheKey, RequestView, Snapshot
from kvfuzz.core.trace import Op
from kvfuzz.reference_model.layout import Layout
from kvfuzz.reference_model.lookup import Lists
from kvfuzz.reference_model.manager import Manager
from kvfuzz.reference_model.requests import Request
from kvfuzz.reference_model.scheduler import Driver

MISUSE = {"error": "ValueError"}

API_OPS = (
    "add_request",
    "get_computed_blocks",
    "get_num_cached_tokens",
    "allocate_slots",
    "free",
    "append_tokens",
    "cache_blocks",
    "evict_blocks",
    "reset_prefix_cache",
    "take_new_block_ids",
    "take_kv_cache_block_copies",
    "release_copies",
    "new_step_starts",
    "take_events",
    "free_deferred",
    "release_deferred",
)
SCHEDULER_OPS = ("add_request", "step", "complete_step", "abort", "finish", "load_remote",
                 "finish_load", "reset_prefix_cache", "take_events")


class ReferenceModel:
    """Slow, obviously-correct model of docs/spec.md Tier A and B, implementing kvfuzz.core.sides.Side."""

    name = "model"

    def __init__(self, config: Config, level: str) -> None:
        if level not in ("api", "scheduler"):
            raise InvalidTrace(f"unknown level {level!r}")
        self.config = config
        self.level = level
        self.layout = Layout.from_config(config)
        self.manager = Manager(self.layout)
        self.driver = Driver(self.manager)
        self.requests: dict[str, Request] = {}
        self._mm_lengths: dict[int, int] = {}
        self._deferred: list[list[list[int]]] = []
        self.lookups: dict[str, tuple[Lists, int]] = {}
        """API level: request id -> its live lookup (blocks, hit)."""
        self._views: dict[str, tuple[tuple[Any, ...], RequestView]] = {}
        """Request id -> the fields of its last snapshot view and the view (reused while equal)."""
        self._cache_of: tuple[list[tuple[CacheKey, int]], dict[CacheKey, tuple[int, ...]]] = ([], {})
        """The cache entries the last snapshot reported, and the map made of them."""
        self.misuse_ops = 0
        """Ops answered as API misuse so far (docs/traces.md "API misuse")."""

    # ----- Side protocol -----

    def apply(self, op: Op) -> Any:
        name = op["op"]
        allowed = API_OPS if self.level == "api" else SCHEDULER_OPS
        if name not in allowed:
            raise InvalidTrace(f"op {name!r} is not a {self.level}-level op")
        self.manager.observations = Observations()
        try:
            result = getattr(self, f"_op_{name}")(op)
            self.misuse_ops += result is MISUSE
            return result
        finally:
            if name not in ("get_computed_blocks", "add_request", "get_num_cached_tokens"):
                self.lookups = {}  # a lookup dies at any other op

    def observations(self) -> Observations:
        return self.manager.observations

    def snapshot(self) -> Snapshot:
        state = self.manager.state
        if state.entries != self._cache_of[0]:  # the map as last reported, else read afresh
            lists: dict[CacheKey, list[int]] = {}
            for key, block in state.entries:
                lists.setdefault(key, []).append(block)
            cache = {key: tuple(blocks) for key, blocks in lists.items()}
            self._cache_of = (list(state.entries), cache)
        # A request no group's table, num_cached_block or partial-hit record mentions reads as
        # untracked everywhere; a request whose fields read as last time keeps its view.
        tracked = set().union(*state.tables, *state.num_cached, *state.partial_hits)
        untracked = (None,) * len(state.tables)
        views = {}
        for rid, req in self.requests.items():
            if rid in tracked:
                tables = tuple([None if t.get(rid) is None else tuple(t[rid]) for t in state.tables])
                cached = tuple([counts.get(rid) for counts in state.num_cached])
                partial = tuple([hits.get(rid) for hits in state.partial_hits])
            else:
                tables = cached = partial = untracked
            fields = (req.status, req.num_computed_tokens, req.num_tokens, tables, cached, partial,
                      req.shared_prefix_boundary, 0 if req.is_finished else len(req.spec))
            known = self._views.get(rid)
            if known is None or known[0] != fields:
                # Tokens are only ever appended, so an unchanged num_tokens means unchanged tokens.
                known = self._views[rid] = (fields, RequestView(*fields, tokens=tuple(req.tokens)))
            views[rid] = known[1]
        return Snapshot(
            num_blocks=state.num_blocks,
            ref_cnt=tuple(state.ref_counts()),
            free_queue=tuple(state.free),
            num_free_blocks=len(state.free),
            linked=frozenset(state.free),
            block_keys=tuple(state.primary),
            block_key_tokens=tuple(state.primary_tokens),
            extra_keys={b: frozenset(keys) for b, keys in state.extras.items() if keys},
            cache=self._cache_of[1],
            requests=views,
            pending_copies=tuple([pair for g in state.pending_copies for pair in g]),
            retained_copies=tuple(state.retained),
            deferred_frees=tuple(tuple(run) for batches in (self._deferred, [
                runs for _, runs in self.driver.deferred]) for runs in batches for run in runs),
            new_block_ids=tuple([b for g in state.new_block_ids for b in g]),
            waiting=tuple([r.request_id for r in self.driver.waiting]),
            running=tuple([r.request_id for r in self.driver.running]),
            loads=tuple(sorted(self.driver.loads)),
            in_flight=tuple(self.driver.in_flight),
        )

    # ----- validity helpers -----

    def _live(self, rid: str) -> Request:
        """The request, which must have been added and not be finished."""
        req = self.requests.get(rid)
        if req is None:
            raise InvalidTrace(f"request {rid!r} was not added")
        if req.is_finished:
            raise InvalidTrace(f"request {rid!r} is finished ({req.status})")
        return req

    def _added(self, rid: str) -> Request:
        req = self.requests.get(rid)
        if req is None:
            raise InvalidTrace(f"request {rid!r} was not added")
        return req

    # ----- both levels -----

    def _op_add_request(self, op: Op) -> None:
        rid, prompt = op["request_id"], op["prompt"]
        if rid in self.requests:
            raise InvalidTrace(f"request {rid!r} was added before")
        if not 1 <= len(prompt) <= self.layout.max_model_len - 1:
            raise InvalidTrace(
                f"prompt of {len(prompt)} tokens (needs 1 … {self.layout.max_model_len - 1})"
            )
        if any(t < 0 for t in prompt):
            raise InvalidTrace(f"prompt has a negative token id: {prompt!r}")
        if op["max_tokens"] < 1:
            raise InvalidTrace(f"max_tokens must be >= 1, got {op['max_tokens']}")
        if op["num_encoder_tokens"] < 0:
            raise InvalidTrace(f"num_encoder_tokens must be >= 0, got {op['num_encoder_tokens']}")
        extras = Extras.of_op(op)
        problem = extras_problem(extras, prompt, self._mm_lengths)
        if problem:
            raise InvalidTrace(f"add_request {rid!r}: {problem}")
        req = Request(
            request_id=rid,
            prompt=list(prompt),
            salt=op["cache_salt"] or None,
            hbs=self.layout.hbs,
            lookahead=self.layout.lookahead,
            extras=extras,
            priority=op["priority"],
            arrival_time=float(len(self.requests)),
            max_tokens=op["max_tokens"],
            skip_reading_prefix_cache=op["skip_reading_prefix_cache"],
            num_encoder_tokens=op["num_encoder_tokens"],
            tokens=list(prompt),
            prefix_cache_hit_limit=op["prefix_cache_hit_limit"],
        )
        self.requests[rid] = req
        if self.level == "scheduler":
            self.driver.add(req)
        return None

    # ----- API level -----

    def _op_get_computed_blocks(self, op: Op) -> Any:
        req = self._live(op["request_id"])
        lists, hit, boundary = self.manager.get_computed_blocks(req, op["max_cache_hit_length"])
        self.lookups[req.request_id] = (lists, hit)
        self.manager.observations.lookups.append((req.request_id, hit, boundary))
        return {"block_ids": [list(lst) for lst in lists], "num_computed_tokens": hit}

    def _op_get_num_cached_tokens(self, op: Op) -> Any:
        """The probe answers what get_computed_blocks (without a bound) would hit."""
        req = self._live(op["request_id"])
        _, hit, _ = self.manager.get_computed_blocks(req)
        self.manager.observations.cached_token_probes.append(
            CachedTokensProbe(req.request_id, hit, hit))
        return {"num_cached_tokens": hit}

    def _op_allocate_slots(self, op: Op) -> Any:
        req = self._live(op["request_id"])
        hits: Lists | None = None
        hit = 0
        if op["use_lookup"]:
            if req.request_id not in self.lookups:
                raise InvalidTrace(f"request {req.request_id!r} has no live lookup")
            hits, hit = self.lookups[req.request_id]
        n, ext = op["num_new_tokens"], op["num_external_computed_tokens"]
        if req.num_computed_tokens + hit + max(ext, 0) + n > req.num_tokens:
            raise InvalidTrace(
                f"num_computed_tokens {req.num_computed_tokens} + hit {hit} + external "
                f"{ext} + num_new_tokens {n} > num_tokens {req.num_tokens}"
            )
        counts = ("num_new_tokens", "num_lookahead_tokens", "reserved_blocks", "num_encoder_tokens",
                  "num_external_computed_tokens")
        if (
            (n == 0 and hit == 0 and ext == 0)
            or any(op[f] < 0 for f in counts)
            or (hits is not None and any(hits) and self.manager.tracked(req.request_id))
            or (ext > 0 and not self._takes_external(req))
        ):
            self.manager.record_error(req.request_id)
            return MISUSE
        new = self.manager.allocate_slots(
            req,
            n,
            hit,
            hits,
            op["num_lookahead_tokens"],
            op["num_encoder_tokens"],
            op["full_sequence_must_fit"],
            op["reserved_blocks"],
            op["has_scheduled_reqs"],
            ext,
            op["delay_cache_blocks"],
        )
        if new is None:
            return None
        req.num_computed_tokens += hit + ext + n
        req.status = "RUNNING"
        return {"block_ids": [list(lst) for lst in new]}

    def _takes_external(self, req: Request) -> bool:
        """docs/spec.md §13.1: external tokens only for a request holding nothing."""
        return not self.manager.tracked(req.request_id)

    def _op_free(self, op: Op) -> Any:
        req = self._live(op["request_id"])
        # A request that holds nothing is freed as a no-op (docs/spec.md §5.2).
        self.manager.free(req.request_id)
        if op["preempt"]:
            req.status = "PREEMPTED"
            req.num_computed_tokens = 0
            req.num_preemptions += 1
        else:
            req.status = "FINISHED_STOPPED"
        return None

    def _op_append_tokens(self, op: Op) -> None:
        req = self._live(op["request_id"])
        tokens = op["tokens"]
        if not tokens or any(t < 0 for t in tokens):
            raise InvalidTrace(f"tokens must be a non-empty list of ids >= 0, got {tokens!r}")
        if req.num_tokens + len(tokens) > self.layout.max_model_len:
            raise InvalidTrace(
                f"{req.num_tokens} + {len(tokens)} tokens exceed max_model_len "
                f"{self.layout.max_model_len}"
            )
        req.tokens.extend(tokens)
        return None

    def _op_cache_blocks(self, op: Op) -> Any:
        req = self._live(op["request_id"])
        n = op["num_computed_tokens"]
        if n is None:
            n = req.num_computed_tokens
        rid = req.request_id
        state = self.manager.state
        if (
            not self.manager.tracked(rid)
            or n < 0
            or any(
                n > len(state.tables[g.gid][rid]) * g.bs
                for g in self.layout.groups
                if g.kind not in ("cross", "circular_buffer", "encoder_only")
            )
        ):
            return MISUSE
        self.manager.cache_blocks(req, n)
        return None

    def _op_evict_blocks(self, op: Op) -> Any:
        ids = op["block_ids"]
        if any(b < 0 or b >= self.layout.num_blocks for b in ids):
            return MISUSE
        self.manager.evict_blocks(set(ids))
        return None

    def _op_free_deferred(self, op: Op) -> list[int]:
        """pop_blocks_for_free: every group's table (leading nulls trimmed) kept as one run,
        still held; the request is finished."""
        req = self._live(op["request_id"])
        runs = [run for run in self.manager.pop_blocks_for_free(req.request_id) if run]
        if runs:
            self._deferred.append(runs)
            for run in runs:
                self.manager.state.deferred.extend(run)
        req.status = "FINISHED_STOPPED"
        return [b for run in runs for b in run]

    def _op_release_deferred(self, op: Op) -> None:
        """Each kept batch, oldest first, released as a free would: group after group, each
        run tail first; with evict_first its cached blocks join the head run too."""
        batches, self._deferred = self._deferred, []
        for runs in batches:
            for run in runs:
                for b in run:
                    self.manager.state.deferred.remove(b)
                self.manager.state.release(run[::-1], evict_first=op["evict_first"])
        return None

    def _op_take_events(self, op: Op) -> dict[str, list[str]]:
        """The keys a consumer of every event believes cached: exactly the cache map's."""
        if not self.config.kv_events:
            raise InvalidTrace("take_events needs a config with kv_events on")
        return take_events_result({key for key, _ in self.manager.state.entries})

    def _op_reset_prefix_cache(self, op: Op) -> bool:
        if self.level == "api":
            return self.manager.reset_prefix_cache()
        if self.config.kv_connector or self.driver.in_flight:
            raise InvalidTrace("reset_prefix_cache at the scheduler level needs no step in "
                               "flight and a config without kv_connector")
        return self.driver.reset(op["reset_running_requests"])

    def _op_take_new_block_ids(self, op: Op) -> list[int]:
        return self.manager.take_new_block_ids()

    def _op_take_kv_cache_block_copies(self, op: Op) -> list[list[int]]:
        return [[src, dst] for src, dst in self.manager.take_kv_cache_block_copies()]

    def _op_new_step_starts(self, op: Op) -> None:
        self.manager.new_step_starts()
        return None

    def _op_release_copies(self, op: Op) -> None:
        self.manager.release_copies()
        return None

    # ----- scheduler level -----

    def _op_step(self, op: Op) -> dict[str, Any]:
        draft, accept = op["draft"], op["accept"]
        if not 0 <= draft <= self.manager.layout.max_model_len or (accept or 0) < 0:
            raise InvalidTrace(f"step: draft {draft} must be 0 to max_model_len "
                               f"({self.manager.layout.max_model_len}), accept {accept} null "
                               "or >= 0")
        if draft and self.driver.fixed:
            raise InvalidTrace(f"step: draft {draft} on a config with "
                               f"scheduler.num_speculative_tokens {self.driver.fixed}, whose "
                               "drafts are placed every step: draft must be 0")
        drafted = op["drafted"]
        if drafted and min(drafted.values()) < 0:
            raise InvalidTrace(f"step: drafted {drafted} must name counts >= 0")
        return self.driver.step(op["sample"], op["in_flight"], draft, accept, drafted)

    def _op_complete_step(self, op: Op) -> list[int]:
        if not self.driver.in_flight:
            raise InvalidTrace("complete_step: no step is in flight")
        return self.driver.complete()

    def _op_abort(self, op: Op) -> None:
        self.driver.stop(self._added(op["request_id"]), "FINISHED_ABORTED")
        return None

    def _op_load_remote(self, op: Op) -> Any:
        refusal = sync_failure_refusal(self.config, op)
        if refusal is not None:
            raise InvalidTrace(refusal)
        if op["num_external_tokens"] < 0:
            return MISUSE
        return self.driver.load(self._added(op["request_id"]), op["num_external_tokens"],
                                op["sync"], op["num_loaded_tokens"])

    def _op_finish_load(self, op: Op) -> Any:
        req = self._added(op["request_id"])
        loaded = op["num_loaded_tokens"]
        if req.request_id not in self.driver.loads or (loaded is not None and loaded < 0):
            return MISUSE
        return self.driver.load_done(req, loaded)

    def _op_finish(self, op: Op) -> None:
        self.driver.stop(self._added(op["request_id"]), "FINISHED_STOPPED")
        return None
