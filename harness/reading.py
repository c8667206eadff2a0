"""Reading a `Snapshot` out of a vLLM-shaped manager (kvcache, or vLLM itself).

Both name their state alike (docs/spec.md, NOTES.md): `block_pool.blocks[i].ref_cnt / block_hash /
block_hash_num_tokens`, the free queue's sentinels and links, `cached_block_hash_to_block._cache`
(and `_dup_ids` where the map holds block ids: kvcache, vLLM 0.34),
`cached_block_hashes_by_block`, and per layer-3 manager `req_to_blocks`, `num_cached_block`,
`_partial_hit_reqs`, `_pending_cow_copies`, `new_block_ids`. Hash keys are translated to content
(`CacheKey`) through the prefixes of the requests the harness created.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum
from operator import attrgetter
from typing import Any

from kvfuzz.core.extra_keys import Extras, key_identity
from kvfuzz.core.snapshot import CacheKey, RequestView, Snapshot


def packed_key(block_hash: Any, group: int) -> bytes:
    """The key a block is filed under in vLLM's and kvcache's hash map: its hash, then its KV
    cache group as 4 big-endian bytes (`KeyTranslator` reads it back)."""
    return bytes(block_hash) + group.to_bytes(4, "big")


class KeyTranslator:
    """Maps packed keys (hash bytes + 4-byte big-endian group id, as vLLM and kvcache key
    blocks) back to prefix content, and keeps each request's tokens as a tuple
    (re-read only when the request grows)."""

    def __init__(self, hash_block_size: int, strict: bool = True, lookahead: int = 0) -> None:
        self._hbs = hash_block_size
        self._lookahead = lookahead
        """num_hash_lookahead_tokens: a key also stands for the tokens after its prefix."""
        self._strict = strict
        self._prefix_of: dict[bytes, tuple[Any, tuple[int, ...]]] = {}
        self._seen: dict[str, int] = {}
        self._unknown: set[str] = set()
        self._memo: dict[bytes, CacheKey] = {}
        self._tokens: dict[str, tuple[int, ...]] = {}
        self._status_names: dict[type, dict[Any, str]] = {}
        self.views: dict[str, tuple[tuple[Any, ...], RequestView]] = {}
        """Request id -> the fields last read for it and the `RequestView` made of them."""
        self.last: dict[str, tuple[Any, ...]] = {}
        """Part of a snapshot -> what `read_snapshot` last read for it and what it made of that."""
        self.collisions: list[str] = []
        self.extras: dict[str, Extras] = {}
        """Request id -> its extra-key inputs, for requests that have any."""

    def tokens(self, request: Any, num_tokens: int | None = None) -> tuple[int, ...]:
        """The request's tokens; tokens are only ever appended, so the length says if stale."""
        known = self._tokens.get(request.request_id)
        if known is None or len(known) != (
            request.num_tokens if num_tokens is None else num_tokens
        ):
            known = self._tokens[request.request_id] = tuple(request.all_token_ids)
        return known

    @property
    def num_prefixes(self) -> int:
        """How many prefixes are known: they only grow, so an equal count means equal keys."""
        return len(self._prefix_of)

    def status_name(self, status: Any) -> str:
        """`status.name`, looked up once per enum member (an Enum's `name` is a slow property)."""
        names = self._status_names.get(type(status))
        if names is None:
            if not isinstance(status, Enum):
                return status.name
            names = self._status_names[type(status)] = {m: m.name for m in type(status)}
        return names[status]

    def learn_all(self, requests: Iterable[Any]) -> None:
        """`learn` every request that computed block hashes since last time."""
        seen = self._seen
        for request in requests:
            if seen.get(request.request_id, 0) != len(request.block_hashes):
                self.learn(request)

    def learn(self, request: Any) -> None:
        """Record the prefixes behind any block hashes the request computed since last time."""
        hashes = request.block_hashes
        start = self._seen.get(request.request_id, 0)
        if start == len(hashes):
            return
        salt = request.cache_salt or None
        tokens = self.tokens(request)
        extras = self.extras.get(request.request_id)
        lookahead = self._lookahead
        for k in range(start, len(hashes)):
            end = (k + 1) * self._hbs
            ident = salt if extras is None and not lookahead else key_identity(
                salt, extras, tokens, end, self._hbs, lookahead)
            prefix = (ident, tokens[:end])
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


def _prefix_text(prefix: tuple[Any, tuple[int, ...]]) -> str:
    salt, tokens = prefix
    return f"({len(tokens)} tokens, {'extras' if isinstance(salt, tuple) else 'salt'} {salt!r})"


