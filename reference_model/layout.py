"""Static facts derived from a config: per-group kinds and sizes, EAGLE flags, admission caps,
the hybrid spec groups and the pool-wide sizes (docs/spec.md §0.3, §2.5, §4.2, §4.3, §5.1, §5.5, §6.1)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvfuzz.core.config import FULL_ATTENTION_KINDS, Config, SchedulerConfig


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative a (docs/spec.md §0.1)."""
    return -(-a // b)


@dataclass(frozen=True)
class Group:
    """One KV cache group (one layer-3 manager)."""

    gid: int
    kind: str
    bs: int
    window: int
    """Sliding window w (sliding_window groups only, else 0)."""
    extra: int
    """extra_retained_tokens x (sliding_window groups only, else 0)."""
    chunk: int
    """attention_chunk_size c (chunked_local groups only, else 0)."""
    is_eagle_group: bool
    """Member of the EAGLE group set of docs/spec.md §5.1 step 3."""
    drops: bool
    """Actually drops the EAGLE block at lookup (use_eagle and an EAGLE group, §5.1 step 3)."""
    use_eagle: bool
    """The layer-3 manager's use_eagle flag (§5.4 unitary; §5.5 step 4 propagated per spec group)."""
    cap: int | None
    """Admission cap in blocks (§4.3), None for full and cross attention."""
    speculative: int = 0
    """Slots for draft-token states: num_speculative_blocks * bs (mamba groups, §11.2)."""
    variant: str = ""
    """The config kind where `kind` is "full" for a full-attention variant (mla, sink_full,
    rswa; §12.1): a different spec, so a hybrid looks it up as its own spec group."""
    sink: int = 0
    """Attention-sink tokens (sink_full groups only); the manager is full attention's."""
    rswa: int = 0
    """R-SWA decode window (rswa groups only, §12.2)."""
    align: bool = False
    """A mamba group in mamba_cache_mode "align" (§11.3)."""
    checkpoint_blocks: int = 0
    """num_prefill_checkpoint_blocks (mamba groups; read only in "align" mode, §11.6)."""
    checkpoint_alignment: int | None = None
    """prefill_checkpoint_alignment: the kernel exports a checkpoint this many tokens apart
    from a chunk's start (None: it cannot)."""

    @property
    def spec(self) -> tuple[str, int, int, int, int, str, int, int, int, bool, int, int | None]:
        """The KVCacheSpec fields; equal specs merge into one hybrid spec group (§5.5 step 4)."""
        return (self.kind, self.bs, self.window, self.extra, self.chunk, self.variant, self.sink,
                self.rswa, self.speculative, self.align, self.checkpoint_blocks,
                self.checkpoint_alignment)

    @property
    def checkpoints(self) -> bool:
        """The group reserves a prefill checkpoint block where a chunk can export one (§11.6)."""
        return self.align and self.checkpoint_blocks > 0

    @property
    def spec_blocks(self) -> int:
        """num_speculative_blocks (mamba groups)."""
        return self.speculative // self.bs

    def skipped(self, n: int) -> int:
        """get_num_skipped_tokens (§4.2): leading tokens no future token attends to."""
        if self.kind == "sliding_window":
            return max(0, n - self.window + 1 - self.extra)
        if self.kind == "chunked_local":
            return (n // self.chunk) * self.chunk
        if self.kind == "mamba":
            return max(n - 1, 0)
        return 0


@dataclass(frozen=True)
class SpecGroup:
    """Hybrid spec group: groups with equal specs, looked up jointly (§5.5 step 4)."""

    spec: Group
    """The first member; every member has the same kind and sizes."""
    gids: tuple[int, ...]
    use_eagle: bool
    """Some member drops the EAGLE block; propagated to every member's manager."""


@dataclass(frozen=True)
class Layout:
    """Everything about the manager that does not change while a trace runs."""

    groups: tuple[Group, ...]
    spec_groups: tuple[SpecGroup, ...]
    """Sorted spec groups of the hybrid coordinator; empty unless hybrid with caching on."""
    num_blocks: int
    max_model_len: int
    caching: bool
    hybrid: bool
    """Hybrid coordinator in use: caching on and more than one group (§5.6)."""
    hbs: int
    sbs: int
    alignment: int
    partial_hits: bool
    watermark_blocks: int
    scheduler: SchedulerConfig
    zeroing: bool = False
    """New attention blocks are recorded for the worker to zero: a mamba group shares the pool
    (its states are read before written, §11.2)."""
    retention: int | None = None
    """prefix_cache_retention_interval: which window blocks (§4.9.2) and state blocks (§11.3) get
    keys."""
    replay_eagle: bool = False
    """Replay boundaries follow EAGLE's (use_eagle)."""
    checkpoint_alignment: int | None = None
    """The driver's prefill checkpoint alignment (Config.prefill_checkpoint_alignment): set
    only when every state group is "align" with checkpoint blocks (§11.6)."""
    lookahead: int = 0
    """num_hash_lookahead_tokens: tokens after a hash block its key covers (§5.7)."""
    reprefillable: int = 0
    """max(0, num_prefill_lookahead − 1): computed tokens not yet final, never cached (§5.7)."""
    prefill_lookahead: int = 0
    """num_prefill_lookahead: no prefill chunk ends fewer tokens than this short of the end."""
    junction_states: bool = False
    """Config.shared_prefix_checkpoints: state groups also key the state at a request's
    junction, and a prompt chunk stops at the junction itself (§11.3)."""

    @classmethod
    def from_config(cls, config: Config) -> Layout:
        flagged = [g.eagle for g in config.groups]
        if config.use_eagle and not any(flagged):
            flagged = [True] * len(flagged)
        F, M = config.resolved_max_in_flight_tokens, config.max_model_len
        groups = []
        for gid, g in enumerate(config.groups):
            window = g.sliding_window or 0
            extra = g.extra_retained_tokens if g.kind == "sliding_window" else 0
            chunk = g.attention_chunk_size or 0
            cap: int | None = None
            if g.kind == "sliding_window":
                cap = cdiv(min(window - 1 + extra + F, M), g.block_size) + 1
            elif g.kind == "chunked_local":
                cap = cdiv(min(chunk + F, M), g.block_size)
            drops = config.use_eagle and flagged[gid]
            speculative = g.num_speculative_blocks * g.block_size
            kind, variant = ("full", g.kind) if g.kind in FULL_ATTENTION_KINDS else (g.kind, "")
            groups.append(
                Group(gid, kind, g.block_size, window, extra, chunk, flagged[gid], drops, drops,
                      cap, speculative, variant, g.sink_len or 0, g.rswa_window or 0,
                      g.kind == "mamba" and g.mamba_cache_mode == "align",
                      g.num_prefill_checkpoint_blocks if g.kind == "mamba" else 0,
                      g.prefill_checkpoint_alignment if g.kind == "mamba" else None)
            )
        hybrid = config.enable_caching and len(groups) > 1
        spec_groups: list[SpecGroup] = []
        if hybrid:
            members: dict[tuple[Any, ...], list[int]] = {}
            for g in groups:
                if g.kind != "circular_buffer":  # scratch: no part in lookups (§12.3)
                    members.setdefault(g.spec, []).append(g.gid)
            spec_groups = [
                SpecGroup(groups[gids[0]], tuple(gids), any(groups[m].drops for m in gids))
                for gids in members.values()
            ]
            spec_groups.sort(key=lambda sg: 0 if sg.spec.kind == "full" else 1)
            for sg in spec_groups:
                for m in sg.gids:
                    groups[m] = replace(groups[m], use_eagle=sg.use_eagle)
        return cls(
            groups=tuple(groups),
            spec_groups=tuple(spec_groups),
            num_blocks=config.num_blocks,
            max_model_len=M,
            caching=config.enable_caching,
            hybrid=hybrid,
            hbs=config.resolved_hash_block_size,
            sbs=config.scheduler_block_size,
            alignment=config.alignment_tokens,
            partial_hits=config.partial_hash_hits,
            watermark_blocks=int(config.watermark * config.num_blocks),
            scheduler=config.scheduler,
            zeroing=any(g.kind == "mamba" for g in groups),
            retention=config.prefix_cache_retention_interval,
            replay_eagle=config.use_eagle,
            checkpoint_alignment=config.prefill_checkpoint_alignment,
            lookahead=config.num_hash_lookahead_tokens,
            reprefillable=max(config.num_prefill_lookahead - 1, 0),
            prefill_lookahead=config.num_prefill_lookahead,
            junction_states=config.shared_prefix_checkpoints,
        )
