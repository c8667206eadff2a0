"""The config a trace starts from: groups, pool size, policy knobs (docs/traces.md#config).

Plain data shared by every target and the reference model. Derived sizes follow docs/spec.md §0.3.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from kvfuzz.core.errors import ConfigError
from kvfuzz.core.limits import MAX_GROUPS, MAX_NUM_BLOCKS, MAX_SIZE, shown

GroupKind = Literal[
    "full", "sliding_window", "chunked_local", "cross", "mamba", "mla", "sink_full", "rswa",
    "circular_buffer", "encoder_only",
]
GROUP_KINDS: tuple[str, ...] = (
    "full", "sliding_window", "chunked_local", "cross", "mamba", "mla", "sink_full", "rswa",
    "circular_buffer", "encoder_only",
)
# Kinds vLLM manages as full attention (specs that subclass FullAttentionSpec).
FULL_ATTENTION_KINDS: tuple[str, ...] = ("full", "mla", "sink_full", "rswa")
# vLLM 0.34.0's MambaCacheMode (docs/spec.md §11).
MAMBA_CACHE_MODES: tuple[str, ...] = ("none", "align")
MAMBA_PREFIX_CACHING_REASON = "Mamba prefix caching requires mamba_cache_mode='align'"
POLICIES: tuple[str, ...] = ("fcfs", "priority")
# vLLM 0.34.0's Request.kv_cache_report_mode values (vllm/v1/request.py:130-134).
REPORT_MODES: tuple[str, ...] = ("incremental", "full")
LOAD_FAILURE_POLICIES: tuple[str, ...] = ("recompute", "fail")
"""What a KV connector load that ends short does (vLLM's `kv_load_failure_policy`)."""
IN_FLIGHT_SAMPLING_RULES: tuple[str, ...] = ("placeholders", "wait")
"""How a request whose sampling step is in flight is scheduled (docs/spec.md §7.1)."""
SELF_PREEMPTION_RULES: tuple[str, ...] = ("continue", "stop")
"""What the running loop does after a request preempted itself under priority (§7)."""
BLOCKED_WAITING_RULES: tuple[str, ...] = ("skip", "stop")
"""What the waiting loop does at a request whose chunk comes to no token (§7.2)."""
SETTLED_BLOCKS_RULES: tuple[str, ...] = ("at_output", "next_step")
"""When a Mamba hybrid's blocks its output settles are cached (§7)."""
LOOP_RULES: tuple[str, ...] = ("self_preemption", "blocked_waiting", "settled_blocks")
"""Scheduler fields an engine fixes (vLLM's release): a shrinker keeps them as they are."""
# vLLM 0.34.0's reasons (ModelConfig.is_prefix_caching_supported / is_chunked_prefill_supported)
# for a model with encoder-only (bidirectional) attention (docs/spec.md §12.4).
ENCODER_ONLY_CACHING_REASON = (
    "Pooling models with bidirectional attn do not support prefix caching."
)
ENCODER_ONLY_CHUNKING_REASON = (
    "Pooling models with bidirectional attn do not support chunked prefill."
)


def _int_in(where: str, value: Any, low: int, high: int = MAX_SIZE) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{where} must be an int in [{low}, {high}], got {shown(value)}")


def _positive_int(where: str, value: Any) -> None:
    _int_in(where, value, 1)


def _non_negative_int(where: str, value: Any) -> None:
    _int_in(where, value, 0)


def _text(where: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{where} must be text, got {value!r} (a lone surrogate)") from None


def _bool(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}")


@dataclass(frozen=True)
class GroupConfig:
    """One KV cache group: its attention kind and block size."""

    kind: GroupKind
    block_size: int
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    attention_chunk_size: int | None = None
    eagle: bool = False
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    sink_len: int | None = None
    rswa_window: int | None = None

    def _validate_prefill_checkpoints(self, where: str) -> None:
        """Checkpoint blocks: vLLM reads them only in "align" mode (its Mamba2 layers declare
        them in every mode); docs/spec.md §11.6."""
        _non_negative_int(f"{where}.num_prefill_checkpoint_blocks",
                          self.num_prefill_checkpoint_blocks)
        if self.prefill_checkpoint_alignment is not None:
            _positive_int(f"{where}.prefill_checkpoint_alignment",
                          self.prefill_checkpoint_alignment)

    def validate(self, where: str) -> None:
        if self.kind not in GROUP_KINDS:
            import difflib

            close = difflib.get_close_matches(str(self.kind), GROUP_KINDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}.kind must be one of {GROUP_KINDS}, got "
                              f"{shown(self.kind)}{hint}")
        _positive_int(f"{where}.block_size", self.block_size)
        _bool(f"{where}.eagle", self.eagle)
        if self.kind == "sliding_window":
            _positive_int(f"{where}.sliding_window", self.sliding_window)
            _non_negative_int(f"{where}.extra_retained_tokens", self.extra_retained_tokens)
        elif self.sliding_window is not None or self.extra_retained_tokens:
            raise ConfigError(f"{where}: sliding_window settings on a {self.kind!r} group")
        if self.kind == "chunked_local":
            _positive_int(f"{where}.attention_chunk_size", self.attention_chunk_size)
        elif self.attention_chunk_size is not None:
            raise ConfigError(f"{where}: attention_chunk_size on a {self.kind!r} group")
        if self.kind == "mamba":
            if not isinstance(self.mamba_cache_mode, str) or (
                self.mamba_cache_mode not in MAMBA_CACHE_MODES
            ):
                raise ConfigError(
                    f"{where}.mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, "
                    f"got {self.mamba_cache_mode!r}"
                )
            _non_negative_int(f"{where}.num_speculative_blocks", self.num_speculative_blocks)
            self._validate_prefill_checkpoints(where)
        elif (self.mamba_cache_mode != "none" or self.num_speculative_blocks
              or self.num_prefill_checkpoint_blocks or self.prefill_checkpoint_alignment is not None):
            raise ConfigError(f"{where}: mamba settings on a {self.kind!r} group")
        if self.kind == "sink_full":
            _positive_int(f"{where}.sink_len", self.sink_len)
            if self.sink_len % self.block_size:  # type: ignore[operator]
                raise ConfigError(
                    f"{where}.sink_len {self.sink_len} must be a multiple of block_size "
                    f"{self.block_size}"
                )
        elif self.sink_len is not None:
            raise ConfigError(f"{where}: sink_len on a {self.kind!r} group")
        if self.kind == "rswa":
            _positive_int(f"{where}.rswa_window", self.rswa_window)
        elif self.rswa_window is not None:
            raise ConfigError(f"{where}: rswa_window on a {self.kind!r} group")


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the scheduler driver (docs/traces.md#the-driver-step)."""

    policy: Literal["fcfs", "priority"] = "fcfs"
    token_budget: int = 32
    max_running: int = 4
    chunked_prefill: bool = True
    full_sequence_must_fit: bool = False
    num_lookahead_tokens: int = 0
    reserved_blocks: int = 0
    vocab_size: int = 4
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    """A KV load that ends short rolls back to its valid prefix ("recompute") or fails its
    request, FINISHED_ERROR, its blocks freed ("fail"; docs/spec.md §13.2)."""
    in_flight_sampling: Literal["placeholders", "wait"] = "placeholders"
    """A request whose sampling step is in flight is scheduled past the token still to come
    ("placeholders": vLLM's AsyncScheduler) or waits for the step's output ("wait": vLLM's
    Scheduler under pipeline parallelism; docs/spec.md §7.1)."""
    self_preemption: Literal["continue", "stop"] = "continue"
    """Under the priority policy, a running request that preempted itself (it was the least
    important) lets the running loop go on to the requests after it ("continue": vLLM 0.33+)
    or ends the loop ("stop": vLLM 0.32's `break`; docs/spec.md §7)."""
    blocked_waiting: Literal["skip", "stop"] = "skip"
    """A waiting request whose chunk its encoder inputs or the prefill lookahead cut to no
    token is passed over, keeping its place ("skip": vLLM 0.33+), or ends the waiting loop
    ("stop": vLLM 0.32's `break`; docs/spec.md §7.2)."""
    settled_blocks: Literal["at_output", "next_step"] = "at_output"
    """On a Mamba hybrid with prefix caching, the blocks a request's output settles (its
    accepted drafts; under hash lookahead, the block its sampled token completes) are cached
    right after the output ("at_output": vLLM 0.34's `update_from_output`) or by the
    request's next step ("next_step": 0.32, 0.33; docs/spec.md §7)."""
    num_speculative_tokens: int = 0
    """Placeholder drafts per step, as vLLM's async scheduling with a `SpeculativeConfig`:
    each request that samples gets this many, and a one-token admission is padded to them
    (docs/traces.md, "Fixed drafts"); 0: drafts come from the trace's `draft`."""
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    """Dynamic speculative decoding (vLLM's `SpeculativeConfig` field of that name): ranges
    `[first, last, k]` of a step's batch size (requests scheduled), each giving that many
    placeholder drafts, at most `num_speculative_tokens`, and no admission padded; None: every
    step `num_speculative_tokens` (docs/spec.md §7.3)."""
    encoder_budget: int | None = None
    """Encoder embeddings a step may compute for multimodal inputs (vLLM's
    `max_num_encoder_input_tokens`); None: unbounded (docs/spec.md §7.2)."""
    encoder_cache_size: int | None = None
    """Encoder embeddings the encoder cache holds (vLLM's `encoder_cache_size`); None:
    unbounded (docs/spec.md §7.2)."""
    async_scheduling: bool = False
    """Every step that samples counts its sampled tokens as output placeholders until its
    output is taken, as vLLM's AsyncScheduler does, so the encoder inputs its output releases
    end by `computed − placeholders`, the step's own included (docs/spec.md §7.2), and, with
    caching on, each output publishes the request's settled tokens (§7)."""

    def __post_init__(self) -> None:
        ranges = self.num_speculative_tokens_per_batch_size
        if isinstance(ranges, list) and all(isinstance(r, list | tuple) for r in ranges):
            object.__setattr__(self, "num_speculative_tokens_per_batch_size",
                               tuple(tuple(r) for r in ranges))

    def validate(self) -> None:
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ConfigError(f"scheduler.policy must be one of {POLICIES}, got {self.policy!r}")
        _positive_int("scheduler.token_budget", self.token_budget)
        _positive_int("scheduler.max_running", self.max_running)
        _bool("scheduler.chunked_prefill", self.chunked_prefill)
        _bool("scheduler.full_sequence_must_fit", self.full_sequence_must_fit)
        _bool("scheduler.async_scheduling", self.async_scheduling)
        _non_negative_int("scheduler.num_lookahead_tokens", self.num_lookahead_tokens)
        _non_negative_int("scheduler.reserved_blocks", self.reserved_blocks)
        _positive_int("scheduler.vocab_size", self.vocab_size)
        _non_negative_int("scheduler.num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens_per_batch_size is not None:
            _validate_drafts_per_batch_size(self.num_speculative_tokens_per_batch_size,
                                            self.num_speculative_tokens)
        for name in ("encoder_budget", "encoder_cache_size"):
            if getattr(self, name) is not None:
                _positive_int(f"scheduler.{name}", getattr(self, name))
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError(f"scheduler.kv_load_failure_policy must be one of "
                              f"{LOAD_FAILURE_POLICIES}, got {shown(self.kv_load_failure_policy)}")
        if self.in_flight_sampling not in IN_FLIGHT_SAMPLING_RULES:
            raise ConfigError(f"scheduler.in_flight_sampling must be one of "
                              f"{IN_FLIGHT_SAMPLING_RULES}, got {shown(self.in_flight_sampling)}")
        for name, rules in (("self_preemption", SELF_PREEMPTION_RULES),
                            ("blocked_waiting", BLOCKED_WAITING_RULES),
                            ("settled_blocks", SETTLED_BLOCKS_RULES)):
            if getattr(self, name) not in rules:
                raise ConfigError(f"scheduler.{name} must be one of {rules}, got "
                                  f"{shown(getattr(self, name))}")


def _validate_drafts_per_batch_size(ranges: Any, num_speculative_tokens: int) -> None:
    """vLLM's rules for `num_speculative_tokens_per_batch_size` (`validate_and_normalize_
    dynamic_sd_schedule`, vllm/v1/spec_decode/dynamic/utils.py in 0.32.0-0.34.0), and the
    fixed drafts it needs (its lookup refuses `num_speculative_tokens` 0)."""
    where = "scheduler.num_speculative_tokens_per_batch_size"
    if not isinstance(ranges, tuple) or not ranges:
        raise ConfigError(f"{where} must be a non-empty list of [first, last, k] batch-size "
                          f"ranges, got {shown(list(ranges) if ranges == () else ranges)}")
    for i, entry in enumerate(ranges):
        if len(entry) != 3:
            raise ConfigError(f"{where}[{i}] must be [first, last, k], got {shown(list(entry))}")
        _positive_int(f"{where}[{i}][0]", entry[0])
        _positive_int(f"{where}[{i}][1]", entry[1])
        _non_negative_int(f"{where}[{i}][2]", entry[2])
        if entry[0] > entry[1]:
            raise ConfigError(f"{where}[{i}]: range start {entry[0]} is above its end "
                              f"{entry[1]}")
    ordered = sorted(ranges)
    if ordered[0][0] != 1:
        raise ConfigError(f"{where}: the first range must start at batch size 1, got "
                          f"{ordered[0][0]}")
    for before, after in zip(ordered, ordered[1:]):
        if after[0] <= before[1]:
            raise ConfigError(f"{where}: ranges {list(before)} and {list(after)} overlap")
    if not num_speculative_tokens:
        raise ConfigError(f"{where} needs scheduler.num_speculative_tokens > 0 (the most "
                          f"drafts a step gets), got 0")


# Kinds whose KV a connector may load (docs/spec.md §13.1).
_CONNECTOR_KINDS = ("full", "mla", "sink_full", "sliding_window", "chunked_local", "rswa",
                    "mamba", "cross", "circular_buffer")


@dataclass(frozen=True)
class Config:
    """Everything a target needs to build its manager (and the driver) for a trace."""

    num_blocks: int
    groups: tuple[GroupConfig, ...]
    name: str = "custom"
    max_model_len: int = 128
    enable_caching: bool = True
    hash_block_size: int | None = None
    max_in_flight_tokens: int | None = None
    use_eagle: bool = False
    partial_hits: bool = False
    watermark: float = 0.0
    none_hash_seed: str = "kvfuzz"
    extra_keys: bool = False
    """Generators give requests LoRA adapters, multimodal inputs and prompt embeddings."""
    deferred_frees: bool = False
    """Generators free some requests in two steps: pop their blocks, release them later."""
    kv_events: bool = False
    """The manager queues KV cache events; `take_events` ops read them (docs/spec.md §3.10)."""
    kv_cache_report_mode: str = "incremental"
    """Every request's `kv_cache_report_mode`: "full" re-announces a prefix hit's blocks as
    BlockStored (docs/spec.md §3.10)."""
    prefix_cache_retention_interval: int | None = None
    """Sparse prefix-cache retention of sliding-window and Mamba "align" groups (docs/spec.md
    §4.9.2, §11.3): None dense, 0 only replay boundaries, R a segment end every R tokens and
    replay boundaries."""
    kv_connector: bool = False
    """Generators load some requests' KV from a simulated connector (docs/spec.md §13)."""
    num_hash_lookahead_tokens: int = 0
    """MTP / draft lookahead: each block hash also covers this many tokens after the block
    (docs/spec.md §5.7)."""
    num_prefill_lookahead: int = 0
    """Prefill tokens a multi-module MTP drafter reads past the computed ones: the last
    `num_prefill_lookahead − 1` computed tokens are never cached (docs/spec.md §5.7)."""
    enable_mamba_shared_prefix_checkpoint: bool = False
    """Mamba "align" groups also register the state at a request's shared-prefix junction,
    and the scheduler stops a prefill chunk at the junction itself (vLLM 0.34's option of the
    same name; it applies only with EAGLE groups, sub-block hits and no multi-module MTP,
    docs/spec.md §11.3)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        self.validate()

    # ----- derived sizes (docs/spec.md §0.3) -----

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(g.block_size for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def scheduler_block_size(self) -> int:
        return self.groups[0].block_size if not self.is_hybrid else math.lcm(*self.block_sizes)

    @property
    def cacheable_block_sizes(self) -> tuple[int, ...]:
        """Block sizes of the groups that take part in prefix caching (a circular buffer does
        not); all of them if none does."""
        sizes = tuple(g.block_size for g in self.groups if g.kind != "circular_buffer")
        return sizes or self.block_sizes

    @property
    def resolved_hash_block_size(self) -> int:
        if self.hash_block_size is not None:
            return self.hash_block_size
        if not self.is_hybrid:
            return self.groups[0].block_size
        if self.enable_caching:
            return math.gcd(*self.cacheable_block_sizes)
        return self.scheduler_block_size

    @property
    def shared_prefix_checkpoints(self) -> bool:
        """`enable_mamba_shared_prefix_checkpoint` in effect: also EAGLE groups (`use_eagle` or
        an `eagle` group), sub-block hits and no multi-module MTP (`num_prefill_lookahead` at
        most 1), as vLLM 0.34 narrows it (docs/spec.md §11.3)."""
        return (self.enable_mamba_shared_prefix_checkpoint and self.partial_hash_hits
                and (self.use_eagle or any(g.eagle for g in self.groups))
                and self.num_prefill_lookahead <= 1)

    @property
    def partial_hash_hits(self) -> bool:
        """Sub-block hits are on: forced by `partial_hits`, or as vLLM turns them on (caching,
        several groups, a Mamba "align" group with block_size > hbs, and every other cacheable
        group fine-grained (full attention kinds, mamba) or of block_size hbs; docs/spec.md
        §5.5)."""
        if self.partial_hits:
            return True
        if not (self.enable_caching and self.is_hybrid):
            return False
        hbs = self.resolved_hash_block_size
        if not any(g.kind == "mamba" and g.mamba_cache_mode == "align" and g.block_size > hbs
                   for g in self.groups):
            return False
        return all(g.kind in (*FULL_ATTENTION_KINDS, "mamba", "circular_buffer")
                   or g.block_size == hbs for g in self.groups)

    @property
    def prefill_checkpoint_alignment(self) -> int | None:
        """The alignment of Mamba prefill checkpoints when a prompt's last chunk exports its
        checkpoint mid-chunk (docs/spec.md §11.6), else None: as vLLM's scheduler decides, the
        first Mamba group's alignment, and only when every Mamba group is "align" with
        checkpoint blocks."""
        mamba = [g for g in self.groups if g.kind == "mamba"]
        if not mamba or not all(g.mamba_cache_mode == "align" and g.num_prefill_checkpoint_blocks
                                for g in mamba):
            return None
        return mamba[0].prefill_checkpoint_alignment

    @property
    def alignment_tokens(self) -> int:
        """Hit alignment: bs_0 for one group, hbs with partial hits, else sbs."""
        if not self.is_hybrid:
            return self.groups[0].block_size
        return (self.resolved_hash_block_size if self.partial_hash_hits
                else self.scheduler_block_size)

    @property
    def resolved_max_in_flight_tokens(self) -> int:
        if self.max_in_flight_tokens is None:
            return self.max_model_len
        return self.max_in_flight_tokens

    @property
    def has_cross_attention(self) -> bool:
        return any(g.kind == "cross" for g in self.groups)

    @property
    def max_drafts(self) -> int | None:
        """The most drafts a request may verify in a step where state groups keep a block per
        draft (vLLM sizes `num_speculative_blocks` to `num_speculative_tokens`, the drafter's
        most: a state group without any drafts none), or None: unbounded by the layout."""
        return min((g.num_speculative_blocks for g in self.groups if g.kind == "mamba"),
                   default=None)

    # ----- validation -----

    def validate(self) -> None:
        _text("name", self.name)
        _int_in("num_blocks", self.num_blocks, 2, MAX_NUM_BLOCKS)
        _int_in("max_model_len", self.max_model_len, 2)
        if not isinstance(self.groups, tuple) or not self.groups:
            raise ConfigError("groups must list at least one KV cache group")
        for i, group in enumerate(self.groups):
            if not isinstance(group, GroupConfig):
                raise ConfigError(f"groups[{i}] must be a group object, got {group!r}")
            group.validate(f"groups[{i}]")
        for flag in ("enable_caching", "use_eagle", "partial_hits", "extra_keys", "kv_events",
                     "deferred_frees", "kv_connector", "enable_mamba_shared_prefix_checkpoint"):
            _bool(flag, getattr(self, flag))
        if self.hash_block_size is not None:
            _positive_int("hash_block_size", self.hash_block_size)
        if self.max_in_flight_tokens is not None:
            _positive_int("max_in_flight_tokens", self.max_in_flight_tokens)
        _non_negative_int("num_hash_lookahead_tokens", self.num_hash_lookahead_tokens)
        _non_negative_int("num_prefill_lookahead", self.num_prefill_lookahead)
        if self.prefix_cache_retention_interval is not None:
            _int_in("prefix_cache_retention_interval", self.prefix_cache_retention_interval,
                    -MAX_SIZE)
        if not isinstance(self.watermark, (int, float)) or isinstance(self.watermark, bool) or (
            not 0 <= self.watermark <= 1  # also rejects NaN
        ):
            raise ConfigError(f"watermark must be a number in [0, 1], got {shown(self.watermark)}")
        _text("none_hash_seed", self.none_hash_seed)
        if self.kv_cache_report_mode not in REPORT_MODES:
            raise ConfigError(f"kv_cache_report_mode must be one of {', '.join(REPORT_MODES)}, "
                              f"got {shown(self.kv_cache_report_mode)}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError(f"scheduler must be a scheduler object, got {self.scheduler!r}")
        self.scheduler.validate()
        self._validate_sizes()
        self._validate_features()

    def _validate_sizes(self) -> None:
        if len(self.groups) > MAX_GROUPS:
            raise ConfigError(f"groups lists {len(self.groups)} groups, at most {MAX_GROUPS}")
        sbs, hbs = self.scheduler_block_size, self.resolved_hash_block_size
        if sbs > MAX_SIZE:
            raise ConfigError(f"the scheduler block size (the LCM of the block sizes "
                              f"{list(self.block_sizes)}) is {sbs}, at most {MAX_SIZE}")
        if sbs % hbs:
            raise ConfigError(
                f"hash_block_size {hbs} does not divide the scheduler block size {sbs}"
            )
        for i, g in enumerate(self.groups):
            if g.kind == "circular_buffer":
                continue  # scratch: never hashed
            if self.enable_caching and self.is_hybrid and g.block_size % hbs:
                raise ConfigError(
                    f"groups[{i}].block_size {g.block_size} is not a multiple of "
                    f"hash_block_size {hbs}"
                )
        if self.enable_caching and not self.is_hybrid and hbs != self.groups[0].block_size:
            raise ConfigError(
                f"hash_block_size {hbs} must equal the block size "
                f"{self.groups[0].block_size} of a single-group config with caching on"
            )

    def _validate_features(self) -> None:
        kinds = [g.kind for g in self.groups]
        if self.enable_caching and "cross" in kinds:
            raise ConfigError("a cross-attention group needs enable_caching false")
        if "encoder_only" in kinds:
            if self.enable_caching:
                raise ConfigError(f"an encoder_only group needs enable_caching false: "
                                  f"{ENCODER_ONLY_CACHING_REASON}")
            if self.scheduler.chunked_prefill:
                raise ConfigError(f"an encoder_only group needs scheduler.chunked_prefill "
                                  f"false: {ENCODER_ONLY_CHUNKING_REASON}")
        if self.enable_caching and self.is_hybrid and all(k == "circular_buffer" for k in kinds):
            raise ConfigError(
                "with enable_caching true a config with several groups needs one that is not a "
                "circular_buffer (vLLM: HybridKVCacheCoordinator requires at least one "
                "cacheable group)"
            )
        for i, g in enumerate(self.groups):
            if g.kind == "mamba" and self.enable_caching and g.mamba_cache_mode != "align":
                raise ConfigError(
                    f"groups[{i}] (mamba, mamba_cache_mode {g.mamba_cache_mode!r}) with "
                    f"enable_caching true: {MAMBA_PREFIX_CACHING_REASON}"
                )
        self._validate_retention(kinds)
        if self.kv_connector:
            for i, g in enumerate(self.groups):
                if g.kind not in _CONNECTOR_KINDS:
                    raise ConfigError(
                        f"kv_connector with groups[{i}] ({g.kind}): KV connector tokens are "
                        f"modelled on {', '.join(_CONNECTOR_KINDS)} groups only "
                        "(docs/spec.md §13.1)"
                    )
        if (self.enable_caching and (self.use_eagle or any(g.eagle for g in self.groups))
                and self.scheduler_block_size < self.num_prefill_lookahead):
            raise ConfigError(
                f"num_prefill_lookahead {self.num_prefill_lookahead} with EAGLE groups and "
                f"caching on: Multi-module MTP with prefix caching requires "
                f"scheduler_block_size (={self.scheduler_block_size}) >= "
                f"num_speculative_tokens (={self.num_prefill_lookahead})."
            )
        if self.use_eagle and self.num_hash_lookahead_tokens:
            raise ConfigError(
                f"use_eagle with num_hash_lookahead_tokens {self.num_hash_lookahead_tokens}: "
                "vLLM never builds a manager that hashes ahead and drops EAGLE's block "
                "(lookahead hashes prove the boundary token, so its Scheduler clears the drop; "
                "docs/spec.md §5.7): set use_eagle false, or num_hash_lookahead_tokens 0 for "
                "the drop instead (vLLM's disable_lookahead_block_hashes)")
        if self.scheduler.num_speculative_tokens and (self.kv_connector or "mamba" in kinds):
            raise ConfigError(
                "scheduler.num_speculative_tokens with kv_connector or a mamba group: the "
                "drafts' reserved blocks of an async load and the states of speculative blocks "
                "are not modelled (docs/traces.md, \"Fixed drafts\")")
        if self.use_eagle and "chunked_local" in kinds:
            raise ConfigError("use_eagle is not supported with a chunked_local group")
        if self.enable_caching and self.is_hybrid:
            for i, g in enumerate(self.groups):
                if g.kind == "chunked_local" and g.block_size != self.alignment_tokens:
                    raise ConfigError(
                        f"groups[{i}] (chunked_local) block_size {g.block_size} must equal "
                        f"the hit alignment {self.alignment_tokens}"
                    )
        if self.partial_hits:
            if not self.enable_caching or not self.is_hybrid:
                raise ConfigError("partial_hits needs enable_caching and at least two groups")
            hbs = self.resolved_hash_block_size
            for i, g in enumerate(self.groups):
                if g.kind not in ("full", "mamba", "circular_buffer") and g.block_size != hbs:
                    raise ConfigError(
                        f"partial_hits: groups[{i}] ({g.kind}) block_size {g.block_size} "
                        f"must equal hash_block_size {hbs}"
                    )

    def _validate_retention(self, kinds: list[str]) -> None:
        """vLLM's rules for the retention interval, with its messages (docs/spec.md §4.9.2)."""
        retention = self.prefix_cache_retention_interval
        if retention is None:
            return
        if "sliding_window" not in kinds and "mamba" not in kinds:
            if retention == 0:
                return
            raise ConfigError(
                "prefix_cache_retention_interval is set but this model has no sliding-window "
                "or Mamba KV cache group, so retention has no effect. Set it to 0 (it only "
                "applies to sliding-window and Mamba attention)."
            )
        sbs = self.scheduler_block_size
        if retention < 0 or retention % sbs:
            raise ConfigError(
                f"prefix_cache_retention_interval ({retention}) must be non-negative and a "
                f"multiple of scheduler_block_size ({sbs})."
            )

    # ----- (de)serialisation -----

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready data, defaults left out."""
        return _non_defaults(self)

    @classmethod
    def from_dict(cls, data: Any) -> Config:
        """Build and validate a config; unknown or mistyped fields raise ConfigError."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be an object, got {type(data).__name__}")
        _reject_unknown("config", data, cls)
        kwargs = dict(data)
        if "num_blocks" not in kwargs or "groups" not in kwargs:
            raise ConfigError("config needs num_blocks and groups")
        groups = kwargs["groups"]
        if not isinstance(groups, list):
            raise ConfigError(f"groups must be a list, got {groups!r}")
        parsed = []
        for i, g in enumerate(groups):
            if not isinstance(g, dict):
                raise ConfigError(f"groups[{i}] must be an object, got {g!r}")
            _reject_unknown(f"groups[{i}]", g, GroupConfig)
            if "kind" not in g or "block_size" not in g:
                raise ConfigError(f"groups[{i}] needs kind and block_size")
            parsed.append(GroupConfig(**g))
        kwargs["groups"] = tuple(parsed)
        if "scheduler" in kwargs:
            sched = kwargs["scheduler"]
            if not isinstance(sched, dict):
                raise ConfigError(f"scheduler must be an object, got {sched!r}")
            _reject_unknown("scheduler", sched, SchedulerConfig)
            kwargs["scheduler"] = SchedulerConfig(**sched)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


def _reject_unknown(where: str, data: dict[str, Any], cls: type) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        import difflib

        hints = [f"{name!r} (did you mean {close[0]!r}?)" if (
            close := difflib.get_close_matches(str(name), sorted(known), n=1)) else repr(name)
                 for name in unknown]
        raise ConfigError(f"{where}: unknown field(s) {', '.join(hints)}")


def _non_defaults(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, tuple) and all(dataclasses.is_dataclass(v) for v in value):
            out[f.name] = [_non_defaults(v) for v in value]
            continue
        if dataclasses.is_dataclass(value):
            nested = _non_defaults(value)
            if nested:
                out[f.name] = nested
            continue
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        if default is dataclasses.MISSING or value != default:
            out[f.name] = value
    return out
