"""The rules that build valid ops from the execution's state, and the example loop of campaigns.

`ApiRules` plays the scheduler itself and makes layer-1 calls (lookups, admissions, decode
steps, frees, preemptions, cache/evict/reset, copies, and some API misuse); `SchedulerRules`
adds requests and runs steps of the scheduler driver. A rule reads the reference's state from the
`Execution`, takes its decisions from a choice source (`kvfuzz.fuzz.strategies`) and applies
its ops through the execution, which checks every invariant after every op. Only valid ops are
built, so no example is thrown away.

Two drivers share these rules: the Hypothesis state machines (`kvfuzz.fuzz.machines`, where
Hypothesis picks the rule and draws each decision) and `run_example`, the loop of both campaign
engines, which picks the rule and every decision from one byte string.

Swarm testing (`Swarm`): an example may leave out some rules and knobs (drawn first, from the
same bytes, so a replay of the example runs the same subset); the rules it keeps then get the
whole example. A knob left out keeps its default value. The swarm's decisions are read whether
swarm testing is on or not, so an example that keeps everything is the same in both.

Boundaries (`kvfuzz.fuzz.boundaries`): on a config with a watermark or a chunked-local group,
half the arrivals, admissions, growths and frees land at the edge that knob draws; with a hash
lookahead, half the prompts end where their tail block's partial key is promoted; with Mamba
prefill checkpoints, half the prompts put theirs on a block end far in, and half the
admissions stop where the last chunk starts next to the checkpoint's column. Connector
offers (`kvfuzz.fuzz.connector_offers`): on a KV connector config, three scheduler arrivals in
four copy an earlier prompt, whole or cut to whole blocks, and get a connector offer at once.
Align drafts (`kvfuzz.fuzz.align_drafts`): on a Mamba "align" config with a drafter, half the
spec steps taken while a decoding request sits short of a block end cross it with the most
drafts and reject them at the next step. Resumed checkpoints (`kvfuzz.fuzz.resumed_checkpoints`):
on a config with prefill checkpoint blocks, half the API level's samples, frees and admissions
make a request with outputs come back in one chunk whose checkpoint is a block end. State tails
(`kvfuzz.fuzz.state_tails`): with hash blocks of 1 and a Mamba "align" group, half the prompts
are 2 tokens long, so their state is keyed at token 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.core.sync_load_failures import (
    SEVERAL_GROUP_FAILURES,
    fails_sync_loads,
    several_groups,
)
from kvfuzz.core.snapshot import RequestView
from kvfuzz.fuzz import (
    align_drafts, boundaries, connector_offers, resumed_checkpoints, state_tails,
)
from kvfuzz.fuzz.strategies import (
    TOKEN_VOCAB, BytesChoices, Choices, Exhausted, between, extra_keys, flip, pick, prefixes,
    prompt, tokens, vary_config,
)
from kvfuzz.harness.executor import Execution

Views = list[tuple[str, RequestView]]


@dataclass(frozen=True)
class Swarm:
    """The rules and knobs one example may use (everything: `ALL`)."""

    off: frozenset[str] = frozenset()

    def on(self, feature: str) -> bool:
        return feature not in self.off


ALL = Swarm()
CONNECTOR_FEATURES = frozenset({"external", "load_remote", "finish_load", "short_load",
                                "sync_load"})
"""Rules and knobs of KV connector configs only (docs/spec.md §13)."""
IN_FLIGHT_FEATURES = frozenset({"step_in_flight", "complete_step"})
"""Rules of configs with deferred frees only: steps left in flight (docs/spec.md §7.1)."""
SPEC_FEATURES = frozenset({"step_spec"})
"""Rules of configs with a drafter only: steps that verify and propose drafts (spec decode)."""
EVENT_FEATURES = frozenset({"take_events", "reset_prefix_cache"})
"""Scheduler rules of configs with kv_events only (a reset also where focused), so that other
configs draw exactly as before."""
DATA_CHECKS = "kvfuzz.properties.data"
"""The module of the data checks (`--data`), which do not model the states of drafts."""
MAX_DRAFTS = 4
"""Drafts a request proposes per step, at most."""
MAX_BURST = 3
"""Requests that arrive together at most (`SchedulerRules.add_request`)."""
MAX_OUTPUTS = 16
"""A scheduler-level request's `max_tokens` at most. With one arrival per rule and at most 6
outputs, requests overlapped little: the pool ran dry in 7 % of `watermark`'s scheduler
examples and 2 % of `chunked_local`'s (13 % and 8 % with bursts and 16; docs/mutation.md)."""
MAX_STEPS_IN_FLIGHT = 2
"""As vLLM's async scheduling keeps at most two batches in flight."""


