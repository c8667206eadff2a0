"""Target `vllm`: the installed vLLM's own v1 KV cache manager, driven through the shared harness.

What the install offers is probed by `vllm_api.load_vllm()` (never by version string); this
module builds the manager and requests from a config with what was found, and lists the
known deviations, each with the features (release range) it applies to. Importing vLLM costs
seconds, so nothing is imported until a side is built or checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.extra_keys import Extras, lora_path
from kvfuzz.core.trace import Op
from kvfuzz.kvcache.single_type_kv_cache_manager import MambaManager
from kvfuzz.harness.manager_side import ManagerSide
from kvfuzz.harness.reading import packed_key
from kvfuzz.harness.router_hash import BlockChain, vllm_chain
from kvfuzz.harness.tolerance import Tolerance
from kvfuzz.harness.vllm_api import (
    FEATURES,
    VllmApi,
    VllmUnavailable,
    VllmUnsupported,
    check_vllm,
    load_vllm,
)
from kvfuzz.core.snapshot import RequestView, Snapshot


def vllm_available() -> bool:
    """Whether an installed vLLM that this adapter can drive imports in this Python."""
    try:
        load_vllm()
    except VllmUnavailable:
        return False
    return True


def _spec(group: GroupConfig, v: VllmApi) -> Any:
    iface = v["interface"]
    common = {"block_size": group.block_size, "num_kv_heads": 1, "head_size": 8, "dtype": v["dtype"]}
    if group.kind == "full":
        return iface.FullAttentionSpec(**common)
    if group.kind == "sliding_window":
        return iface.SlidingWindowSpec(
            **common,
            sliding_window=group.sliding_window,
            extra_retained_tokens=group.extra_retained_tokens,
        )
    if group.kind == "chunked_local":
        return iface.ChunkedLocalAttentionSpec(
            **common, attention_chunk_size=group.attention_chunk_size
        )
    if group.kind == "circular_buffer":
        return iface.CircularBufferSpec(**common)
    if group.kind == "mla":
        return iface.MLAAttentionSpec(**common)
    if group.kind == "sink_full":
        return iface.SinkFullAttentionSpec(**common, sink_len=group.sink_len)
    if group.kind == "rswa":
        return iface.RSWASpec(**common, rswa_window=group.rswa_window)
    if group.kind == "mamba":
        # One small state tensor per block; the manager reads only block counts.
        return iface.MambaSpec(
            block_size=group.block_size,
            shapes=((8,),),
            dtypes=(v["dtype"],),
            mamba_cache_mode=group.mamba_cache_mode,
            num_speculative_blocks=group.num_speculative_blocks,
            **_prefill_checkpoint_fields(group),
        )
    return iface.CrossAttentionSpec(**common)


def _checkpoint_block(single: Any, request_id: str, start: int, end: int, prefill_end: int,
                      gate: bool) -> int:
    """1 when vLLM's Mamba manager reserves a prefill checkpoint block for this step: what its
    count just recorded, or for the full-sequence gate (which records nothing) its rule."""
    if not gate:
        return int(request_id in getattr(single, "_checkpoints", ()))
    needs = getattr(single, "_needs_internal_checkpoint", None)
    if needs is None:
        return 0
    module = importlib.import_module(type(single).__module__)
    position = module.get_mamba_prefill_checkpoint_position(
        end, single.cache_hit_alignment_tokens, single.drop_eagle_checkpoint_block)
    return int(needs(request_id, start, end, position, prefill_end))


def _prefill_checkpoint_fields(group: GroupConfig) -> dict[str, Any]:
    """A Mamba group's checkpoint settings, left out at their defaults so that a vLLM without
    them builds the spec (`VllmTarget.build_manager` refuses them set on such a vLLM)."""
    if not group.num_prefill_checkpoint_blocks and group.prefill_checkpoint_alignment is None:
        return {}
    return {"num_prefill_checkpoint_blocks": group.num_prefill_checkpoint_blocks,
            "prefill_checkpoint_alignment": group.prefill_checkpoint_alignment}


def vllm_group_ids(config: Config) -> tuple[int, ...]:
    """The config groups vLLM builds a KV cache group for: not encoder-only ones, whose layers
    return no spec (`Attention.get_kv_cache_spec`), so no manager is registered for them."""
    return tuple(i for i, g in enumerate(config.groups) if g.kind != "encoder_only")


@contextlib.contextmanager
def _partial_hits_forced(v: VllmApi, on: bool) -> Iterator[None]:
    """vLLM enables fine-grained hits only beside Mamba "align" groups; force them on."""
    if not on:
        yield
        return
    coordinator = v["coordinator"]
    original = coordinator.partial_hash_hits_enabled
    coordinator.partial_hash_hits_enabled = lambda *args, **kwargs: True
    try:
        yield
    finally:
        coordinator.partial_hash_hits_enabled = original


def build_kv_cache_config(config: Config) -> Any:
    """The installed vLLM's KVCacheConfig for a harness config (one layer per group)."""
    v = load_vllm()
    iface = v["interface"]
    retention = ({"prefix_cache_retention_interval": config.prefix_cache_retention_interval}
                 if v.has("retention") else {})
    return iface.KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        **retention,
        kv_cache_groups=[
            iface.KVCacheGroupSpec([f"layer.{i}"], _spec(config.groups[i], v),
                                   is_eagle_group=config.groups[i].eagle)
            for i in vllm_group_ids(config)
        ],
    )


def build_vllm_manager(config: Config) -> Any:
    """The installed vLLM's KVCacheManager for a harness config."""
    v = load_vllm()
    kv_cache_config = build_kv_cache_config(config)
    with _partial_hits_forced(v, config.partial_hits):
        return v["KVCacheManager"](
            kv_cache_config,
            max_model_len=config.max_model_len,
            scheduler_block_size=config.scheduler_block_size,
            hash_block_size=config.resolved_hash_block_size,
            max_in_flight_tokens=config.max_in_flight_tokens,
            enable_caching=config.enable_caching,
            use_eagle=config.use_eagle,
            watermark=config.watermark,
            **({"enable_kv_cache_events": True} if config.kv_events else {}),
            **_lookahead_arguments(config),
            **({"enable_mamba_shared_prefix_checkpoint": True}
               if config.enable_mamba_shared_prefix_checkpoint else {}),
        )


