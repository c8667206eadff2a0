"""The state every side reports after every op: plain data, equal for two correct sides.

See docs/traces.md#snapshot. Cache keys are content, not hashes, so a target with a wrong or
colliding hash disagrees with the reference model (which never hashes).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

CacheKey = tuple[int, str | None, tuple[int, ...]]
"""(group id, identity, token ids of the prefix the key fingerprints). The identity is the cache
salt or None for a plain request, else the prefix's extra keys by value (core/extra_keys.py)."""


def format_key(key: CacheKey) -> str:
    group, salt, tokens = key
    if isinstance(salt, tuple) and salt[0] == "ahead":
        return format_key((group, salt[1], tokens)) + f" ahead={list(salt[2])}"
    if isinstance(salt, tuple):
        salt_part = f" extras={salt[-1]!r}" if len(salt) > 1 else ""
    else:
        salt_part = f" salt={salt!r}" if salt is not None else ""
    shown = ",".join(map(str, tokens[:6])) + (",…" if len(tokens) > 6 else "")
    return f"g{group}{salt_part} [{len(tokens)} tok: {shown}]"


@dataclass(frozen=True)
class RequestView:
    """One request as the manager and the harness see it."""

    status: str
    num_computed_tokens: int
    num_tokens: int
    tables: tuple[tuple[int, ...] | None, ...]
    num_cached_blocks: tuple[int | None, ...]
    partial_hit: tuple[tuple[int, int] | None, ...]
    shared_prefix_boundary: int = 0
    """The junction the scheduler driver's last lookup for it wrote (docs/spec.md §7); 0 at
    the api level."""
    num_drafts: int = 0
    """Scheduler level: the drafts (placeholders included) its next step may verify; 0 once
    it has finished."""
    tokens: tuple[int, ...] = field(default=(), compare=False)
    """The request's token ids, when the side reports them (targets do; checks read them)."""

    def held_blocks(self) -> list[int]:
        """Every non-null block id in this request's tables, with repetitions."""
        return [b for t in self.tables if t for b in t if b != 0]


@dataclass(frozen=True)
class Snapshot:
    """Pool, cache, tables and queues after an op (docs/traces.md#snapshot)."""

    num_blocks: int
    ref_cnt: tuple[int, ...]
    free_queue: tuple[int, ...]
    num_free_blocks: int
    linked: frozenset[int]
    block_keys: tuple[CacheKey | None, ...]
    block_key_tokens: tuple[int | None, ...]
    extra_keys: dict[int, frozenset[CacheKey]]
    cache: dict[CacheKey, tuple[int, ...]]
    requests: dict[str, RequestView]
    pending_copies: tuple[tuple[int, int], ...] = ()
    retained_copies: tuple[tuple[int, int], ...] = ()
    deferred_frees: tuple[tuple[int, ...], ...] = ()
    """Blocks popped for deferred frees and not yet released: one run per (batch, group), in
    the order they will be released (each run tail first); each entry holds a reference."""
    new_block_ids: tuple[int, ...] = ()
    waiting: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    loads: tuple[str, ...] = ()
    """Scheduler level: requests whose KV connector load is in flight, sorted (spec §13.2)."""
    in_flight: tuple[tuple[int, tuple[int, ...], tuple[tuple[str, int], ...]], ...] = ()
    """Scheduler level: steps launched and not yet completed, oldest first, each as (step
    number, the non-null block ids its scheduled requests' tables held at launch, sorted,
    (request id, tokens scheduled) in scheduling order)."""
    hash_collisions: tuple[str, ...] = ()
    _derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # Derived views, computed once per snapshot and shared by every invariant.

    def holders(self) -> list[int]:
        """Per block id: table entries + copy endpoints (pending or retained) holding it."""
        cached = self._derived.get("holders")
        if cached is None:
            cached = [0] * self.num_blocks
            for view in self.requests.values():
                for table in view.tables:
                    if table:
                        for b in table:
                            cached[b] += 1  # null entries too: cached[0] is reset below
            for pairs in (self.pending_copies, self.retained_copies):
                for src, dst in pairs:
                    cached[src] += 1
                    cached[dst] += 1
            for batch in self.deferred_frees:
                for b in batch:
                    cached[b] += 1
            cached[0] = 0
            self._derived["holders"] = cached
        return cached

    def free_set(self) -> frozenset[int]:
        cached = self._derived.get("free_set")
        if cached is None:
            cached = frozenset(self.free_queue)
            self._derived["free_set"] = cached
        return cached

    def differences(self, other: Snapshot) -> list[str]:
        """Readable lines naming every field where self and other differ."""
        lines: list[str] = []
        for f in fields(self):
            if not f.compare:
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                lines.extend(_describe(f.name, a, b))
        return lines

    def render(self) -> str:
        """A compact human-readable dump of the state."""
        out = [
            f"free ({self.num_free_blocks}): {list(self.free_queue)}",
            "ref_cnt: " + " ".join(f"{i}:{r}" for i, r in enumerate(self.ref_cnt) if r),
        ]
        for key, ids in sorted(self.cache.items(), key=lambda kv: (kv[0][0], kv[1])):
            out.append(f"cache {format_key(key)} -> {list(ids)}")
        for rid, view in self.requests.items():
            out.append(
                f"{rid} {view.status} computed={view.num_computed_tokens}/{view.num_tokens} "
                f"tables={[list(t) if t is not None else None for t in view.tables]} "
                f"cached={list(view.num_cached_blocks)}"
                + (f" junction={view.shared_prefix_boundary}" if view.shared_prefix_boundary
                   else "")
            )
        for name in ("pending_copies", "retained_copies", "new_block_ids", "waiting", "running"):
            value = getattr(self, name)
            if value:
                out.append(f"{name}: {list(value)}")
        return "\n".join(out)


def _describe(name: str, a: Any, b: Any) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        lines = []
        for k in sorted(set(a) | set(b), key=repr):
            x, y = a.get(k), b.get(k)
            if x == y:
                continue
            label = format_key(k) if isinstance(k, tuple) and len(k) == 3 else repr(k)
            if isinstance(x, RequestView) and isinstance(y, RequestView):
                lines.extend(
                    f"{name}[{label}].{f.name}: {getattr(x, f.name)!r} vs {getattr(y, f.name)!r}"
                    for f in fields(RequestView)
                    if f.compare and getattr(x, f.name) != getattr(y, f.name)
                )
            else:
                lines.append(f"{name}[{label}]: {x!r} vs {y!r}")
        return lines
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and name in (
        "ref_cnt",
        "block_keys",
        "block_key_tokens",
    ):
        return [f"{name}[block {i}]: {x!r} vs {y!r}" for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return [f"{name}: {a!r} vs {b!r}"]