def read_snapshot(
    manager: Any,
    requests: Iterable[Any],
    keys: KeyTranslator,
    retained_copies: Sequence[tuple[int, int]] = (),
    waiting: Iterable[Any] = (),
    running: Iterable[Any] = (),
) -> Snapshot:
    """The state of `manager` and of the harness-held requests and copies.

    Runs after every op, so it reads every field, in plain loops, but does not rebuild what
    reads as last time (`keys` keeps it): a key's translation, a request's tokens, a request's
    `RequestView` when all its fields read the same (the same object then stands in both
    snapshots, so comparing them is cheap), the block keys when every block's hash is the same,
    the linked set when the same blocks are linked, and the map when it holds the same entries.
    """
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
    # Most ops change neither keys nor links. A translation depends only on the prefixes the
    # translator knows, which only grow: the same count of them means the same translations.
    last = keys.last
    known_prefixes = keys.num_prefixes
    # The private fields behind the block_hash properties where they are properties (kvcache,
    # vLLM up to 0.33), else the plain fields (vLLM 0.34); a snapshot reads every block after
    # every op.
    private = hasattr(blocks[0], "_block_hash") if blocks else True
    hashes = [b._block_hash for b in blocks] if private else [b.block_hash for b in blocks]
    prev = last.get("block_keys")
    if prev is not None and prev[0] == hashes and prev[1] == known_prefixes:
        block_keys = prev[2]
    else:
        block_keys = tuple([None if h is None else key(h) for h in hashes])
        last["block_keys"] = (hashes, known_prefixes, block_keys)
    key_tokens = tuple([b._block_hash_num_tokens for b in blocks] if private
                       else [b.block_hash_num_tokens for b in blocks])
    linked_ids = [
        b.block_id for b in blocks if b.prev_free_block is not None and b.next_free_block is not None
    ]
    prev = last.get("linked")
    if prev is not None and prev[0] == linked_ids:
        linked = prev[1]
    else:
        linked = frozenset(linked_ids)
        last["linked"] = (linked_ids, linked)
    hash_map = pool.cached_block_hash_to_block
    entries = hash_map._cache
    dup_ids = getattr(hash_map, "_dup_ids", None)
    if dup_ids is None:
        # Per key one block or a dict of blocks (vLLM up to 0.33); the map reads the
        # same when the same keys hold the same block objects (a block's id never changes).
        held = [tuple(e.values()) if isinstance(e, dict) else e for e in entries.values()]
    else:
        # Per key a block id, and every id of a key several blocks hold in _dup_ids (kvcache,
        # vLLM 0.34).
        held = [tuple(dup_ids[k]) if k in dup_ids else i for k, i in entries.items()]
    prev = last.get("cache")
    if prev is not None and prev[1] == held and prev[0] == list(entries) and (
        prev[2] == known_prefixes
    ):
        cache = prev[3]
    else:
        cache = {}
        for packed, blocks_of_key in zip(entries, held):
            cache[key(packed)] = (
                tuple([_block_id(b) for b in blocks_of_key]) if type(blocks_of_key) is tuple
                else (_block_id(blocks_of_key),)
            )
        last["cache"] = (list(entries), held, known_prefixes, cache)
    singles = manager.coordinator.single_type_managers
    tables_of = [m.req_to_blocks for m in singles]
    cached_of = [m.num_cached_block for m in singles]
    partial_of = [m._partial_hit_reqs for m in singles]
    # A request none of these maps mentions reads as untracked in every group.
    tracked = set().union(*tables_of, *cached_of, *partial_of)
    untracked = (None,) * len(singles)
    known_views = keys.views
    views = {}
    for request in requests:
        rid = request.request_id
        num_tokens = request.num_tokens
        tokens = keys.tokens(request, num_tokens)
        name = keys.status_name(request.status)
        if rid in tracked:
            tables = tuple([_table(t.get(rid)) for t in tables_of])
            cached = tuple([c.get(rid) for c in cached_of])
            partial = tuple([_partial(p.get(rid)) for p in partial_of])
        else:
            tables = cached = partial = untracked
        drafts = 0 if name.startswith("FINISHED") else len(getattr(request, "spec_token_ids",
                                                                   ()))
        fields = (name, request.num_computed_tokens, num_tokens, tables, cached, partial,
                  request.shared_prefix_boundary, drafts, tokens)
        known = known_views.get(rid)
        if known is None or known[0] != fields:
            known = known_views[rid] = (fields, RequestView(*fields))
        views[rid] = known[1]
    return Snapshot(
        num_blocks=len(blocks),
        ref_cnt=tuple([b.ref_cnt for b in blocks]),
        free_queue=tuple(free),
        num_free_blocks=pool.get_num_free_blocks(),
        linked=linked,
        block_keys=block_keys,
        block_key_tokens=key_tokens,
        extra_keys={
            bid: frozenset([key(k) for k in extra])
            for bid, extra in pool.cached_block_hashes_by_block.items()
            if extra
        },
        cache=cache,
        requests=views,
        pending_copies=tuple(
            [(src.block_id, dst.block_id) for m in singles for src, dst in m._pending_cow_copies]
        ),
        retained_copies=tuple(retained_copies),
        new_block_ids=tuple([i for m in singles for i in m.new_block_ids]),
        waiting=tuple([r.request_id for r in waiting]),
        running=tuple([r.request_id for r in running]),
        hash_collisions=tuple(keys.collisions),
    )


def _block_id(block: Any) -> int:
    return block if type(block) is int else block.block_id


def _table(blocks: Sequence[Any] | None) -> tuple[int, ...] | None:
    return None if blocks is None else tuple([b.block_id for b in blocks])


def _partial(entry: tuple[int, Any] | None) -> tuple[int, int] | None:
    return None if entry is None else (entry[0], entry[1].block_id)