def _lookahead_arguments(config: Config) -> dict[str, int]:
    """The MTP / draft lookahead arguments the config sets (docs/spec.md §5.7), passed only
    when set: a release without them is never asked (`VllmSide.build_manager` refuses)."""
    return {name: getattr(config, name)
            for name in ("num_hash_lookahead_tokens", "num_prefill_lookahead")
            if getattr(config, name)}


@dataclass(frozen=True)
class KnownDeviation:
    """A documented way vLLM differs from docs/spec.md, which target `vllm` tolerates.

    `tolerate(snapshot, config)` returns the snapshot with exactly that difference undone and
    the request ids it was undone for; everything else is still compared and checked.
    `applies(api)` says, from the probed features, whether the installed vLLM has it;
    `releases` names that range for docs and reports.
    """

    name: str
    finding: str
    """The finding document (docs/findings/) that describes it."""
    tolerate: Callable[[Snapshot, Config], tuple[Snapshot, list[str]]]
    releases: str = "0.32–0.34"
    applies: Callable[[VllmApi], bool] = lambda api: True
    unbuildable: Callable[[BaseException], bool] | None = None
    """For a manager vLLM cannot build: whether an exception raised building it is this one
    (`VllmSide.tolerated_build`); the config then cannot run on `vllm` at all."""

    @property
    def id(self) -> str:
        """The finding's number (`013`), by which `--tolerate` names it."""
        return self.finding.rsplit("/", 1)[-1].split("-", 1)[0]

    @property
    def label(self) -> str:
        return f"{self.id} {self.name}"


_WINDOW_KINDS = ("sliding_window", "chunked_local")


def _drop_empty_window_entries(snapshot: Snapshot, config: Config) -> tuple[Snapshot, list[str]]:
    """An empty window-group table of a request that is not running reads as no entry: vLLM's
    `remove_skipped_blocks` inserts it when a first allocate_slots is refused (docs/spec.md §10.1).
    Mode "none" state groups skip too: external tokens reach them on a first allocation (an
    "align" group's entry is 013's).
    """
    return _drop_empty_entries(
        snapshot, {g for g, group in enumerate(config.groups)
                   if group.kind in _WINDOW_KINDS
                   or group.kind == "mamba" and group.mamba_cache_mode != "align"}
    )


def _drop_empty_state_entries(snapshot: Snapshot, config: Config) -> tuple[Snapshot, list[str]]:
    """An empty Mamba "align" table of a request that is not running reads as no entry: vLLM's
    align-mode predictor inserts it (docs/findings/013)."""
    return _drop_empty_entries(
        snapshot, {g for g, group in enumerate(config.groups)
                   if group.kind == "mamba" and group.mamba_cache_mode == "align"}
    )


def _drop_empty_entries(snapshot: Snapshot, windows: set[int]) -> tuple[Snapshot, list[str]]:
    """Empty tables of the given groups, for requests that are not running, read as None."""
    changed: dict[str, RequestView] = {}
    for rid, view in snapshot.requests.items():
        if view.status == "RUNNING" or not any(view.tables[g] == () for g in windows):
            continue
        tables = tuple(
            None if g in windows and table == () else table for g, table in enumerate(view.tables)
        )
        changed[rid] = dataclasses.replace(view, tables=tables)
    if not changed:
        return snapshot, []
    return dataclasses.replace(snapshot, requests={**snapshot.requests, **changed}), list(changed)


def _zero_null_ref_cnt(snapshot: Snapshot, config: Config) -> tuple[Snapshot, list[str]]:
    """The null block (block 0) reads with ref_cnt 0: vLLM 0.32's touch and free_blocks move it."""
    if not snapshot.ref_cnt or snapshot.ref_cnt[0] == 0:
        return snapshot, []
    return dataclasses.replace(snapshot, ref_cnt=(0, *snapshot.ref_cnt[1:])), ["null block"]


def _no_snapshot_change(snapshot: Snapshot, config: Config) -> tuple[Snapshot, list[str]]:
    return snapshot, []


def _sink_manager_rejects_zeroing(exc: BaseException) -> bool:
    """vLLM's SinkFullAttentionManager refuses the `needs_kv_cache_zeroing` keyword every
    manager is built with (docs/findings/012)."""
    return (isinstance(exc, TypeError) and "SinkFullAttentionManager" in str(exc)
            and "needs_kv_cache_zeroing" in str(exc))


EMBEDS_MASK = "embeds-mask-unkeyed"
"""vLLM keys a block's prompt embeddings without the token-id mask (docs/findings/010): `vllm`
fills token positions of the embedding tensor with a value no embedding takes (-1.0), so the
tensor alone tells them apart; `vllm-strict` fills them with 0.0."""

REMOVED_WHILE_HELD = "removed-while-held"
"""vLLM emits BlockRemoved for each evicted copy of a key, even while another block still
holds it (docs/findings/011): `vllm` drops such removals when it reads the events."""

STATE_TAIL_REKEYED = "state-tail-rekeyed"
"""vLLM 0.32 marks a state already keyed at the prompt's tail as cached again, deferring hits on
it (docs/findings/014): `vllm` gives its state managers 0.33's "already keyed" return."""

CHECKPOINT_START_KEYED = "checkpoint-start-keyed"
"""vLLM keys the block that a prefill chunk reserving a checkpoint resumed from inside at that
block's end, though it holds the state at the chunk's start (docs/findings/020): `vllm` leaves
that block unkeyed, as kvcache does."""

JUNCTION_START_KEYED = "junction-start-keyed"
"""vLLM keys the block that a prefill chunk cut at its shared-prefix junction resumed from
inside at that block's end, though it holds the state at the chunk's start
(docs/findings/021): `vllm` leaves that block unkeyed, as kvcache does."""

JUNCTION_EAGLE_UNKEPT = "junction-eagle-block-unkept"
"""vLLM 0.32's retention masks keep the blocks at a request's shared-prefix junction but, under
EAGLE, not the block one below it, where a diverging sibling's hit lands (docs/findings/022):
`vllm` keeps it, as 0.33+ and kvcache do."""

EXTERNAL_STATE_UNCOUNTED = "external-state-block-uncounted"
"""vLLM's align-mode predictor caps a first allocation at one state block even when external
tokens take a block of their own, and counts hit states the external tokens pass
(docs/findings/017): `vllm` gives its align managers the exact count of such allocations."""

