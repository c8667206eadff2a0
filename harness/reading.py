"""Reading a `Snapshot` out of a vLLM-shaped manager (kvcache, or vLLM 0.33.0 itself).

Both name their state alike (SPEC.md, NOTES.md): `block_pool.blocks[i].ref_cnt / block_hash /
block_hash_num_tokens`, the free queue's sentinels and links, `cached_block_hash_to_block._cache`,
`cached_block_hashes_by_block`, and per layer-3 manager `req_to_blocks`, `num_cached_block`,
`_partial_hit_reqs`, `_pending_cow_copies`, `new_block_ids`. Hash keys are translated to content
(`CacheKey`) through the prefixes of the requests the harness created.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from harness.snapshot import CacheKey, RequestView, Snapshot


class KeyTranslator:
    """Maps packed keys (hash bytes + 4-byte big-endian group id) back to prefix content, and
    keeps each request's tokens as a tuple (re-read only when the request grows)."""

    def __init__(self, hash_block_size: int, strict: bool = True) -> None:
        self._hbs = hash_block_size
        self._strict = strict
        self._prefix_of: dict[bytes, tuple[str | None, tuple[int, ...]]] = {}
        self._seen: dict[str, int] = {}
        self._unknown: set[str] = set()
        self._memo: dict[bytes, CacheKey] = {}
        self._tokens: dict[str, tuple[int, ...]] = {}
        self.collisions: list[str] = []

    def tokens(self, request: Any) -> tuple[int, ...]:
        """The request's tokens; tokens are only ever appended, so the length says if stale."""
        known = self._tokens.get(request.request_id)
        if known is None or len(known) != request.num_tokens:
            known = self._tokens[request.request_id] = tuple(request.all_token_ids)
        return known

    def learn(self, request: Any) -> None:
        """Record the prefixes behind any block hashes the request computed since last time."""
        hashes = request.block_hashes
        start = self._seen.get(request.request_id, 0)
        if start == len(hashes):
            return
        salt = request.cache_salt or None
        tokens = self.tokens(request)
        for k in range(start, len(hashes)):
            prefix = (salt, tokens[: (k + 1) * self._hbs])
            known = self._prefix_of.setdefault(hashes[k], prefix)
            if known != prefix:
                self.collisions.append(
                    f"hash {bytes(hashes[k])[:6].hex()}… of request {request.request_id!r} "
                    f"fingerprints {_prefix_text(prefix)} but also {_prefix_text(known)}"
                )
        self._seen[request.request_id] = len(hashes)

    def key(self, packed: bytes) -> CacheKey:
        """The content behind a key; an unknown hash reads as `(group, "<hash …>", ())`."""
        known = self._memo.get(packed)
        if known is None:
            known = self._translate(packed)
            if known[2]:
                self._memo[packed] = known
        return known

    def _translate(self, packed: bytes) -> CacheKey:
        group = int.from_bytes(packed[-4:], "big")
        raw = bytes(packed[:-4])
        known = self._prefix_of.get(raw)
        if known is None:
            label = f"<hash {raw[:6].hex()}>"
            if self._strict and label not in self._unknown:
                self._unknown.add(label)
                self.collisions.append(f"cache key {label} of group {group} matches no prefix")
            return (group, label, ())
        return (group, known[0], known[1])


def _prefix_text(prefix: tuple[str | None, tuple[int, ...]]) -> str:
    salt, tokens = prefix
    return f"({len(tokens)} tokens, salt {salt!r})"


def read_snapshot(
    manager: Any,
    requests: Iterable[Any],
    keys: KeyTranslator,
    retained_copies: Sequence[tuple[int, int]] = (),
    waiting: Iterable[Any] = (),
    running: Iterable[Any] = (),
) -> Snapshot:
    """The state of `manager` and of the harness-held requests and copies."""
    pool = manager.block_pool
    blocks = pool.blocks
    queue = pool.free_block_queue
    free: list[int] = []
    append = free.append
    node = queue.fake_free_list_head.next_free_block
    tail = queue.fake_free_list_tail
    for _ in range(len(blocks) + 2):  # bounded: a corrupted queue may have a cycle
        if node is None or node is tail:
            break
        append(node.block_id)
        node = node.next_free_block
    key = keys.key
    # The private fields behind the block_hash properties: both implementations name them so,
    # and a snapshot reads every block after every op.
    hashes = [b._block_hash for b in blocks]
    block_keys = tuple([None if h is None else key(h) for h in hashes])
    key_tokens = tuple([b._block_hash_num_tokens for b in blocks])
    linked = frozenset(
        [b.block_id for b in blocks if b.prev_free_block is not None and b.next_free_block is not None]
    )
    cache: dict[CacheKey, tuple[int, ...]] = {}
    for packed, entry in pool.cached_block_hash_to_block._cache.items():
        ids = tuple(b.block_id for b in entry.values()) if isinstance(entry, dict) else (
            entry.block_id,
        )
        cache[key(packed)] = ids
    singles = manager.coordinator.single_type_managers
    tables_of = [m.req_to_blocks for m in singles]
    cached_of = [m.num_cached_block for m in singles]
    partial_of = [m._partial_hit_reqs for m in singles]
    views = {}
    for request in requests:
        rid = request.request_id
        views[rid] = RequestView(
            status=request.status.name,
            num_computed_tokens=request.num_computed_tokens,
            num_tokens=request.num_tokens,
            tables=tuple([_table(t.get(rid)) for t in tables_of]),
            num_cached_blocks=tuple([c.get(rid) for c in cached_of]),
            partial_hit=tuple([_partial(p.get(rid)) for p in partial_of]),
            tokens=keys.tokens(request),
        )
    return Snapshot(
        num_blocks=len(blocks),
        ref_cnt=tuple([b.ref_cnt for b in blocks]),
        free_queue=tuple(free),
        num_free_blocks=pool.get_num_free_blocks(),
        linked=linked,
        block_keys=block_keys,
        block_key_tokens=key_tokens,
        extra_keys={
            bid: frozenset(key(k) for k in extra)
            for bid, extra in pool.cached_block_hashes_by_block.items()
            if extra
        },
        cache=cache,
        requests=views,
        pending_copies=tuple(
            (src.block_id, dst.block_id) for m in singles for src, dst in m._pending_cow_copies
        ),
        retained_copies=tuple(retained_copies),
        new_block_ids=tuple(i for m in singles for i in m.new_block_ids),
        waiting=tuple(r.request_id for r in waiting),
        running=tuple(r.request_id for r in running),
        hash_collisions=tuple(keys.collisions),
    )


def _table(blocks: Sequence[Any] | None) -> tuple[int, ...] | None:
    return None if blocks is None else tuple([b.block_id for b in blocks])


def _partial(entry: tuple[int, Any] | None) -> tuple[int, int] | None:
    return None if entry is None else (entry[0], entry[1].block_id)