class Rules:
    """Shared plumbing: requests, views of the reference's state, rule choice."""

    level = "api"
    RULES: tuple[str, ...] = ()
    """The rule names, in the order a choice picks among them."""
    CORE: frozenset[str] = frozenset()
    """Rules every swarm keeps (without them an example does nothing)."""
    KNOBS: tuple[str, ...] = ()
    """Features of single ops a swarm may leave at their default."""
    max_requests = 8
    on_op: Callable[[Execution, Any], None] | None = None
    """Called after each op with the execution and the reference's snapshot before the op
    (`kvfuzz.fuzz.coverage.StateProbe.observe`)."""

    def __init__(self, execution: Execution, choices: Choices, *, allow_misuse: bool = True,
                 swarm: Swarm = ALL, focus: Iterable[str] = ()) -> None:
        self.execution = execution
        self.choices = choices
        self.allow_misuse = allow_misuse
        self.swarm = swarm
        self.focus = frozenset(focus)
        self.shared: list[list[int]] = [[0]]
        self.count = 0
        self.edges = boundaries.edges(execution.config)
        """The config's own boundaries, where some draws land (`kvfuzz.fuzz.boundaries`)."""

    @classmethod
    def features(cls, config: Config | None = None) -> tuple[str, ...]:
        """What a swarm may leave out: the optional rules, then the knobs (the connector's only
        on a connector config, so that other configs draw exactly as before)."""
        features = tuple(r for r in cls.RULES if r not in cls.CORE) + cls.KNOBS
        off = (frozenset() if config is not None and config.kv_connector else CONNECTOR_FEATURES)
        if config is None or not config.deferred_frees:
            off |= IN_FLIGHT_FEATURES
        if config is None or not has_drafter(config):
            off |= SPEC_FEATURES
        return tuple(f for f in features if f not in off)

    @classmethod
    def draw_swarm(cls, choices: Choices, keep: Iterable[str] = (),
                   config: Config | None = None) -> Swarm:
        """Half the examples keep every feature; the others leave each optional rule out with
        a probability p drawn per example, up to 1/2, and each knob with p/4 (as Hypothesis'
        own feature flags do, milder). Those in `keep` are always kept.

        Measured on the planted bugs (docs/engines.md, per-example rates): leaving rules out
        makes the others more frequent, which finds the plants that need a rule to be rare
        (watermark-ignored) sooner; leaving a knob out gained nothing measurable, and leaving a
        feature out costs every bug that needs it 1/(1 - P(left out)): these rates bound that
        cost to about 10 % for a plant that needs one rule or a few knobs.
        """
        p = max(0, choices.below(256) - 128)
        kept = set(keep)
        knobs = set(cls.KNOBS)
        return Swarm(frozenset(
            f for f in cls.features(config)
            if f not in kept and choices.below(256) < (p // 4 if f in knobs else p)
        ))

    @property
    def config(self) -> Config:
        return self.execution.config

    def start(self) -> None:
        """Draw the run's shared prompt prefixes."""
        self.shared = prefixes(self.choices, self.config.max_model_len // 2)

    def apply(self, **op: Any) -> Any:
        before = self.execution.state
        result = self.execution.apply(op)
        if self.on_op is not None:
            self.on_op(self.execution, before)
        return result

    def views(self, *statuses: str) -> Views:
        return [
            (rid, v) for rid, v in self.execution.state.requests.items() if v.status in statuses
        ]

    def can_add(self) -> bool:
        return self.count < self.max_requests

    def feasible(self, rule: str) -> bool:
        raise NotImplementedError

    def run_one(self) -> bool:
        """Run one rule, chosen among those this example's swarm keeps and that can run now
        (focused rules count three times); False when none can."""
        names = [r for r in self.RULES if self.swarm.on(r) and self.feasible(r)]
        if not names:
            return False
        names += [r for r in names if r in self.focus] * 2
        getattr(self, pick(self.choices, names))()
        return True

    def knob(self, feature: str, draw: Callable[[], Any], default: Any) -> Any:
        """`draw()` if this example's swarm keeps the knob, else its default."""
        return draw() if self.swarm.on(feature) else default

    def edge_prompt(self, tokens_in: list[int], longest: int) -> list[int]:
        """`tokens_in`, or an arrival steered to the config's edges: that prompt repeated or
        cut to the steered length (`boundaries.prompt_length`: the pool's free blocks less the
        driver's reserve, or whole chunks; else `boundaries.promoted_tail_length`, else
        `boundaries.checkpoint_length`, else `state_tails.prompt_length`)."""
        free = self.arrival_room()
        length = boundaries.prompt_length(self.choices, self.edges, free, longest)
        if length is None:
            length = boundaries.promoted_tail_length(self.choices, self.edges, len(tokens_in),
                                                     longest)
        if length is None:
            length = boundaries.checkpoint_length(self.choices, self.edges, len(tokens_in),
                                                  longest)
        if length is None:
            length = state_tails.prompt_length(self.choices, self.config)
        if length is None:
            return tokens_in
        return (tokens_in * (length // len(tokens_in) + 1))[:length]

    def steered_prompt(self) -> list[int] | None:
        """A prompt a level steers to a shape of its own, or None (the draw as it was)."""
        return None

    def arrival_room(self) -> int:
        """The blocks an arrival steered to an edge is sized to: the pool's free blocks less
        the driver's reserve."""
        return self.execution.state.num_free_blocks - self.config.scheduler.reserved_blocks

    def new_request(self, **extra: Any) -> str:
        c = self.choices
        rid = f"r{self.count}"
        self.count += 1
        max_len = self.config.max_model_len - 1
        salt = self.knob("salt", lambda: pick(c, (None, None, None, "a", "b")), None)
        encoder = between(c, 1, 12) if self.config.has_cross_attention else 0
        if self.execution.offers("prefix_cache_hit_limit"):
            # vLLM 0.34's per-request limit on prefix hits (prompt scoring): mostly unbounded.
            extra.setdefault("prefix_cache_hit_limit", self.knob(
                "hit_limit", lambda: pick(c, (None,) * 5 + (between(c, 0, max_len),)), None))
        tokens_in = self.steered_prompt() or self.edge_prompt(
            prompt(c, self.shared, max_len), max_len)
        if self.config.extra_keys:
            sizes = {self.config.resolved_hash_block_size}
            sizes.update(g.block_size for g in self.config.groups)
            extra = {**extra_keys(c, tokens_in, tuple(sorted(sizes))), **extra}
            if not self.execution.offers("mm_inputs"):
                extra.pop("mm_inputs", None)
        self.apply(
            op="add_request",
            request_id=rid,
            prompt=tokens_in,
            cache_salt=salt,
            num_encoder_tokens=encoder,
            **extra,
        )
        return rid


class ApiRules(Rules):
    """Layer-1 calls, with the rules playing the scheduler (docs/traces.md, API level)."""

    level = "api"
    RULES = ("add_request", "admit", "compute", "sample", "free", "housekeeping",
             "probe_cached_tokens")
    CORE = frozenset({"add_request", "admit", "compute"})
    KNOBS = ("skip_reading", "salt", "no_lookup", "adopt_only", "lookahead", "gate", "reserved",
             "idle", "preempt", "evict_blocks", "reset_prefix_cache", "take_copies",
             "cache_blocks", "release_copies", "misuse", "hit_limit", "lookup_bound", "external")

    @cached_property
    def checkpoints(self) -> resumed_checkpoints.Checkpoints | None:
        """The config's prefill checkpoints, where resumed requests are steered
        (`kvfuzz.fuzz.resumed_checkpoints`)."""
        return resumed_checkpoints.checkpoints(self.config)

    @property
    def _align(self) -> bool:
        """The config caches Mamba states (align mode)."""
        return self.config.enable_caching and any(
            g.mamba_cache_mode == "align" for g in self.config.groups)

    def feasible(self, rule: str) -> bool:
        if rule == "add_request":
            return self.can_add()
        if rule == "admit":
            return bool(self.views("WAITING", "PREEMPTED"))
        if rule == "compute":
            return bool(self._running(True))
        if rule == "sample":
            return bool(self._running(False))
        if rule == "free":
            return bool(self.views("RUNNING"))
        if rule == "probe_cached_tokens":
            return (bool(self.views("WAITING", "PREEMPTED"))
                    and self.execution.offers("get_num_cached_tokens"))
        return True  # housekeeping

    def add_request(self) -> None:
        c = self.choices
        skip = self.knob("skip_reading", lambda: pick(c, (False,) * 7 + (True,)), False)
        self.new_request(skip_reading_prefix_cache=skip)

    def admit(self) -> None:
        c = self.choices
        waiting = self.views("WAITING", "PREEMPTED")
        resuming = resumed_checkpoints.to_resume(c, self.checkpoints, waiting, self._prompts())
        rid, view = pick(c, resuming or waiting)
        # A resumed request steered onto a block-end checkpoint skips the lookup: the state its
        # prompt left would start the chunk past every checkpoint it can export.
        use_lookup = not resuming and self.knob(
            "no_lookup", lambda: pick(c, (True, True, True, False)), True)
        hit = 0
        if use_lookup:
            bound = None
            if self.execution.offers("max_cache_hit_length"):
                bound = self.knob("lookup_bound", lambda: pick(
                    c, (None, None, None, between(c, 0, view.num_tokens))), None)
            hit = self.apply(op="get_computed_blocks", request_id=rid,
                             max_cache_hit_length=bound)["num_computed_tokens"]
        remaining = view.num_tokens - hit
        least = 0 if hit and self.knob("adopt_only", lambda: flip(c), False) else 1
        # External tokens first: on a Mamba "align" config the chunk starts after them.
        external = self._external(remaining - least)
        computed = hit + external.get("num_external_computed_tokens", 0)
        resumed = self.checkpoints.resumed_chunk(
            computed, len(self.execution.requests[rid].prompt), view.num_tokens
        ) if resuming else None
        num_new_tokens = self._chunk(
            rid, view, computed, resumed or between(c, least, view.num_tokens - computed)
        )
        split = None if resumed else boundaries.checkpoint_split(c, self.edges, computed,
                                                                 view.num_tokens)
        if split is not None:
            num_new_tokens = self._chunk(rid, view, computed, split)
        knobs = {
            "num_new_tokens": num_new_tokens,
            "num_lookahead_tokens": self.knob("lookahead", lambda: between(c, 0, 2), 0),
            "full_sequence_must_fit": self.knob("gate", lambda: flip(c), False),
            "reserved_blocks": self.knob("reserved", lambda: between(c, 0, 2), 0),
            "has_scheduled_reqs": not self.knob("idle", lambda: flip(c), False),
        }
        steered = boundaries.admission(c, self.edges, self.execution.state.num_free_blocks,
                                       computed, least, view.num_tokens - computed)
        if steered is not None:
            knobs.update(steered, num_new_tokens=self._chunk(rid, view, computed,
                                                             steered["num_new_tokens"]))
        self.apply(
            op="allocate_slots",
            request_id=rid,
            **knobs,
            **external,
            use_lookup=use_lookup,
            num_encoder_tokens=self.execution.requests[rid].num_encoder_tokens,
        )

    def _prompts(self) -> dict[str, int]:
        return {rid: len(meta.prompt) for rid, meta in self.execution.requests.items()}

    def _external(self, room: int) -> dict[str, Any]:
        """On a connector config, some admissions take up to `room` external (KV connector)
        tokens, their blocks cached now or left for a later cache_blocks."""
        c = self.choices
        if not self.config.kv_connector or not room or not self.knob("external", lambda: flip(c),
                                                                      False):
            return {}
        return {"num_external_computed_tokens": between(c, 1, room),
                "delay_cache_blocks": flip(c)}

    def probe_cached_tokens(self) -> None:
        """vLLM 0.34's probe: P5 relates its answer to the lookup it predicts."""
        rid, _ = pick(self.choices, self.views("WAITING", "PREEMPTED"))
        self.apply(op="get_num_cached_tokens", request_id=rid)

    def _chunk(self, rid: str, view: RequestView, hit: int, n: int) -> int:
        """n, or on a Mamba "align" config the chunk the scheduler would cut from it (a state
        is written only at a chunk's end, so its key must name that end); the whole rest when
        that cut leaves nothing. No driver writes a junction at the api level: the cut has
        none (the default 0)."""
        if not self._align or n == 0:
            return n
        # Imported here: the atheris engine instruments kvcache, which must not be imported
        # before it is (this module is loaded first).
        from kvfuzz.kvcache.scheduler import mamba_block_aligned_split

        start = view.num_computed_tokens + hit
        sizes = (self.config.scheduler_block_size, self.config.resolved_hash_block_size,
                 self.config.partial_hash_hits, self.config.max_model_len, self.config.use_eagle,
                 self.config.prefill_checkpoint_alignment)
        prompt = len(self.execution.requests[rid].prompt)
        lookahead = {"num_hash_lookahead_tokens": self.config.num_hash_lookahead_tokens}
        return (mamba_block_aligned_split(start, n, prompt, view.num_tokens, *sizes, **lookahead)
                or mamba_block_aligned_split(start, view.num_tokens - start, prompt,
                                             view.num_tokens, *sizes, **lookahead))

    def _running(self, computing: bool) -> Views:
        max_len = self.config.max_model_len
        return [
            (rid, v)
            for rid, v in self.views("RUNNING")
            if (v.num_computed_tokens < v.num_tokens) == computing
            and (computing or v.num_tokens < max_len)
        ]

    def compute(self) -> None:
        c = self.choices
        rid, view = pick(c, boundaries.at_chunk_end(c, self.edges, self._running(True)))
        left = view.num_tokens - view.num_computed_tokens
        num_new_tokens = between(c, 1, left)
        steered = boundaries.growth(c, self.edges, view.num_computed_tokens, left)
        if steered is not None:
            num_new_tokens = steered[0]
        grown = self.apply(
            op="allocate_slots",
            request_id=rid,
            num_new_tokens=self._chunk(rid, view, 0, num_new_tokens),
            num_lookahead_tokens=(self.knob("lookahead", lambda: between(c, 0, 2), 0)
                                  if steered is None else steered[1]),
        )
        if steered is not None and steered[1] and grown is None:  # failed at a chunk end
            self.apply(op="free", request_id=rid, preempt=True)

    def sample(self) -> None:
        c = self.choices
        rid, view = pick(c, self._running(False))
        room = self.config.max_model_len - view.num_tokens
        steered = resumed_checkpoints.outputs(c, self.checkpoints, view,
                                              len(self.execution.requests[rid].prompt), room)
        self.apply(op="append_tokens", request_id=rid,
                   tokens=tokens(c, steered or between(c, 1, min(3, room))))

    def free(self) -> None:
        c = self.choices
        resumable = resumed_checkpoints.to_preempt(c, self.checkpoints, self.views("RUNNING"),
                                                   self._prompts())
        if resumable:
            self.apply(op="free", request_id=pick(c, resumable)[0], preempt=True)
            return
        rid, _ = pick(c, boundaries.at_chunk_end(c, self.edges, self.views("RUNNING")))
        if self.config.deferred_frees and flip(c):
            self.apply(op="free_deferred", request_id=rid)
            return
        self.apply(op="free", request_id=rid, preempt=self.knob("preempt", lambda: flip(c), False))

    def housekeeping(self) -> None:
        """The less frequent calls, behind one rule so the main ones dominate a run."""
        c = self.choices
        kinds = [k for k in ("evict_blocks", "reset_prefix_cache", "take_copies")
                 if self.swarm.on(k)]
        if self.swarm.on("cache_blocks") and self.views("RUNNING"):
            kinds.append("cache_blocks")
        if self.swarm.on("release_copies") and self.execution.state.retained_copies:
            kinds.append("release_copies")
        if self.allow_misuse and self.count and self.swarm.on("misuse"):
            kinds.append("misuse")
        if not kinds:
            kinds.append("take_copies")
        if self.config.kv_events:
            kinds += ["take_events"] * 2
        if self.config.deferred_frees:
            kinds += ["release_deferred"] * 2
        if self._align:
            kinds += ["new_step_starts"] * 3  # a state hit waits for the step after its write
        kinds += [k for k in kinds if k in self.focus] * 2
        kind = pick(c, kinds)
        if kind == "evict_blocks":
            n = between(c, 0, 3)
            ids = [between(c, 1, self.config.num_blocks - 1) for _ in range(n)]
            self.apply(op="evict_blocks", block_ids=ids)
        elif kind == "reset_prefix_cache":
            self.apply(op="reset_prefix_cache")
        elif kind == "take_copies":
            self.apply(op="take_kv_cache_block_copies")
            self.apply(op="take_new_block_ids")
        elif kind == "cache_blocks":
            rid, view = pick(c, self.views("RUNNING"))
            n = None if flip(c) else between(c, 0, view.num_computed_tokens)
            if n is not None and self._align:
                # A state key must name the state its block holds: only the computed count.
                n = None
            self.apply(op="cache_blocks", request_id=rid, num_computed_tokens=n)
        elif kind == "release_copies":
            self.apply(op="release_copies")
        elif kind == "take_events":
            self.apply(op="take_events")
        elif kind == "release_deferred":
            # vLLM 0.34's option: blocks another tier holds are the next evicted (F1).
            first = self.execution.offers("evict_first") and flip(c)
            self.apply(op="release_deferred", evict_first=first)
        elif kind == "new_step_starts":
            self.apply(op="new_step_starts")
        else:
            self._misuse()

    def _misuse(self) -> None:
        """Bad input must raise ValueError and change nothing (checked by I10)."""
        c = self.choices
        waiting = [rid for rid, _ in self.views("WAITING", "PREEMPTED")]
        running = [rid for rid, _ in self.views("RUNNING")]
        choices = ["evict_out_of_range"]
        if waiting:
            choices += ["zero_tokens"]
        if running:
            choices += ["negative_tokens"]
        if waiting and self.config.kv_connector:
            choices += ["negative_external"] * 2
        kind = pick(c, choices)
        if kind == "evict_out_of_range":
            self.apply(op="evict_blocks", block_ids=[self.config.num_blocks])
        elif kind == "zero_tokens":
            self.apply(op="allocate_slots", request_id=pick(c, waiting), num_new_tokens=0)
        elif kind == "negative_external":
            self.apply(op="allocate_slots", request_id=pick(c, waiting), num_new_tokens=1,
                       num_external_computed_tokens=-between(c, 1, 8))
        else:
            self.apply(op="allocate_slots", request_id=pick(c, running), num_new_tokens=-1)


class SchedulerRules(Rules):
    """Requests arrive, finish and abort while the scheduler driver runs steps."""

    level = "scheduler"
    RULES = ("add_request", "step", "step_again", "abort", "load_remote", "finish_load",
             "step_in_flight", "complete_step", "step_spec", "take_events", "reset_prefix_cache")
    """Two step rules: steps dominate the runs."""
    CORE = frozenset({"add_request", "step", "step_again"})
    KNOBS = ("salt", "priority", "max_tokens", "hit_limit", "short_load", "sync_load", "burst",
             "skip_reading")
    max_requests = 10
    copied: list[int] | None = None
    """The last arrival's prompt when it copied an earlier one (`steered_prompt`)."""

    @classmethod
    def features(cls, config: Config | None = None) -> tuple[str, ...]:
        off = frozenset() if config is not None and config.kv_events else EVENT_FEATURES
        return tuple(f for f in super().features(config) if f not in off)

    def feasible(self, rule: str) -> bool:
        if rule == "add_request":
            return self.can_add()
        if rule == "abort":
            return bool(self.views("WAITING", "PREEMPTED", "RUNNING", "WAITING_FOR_REMOTE_KVS"))
        if rule == "load_remote":
            return self.config.kv_connector and bool(self._loadable())
        if rule == "finish_load":
            return self.config.kv_connector and bool(self.execution.state.loads)
        if rule == "step_in_flight":
            return (self.config.deferred_frees and self.execution.offers("in_flight")
                    and len(self.execution.state.in_flight) < MAX_STEPS_IN_FLIGHT
                    and (self.execution.offers("in_flight_sampling") or not self._may_sample()))
        if rule == "complete_step":
            return bool(self.execution.state.in_flight)
        if rule == "step_spec":
            return has_drafter(self.config) and (
                bool(self.config.scheduler.num_speculative_tokens) or self.execution.offers("draft")
            ) and not (any(g.kind == "mamba" for g in self.config.groups) and any(
                c.module == DATA_CHECKS for c in self.execution.checks))
        if rule == "take_events":
            return self.config.kv_events
        if rule == "reset_prefix_cache":
            return ((self.config.kv_events or rule in self.focus) and not self.config.kv_connector
                    and not self.execution.state.in_flight)
        return True

    def _may_sample(self) -> bool:
        """Whether the next step may compute all of some request's tokens (and sample): a
        running one gets at most the budget, and one with more left than the budget leaves
        none to admit a waiting one with (which may hit all but its last token). A target
        whose steps in flight cannot sample as kvfuzz's driver's do (`in_flight_sampling` not
        offered: vLLM's synchronous Scheduler under pipeline parallelism) is given steps in
        flight only where none can."""
        budget = self.config.scheduler.token_budget
        running = [v.num_tokens - v.num_computed_tokens for _, v in self.views("RUNNING")]
        return any(left <= budget for left in running) or not running and bool(
            self.views("WAITING", "PREEMPTED", "WAITING_FOR_REMOTE_KVS"))

    def _loadable(self) -> Views:
        return [(rid, v) for rid, v in self.views("WAITING", "PREEMPTED")
                if not v.num_computed_tokens and not any(v.tables)]

    def arrival_room(self) -> int:
        """As `Rules.arrival_room`, less the blocks of the prompts waiting ahead of the
        arrival: the driver admits those first, so the arrival meets the edge at its own
        admission."""
        block = self.edges.block_size or 1
        waiting = sum(-(-v.num_tokens // block) * self.edges.groups
                      for _, v in self.views("WAITING", "PREEMPTED"))
        return super().arrival_room() - waiting

    def steered_prompt(self) -> list[int] | None:
        """On a connector config, half the arrivals copy an earlier prompt, whole or cut to
        whole blocks (`connector_offers`), and get a connector offer at once (`add_request`)."""
        earlier = [meta.prompt for meta in self.execution.requests.values()]
        self.copied = connector_offers.copied_prompt(
            self.choices, connector_offers.copy_block(self.config), earlier)
        return self.copied

    def load_remote(self) -> None:
        """A connector offers some of a waiting request's tokens (docs/spec.md §13.2)."""
        self._offer(*pick(self.choices, self._loadable()))

    def _offer(self, rid: str, view: RequestView) -> None:
        """A connector offer for `rid`, one in four loaded synchronously at its admission
        (§13.3)."""
        c = self.choices
        sync = self.knob("sync_load", lambda: c.below(4) == 0, False)
        external = between(c, 1, view.num_tokens)
        fails = {}
        if sync and self._sync_loads_fail():  # half of them fill part of their blocks
            loaded = pick(c, (None, between(c, 0, external)))
            fails = {} if loaded is None else {"num_loaded_tokens": loaded}
        self.apply(op="load_remote", request_id=rid, num_external_tokens=external,
                   **({"sync": True} if sync else {}), **fails)

    def _sync_loads_fail(self) -> bool:
        """Whether a synchronous load may fail here (docs/spec.md §13.3): a config it is valid
        on, no step in flight; under "recompute" where every target recomputes one as the
        driver does (the vLLM targets keep the failed blocks keyed, a tolerated deviation:
        docs/findings/029); on several groups where every target takes it (finding 031)."""
        return fails_sync_loads(self.config) and not self.config.deferred_frees and (
            self.config.scheduler.kv_load_failure_policy == "fail"
            or self.execution.offers("recomputed_sync_failures")) and (
            not several_groups(self.config) or self.execution.offers(SEVERAL_GROUP_FAILURES))

    def finish_load(self) -> None:
        """A load ends: whole, short or failed (0 tokens), as the choice decides."""
        c = self.choices
        rid = pick(c, self.execution.state.loads)
        loaded = self.knob("short_load", lambda: pick(c, (None, None, 0, between(c, 0, 8))),
                           None)
        self.apply(op="finish_load", request_id=rid, num_loaded_tokens=loaded)

    def add_request(self) -> None:
        """One request, or a burst of up to MAX_BURST arriving together (knob `burst`), each
        generating up to MAX_OUTPUTS tokens: requests then overlap enough that the pool runs
        dry, admissions meet the watermark and running requests are preempted."""
        c = self.choices
        for _ in range(self.knob("burst", lambda: between(c, 1, MAX_BURST), 1)):
            if not self.can_add():
                break
            rid = self.new_request(
                priority=self.knob("priority", lambda: between(c, 0, 2), 0),
                max_tokens=self.knob("max_tokens", lambda: between(c, 1, MAX_OUTPUTS), 4),
                # A request asking for prompt logprobs reads no cache (docs/spec.md §6.3).
                skip_reading_prefix_cache=self.knob(
                    "skip_reading", lambda: pick(c, (False,) * 7 + (True,)), False),
            )
            if self.copied is not None and self.swarm.on("load_remote"):
                self._offer(rid, self.execution.state.requests[rid])

    def step(self) -> None:
        self.apply(op="step", sample=self.choices.below(TOKEN_VOCAB))

    step_again = step

    def step_in_flight(self) -> None:
        """A step launched and left in flight until a `complete_step` (docs/spec.md §7.1)."""
        self.apply(op="step", sample=self.choices.below(TOKEN_VOCAB), in_flight=True)

    def complete_step(self) -> None:
        self.apply(op="complete_step")

    def step_spec(self) -> None:
        """A step of spec decode: the drafts it verifies are all kept, all rejected or the
        first few kept; each request that sampled proposes up to MAX_DRAFTS new ones (no more
        than the state groups keep blocks for, `Config.max_drafts`; fixed
        drafts: fills its placeholders), half the time some running requests fewer, as a
        drafter that finds fewer (n-gram) does (`drafted`). On a Mamba "align" config, half
        the time a decoding request sits short of a block end, the most drafts cross it and
        the next step rejects them and proposes none (`kvfuzz.fuzz.align_drafts`)."""
        c = self.choices
        fixed = self.config.scheduler.num_speculative_tokens  # placed every step: no draft
        sample = c.below(TOKEN_VOCAB)
        kept = self.config.max_drafts
        most = MAX_DRAFTS if kept is None else min(MAX_DRAFTS, kept)
        if not fixed and align_drafts.crosses_block_end(
                align_drafts.align_block_size(self.config), self.views("RUNNING"), most
        ) and flip(c):
            self.apply(op="step", sample=sample, draft=most, accept=0)
            self.apply(op="step", sample=c.below(TOKEN_VOCAB), accept=0)
            return
        draft = 0 if fixed else between(c, 0, most)
        accept = pick(c, (None, 0, between(c, 0, fixed or most)))
        drafted = {rid: between(c, 0, fixed or draft) for rid, _ in self.views("RUNNING")
                   if flip(c)} if flip(c) else None
        self.apply(op="step", sample=sample, draft=draft, accept=accept,
                   **({"drafted": drafted} if drafted is not None else {}))

    def take_events(self) -> None:
        self.apply(op="take_events")

    def reset_prefix_cache(self) -> None:
        """The engine resets the prefix cache, half the time preempting every running request
        first (`reset_running_requests`)."""
        self.apply(op="reset_prefix_cache", reset_running_requests=flip(self.choices))

    def abort(self) -> None:
        c = self.choices
        rid, _ = pick(c, self.views("WAITING", "PREEMPTED", "RUNNING", "WAITING_FOR_REMOTE_KVS"))
        self.apply(op=pick(c, ("abort", "finish")), request_id=rid)


FOCUS_OPS: dict[str, tuple[str, ...]] = {
    "add_request": ("add_request",),
    "get_computed_blocks": ("admit",),
    "get_num_cached_tokens": ("probe_cached_tokens",),
    "allocate_slots": ("admit", "compute"),
    "append_tokens": ("sample",),
    "free": ("free", "preempt"),
    "cache_blocks": ("housekeeping", "cache_blocks"),
    "evict_blocks": ("housekeeping", "evict_blocks"),
    "reset_prefix_cache": ("housekeeping", "reset_prefix_cache"),
    "take_kv_cache_block_copies": ("housekeeping", "take_copies"),
    "take_new_block_ids": ("housekeeping", "take_copies"),
    "release_copies": ("housekeeping", "release_copies"),
    "new_step_starts": ("housekeeping",),
    "step": ("step", "step_again", "step_in_flight", "step_spec"),
    "complete_step": ("complete_step",),
    "abort": ("abort",),
    "finish": ("abort",),
    "load_remote": ("load_remote",),
    "finish_load": ("finish_load",),
}
"""`--focus` op names (the trace's, docs/traces.md) and the rules and knobs that make them."""


def has_drafter(config: Config) -> bool:
    """Whether the generators propose and verify drafts on the config: its model drafts (EAGLE,
    lookahead slots or fixed drafts). With a state group they do so only without the data
    checks (a state group keeps one state per draft position in its speculative blocks, which
    the data checks do not model: docs/traces.md)."""
    return bool(config.use_eagle or config.scheduler.num_lookahead_tokens
                or config.scheduler.num_speculative_tokens)


def focus_features(ops: Iterable[str]) -> frozenset[str]:
    """The rules and knobs to favour for focused ops: swarms keep them, rule choice weighs
    them three times."""
    return frozenset(f for op in ops for f in FOCUS_OPS[op])


RULES_BY_LEVEL: dict[str, type[Rules]] = {"api": ApiRules, "scheduler": SchedulerRules}


def run_example(
    data: bytes,
    base: Config,
    level: str,
    *,
    steps: int,
    targets: tuple[Any, ...],
    model: bool = True,
    checks: tuple[Any, ...] | None = None,
    allow_misuse: bool = True,
    swarm: bool = True,
    focus: frozenset[str] = frozenset(),
    on_execution: Callable[[Execution], None] | None = None,
    vary: bool = True,
    on_op: Callable[[Execution, Any], None] | None = None,
    stop: Callable[[], None] | None = None,
) -> Execution | None:
    """One example of a campaign: every decision read from `data` (`BytesChoices`): the varied
    config, the swarm, the prompt prefixes, then up to `steps` rules. The example ends early,
    passing, when the bytes run out or no rule can run; a failed check raises `Counterexample`.
    `focus` holds rule and knob names (`focus_features`); `vary=False` keeps `base` as it is
    (a user's config file); `on_op` is told of every op (`Rules.on_op`); `stop` is the
    execution's (`Execution.stop`)."""
    choices = BytesChoices(data)
    rules_class = RULES_BY_LEVEL[level]
    try:
        config = vary_config(choices, base) if vary else base
        # Drawn even without swarm testing, so that an example that keeps everything is the
        # same example either way.
        chosen = rules_class.draw_swarm(choices, keep=focus, config=config)
        if not swarm:
            chosen = ALL
        execution = Execution(config, level, targets, model=model, checks=checks, stop=stop)
    except Exhausted:
        return None
    if on_execution is not None:
        on_execution(execution)
    rules = rules_class(execution, choices, allow_misuse=allow_misuse, swarm=chosen, focus=focus)
    rules.on_op = on_op
    try:
        rules.start()
        for _ in range(steps):
            if not rules.run_one():
                break
    except Exhausted:
        pass
    return execution