CHECKPOINT_RECORD_KEPT = "checkpoint-record-kept"
"""vLLM's align-mode count records a request's prefill checkpoint (or forgets it) before the
capacity check, so a refused allocate_slots leaves a record no step allocated, which a later
cache_blocks reads (docs/findings/019): `vllm` restores the record a refused allocation
changed."""

CHECKPOINT_AMONG_DRAFTS = "checkpoint-among-drafts"
"""vLLM's align-mode count reserves a prefill checkpoint for a step that verifies drafts, at a
position among them that the worker never writes, whose hash does not exist: cache_blocks
asserts (docs/findings/035). `vllm` reserves none there, as kvcache does."""

STORED_SPANS_NULLS = "stored-event-spans-null-blocks"
"""vLLM's BlockStored keys only its range's real, unmasked blocks but sends the token ids of
the whole range, chained on the position before it (docs/findings/026: a Mamba "align" group's
nulls, a retention mask's unkept blocks): `vllm` splits such an event into one per run of keyed
blocks, each with its own parent and token ids, and drops one that keys nothing, as kvcache
sends them."""

HIT_REPORT_NULLS = "hit-report-names-null-blocks"
"""vLLM's full-mode re-announcement of a hit names the keys of the whole hit list from token 0,
its null placeholders' included (docs/findings/027: a sliding window's blocks before the
window, whose keys may have been evicted): `vllm` splits it into one event per run of the
hit's real blocks, each chained on the position before the run with that run's token ids, as
kvcache sends them."""

ALIGN_COUNT_NEGATIVE = "align-count-negative"
"""vLLM's Mamba "align" count of new blocks goes negative once rejected drafts leave a
request's table longer than its step needs (docs/findings/028): `vllm` floors that count at 0,
as kvcache and the model do (docs/spec.md §11.3)."""

KNOWN_DEVIATIONS: tuple[KnownDeviation, ...] = (
    KnownDeviation(
        "empty-window-entry",
        "docs/findings/001-empty-window-entry.md",
        _drop_empty_window_entries,
    ),
    # A manager vLLM cannot build: the config is left out (`VllmSide.tolerated_build`).
    KnownDeviation(
        "sink-full-attention-unbuildable",
        "docs/findings/012-sink-full-attention-unbuildable.md",
        _no_snapshot_change,
        unbuildable=_sink_manager_rejects_zeroing,
    ),
    KnownDeviation(
        "empty-state-entry",
        "docs/findings/013-empty-state-entry.md",
        _drop_empty_state_entries,
    ),
    KnownDeviation(
        "null-block-ref-count",
        "docs/findings/007-null-block-ref-count.md",
        _zero_null_ref_cnt,
        releases="0.32",
        applies=lambda api: api.has("null_ref_counted"),
    ),
    # A result, not a snapshot: `VllmSide.num_cached_tokens` undoes it (see there).
    KnownDeviation(
        "probe-ignores-hit-limit",
        "docs/findings/008-probe-ignores-hit-limit.md",
        _no_snapshot_change,
        releases="0.34",
        applies=lambda api: api.has("cached_tokens_probe") and api.has("request_hit_limit"),
    ),
    KnownDeviation(
        REMOVED_WHILE_HELD,
        "docs/findings/011-block-removed-while-held.md",
        _no_snapshot_change,
        releases="0.33–0.34",
        applies=lambda api: api.has("kv_events"),
    ),
    KnownDeviation(
        EMBEDS_MASK,
        "docs/findings/010-prompt-embeds-mask-unkeyed.md",
        _no_snapshot_change,
        releases="0.33–0.34",
        applies=lambda api: api.has("prompt_embeds_mask"),
    ),
    # A manager method, not a snapshot: `VllmSide.build_manager` undoes it (see there).
    KnownDeviation(
        STATE_TAIL_REKEYED,
        "docs/findings/014-state-tail-rekeyed.md",
        _no_snapshot_change,
        releases="0.32",
        applies=lambda api: api.has("state_tail_rekeyed"),
    ),
    # A manager method, not a snapshot: `VllmSide.build_manager` undoes it (see there).
    KnownDeviation(
        CHECKPOINT_START_KEYED,
        "docs/findings/020-checkpoint-chunk-keys-start-state.md",
        _no_snapshot_change,
        releases="0.32–0.34",
        applies=lambda api: api.has("prefill_checkpoints"),
    ),
    # A manager method, not a snapshot: `VllmSide.build_manager` undoes it (see there).
    KnownDeviation(
        JUNCTION_START_KEYED,
        "docs/findings/021-junction-chunk-keys-start-state.md",
        _no_snapshot_change,
        releases="0.32–0.34",
        applies=lambda api: api.has("prefill_checkpoints"),
    ),
    # A manager method, not a snapshot: `VllmSide.build_manager` undoes it (see there).
    KnownDeviation(
        JUNCTION_EAGLE_UNKEPT,
        "docs/findings/022-junction-eagle-block-unkept.md",
        _no_snapshot_change,
        releases="0.32",
        applies=lambda api: api.has("junction_eagle_unkept"),
    ),
    # A manager method, not a snapshot: `VllmSide.build_manager` undoes it (see there).
    KnownDeviation(
        EXTERNAL_STATE_UNCOUNTED,
        "docs/findings/017-external-state-block-uncounted.md",
        _no_snapshot_change,
        releases="0.33–0.34",
        applies=lambda api: api.has("kv_connector"),
    ),
    # A manager method, not a snapshot: `VllmSide.build_manager` undoes it (see there).
    KnownDeviation(
        CHECKPOINT_RECORD_KEPT,
        "docs/findings/019-checkpoint-record-kept.md",
        _no_snapshot_change,
        releases="0.32–0.34",
        applies=lambda api: api.has("prefill_checkpoints"),
    ),
    # A manager method, not a snapshot: `VllmSide.build_manager` undoes it (see there).
    KnownDeviation(
        CHECKPOINT_AMONG_DRAFTS,
        "docs/findings/035-checkpoint-among-drafts.md",
        _no_snapshot_change,
        releases="0.34",
        applies=lambda api: api.has("prefill_checkpoints"),
    ),
    # An event, not a snapshot: `VllmSide._split_stored_at_unkeyed_blocks` undoes it (see there).
    KnownDeviation(
        STORED_SPANS_NULLS,
        "docs/findings/026-stored-event-spans-null-blocks.md",
        _no_snapshot_change,
        applies=lambda api: api.has("kv_events"),
    ),
    # An event, not a snapshot: `VllmSide._skip_null_hit_reports` undoes it (see there).
    KnownDeviation(
        HIT_REPORT_NULLS,
        "docs/findings/027-hit-report-names-null-blocks.md",
        _no_snapshot_change,
        applies=lambda api: api.has("kv_events") and api.has("report_mode"),
    ),
    # A manager method, not a snapshot: `VllmSide.build_manager` undoes it (see there).
    KnownDeviation(
        ALIGN_COUNT_NEGATIVE,
        "docs/findings/028-align-count-negative.md",
        _no_snapshot_change,
    ),
    # An input, not a snapshot: `VllmSide.lookup` undoes it (see there).
    KnownDeviation(
        "bound-raises-ceiling",
        "docs/findings/009-lookup-bound-raises-ceiling.md",
        _no_snapshot_change,
        releases="0.33",
        # The bound exists, but not get_max_cache_hit_length, which makes it only lower.
        applies=lambda api: api.has("lookup_bound") and not api.has("request_hit_limit"),
    ),
)

