"""All mutable manager state, and the block-pool operations on it (docs/spec.md §2.2, §2.4, §3, §4.1).

Ownership is explicit: per group, each request's block table is a plain list of ids (null block
= 0); copy-on-write pairs are held in `pending_copies` (recorded by layer 3, not yet taken) and
`retained` (taken, not yet released). A block's reference count is *derived* by counting those
holders; it is never stored. The free queue is a plain list, head first. The cache is a plain list
of (content key, block id) entries in insertion order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfuzz.core.snapshot import CacheKey

NULL = 0


@dataclass
class State:
    num_blocks: int
    caching: bool
    free: list[int]
    """The free queue, head (reused first) at index 0."""
    primary: list[CacheKey | None]
    """Primary key of block i (docs/spec.md §2.1 block_hash)."""
    primary_tokens: list[int | None]
    """block_hash_num_tokens of block i."""
    extras: dict[int, set[CacheKey]]
    """Block id -> keys it is reachable under besides its primary (Tier B partial entries)."""
    entries: list[tuple[CacheKey, int]]
    """The hash -> block map, as (key, block id) in insertion order (docs/spec.md §2.4)."""
    tables: list[dict[str, list[int]]]
    """Per group: request id -> block table (req_to_blocks, docs/spec.md §4.1)."""
    num_cached: list[dict[str, int]]
    """Per group: request id -> num_cached_block."""
    partial_hits: list[dict[str, tuple[int, int]]]
    """Per group: request id -> (block index, source block id) awaiting copy-on-write."""
    pending_copies: list[list[tuple[int, int]]]
    """Per group: CoW pairs (src, dst) not yet taken; each endpoint holds one reference."""
    new_block_ids: list[list[int]]
    """Per group: ids recorded for zeroing and not yet drained (only CoW ids: no zeroing)."""
    retained: list[tuple[int, int]]
    """CoW pairs taken by take_kv_cache_block_copies and not yet released."""
    allocated: list[set[str]] = field(default_factory=list)
    """Per group (mamba align): requests past their first allocation (docs/spec.md §11.3)."""
    last_state: list[dict[str, int]] = field(default_factory=list)
    """Per group (mamba align): request -> index of the previous step's state block."""
    retired: list[dict[str, int]] = field(default_factory=list)
    """Per group (mamba align): request -> positions below this were already nulled."""
    cached_this_step: list[set[CacheKey]] = field(default_factory=list)
    """Per group (mamba): keys registered since the last new_step_starts."""
    checkpoints: list[dict[str, tuple[int, int, int]]] = field(default_factory=list)
    """Per group (mamba align with checkpoint blocks): request -> (checkpoint position, table
    index of its reserved block, the step's start), as the last successful allocation decided
    (docs/spec.md §11.6)."""
    step_starts: list[dict[str, int]] = field(default_factory=list)
    """Per group (mamba align with checkpoint blocks): request -> the start of the step its
    last successful allocation was for, checkpoint or not."""
    deferred: list[int] = field(default_factory=list)
    """Blocks popped by a deferred free and not yet released; each entry holds one reference."""
    phantoms_used: int = 0
    """Blocks handed out beyond the free queue (ids >= num_blocks); see get_new_blocks."""

    @classmethod
    def fresh(cls, num_blocks: int, num_groups: int, caching: bool) -> State:
        """A new pool (docs/spec.md §3.1): ids 0 … N−1 queued in order, then block 0 popped as null."""
        queue = list(range(num_blocks))
        queue.pop(0)
        return cls(
            num_blocks=num_blocks,
            caching=caching,
            free=queue,
            primary=[None] * num_blocks,
            primary_tokens=[None] * num_blocks,
            extras={},
            entries=[],
            tables=[{} for _ in range(num_groups)],
            num_cached=[{} for _ in range(num_groups)],
            partial_hits=[{} for _ in range(num_groups)],
            pending_copies=[[] for _ in range(num_groups)],
            new_block_ids=[[] for _ in range(num_groups)],
            retained=[],
            allocated=[set() for _ in range(num_groups)],
            last_state=[{} for _ in range(num_groups)],
            retired=[{} for _ in range(num_groups)],
            cached_this_step=[set() for _ in range(num_groups)],
            checkpoints=[{} for _ in range(num_groups)],
            step_starts=[{} for _ in range(num_groups)],
        )

    def trial_copy(self) -> State:
        """A copy for a predictor trial: docs/spec.md §6.4 steps 7-8 run on it, and it replaces the
        real state only if the capacity check passes."""
        return State(
            num_blocks=self.num_blocks,
            caching=self.caching,
            free=list(self.free),
            primary=list(self.primary),
            primary_tokens=list(self.primary_tokens),
            extras={b: set(keys) for b, keys in self.extras.items()},
            entries=list(self.entries),
            tables=[{r: list(t) for r, t in g.items()} for g in self.tables],
            num_cached=[dict(g) for g in self.num_cached],
            partial_hits=[dict(g) for g in self.partial_hits],
            pending_copies=[list(g) for g in self.pending_copies],
            new_block_ids=[list(g) for g in self.new_block_ids],
            retained=list(self.retained),
            allocated=[set(g) for g in self.allocated],
            last_state=[dict(g) for g in self.last_state],
            retired=[dict(g) for g in self.retired],
            cached_this_step=[set(g) for g in self.cached_this_step],
            checkpoints=[dict(g) for g in self.checkpoints],
            step_starts=[dict(g) for g in self.step_starts],
            deferred=list(self.deferred),
        )

    def blocks_taken_since(self, free_before: int) -> int:
        """Blocks that left the free queue since it held free_before, phantoms included."""
        return free_before - len(self.free) + self.phantoms_used

    # ----- ownership -----

    def ref_count(self, block: int) -> int:
        """ref_cnt of a non-null block = number of holders (docs/spec.md I2): table entries plus
        copy-pair endpoints (pending or retained)."""
        count = 0
        for group in self.tables:
            for table in group.values():
                count += table.count(block)
        for pairs in [*self.pending_copies, self.retained]:
            for src, dst in pairs:
                count += (src == block) + (dst == block)
        return count + self.deferred.count(block)

    def ref_counts(self) -> list[int]:
        """ref_cnt of every block, the null block's as 0 (never maintained, docs/spec.md §3.1)."""
        counts = [0] * self.num_blocks
        for group in self.tables:
            for table in group.values():
                for b in table:
                    counts[b] += 1
        for pairs in [*self.pending_copies, self.retained]:
            for src, dst in pairs:
                counts[src] += 1
                counts[dst] += 1
        for b in self.deferred:
            counts[b] += 1
        counts[NULL] = 0
        return counts

    # ----- layer 4: queue and references (docs/spec.md §3.4-§3.6) -----

    def get_new_blocks(self, k: int) -> list[int]:
        """Pop k blocks from the head; evict each popped block's cache keys (docs/spec.md §3.4). The
        caller makes each returned block a holder at once (ref_cnt 1).

        Never fails: past the end of the queue it hands out phantom ids >= num_blocks and counts
        them, so a trial learns how many blocks an allocation takes even when that exceeds the
        free count. A state that used a phantom is never adopted (allocation.allocate_slots).
        """
        taken = self.free[:k]
        del self.free[:k]
        if self.caching:
            for b in taken:
                self.drop_keys(b)
        phantoms = [self.num_blocks + self.phantoms_used + i for i in range(k - len(taken))]
        self.phantoms_used += len(phantoms)
        return taken + phantoms

    def touch(self, block: int) -> None:
        """docs/spec.md §3.5, before the caller adds its holder entry: a block nobody holds leaves the
        free queue (it was an eviction candidate). The null block is skipped."""
        if block != NULL and self.ref_count(block) == 0:
            self.free.remove(block)

    def release(self, ordered: list[int], evict_first: bool = False) -> None:
        """free_blocks (docs/spec.md §3.6) for blocks whose holder entries the caller already removed.

        Each occurrence is one decrement, in the given order; a block's count reaches 0 at its
        last occurrence iff nothing holds it any more. Blocks reaching 0 without a primary key
        (or with caching off) go to the head as one run, in order; cached ones to the tail, or
        with `evict_first` into the head run as well (keeping their keys).
        """
        uncached: list[int] = []
        cached: list[int] = []
        for i, b in enumerate(ordered):
            if b == NULL or b in ordered[i + 1 :]:
                continue
            if self.ref_count(b) == 0:
                if b in self.free:
                    raise AssertionError(f"block {b} released twice")
                if self.caching and self.primary[b] is not None and not evict_first:
                    cached.append(b)
                else:
                    uncached.append(b)
        self.free[:0] = uncached
        self.free.extend(cached)

    # ----- layer 4: the cache map (docs/spec.md §2.4, §3.3, §3.7, §3.8, §3.11) -----

    def find_block(self, key: CacheKey) -> int | None:
        """get_one_block: the earliest inserted block still present under key."""
        for k, b in self.entries:
            if k == key:
                return b
        return None

    def carries(self, block: int, key: CacheKey) -> bool:
        """The block is reachable under key (as its primary or as an extra)."""
        return self.primary[block] == key or key in self.extras.get(block, ())

    def drop_keys(self, block: int) -> None:
        """Remove every key of the block from the map and clear its hash fields."""
        self.entries = [(k, b) for k, b in self.entries if b != block]
        self.primary[block] = None
        self.primary_tokens[block] = None
        self.extras.pop(block, None)

    def add_key(self, block: int, key: CacheKey, num_tokens: int) -> None:
        """Insert as in docs/spec.md §3.3: nothing if the block already carries key; else the key becomes
        the primary (with num_tokens) when the block has none, an extra otherwise; then it is
        added to the map."""
        if self.carries(block, key):
            return
        if self.primary[block] is None:
            self.primary[block] = key
            self.primary_tokens[block] = num_tokens
        else:
            self.extras.setdefault(block, set()).add(key)
        self.entries.append((key, block))

    def move_keys(self, src: int, dst: int) -> None:
        """move_block_hashes (docs/spec.md §11.3): every key of src now reaches dst instead
        (dst has none); the primary stays the primary, with its token count."""
        primary, tokens = self.primary[src], self.primary_tokens[src]
        if primary is None:
            return
        extras = self.extras.get(src, set())
        self.drop_keys(src)
        assert tokens is not None
        self.add_key(dst, primary, tokens)
        for key in extras:
            self.add_key(dst, key, tokens)

    def reset_cache(self) -> bool:
        """reset_prefix_cache (docs/spec.md §3.8): refuse unless only the null block is in use."""
        if self.num_blocks - len(self.free) != 1:
            return False
        self.entries = []
        self.extras = {}
        self.primary = [None] * self.num_blocks
        self.primary_tokens = [None] * self.num_blocks
        return True
