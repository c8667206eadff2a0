"""Prefix-cache lookup: the per-kind hit searches (docs/spec.md §4.9), the unitary and hybrid
coordinators' reconciliation (§5.4, §5.5) and get_computed_blocks (§6.3).

A position hits when, for every group in the call, some cache entry holds exactly the request's
salt and token prefix ending at that position. Everything here only reads the state.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfuzz.reference_model.layout import Group, Layout, cdiv
from kvfuzz.reference_model.requests import Request
from kvfuzz.reference_model.state import NULL, State

Lists = list[list[int]]


@dataclass(frozen=True)
class Search:
    """The arguments of one find_longest_cache_hit call (docs/spec.md §4.9)."""

    state: State
    req: Request
    hashed: int
    """len(block_hashes) · hbs: prefixes longer than this have no hash."""
    hbs: int
    gids: tuple[int, ...]
    spec: Group
    max_length: int
    drop_eagle: bool
    alignment: int

    def probe(self, num_tokens: int) -> list[int] | None:
        """get_cached_block (docs/spec.md §3.2) for the prefix of num_tokens tokens: one block per
        group id, or None when some group misses (or the prefix has no hash)."""
        if num_tokens > self.hashed:
            return None
        found = []
        for g in self.gids:
            block = self.state.find_block(self.req.key(g, num_tokens))
            if block is None:
                return None
            found.append(block)
        return found


def search_full(s: Search) -> tuple[Lists, int]:
    """Full attention (docs/spec.md §4.9.1): left to right, stop at the first miss; Tier-B phase 2
    probes partial entries inside the next block; EAGLE drop; alignment trim."""
    bs = s.spec.bs
    lists: Lists = [[] for _ in s.gids]
    count = 0
    for j in range(s.max_length // bs):
        found = s.probe((j + 1) * bs)
        if found is None:
            break
        for lst, b in zip(lists, found):
            lst.append(b)
        count += 1
    hit = count * bs
    if s.alignment < bs and bs % s.alignment == 0:
        m = bs // s.alignment
        first = count * m
        top = min(first + m - 1, s.max_length // s.alignment, s.hashed // s.hbs)
        for index in range(top - 1, first - 1, -1):
            found = s.probe((index + 1) * s.hbs)
            if found is not None:
                for lst, b in zip(lists, found):
                    lst.append(b)
                hit = (index + 1) * s.alignment
                break
    if s.drop_eagle and hit > 0:
        hit -= min(s.alignment, bs)
    hit -= hit % s.alignment
    return [lst[: cdiv(hit, bs)] for lst in lists], hit


def search_sliding(s: Search) -> tuple[Lists, int]:
    """Sliding window (docs/spec.md §4.9.2): right to left for `need` contiguous hits ending at an
    aligned edge; else the run from block 0; EAGLE drop; alignment trims."""
    bs = s.spec.bs
    need = cdiv(s.spec.window - 1, bs) + (1 if s.drop_eagle else 0)
    max_blocks = s.max_length // bs
    lists: Lists = [[NULL] * max_blocks for _ in s.gids]
    run = 0
    found_run = False
    for i in range(max_blocks - 1, -1, -1):
        found = s.probe((i + 1) * bs)
        if found is None:
            run = 0
            continue
        if run == 0 and bs != s.alignment:
            edge = (i if s.drop_eagle else i + 1) * bs
            if edge % s.alignment != 0:
                continue
        for lst, b in zip(lists, found):
            lst[i] = b
        run += 1
        if run >= need:
            lists = [lst[: i + run] for lst in lists]
            found_run = True
            break
    if not found_run:
        lists = [lst[:run] for lst in lists]
        lists = _trim_to_alignment(lists, bs, s.alignment)
    if s.drop_eagle and lists[0]:
        lists = [lst[:-1] for lst in lists]
        lists = _trim_to_alignment(lists, bs, s.alignment)
    return lists, len(lists[0]) * bs


def _trim_to_alignment(lists: Lists, bs: int, alignment: int) -> Lists:
    """When bs != alignment, drop trailing blocks until len · bs is a multiple of alignment."""
    length = len(lists[0])
    if bs != alignment:
        while length > 0 and (length * bs) % alignment != 0:
            length -= 1
    return [lst[:length] for lst in lists]


def search_chunked(s: Search) -> tuple[Lists, int]:
    """Chunked local (docs/spec.md §4.9.3): nulls up to the current chunk, then left to right."""
    bs, c = s.spec.bs, s.spec.chunk
    max_blocks = s.max_length // bs
    start = (s.max_length // c) * c if s.max_length > 0 else 0
    lists: Lists = [[NULL] * (start // bs) for _ in s.gids]
    for j in range(start // bs, max_blocks):
        found = s.probe((j + 1) * bs)
        if found is None:
            break
        for lst, b in zip(lists, found):
            lst.append(b)
    return lists, len(lists[0]) * bs


def search_mamba(s: Search) -> tuple[Lists, int]:
    """Recurrent state (docs/spec.md §11.3): the rightmost cached state at or below max_length,
    at any hash boundary when the alignment is finer than bs, else at a block end that is a
    multiple of the alignment; the hit block comes after nulls."""
    bs = s.spec.bs
    if s.alignment < bs and bs % s.alignment == 0:
        ends = [(i + 1) * s.hbs for i in range(min(s.max_length, s.hashed) // s.hbs)]
    else:
        ends = [(i + 1) * bs for i in range(s.max_length // bs)
                if (i + 1) * bs % s.alignment == 0]
    for end in reversed(ends):
        found = s.probe(end)
        if found is not None:
            return [[NULL] * ((end - 1) // bs) + [b] for b in found], end
    return [[] for _ in s.gids], 0


def search_nothing(s: Search) -> tuple[Lists, int]:
    """A circular buffer is never cached (docs/spec.md §12.3)."""
    return [[] for _ in s.gids], 0


SEARCHES = {"full": search_full, "sliding_window": search_sliding, "chunked_local": search_chunked,
            "circular_buffer": search_nothing, "mamba": search_mamba}


def find_longest_cache_hit(layout: Layout, state: State, req: Request,
                           bound: int | None = None) -> tuple[Lists, int, int]:
    """The coordinator's lookup with max_cache_hit_length = the least of num_tokens − 1, the
    request's prefix_cache_hit_limit and `bound` (docs/spec.md §6.3 step 2): the lists, the hit,
    and the uncached common prefix (0 with one group)."""
    max_hit = min(x for x in (req.num_tokens - 1, req.prefix_cache_hit_limit, bound)
                  if x is not None)
    hashed = req.hashed_tokens(layout.hbs)
    if not layout.hybrid:
        g = layout.groups[0]
        s = Search(state, req, hashed, layout.hbs, (0,), g, max_hit, g.drops, g.bs)
        return (*SEARCHES[g.kind](s), 0)
    return _hybrid_fixed_point(layout, state, req, max_hit, hashed)


def _hybrid_fixed_point(
    layout: Layout, state: State, req: Request, max_hit: int, hashed: int
) -> tuple[Lists, int, int]:
    """docs/spec.md §5.5 "Lookup (fixed point)"."""
    L = max_hit
    longest = 0
    results: dict[int, tuple[Lists, int]] = {}
    """Spec-group index -> its latest search result."""
    verified: set[int] = set()
    sgs = layout.spec_groups
    simple = len(sgs) == 2 and sgs[0].spec.kind == "full"
    while True:
        cur = L
        for n, sg in enumerate(sgs):
            if sg.spec.kind == "full" and n in results:
                cur = min(cur, results[n][1])
                continue
            drop = sg.use_eagle and n not in verified
            max_len = min(cur + _eagle_margin(layout, sg.spec), hashed) if drop else cur
            s = Search(state, req, hashed, layout.hbs, sg.gids, sg.spec, max_len, drop,
                       layout.alignment)
            lists, length = SEARCHES[sg.spec.kind](s)
            if drop:
                verified.add(n)
            elif length < cur:
                verified.clear()
            cur = length
            longest = max(longest, cur)
            results[n] = (lists, length)
        if cur >= L:
            break
        L = cur
        if simple:
            break
    out: Lists = [[] for _ in layout.groups]
    for n, sg in enumerate(sgs):
        lists, _ = results[n]
        for gid, lst in zip(sg.gids, lists):
            out[gid] = lst[: cdiv(L, sg.spec.bs)] if sg.spec.kind == "full" else lst
    return out, L, longest - L


def _eagle_margin(layout: Layout, spec: Group) -> int:
    """How far past the bound an EAGLE search matches before it drops its last unit: one hash
    block for full attention under partial hits, else one block; none for Mamba, whose search
    never drops (§11.3)."""
    if spec.kind == "mamba":
        return 0
    return layout.hbs if spec.kind == "full" and layout.partial_hits else spec.bs


def get_computed_blocks(layout: Layout, state: State, req: Request,
                        bound: int | None = None) -> tuple[Lists, int, int]:
    """docs/spec.md §6.3: (per-group hit lists, hit length, shared-prefix boundary); empty when
    the lookup is disabled (no caching, skip_reading_prefix_cache, or a hit limit of 0)."""
    if not layout.caching or req.skip_reading_prefix_cache or req.prefix_cache_hit_limit == 0:
        return [[] for _ in layout.groups], 0, 0
    lists, hit, uncached = find_longest_cache_hit(layout, state, req, bound)
    return lists, hit, hit + uncached if uncached else 0


def get_computed_blocks_for_connector(layout: Layout, state: State, req: Request
                                      ) -> tuple[Lists, int, int, bool]:
    """docs/spec.md §13.1: with state groups beside full attention (and caching on), every
    spec group searched alone (an EAGLE group past the bound, then dropping, as in the fixed
    point); full attention's hit is the local prefix unless another group
    hit deeper (then get_computed_blocks). Also: whether some group's hit (0 for a group never
    searched) is shorter than it. Otherwise get_computed_blocks and False."""
    sgs = layout.spec_groups if layout.hybrid else []
    if not (layout.caching and sgs and sgs[0].spec.kind == "full"
            and any(g.kind == "mamba" for g in layout.groups)):
        return (*get_computed_blocks(layout, state, req), False)
    if req.skip_reading_prefix_cache or req.prefix_cache_hit_limit == 0:
        return [[] for _ in layout.groups], 0, 0, False
    max_hit = min(x for x in (req.num_tokens - 1, req.prefix_cache_hit_limit) if x is not None)
    hashed = req.hashed_tokens(layout.hbs)
    lists: Lists = [[] for _ in layout.groups]
    hits = [0] * len(layout.groups)
    for sg in sgs:
        max_len = max_hit
        if sg.use_eagle:
            max_len = min(max_hit + _eagle_margin(layout, sg.spec), hashed)
        s = Search(state, req, hashed, layout.hbs, sg.gids, sg.spec, max_len, sg.use_eagle,
                   layout.alignment)
        found, length = SEARCHES[sg.spec.kind](s)
        for gid, lst in zip(sg.gids, found):
            lists[gid], hits[gid] = lst, length
    local = hits[sgs[0].gids[0]]
    if max(hits) > local:
        return (*get_computed_blocks(layout, state, req), False)
    return lists, local, 0, min(hits) < local