# Trace fields and ops that need an optional feature of the installed vLLM (vllm_api.FEATURES).
OP_FEATURES = {
    "get_num_cached_tokens": "cached_tokens_probe",
    "max_cache_hit_length": "lookup_bound",
    "prefix_cache_hit_limit": "request_hit_limit",
    "take_events": "kv_events",
    "evict_first": "free_evict_first",
    "num_external_computed_tokens": "kv_connector",
    "load_remote": "kv_connector",
    "finish_load": "kv_connector",
    "in_flight": "deferred_free",
    "complete_step": "deferred_free",
}


def _stored_runs(event: Any, request: Any, span: range, listed: Sequence[int],
                 kept: Sequence[int], block_size: int, hash_block_size: int) -> list[Any] | None:
    """vLLM's BlockStored `event` of `request`'s blocks `span` (of `block_size` tokens), whose
    lists name the blocks `listed`, as kvcache announces it: one event per run of consecutive
    blocks of `kept`, chained on the block before its run, with that run's token ids and list
    entries (findings 026, 027). None where it stays as it is: every block of `span` is kept,
    or the event is not vLLM's own (another type, parent, token ids or keys)."""
    if len(kept) == len(span):
        return None
    scale = block_size // hash_block_size

    def block_hash(i: int) -> Any:
        return None if i < 0 else request.block_hashes[(i + 1) * scale - 1]

    if (type(event).__name__ != "BlockStored"
            or event.parent_block_hash != block_hash(span.start - 1)
            or list(event.token_ids)
            != list(request.all_token_ids[span.start * block_size:span.stop * block_size])
            or [bytes(h) for h in event.block_hashes] != [bytes(block_hash(i)) for i in listed]):
        return None
    import msgspec  # vLLM's events are msgspec structs

    runs: list[list[int]] = []  # the blocks of each run of consecutive kept blocks
    for i in kept:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    events = []
    for run in runs:
        at = listed.index(run[0])
        part = slice(at, at + len(run))
        first, end = run[0], run[-1] + 1
        events.append(msgspec.structs.replace(
            event, block_hashes=event.block_hashes[part],
            parent_block_hash=block_hash(first - 1),
            token_ids=list(request.all_token_ids[first * block_size:end * block_size]),
            **{field: getattr(event, field)[part]
               for field in ("extra_keys", "lookahead_token_ids")
               if getattr(event, field, None) is not None}))
    return events


def _checkpoint_managers(manager: Any) -> list[Any]:
    """The state managers of `manager` with prefill checkpoint blocks."""
    return [single for single in manager.coordinator.single_type_managers
            if getattr(single, "has_prefill_checkpoint_blocks", False)]


def _noting_request(allocate_slots: Callable[..., Any],
                    allocating: list[Any]) -> Callable[..., Any]:
    """`allocate_slots`, keeping the request it runs for on top of `allocating` meanwhile."""
    def noted(request: Any, *args: Any, **kwargs: Any) -> Any:
        allocating.append(request)
        try:
            return allocate_slots(request, *args, **kwargs)
        finally:
            allocating.pop()
    return noted


