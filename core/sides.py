"""What the executor sees of a target or of the reference model: a `Side`.

A side is built from a config and a level, applies normalized ops (docs/traces.md), and after
every op reports its result, a `Snapshot` and the `Observations` its probes made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from kvfuzz.core.config import Config
from kvfuzz.core.snapshot import CacheKey, Snapshot
from kvfuzz.core.trace import Op

Outcome = Literal["blocks", "gate", "capacity", "error"]


@dataclass(frozen=True)
class AllocationProbe:
    """One allocate_slots call, seen from outside layer 1.

    `prediction` is the per-step prediction of docs/spec.md §6.4 step 5 (None when the
    full-sequence gate refused first), `free_before` the free count when step 5 ran,
    `free_after` the free count when the call returned blocks. `group_predictions[g]` is what
    group g's get_num_blocks_to_allocate returned at step 5 and `group_taken[g]` how many
    blocks left the free queue while group g adopted hits and allocated (steps 7-8).
    """

    request_id: str
    outcome: Outcome
    prediction: int | None = None
    free_before: int | None = None
    free_after: int | None = None
    group_predictions: tuple[int, ...] | None = None
    group_taken: tuple[int, ...] | None = None
    reserved_blocks: int = 0
    admission: bool = False
    """The call was made for a WAITING or PREEMPTED request with has_scheduled_reqs set, so
    the watermark applies (docs/spec.md §6.4 step 1)."""
    new_block_ids: tuple[tuple[int, ...], ...] | None = None
    """When the call returned blocks on a target: per group of the manager, the ids of the
    blocks its layer-3 allocate_new_blocks returned (W2); None where not probed."""
    reported_new_block_ids: tuple[tuple[int, ...], ...] | None = None
    """With `new_block_ids`: what the returned KVCacheBlocks' `get_block_ids(allow_none=True)`
    answered, the scheduler's word to the worker (None: no new block in any group)."""

    def compared(self) -> tuple[str, str, int | None]:
        """The part two correct sides agree on."""
        return (self.request_id, self.outcome, self.prediction)


@dataclass(frozen=True)
class ForwardPass:
    """A simulated forward pass of one request: it writes the KV of positions start..end-1
    through the block tables it has at that moment (per group, block ids)."""

    request_id: str
    start: int
    end: int
    tables: tuple[tuple[int, ...], ...]
    load: bool = False
    """A KV connector load (docs/spec.md §13): positions whose block is a window null (left out
    of the window on allocation) are not loaded."""
    unfilled: bool = False
    """With `load`: positions a failing KV load did not fill (docs/spec.md §13.3, step 5);
    afterwards they hold no request's KV."""
    earlier: bool = False
    """A pass of a step launched before this op, seen once the token it computes is known
    (a step in flight that samples, docs/spec.md §7.1): it runs before the op's own passes."""


class CachedTokensProbe(NamedTuple):
    """A `get_num_cached_tokens` answer beside the hit `get_computed_blocks` gives right after
    (read-only, same state): P5 requires them equal."""

    request_id: str
    num_cached_tokens: int
    lookup_hit: int


class CachedReport(NamedTuple):
    """What a `get_computed_blocks` of a request in kv_cache_report_mode "full" must
    re-announce for one run of real blocks in one group's hit (docs/spec.md §3.10): one
    BlockStored of `num_blocks` blocks of `block_size` tokens from block `first_block` (the
    null placeholders before it skipped), chained on the position before it (no parent at
    block 0), with their `token_ids`, naming the keys those blocks hold (`keys`: a probe records
    their packed hashes, the side reads them as content keys)."""

    request_id: str
    group: int
    num_blocks: int
    block_size: int
    token_ids: tuple[int, ...]
    keys: tuple[Any, ...] | None = None
    first_block: int = 0


@dataclass(frozen=True)
class KvEvent:
    """One KV cache event with its hashes read as content keys (docs/spec.md §3.10): `kind` is
    "stored", "removed" or "cleared"; stored events also carry the parent key (None: the chain
    starts at token 0), the token ids, the block size and `extra_keys`: None when the event
    carries none, else per key the LoRA name, `(mm identifier, offset)` pairs and salt it names,
    in order (harness/events.py reads them; the embeddings' digest and other bytes are left out)."""

    kind: str
    group: int = 0
    keys: tuple[CacheKey, ...] = ()
    parent: CacheKey | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    extra_keys: tuple[tuple[Any, ...], ...] | None = None


def take_events_result(keys: Any) -> dict[str, list[str]]:
    """The result of a take_events op (docs/traces.md): the cache keys the events replayed
    from the start say are cached (the model: its cache map's keys), exact reprs, sorted."""
    return {"cached": sorted(repr(k) for k in keys)}


@dataclass
class Observations:
    """What the probes saw during one op."""

    allocations: list[AllocationProbe] = field(default_factory=list)
    pool_shortages: list[str] = field(default_factory=list)
    """Messages of ValueErrors raised by BlockPool.get_new_blocks (P4)."""
    lookups: list[tuple[str, int, int]] = field(default_factory=list)
    """(request, hit, shared_prefix_boundary) of each get_computed_blocks op answered (I20; the
    executor compares them with the reference's, DIFF-probe)."""
    forward: list[ForwardPass] = field(default_factory=list)
    cached_token_probes: list[CachedTokensProbe] = field(default_factory=list)
    """Forward passes a target's harness ran during the op, in order (the data checks write
    through them). The reference model reports none."""
    kv_events: list[KvEvent] = field(default_factory=list)
    """The KV cache events the op made a target emit, in content form, in order (configs with
    kv_events). The reference model reports none."""
    cached_reports: list[CachedReport] = field(default_factory=list)
    """The re-announcements the op's full-mode lookups with a hit owe (EV6), in call order."""
    lost_copies: list[CacheKey] = field(default_factory=list)
    """A key for each copy a block lost while another block still held the key (a target
    announces no removal for it, EV4), in order; the reference model reports none."""
    events_reported: bool = False
    """Whether the side reports its KV cache events (a target on a config with kv_events; the
    reference model does not), so that an empty `kv_events` means no event (EV4)."""
    hash_mismatches: list[str] = field(default_factory=list)
    """Requests whose block hashes differ from the target's documented hash function applied
    to their tokens and extra keys (a router's view, harness/router_hash.py; H2). The
    reference model, which never hashes, reports none."""
    worker_mismatches: list[str] = field(default_factory=list)
    """Where the block tables a scheduler's worker builds from its outputs alone leave the
    manager's tables (a scheduler target's replay, harness/vllm_worker_tables.py; W1). The
    reference model, which has no worker, reports none."""


class Side(Protocol):
    """A target under test or the reference model, as the executor drives it."""

    name: str

    def apply(self, op: Op) -> Any:
        """Run one normalized op and return its result (plain data).

        An exception of the implementation becomes `{"error": "<ClassName>"}`; an op that is
        not valid at this point of the trace raises `kvfuzz.core.errors.InvalidTrace`.
        """
        ...

    def snapshot(self) -> Snapshot:
        """The state after the last op."""
        ...

    def observations(self) -> Observations:
        """What the probes saw during the last op."""
        ...


class SideFactory(Protocol):
    def __call__(self, config: Config, level: str) -> Side: ...