class VllmSide(ManagerSide):
    """The installed vLLM's KVCacheManager and Request, built from our config.

    Its snapshots tolerate the `KNOWN_DEVIATIONS` that apply to the installed vLLM
    (`tolerance` adds or removes some, `kvfuzz.harness.tolerance`); `tolerated` records, per
    deviation name, the request ids it was tolerated for. `VllmStrictSide` tolerates nothing.
    An exception vLLM raises while the manager is built is a finding (check BUILD), unless a
    tolerated deviation documents it.
    """

    name = "vllm"
    known_deviations: tuple[KnownDeviation, ...] = KNOWN_DEVIATIONS
    check_available = staticmethod(check_vllm)
    build_errors_are_findings = True

    def __init__(self, config: Config, level: str, tolerance: Tolerance | None = None) -> None:
        self.api = load_vllm()
        chosen = (tolerance.select(self.known_deviations, self.deviation_catalogue())
                  if tolerance else self.known_deviations)
        self.deviations = tuple(d for d in chosen if d.applies(self.api))
        self.tolerated: dict[str, set[str]] = {d.name: set() for d in self.deviations}
        self._holders: dict[bytes, int] = {}
        """Blocks per key of the hash map after the last op (`tolerate_events`)."""
        super().__init__(config, level)

    @staticmethod
    def deviation_catalogue() -> tuple[KnownDeviation, ...]:
        """Every deviation `--tolerate` can name."""
        return KNOWN_DEVIATIONS

    def tolerated_build(self, exc: Exception) -> str | None:
        for deviation in self.deviations:
            if deviation.unbuildable is not None and deviation.unbuildable(exc):
                return deviation.label
        return None

    def tolerated_labels(self) -> list[str]:
        """The deviations tolerated so far on this side (`id name`)."""
        return [d.label for d in self.deviations if self.tolerated[d.name]]

    def manager_group_ids(self, config: Config) -> tuple[int, ...]:
        return vllm_group_ids(config)

    def offers(self, name: str) -> bool:
        """Whether this vLLM has what an op or field of `OP_FEATURES` needs (generators ask)."""
        feature = OP_FEATURES.get(name)
        return feature is None or self.api.has(feature)

    def require(self, name: str) -> None:
        if not self.offers(name):
            what = FEATURES[OP_FEATURES[name]][0]
            raise VllmUnsupported(
                f"the trace uses {name}, which needs {what}; target {self.name} (vLLM "
                f"{self.api.version}) lacks it (docs/vllm.md, per-release table)"
            )

    def lookup(self, request: Any, bound: int | None) -> Any:
        if bound is not None:
            self.require("max_cache_hit_length")
            ceiling = request.num_tokens - 1
            if "bound-raises-ceiling" in self.tolerated and bound > ceiling:
                # vLLM 0.33 takes a bound above num_tokens - 1 as the ceiling itself; pass
                # the ceiling it would have used, which is what 0.34 does with it.
                self.tolerated["bound-raises-ceiling"].add(request.request_id)
                bound = ceiling
        return super().lookup(request, bound)

    def num_cached_tokens(self, request: Any) -> int:
        self.require("get_num_cached_tokens")
        answer = super().num_cached_tokens(request)
        name = "probe-ignores-hit-limit"
        if name in self.tolerated and request.prefix_cache_hit_limit is not None:
            # vLLM 0.34 probes up to num_tokens - 1 whatever the limit: answer what the lookup
            # it predicts hits (read-only), only where the limit made them differ.
            hit = super().lookup(request, None)[1]
            if hit != answer:
                self.tolerated[name].add(request.request_id)
                return hit
        return answer

    def _allocate_slots(self, op: Op) -> Any:
        if op["num_external_computed_tokens"] or op["delay_cache_blocks"]:
            self.require("num_external_computed_tokens")
        return super()._allocate_slots(op)

    def _load_remote(self, op: Op) -> Any:
        self.require("load_remote")
        return super()._load_remote(op)

    def _finish_load(self, op: Op) -> Any:
        self.require("finish_load")
        return super()._finish_load(op)

    def snapshot(self) -> Snapshot:
        snapshot = super().snapshot()
        for deviation in self.deviations:
            snapshot, rids = deviation.tolerate(snapshot, self.config)
            self.tolerated[deviation.name].update(rids)
        return snapshot

    def _require_option(self, option: str, feature: str) -> None:
        """Exit 2 (VllmUnsupported) naming a config option this vLLM cannot run."""
        if not self.api.has(feature):
            raise VllmUnsupported(
                f"the config sets {option}, which needs {FEATURES[feature][0]}; target "
                f"{self.name} (vLLM {self.api.version}) lacks it (docs/vllm.md)"
            )

    def build_manager(self, config: Config) -> Any:
        v = self.api
        if config.prefix_cache_retention_interval is not None:
            self._require_option("prefix_cache_retention_interval", "retention")
            if config.enable_caching and any(g.mamba_cache_mode == "align"
                                             for g in config.groups):
                self._require_option("prefix_cache_retention_interval with a Mamba 'align' "
                                     "group", "state_retention")
        if any(g.num_prefill_checkpoint_blocks or g.prefill_checkpoint_alignment is not None
               for g in config.groups):
            self._require_option("num_prefill_checkpoint_blocks", "prefill_checkpoints")
        if config.num_hash_lookahead_tokens:
            self._require_option("num_hash_lookahead_tokens", "hash_lookahead")
        if config.num_prefill_lookahead:
            self._require_option("num_prefill_lookahead", "prefill_lookahead")
        if config.enable_mamba_shared_prefix_checkpoint:
            self._require_option("enable_mamba_shared_prefix_checkpoint",
                                 "shared_prefix_checkpoint")
        if config.kv_cache_report_mode != "incremental":
            self._require_option("kv_cache_report_mode", "report_mode")
        if config.kv_events:
            self.require("take_events")
            # Events then carry the block hashes themselves, which the harness reads as content.
            os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
        self.request_status = v["RequestStatus"]
        utils = v["utils"]
        # vLLM keeps its none hash in a module global, read whenever a request hashes.
        utils.NONE_HASH = v["sha256"](config.none_hash_seed)
        self._hasher = utils.get_request_block_hasher(
            config.resolved_hash_block_size, v["sha256"],
            *((config.num_hash_lookahead_tokens,) if config.num_hash_lookahead_tokens else ()))
        manager = self.new_manager(config)
        for single in manager.coordinator.single_type_managers:
            if JUNCTION_EAGLE_UNKEPT in self.tolerated:
                self._keep_eagle_junction_block(single)
            if getattr(single, "mamba_cache_mode", None) != "align":
                continue
            if {CHECKPOINT_START_KEYED, JUNCTION_START_KEYED} & set(self.tolerated) and getattr(
                    single, "has_prefill_checkpoint_blocks", False):
                self._leave_checkpoint_start_unkeyed(single)
            if STATE_TAIL_REKEYED in self.tolerated:
                self._skip_rekeyed_state_tail(single)
            if EXTERNAL_STATE_UNCOUNTED in self.tolerated:
                self._count_external_state_blocks(single)
            if ALIGN_COUNT_NEGATIVE in self.tolerated:
                self._floor_align_count(single)
        if CHECKPOINT_RECORD_KEPT in self.tolerated:
            self._keep_checkpoint_records(manager)
        if CHECKPOINT_AMONG_DRAFTS in self.tolerated:
            self._no_checkpoint_among_drafts(manager)
        if STORED_SPANS_NULLS in self.tolerated and config.kv_events:
            self._split_stored_at_unkeyed_blocks(manager)
        if (HIT_REPORT_NULLS in self.tolerated and config.kv_events
                and config.kv_cache_report_mode == "full"):
            self._skip_null_hit_reports(manager)
        return manager

    def new_manager(self, config: Config) -> Any:
        """vLLM's KVCacheManager for `config`, before the tolerated deviations are undone on it
        (target `vllm-scheduler` takes the one vLLM's own Scheduler builds)."""
        return build_vllm_manager(config)

    def _keep_checkpoint_records(self, manager: Any) -> None:
        """A refused allocate_slots leaves every state manager's checkpoint record of the
        request as it was before the call."""
        singles = _checkpoint_managers(manager)
        if not singles:
            return
        original = manager.allocate_slots
        tolerated = self.tolerated[CHECKPOINT_RECORD_KEPT]

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            rid = request.request_id
            before = [single._checkpoints.get(rid) for single in singles]
            result = original(request, *args, **kwargs)
            if result is None:
                for single, record in zip(singles, before):
                    if single._checkpoints.get(rid) == record:
                        continue
                    tolerated.add(rid)
                    if record is None:
                        del single._checkpoints[rid]
                    else:
                        single._checkpoints[rid] = record
            return result

        manager.allocate_slots = allocate_slots

    def _no_checkpoint_among_drafts(self, manager: Any) -> None:
        """A step whose main-model tokens reach past the request's (it verifies drafts)
        reserves no prefill checkpoint in any state manager."""
        tolerated = self.tolerated[CHECKPOINT_AMONG_DRAFTS]
        allocating: list[Any] = []
        """The request whose allocate_slots is running (the count sees only its id)."""

        def checkpoint_rule(needs: Callable[..., bool]) -> Callable[..., bool]:
            def needs_internal_checkpoint(request_id: str, query_start: int, query_end: int,
                                          *args: Any) -> bool:
                if not needs(request_id, query_start, query_end, *args):
                    return False
                if allocating and query_end > allocating[-1].num_tokens:
                    tolerated.add(request_id)
                    return False
                return True
            return needs_internal_checkpoint

        singles = _checkpoint_managers(manager)
        for single in singles:
            single._needs_internal_checkpoint = checkpoint_rule(single._needs_internal_checkpoint)
        if singles:
            manager.allocate_slots = _noting_request(manager.allocate_slots, allocating)

    def _split_stored_at_unkeyed_blocks(self, manager: Any) -> None:
        """A BlockStored whose range holds null or masked blocks (a Mamba "align" group's
        nulls, a retention mask's unkept blocks) becomes one event per run of the blocks it
        keys, each chained on the position before the run with that run's token ids, and none
        for unkeyed blocks only: kvcache's events (finding 026).
        Only vLLM's own event of the range is changed: its keys, parent and token ids must be
        the request's (vLLM's shape, unkeyed blocks skipped), else EV3 judges it as it is."""
        pool = manager.block_pool
        original = pool.cache_full_blocks
        tolerated = self.tolerated[STORED_SPANS_NULLS]
        hbs = self.config.resolved_hash_block_size

        def cache_full_blocks(request: Any, blocks: Any, num_cached_blocks: int,
                              num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                              *args: Any, **kwargs: Any) -> Any:
            queue = pool.kv_event_queue
            queued = len(queue)
            result = original(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                              kv_cache_group_id, *args, **kwargs)
            if len(queue) == queued:
                return result
            mask = kwargs.get("block_mask", args[0] if args else None)
            keyed = [i for i in range(num_cached_blocks, num_full_blocks)
                     if not blocks[i].is_null
                     and (mask is None or mask[i - num_cached_blocks])]
            runs = _stored_runs(queue[-1], request, range(num_cached_blocks, num_full_blocks),
                                keyed, keyed, block_size, hbs)
            if runs is not None:
                tolerated.add(request.request_id)
                queue[-1:] = runs
            return result

        pool.cache_full_blocks = cache_full_blocks

    def _skip_null_hit_reports(self, manager: Any) -> None:
        """A full-mode re-announcement of a hit whose list holds null placeholders (a sliding
        window's blocks before the window) becomes one event per run of the hit's real blocks,
        each chained on the position before the run with that run's token ids: kvcache's
        events (finding 027). Only vLLM's own event is changed: its keys and token ids must be
        the request's from token 0 over the whole hit list, else EV4 and EV6 judge it as it is."""
        coordinator, pool = manager.coordinator, manager.block_pool
        original = coordinator.emit_cached_block_events
        tolerated = self.tolerated[HIT_REPORT_NULLS]
        hbs = self.config.resolved_hash_block_size

        def emit_cached_block_events(request: Any, computed_blocks: Any) -> None:
            queue = pool.kv_event_queue
            queued = len(queue)
            original(request, computed_blocks)
            hits = [blocks for blocks in computed_blocks if blocks]
            if len(queue) - queued != len(hits):
                return
            events: list[Any] = []
            for event, blocks in zip(queue[queued:], hits):
                span = range(len(blocks))
                runs = _stored_runs(event, request, span, span,
                                    [i for i in span if not blocks[i].is_null],
                                    event.block_size, hbs)
                if runs is None:
                    events.append(event)
                else:
                    tolerated.add(request.request_id)
                    events += runs
            queue[queued:] = events

        coordinator.emit_cached_block_events = emit_cached_block_events

    def _count_external_state_blocks(self, single: Any) -> None:
        """A first allocation with external tokens is predicted as it happens (kvcache's
        count: the passed hits, the external state block, then the step's own)."""
        original = single.get_num_blocks_to_allocate
        tolerated = self.tolerated[EXTERNAL_STATE_UNCOUNTED]

        def get_num_blocks_to_allocate(request_id: str, num_tokens: int,
                                       new_computed_blocks: Any, total_computed_tokens: int,
                                       num_local_computed_tokens: int,
                                       num_tokens_main_model: int, *args: Any,
                                       **kwargs: Any) -> int:
            theirs = original(request_id, num_tokens, new_computed_blocks,
                              total_computed_tokens, num_local_computed_tokens,
                              num_tokens_main_model, *args, **kwargs)
            if (request_id in single.req_to_blocks and single.req_to_blocks[request_id]) or (
                    total_computed_tokens <= num_local_computed_tokens) or theirs > (
                    single.block_pool.num_gpu_blocks):
                return theirs
            required = -(-num_tokens_main_model // single.block_size) + (
                single.num_speculative_blocks)
            checkpoint_block = _checkpoint_block(
                single, request_id, total_computed_tokens, num_tokens_main_model,
                kwargs.get("prefill_end", 0), kwargs.get("apply_admission_cap", False))
            ours = MambaManager._align_external_blocks_to_allocate(
                single, required, new_computed_blocks, num_local_computed_tokens,
                total_computed_tokens, checkpoint_block)
            if ours != theirs:
                tolerated.add(request_id)
            return ours

        single.get_num_blocks_to_allocate = get_num_blocks_to_allocate

    def _floor_align_count(self, single: Any) -> None:
        """A negative count of new state blocks reads as 0 (the hits it evicts still counted):
        the table is already longer than the step needs, and the step takes nothing."""
        original = single.get_num_blocks_to_allocate
        tolerated = self.tolerated[ALIGN_COUNT_NEGATIVE]

        def get_num_blocks_to_allocate(request_id: str, num_tokens: int,
                                       new_computed_blocks: Any, *args: Any,
                                       **kwargs: Any) -> int:
            theirs = original(request_id, num_tokens, new_computed_blocks, *args, **kwargs)
            if theirs > single.block_pool.num_gpu_blocks:  # "not this step" (`:1709-1717`)
                return theirs
            hits = single._get_num_evictable_blocks(new_computed_blocks)
            if theirs >= hits:
                return theirs
            tolerated.add(request_id)
            return hits

        single.get_num_blocks_to_allocate = get_num_blocks_to_allocate

    def _skip_rekeyed_state_tail(self, single: Any) -> None:
        """0.33's return in `_cache_partial_tail_block`: a state block already keyed at
        `num_tokens` is not registered (nor marked cached this step) again. Like 0.33's, it
        comes after the prefill checkpoint's re-keying, which a step with a record takes."""
        original = single._cache_partial_tail_block
        tolerated = self.tolerated[STATE_TAIL_REKEYED]
        checkpoints = getattr(single, "_checkpoints", {})

        def cache_partial_tail_block(request: Any, num_tokens: int, *args: Any,
                                     **kwargs: Any) -> Any:
            if request.request_id in checkpoints:
                return original(request, num_tokens, *args, **kwargs)
            blocks = single.req_to_blocks.get(request.request_id, ())
            index = -(-num_tokens // single.block_size) - 1
            if (num_tokens > 0 and 0 <= index < len(blocks) and not blocks[index].is_null
                    and blocks[index].block_hash_num_tokens == num_tokens
                    and num_tokens % single.block_pool.hash_block_size == 0):
                tolerated.add(request.request_id)
                return None
            return original(request, num_tokens, *args, **kwargs)

        single._cache_partial_tail_block = cache_partial_tail_block

    def _keep_eagle_junction_block(self, single: Any) -> None:
        """0.33's rule: under EAGLE a retention mask also keeps the block ending one block
        below the caching request's junction (the mask reads the boundaries it is passed, so
        `cache_blocks` lends it the request)."""
        cache, mask = single.cache_blocks, single.reachable_block_mask
        caching: list[Any] = []  # the request of the cache_blocks call in progress
        tolerated = self.tolerated[JUNCTION_EAGLE_UNKEPT]

        def cache_blocks(request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
            caching.append(request)
            try:
                return cache(request, num_tokens, *args, **kwargs)
            finally:
                caching.pop()

        def reachable_block_mask(*args: Any, **kwargs: Any) -> Any:
            theirs = mask(*args, **kwargs)
            boundaries = kwargs.get("reachable_boundaries")
            if not (caching and single.use_eagle and boundaries is not None
                    and caching[-1].shared_prefix_boundary):
                return theirs
            below = caching[-1].shared_prefix_boundary - single.block_size
            ours = mask(*args, **{**kwargs, "reachable_boundaries": [*boundaries, below]})
            if ours != theirs:
                tolerated.add(caching[-1].request_id)
            return ours

        single.cache_blocks = cache_blocks
        single.reachable_block_mask = reachable_block_mask

    def _leave_checkpoint_start_unkeyed(self, single: Any) -> None:
        """A step that started inside a block and ran past its end caches its full blocks
        without that block (kvcache's rule, docs/spec.md §11.3, §11.6): one that reserved a
        prefill checkpoint (finding 020), or a chunk cut at a junction (finding 021)."""
        count, allocate, cache, mask = (single.get_num_blocks_to_allocate,
                                        single.allocate_new_blocks, single.cache_blocks,
                                        single.reachable_block_mask)
        counted: dict[str, int] = {}  # request -> its counted step's start ...
        starts: dict[str, int] = {}  # ... and that of its last allocated step
        skipped: list[tuple[str, int, str]] = []  # (request, column, deviation), one call

        def get_num_blocks_to_allocate(request_id: str, num_tokens: int, new_computed_blocks: Any,
                                       total_computed_tokens: int, *args: Any,
                                       **kwargs: Any) -> int:
            if not kwargs.get("apply_admission_cap", False):
                counted[request_id] = total_computed_tokens
            return count(request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                         *args, **kwargs)

        def allocate_new_blocks(request_id: str, *args: Any, **kwargs: Any) -> Any:
            if request_id in counted:
                starts[request_id] = counted.pop(request_id)
            return allocate(request_id, *args, **kwargs)

        def cache_blocks(request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
            rid, bs = request.request_id, single.block_size
            start = starts.get(rid, 0)
            if start % bs and num_tokens > -(-start // bs) * bs:
                name = (CHECKPOINT_START_KEYED if single._checkpoints.get(rid) is not None
                        else JUNCTION_START_KEYED)
                if name in self.tolerated:
                    skipped.append((rid, (start - 1) // bs, name))
            try:
                return cache(request, num_tokens, *args, **kwargs)
            finally:
                skipped.clear()

        def reachable_block_mask(*args: Any, **kwargs: Any) -> Any:
            result = mask(*args, **kwargs)
            first = kwargs.get("start_block", args[0] if args else 0)
            end = kwargs.get("end_block", args[1] if len(args) > 1 else 0)
            for rid, column, name in skipped:
                blocks = single.req_to_blocks.get(rid, ())
                if first <= column < end and column < len(blocks) and not blocks[column].is_null:
                    result = [True] * (end - first) if result is None else list(result)
                    if result[column - first]:
                        self.tolerated[name].add(rid)
                    result[column - first] = False
            return result

        single.get_num_blocks_to_allocate = get_num_blocks_to_allocate
        single.allocate_new_blocks = allocate_new_blocks
        single.cache_blocks = cache_blocks
        single.reachable_block_mask = reachable_block_mask

    def router_chain(self, config: Config) -> BlockChain | None:
        """vLLM's documented chain over SHA-256 of pickle, the function the harness gives it,
        with the adapter paths and embedding tensors `_extra_key_args` makes."""
        return vllm_chain(config.none_hash_seed, "sha256", embeds_rows=self._embeds_rows,
                          lookahead=config.num_hash_lookahead_tokens)

    def _embeds_rows(self, extras: Extras, start: int, end: int) -> bytes:
        """The raw float32 rows [start, end) of the embedding tensor `_extra_key_args` builds."""
        fill = -1.0 if EMBEDS_MASK in self.tolerated else 0.0
        rows = [float(v) if v >= 0 else fill for v in (extras.prompt_embeds or ())[start:end]]
        return struct.pack(f"<{len(rows)}f", *rows)

    def _sampling_params(self, op: Op) -> tuple[dict[str, Any], bool]:
        """`SamplingParams` arguments for `op` beside max_tokens, and whether vLLM derives the
        prompt-scoring hit limit from them (here not: `make_request` sets it)."""
        return {"skip_reading_prefix_cache": op["skip_reading_prefix_cache"] or None}, False

    def make_request(self, op: Op, arrival_time: float) -> Any:
        v = self.api
        kwargs, derived = self._sampling_params(op)
        if self.config.kv_cache_report_mode != "incremental":
            kwargs = {**kwargs, "extra_args": {"kv_cache_report_mode":
                                               self.config.kv_cache_report_mode}}
        params = v["SamplingParams"](max_tokens=op["max_tokens"], **kwargs)
        request = v["Request"](
            op["request_id"],
            list(op["prompt"]),
            params,
            None,
            arrival_time=arrival_time,
            cache_salt=op["cache_salt"],
            priority=op["priority"],
            block_hasher=self._hasher,
            **self._extra_key_args(op),
        )
        # vLLM counts encoder tokens from multimodal features; the driver reads this instead.
        request.num_encoder_tokens = op["num_encoder_tokens"]
        limit = op["prefix_cache_hit_limit"]
        if limit is not None:
            self.require("prefix_cache_hit_limit")
            # What vLLM derives from prompt-scoring parameters, set directly (0 stays 0 when
            # the request skips cache reads).
            if not derived and request.prefix_cache_hit_limit != 0:
                request.prefix_cache_hit_limit = limit
        return request


    def tolerate_events(self, events: list[Any]) -> list[Any]:
        """Drop each BlockRemoved of a copy while other blocks still hold its key (finding
        011), counting the holders of each key from the map after the last op through this
        op's events: vLLM announces every copy it stores and evicts, so the count is exact,
        and the removal of a last copy (the key then stored anew, or not) is kept."""
        if REMOVED_WHILE_HELD not in self.tolerated:
            return events
        held = self._holders
        kept = []
        for event in events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                held.clear()
            packed = [packed_key(h, getattr(event, "group_idx", 0) or 0)
                      for h in getattr(event, "block_hashes", ())]
            if kind == "BlockStored":
                for key in packed:
                    held[key] = held.get(key, 0) + 1
            if kind == "BlockRemoved" and all(held.get(key, 0) > 1 for key in packed):
                self.tolerated[REMOVED_WHILE_HELD].update(
                    bytes(h)[:6].hex() for h in event.block_hashes)
                for key in packed:
                    held[key] -= 1
                continue
            for key in packed if kind == "BlockRemoved" else ():
                held.pop(key, None)
            kept.append(event)
        self._holders = _holder_counts(self.manager.block_pool.cached_block_hash_to_block)
        return kept

    def _extra_key_args(self, op: Op) -> dict[str, Any]:
        """vLLM's Request arguments for the op's extra keys (docs/vllm.md "Extra keys"): a LoRA
        adapter's path is the op's, else its id's default (vLLM keys adapters by name and
        path), a multimodal
        identifier i becomes "mm-i", embedding values a float tensor with the token-id mask."""
        args: dict[str, Any] = {}
        if op["lora_name"] is not None:
            lora_request = self._vllm_class(op, "lora_name", "vllm.lora.request", "LoRARequest")
            args["lora_request"] = lora_request(
                op["lora_name"], op["lora_id"], lora_path(op["lora_id"], op["lora_path"]))
        if op["mm_inputs"]:
            module = "vllm.multimodal.inputs"
            feature = self._vllm_class(op, "mm_inputs", module, "MultiModalFeatureSpec")
            placeholder = self._vllm_class(op, "mm_inputs", module, "PlaceholderRange")
            args["mm_features"] = [
                feature(data=None, modality="image", identifier=f"mm-{i}",
                        mm_position=placeholder(offset=o, length=n))
                for i, o, n in op["mm_inputs"]
            ]
        embeds = op["prompt_embeds"]
        if embeds is not None:
            if not self.api.has("prompt_embeds_mask") and any(v < 0 for v in embeds):
                raise VllmUnsupported(
                    f"add_request {op['request_id']!r}: prompt_embeds with token positions "
                    f"(-1) need Request(prompt_is_token_ids=), which target {self.name} "
                    f"({self.api.describe()}) lacks")
            import torch

            fill = 0.0
            if any(v < 0 for v in embeds):
                args["prompt_is_token_ids"] = [v < 0 for v in embeds]
                if EMBEDS_MASK in self.tolerated:
                    fill = -1.0
                    self.tolerated[EMBEDS_MASK].add(op["request_id"])
            args["prompt_embeds"] = torch.tensor([[float(v) if v >= 0 else fill] for v in embeds])
        return args


    def _vllm_class(self, op: Op, field: str, module: str, name: str) -> Any:
        """A vLLM class an op's field needs; VllmUnsupported (exit 2) naming both if absent."""
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            raise VllmUnsupported(
                f"add_request {op['request_id']!r}: {field} needs {module}.{name}, which target "
                f"{self.name} ({self.api.describe()}) lacks") from None


def _holder_counts(hash_map: Any) -> dict[bytes, int]:
    """How many blocks hold each key of vLLM's hash map (0.34 files the ids of a key several
    blocks hold in `_dup_ids`; earlier releases keep a dict of blocks per such key)."""
    dup_ids = getattr(hash_map, "_dup_ids", None)
    if dup_ids is not None:
        return {k: len(dup_ids[k]) if k in dup_ids else 1 for k in hash_map._cache}
    return {k: len(e) if isinstance(e, dict) else 1 for k, e in hash_map._cache.items()}


class VllmStrictSide(VllmSide):
    """The installed vLLM with no tolerated deviation: replays the findings of docs/findings/."""

    name = "vllm-strict"
    known_deviations = ()
