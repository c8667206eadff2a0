"""The invariants of docs/spec.md §8 beyond the mission properties (I2, I4 and I8 live in P1-P4).

Each check reads snapshots (content keys, tables, queue) and the op's result; none reaches into
an implementation, so the same checks judge kvcache, vLLM and the reference model.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import Any

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.extra_keys import key_identity
from kvfuzz.core.snapshot import CacheKey, Snapshot
from kvfuzz.properties.registry import CheckContext, invariant, transition

# Kinds whose tables do not grow with the tokens: allocated once (encoder, ring) or never
# (encoder-only attention).
_FIXED_KINDS = ("cross", "circular_buffer", "encoder_only")
# Kinds whose tables release blocks no future token reads (nulls left in place).
_WINDOW_KINDS = ("sliding_window", "chunked_local", "mamba", "rswa")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def skipped_tokens(group: GroupConfig, n: int) -> int:
    """Leading tokens no future token attends to, after n computed (docs/spec.md §4.2)."""
    if group.kind == "sliding_window":
        return max(0, n - group.sliding_window + 1 - group.extra_retained_tokens)
    if group.kind == "chunked_local":
        return (n // group.attention_chunk_size) * group.attention_chunk_size
    if group.kind == "mamba":
        return max(n - 1, 0)
    return 0


def _identity(ctx: CheckContext, rid: str, num_tokens: int, tokens: Sequence[int]) -> Any:
    """What rid's prefix of num_tokens of its `tokens` stands for besides them, the tokens
    after it that a hash lookahead covers included (core/extra_keys.py)."""
    meta = ctx.requests[rid]
    config = ctx.config
    return key_identity(meta.cache_salt, meta.extras, tokens, num_tokens,
                        config.resolved_hash_block_size, config.num_hash_lookahead_tokens)


def _keys_of(s: Snapshot, block: int) -> set[CacheKey]:
    keys = set(s.extra_keys.get(block, ()))
    if s.block_keys[block] is not None:
        keys.add(s.block_keys[block])
    return keys


@invariant(
    "I1",
    "free-queue shape: no block twice, links set exactly on queued blocks, the null block "
    "neither queued nor counted",
    covers=("bugs #1", "FreeToken #202"),
)
def queue_shape(s: Snapshot, ctx: CheckContext) -> str | None:
    if len(s.free_queue) != len(s.free_set()):
        seen: set[int] = set()
        twice = next(b for b in s.free_queue if b in seen or seen.add(b))
        return f"block {twice} is in the free queue twice"
    if s.linked != s.free_set():
        stray = sorted(s.linked ^ s.free_set())
        return f"free-queue links disagree with the queue for blocks {stray}"
    if s.ref_cnt[0] != 0:
        return f"the null block has ref_cnt {s.ref_cnt[0]}"
    return None


@invariant(
    "I3",
    "no non-null block twice in one request's table, and every block in the tables of one "
    "group only",
    covers=("bugs #1",),
)
def no_duplicates(s: Snapshot, ctx: CheckContext) -> str | None:
    group_of: dict[int, int] = {}
    for rid, view in s.requests.items():
        if not any(view.tables):
            continue
        for g, table in enumerate(view.tables):
            if not table:
                continue
            real = [b for b in table if b != 0]
            if len(real) != len(set(real)):
                return f"{rid} group {g} lists a block twice: {list(table)}"
            for b in real:
                if group_of.setdefault(b, g) != g:
                    return f"block {b} is in tables of groups {group_of[b]} and {g}"
    return None


@invariant(
    "I4",
    "the free count equals the queue's length and the number of non-null blocks with ref_cnt 0",
    covers=("bugs #5",),
)
def free_count(s: Snapshot, ctx: CheckContext) -> str | None:
    zero = s.ref_cnt.count(0) - (s.ref_cnt[0] == 0)
    if not s.num_free_blocks == len(s.free_queue) == zero:
        return (
            f"free count {s.num_free_blocks}, queue length {len(s.free_queue)}, "
            f"{zero} blocks with ref_cnt 0"
        )
    return None


@invariant(
    "I5",
    "hash-map consistency: every mapped block carries its key, every key a block carries is "
    "mapped, a key's group is its block's group, and the token count goes with the primary key",
    covers=("bugs #7", "bugs #8", "bugs #9", "kvcached #362"),
)
def map_consistent(s: Snapshot, ctx: CheckContext) -> str | None:
    primary, extras, key_tokens = s.block_keys, s.extra_keys, s.block_key_tokens
    for key, ids in s.cache.items():
        for b in ids:
            if b == 0:
                return "the null block is in the hash map"
            if primary[b] != key and key not in extras.get(b, ()):
                return f"the map lists block {b} under a key the block does not carry"
    # Every block is checked, but a block without a key can only fail by having a token count:
    # when the blocks with a key are exactly those with a token count, only they are visited.
    n = min(len(primary), len(key_tokens))
    keyed = list(compress(range(n), primary))
    if (
        len(keyed) != n - primary[:n].count(None)
        or len(keyed) != n - key_tokens[:n].count(None)
        or None in [key_tokens[b] for b in keyed]
    ):
        keyed = range(n)
    group_of: dict[int, int] = {}  # block -> the group of every key it carries, or -1 if mixed
    for b in keyed:
        key, tokens = primary[b], key_tokens[b]
        if (key is None) != (tokens is None):
            return f"block {b}: key {key!r} but hash token count {tokens!r}"
        if key is None:
            continue
        if key[2] and tokens != len(key[2]):
            return f"block {b}: its key covers {len(key[2])} tokens but records {tokens}"
        if b not in s.cache.get(key, ()):
            return f"block {b} carries a key the map does not list it under"
        group_of[b] = key[0]
    for b, keys in extras.items():
        for key in keys:
            if b not in s.cache.get(key, ()):
                return f"block {b} carries an extra key the map does not list it under"
            if group_of.setdefault(b, key[0]) != key[0]:
                group_of[b] = -1
    if not group_of:
        return None
    for view in s.requests.values():
        if not any(view.tables):
            continue
        for g, table in enumerate(view.tables):
            foreign = [b for b in table or () if b and group_of.get(b, g) != g]
            if foreign:
                return f"block {foreign[0]} in a group-{g} table carries another group's key"
    return None


@invariant(
    "H1",
    "block hashes are injective over the prefixes seen: no hash stands for two prefixes",
    covers=("I13", "bugs #16", "bugs #17", "bugs #19"),
)
def no_hash_collision(s: Snapshot, ctx: CheckContext) -> str | None:
    return s.hash_collisions[0] if s.hash_collisions else None


@transition(
    "I6",
    "a block held throughout an op keeps its keys, unless the op is evict_blocks or "
    "reset_prefix_cache (eviction happens only to free blocks), or its keys moved to the "
    "destination of a copy it is the new source of (a Mamba align state, spec §11.3)",
    covers=("I6",),
)
def eviction_only_when_free(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    if ctx.op["op"] in ("evict_blocks", "reset_prefix_cache"):
        return None
    keys0, keys1 = before.block_keys, after.block_keys
    if keys0 == keys1 or None not in [keys1[b] for b in compress(range(len(keys1)), keys0)]:
        return None  # no block lost its key
    copies = set(after.pending_copies) - set(before.pending_copies)
    if ctx.op["op"] == "step" and isinstance(ctx.result, dict):  # taken within the step
        copies |= {(src, dst) for src, dst in ctx.result.get("copies", ())}
    moved = {src for src, dst in copies if keys1[dst] == keys0[src]}
    for rid, old in before.requests.items():
        new = after.requests.get(rid)
        if new is None:
            continue
        for t0, t1 in zip(old.tables, new.tables):
            for b0, b1 in zip(t0 or (), t1 or ()):
                if (b0 and b0 == b1 and before.block_keys[b0] and after.block_keys[b0] is None
                        and b0 not in moved):
                    return f"block {b0}, held by {rid} throughout, lost its key"
    return None


@transition(
    "I7",
    "eviction order: blocks that stay free keep their order and blocks leave from the head (or "
    "as cached hits); released uncached blocks go to the head (later release first), released "
    "cached ones to the tail (earlier release first), each release in the caller's order (a "
    "table tail first; with evict_first cached ones join the head run); so uncached free blocks "
    "precede cached ones, bar keys stripped in place or freed evict_first",
    covers=("bugs #11", "bugs #12", "bugs #13"),
)
def eviction_order(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    q0, q1, kind = before.free_queue, after.free_queue, ctx.op["op"]
    first = bool(ctx.op.get("evict_first"))
    calls = _releases(before, after, ctx)
    head, tail = _queued(before, calls or [], first)
    if q0 == q1 and not head and not tail:
        return None
    pos = {b: i for i, b in enumerate(q0)}
    keys0 = before.block_keys
    # A reset strips keys in place, after its releases: the queue reads with the keys before.
    keys1 = keys0 if kind == "reset_prefix_cache" else after.block_keys
    if calls is None:
        # A step may take blocks (pops from the head, hits) and release them again: at most
        # `reach` blocks of the old queue were popped, and hits are cached blocks.
        reach = sum(p.free_before - p.free_after for p in ctx.observations.allocations
                    if p.outcome == "blocks")

        def moved(b: int) -> bool:
            at = pos.get(b)
            return at is None or at < reach or keys0[b] is not None
    else:

        def moved(b: int) -> bool:
            return b not in pos

    # The queue must read [released uncached | stayed free, in order | released cached].
    i, j = 0, len(q1)
    while i < j and (first or keys1[q1[i]] is None) and moved(q1[i]):
        i += 1
    while j > i and keys1[q1[j - 1]] is not None and moved(q1[j - 1]):
        j -= 1
    last = -1
    for b in q1[i:j]:
        at = pos.get(b)
        if at is None:
            end = "head" if first or keys1[b] is None else "tail"
            return f"{kind} released block {b} into the free queue, not at its {end}: {list(q1)}"
        if at < last:
            return (f"after {kind} block {q0[last]} precedes block {b} in the free queue, unlike "
                    "before (a block that stays free keeps its place, a released one goes to an "
                    "end)")
        last = at
    free1 = after.free_set()
    if i < j:
        first = pos[q1[i]]
        gone = next((b for b in q0[first:] if keys0[b] is None and b not in free1), None)
        if gone is not None:
            return (f"uncached block {gone} left the free queue from behind block {q0[first]}, "
                    "which stayed (blocks are taken from the head)")
    if calls is None:
        return None
    for got, want, end, first_release in ((q1[:i], head, "head", "later"),
                                          (q1[j:], tail, "tail", "earlier")):
        want = [b for b in want if b in free1]
        if list(got) != want:
            return (f"{kind} queued {list(got)} at the {end}, expected {want} ({first_release} "
                    "release first, each in the caller's order: a table tail first)")
    return None


def _releases(before: Snapshot, after: Snapshot, ctx: CheckContext) -> list[list[int]] | None:
    """The op's free_blocks calls, each with its blocks in the caller's order (docs/spec.md §3.6,
    §4.7); None for a scheduler step or step completion, whose releases the snapshots do not
    show."""
    op = ctx.op
    kind = op["op"]
    if kind in ("step", "complete_step"):
        return None
    if kind in ("free", "abort", "finish", "finish_load"):
        view = before.requests.get(op["request_id"])
        if kind == "finish_load" and any(after.requests[op["request_id"]].tables):
            return []  # the load landed: the request keeps its blocks
        return [list(reversed(t)) for t in view.tables if t] if view else []
    if kind == "release_copies":
        return [[b for pair in before.retained_copies for b in pair]]
    if kind == "reset_prefix_cache" and op.get("reset_running_requests"):
        # The scheduler preempts every running request first, the last first.
        return [list(reversed(t)) for rid in reversed(before.running)
                for t in before.requests[rid].tables if t]
    if kind == "release_deferred":
        return [list(reversed(batch)) for batch in before.deferred_frees]
    if kind == "allocate_slots":
        # Out-of-window blocks, nulled and released highest index first, group by group.
        old = before.requests[op["request_id"]].tables
        new = after.requests[op["request_id"]].tables
        return [[t0[k] for k in range(min(len(t0), len(t1)) - 1, -1, -1) if t0[k] and not t1[k]]
                for t0, t1 in zip(old, new) if t0 and t1]
    return []


def _queued(before: Snapshot, calls: list[list[int]],
            evict_first: bool = False) -> tuple[list[int], list[int]]:
    """Where free_blocks puts what these calls release: the head run and the tail run (empty
    with `evict_first`, which puts cached blocks in the head run too)."""
    counts: dict[int, int] = {}
    head: list[int] = []
    tail: list[int] = []
    for blocks in calls:
        run = []
        for b in blocks:
            if b:
                counts[b] = counts.get(b, before.ref_cnt[b]) - 1
                if counts[b] == 0:
                    to_head = evict_first or before.block_keys[b] is None
                    (run if to_head else tail).append(b)
        head[:0] = run
    return head, tail


@transition(
    "F1",
    "an evict_first free is a plain free but for where it queues: the same blocks freed (the "
    "same free count), their keys kept (still hits until popped), and those that reached zero "
    "are the next to evict, ahead of every block already free, which keeps its order",
    covers=("spec §3.6",),
)
def evict_first_free(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    op = ctx.op
    if op["op"] != "release_deferred" or not op.get("evict_first") or ctx.result is not None:
        return None
    calls = _releases(before, after, ctx) or []
    head, _ = _queued(before, calls, evict_first=True)
    plain = _queued(before, calls)
    freed = len(plain[0]) + len(plain[1])
    if after.num_free_blocks != before.num_free_blocks + freed:
        return (f"release_deferred(evict_first) left {after.num_free_blocks} blocks free; the "
                f"plain free frees {freed} more than the {before.num_free_blocks} before")
    changed = [b for b in range(after.num_blocks)
               if after.block_keys[b] != before.block_keys[b]]
    if changed or after.cache != before.cache:
        return (f"release_deferred(evict_first) changed the cache keys (of blocks {changed}); "
                "it only moves where freed blocks queue")
    expected = (*head, *before.free_queue)
    if after.free_queue != expected:
        return (f"release_deferred(evict_first) left the free queue {list(after.free_queue)}, "
                f"expected {list(expected)}: the released {head} next to evict, then the "
                "blocks already free in their order")
    return None


@transition(
    "I9",
    "get_computed_blocks changes no block, queue, map or table",
    covers=("I9",),
)
def lookup_is_pure(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    if ctx.op["op"] == "get_computed_blocks" and before != after:
        return "get_computed_blocks changed: " + "; ".join(before.differences(after)[:3])
    return None


@transition(
    "I10",
    "atomicity: an error changes nothing; a None from the gate changes nothing; a None from "
    "the capacity check only nulls and frees out-of-window blocks of that request",
    covers=("bugs #10", "bugs #23"),
)
def atomic_refusal(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    result = ctx.result
    if isinstance(result, dict) and "error" in result:
        if before != after:
            return f"{ctx.op['op']} raised {result['error']} but changed: " + "; ".join(
                before.differences(after)[:3]
            )
        return None
    if ctx.op["op"] != "allocate_slots" or result is not None:
        return None
    outcome = ctx.observations.allocations[-1].outcome if ctx.observations.allocations else "gate"
    if outcome == "gate":
        if before != after:
            return "the full-sequence gate refused but state changed: " + "; ".join(
                before.differences(after)[:3]
            )
        return None
    rid = ctx.op["request_id"]
    if before.block_keys != after.block_keys or before.cache != after.cache:
        return "a refused allocate_slots changed cache keys"
    for b in range(1, before.num_blocks):
        if after.ref_cnt[b] > before.ref_cnt[b]:
            return f"a refused allocate_slots took a reference on block {b}"
    for other, view in before.requests.items():
        new = after.requests[other]
        if other != rid:
            if new != view:
                return f"a refused allocate_slots of {rid} changed request {other}"
            continue
        if new.num_cached_blocks != view.num_cached_blocks:
            return f"a refused allocate_slots changed num_cached_block of {rid}"
        for g, (t0, t1) in enumerate(zip(view.tables, new.tables)):
            if (t0 or ()) == (t1 or ()):
                continue
            if t0 is None or t1 is None or len(t0) != len(t1) or any(
                b1 not in (b0, 0) for b0, b1 in zip(t0, t1)
            ):
                return f"a refused allocate_slots changed {rid}'s group-{g} table {t0} -> {t1}"
    return None


def scheduled_writes(before: Snapshot, after: Snapshot, ctx: CheckContext):
    """(request id, first position, end position) of the KV each scheduled request writes."""
    op = ctx.op
    if op["op"] == "allocate_slots" and isinstance(ctx.result, dict) and "block_ids" in ctx.result:
        rid = op["request_id"]
        end = after.requests[rid].num_computed_tokens
        yield rid, end - op["num_new_tokens"], end
    elif op["op"] == "step" and isinstance(ctx.result, dict) and "scheduled" in ctx.result:
        for rid, n, hit in ctx.result["scheduled"]:
            if rid in before.requests:
                start = before.requests[rid].num_computed_tokens + hit
                yield rid, start, start + n


@transition(
    "I11",
    "no KV is written into a block the writer already held under a full-block key covering the "
    "written positions (cached blocks are immutable)",
    covers=("bugs #6", "bugs #18"),
)
def cached_blocks_immutable(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    for rid, start, end in scheduled_writes(before, after, ctx):
        old, new = before.requests.get(rid), after.requests.get(rid)
        if old is None or new is None or new.status != "RUNNING":
            continue
        if old.status != "RUNNING" and end - start == 1 and end == old.num_tokens and (
            ctx.config.kv_connector
        ):
            continue  # a landed load covering the prompt recomputes its last token (§13.2)
        for g, group in enumerate(ctx.config.groups):
            t0, t1 = old.tables[g], new.tables[g]
            if group.kind == "cross" or not t0 or not t1:
                continue
            bs = group.block_size
            for index in range(max(start, 0) // bs, min(cdiv(end, bs), len(t0), len(t1))):
                b = t0[index]
                covered = before.block_key_tokens[b] if b else None
                if b == t1[index] and covered is not None and covered > max(start, index * bs):
                    return (
                        f"{rid} writes positions {start}..{end - 1} into block {b} (group {g}), "
                        f"which it already held under a key covering {covered} tokens"
                    )
    return None


@transition(
    "I12",
    "hit bounds: 0 <= hit <= the ceiling (num_tokens-1, lowered by the request's hit limit and "
    "the lookup's bound; the get_num_cached_tokens probe's answer too, up to num_tokens-1), "
    "aligned, within the hashed tokens "
    "(but chunked local's null prefix), cdiv(hit, bs_g) blocks per group, no nulls in "
    "full-attention lists, skipped(hit)//bs leading nulls in sliding-window lists",
    covers=("bugs #14", "bugs #15", "#46453"),
)
def hit_bounds(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    config, op, result = ctx.config, ctx.op, ctx.result
    if op["op"] == "step" and isinstance(result, dict) and "scheduled" in result:
        for rid, _, hit in result["scheduled"]:
            view = before.requests.get(rid)
            if hit and view is not None:
                # A plain step first completes the steps in flight, whose output may append
                # tokens before the lookup; the step itself samples at most one more.
                num_tokens = view.num_tokens if not before.in_flight else max(
                    view.num_tokens, after.requests[rid].num_tokens - 1)
                problem = _hit_length_problem(config, hit, _ceiling(ctx, rid, num_tokens))
                if problem:
                    return f"{rid}: {problem}"
        return None
    if op["op"] not in ("get_computed_blocks", "get_num_cached_tokens") or not isinstance(
            result, dict) or "error" in result:
        return None
    rid = op["request_id"]
    probe = op["op"] == "get_num_cached_tokens"
    hit = result["num_cached_tokens" if probe else "num_computed_tokens"]
    num_tokens = after.requests[rid].num_tokens
    # The probe's answer against the hit limit is P5's (it must equal the lookup's hit).
    ceiling = ((num_tokens, num_tokens - 1) if probe
               else _ceiling(ctx, rid, num_tokens, op.get("max_cache_hit_length")))
    problem = _hit_length_problem(config, hit, ceiling) if hit else None
    if problem:
        return f"{rid}: {problem}" + (" (get_num_cached_tokens)" if probe else "")
    if hit and ctx.requests[rid].skip_reading_prefix_cache:
        return f"{rid} skips reading the prefix cache but hit {hit} tokens"
    if probe:
        return None
    for g, (group, ids) in enumerate(zip(config.groups, result["block_ids"])):
        if group.kind == "circular_buffer":
            if ids:
                return f"group {g} is a circular buffer but the lookup returned blocks {ids}"
            continue
        if len(ids) != cdiv(hit, group.block_size):
            return f"{rid}: group {g} lists {len(ids)} blocks for a {hit}-token hit"
        if group.kind == "full" and 0 in ids:
            return f"{rid}: the full-attention hit of group {g} contains the null block"
        if group.kind == "sliding_window" and not group.extra_retained_tokens and (
            not config.use_eagle
        ):
            nulls = next((i for i, b in enumerate(ids) if b != 0), len(ids))
            expected = skipped_tokens(group, hit) // group.block_size
            if nulls != expected:
                return f"{rid}: group {g} hit starts with {nulls} nulls, expected {expected}"
    return None


@transition(
    "I20",
    "a lookup's shared_prefix_boundary is 0, or lies past the hit and within num_tokens-1; "
    "always 0 with one KV cache group (no other group can lag behind it)",
    covers=("I20",),
)
def prefix_boundary(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    for rid, hit, boundary in ctx.observations.lookups:
        if boundary == 0:
            continue
        if len(ctx.config.groups) == 1:
            return f"{rid}: shared_prefix_boundary {boundary} with a single KV cache group"
        num_tokens = after.requests[rid].num_tokens
        if not hit < boundary <= num_tokens - 1:
            return (f"{rid}: shared_prefix_boundary {boundary} outside {hit + 1}.."
                    f"{num_tokens - 1} (hit {hit}, {num_tokens} tokens)")
    return None


def _ceiling(ctx: CheckContext, rid: str, num_tokens: int, bound: int | None = None
             ) -> tuple[int, int]:
    """(num_tokens, the longest hit allowed): num_tokens - 1, lowered by the request's hit
    limit and the lookup's bound (docs/spec.md §6.3 step 2)."""
    meta = ctx.requests.get(rid)
    limit = meta.prefix_cache_hit_limit if meta is not None else None
    return num_tokens, min(c for c in (num_tokens - 1, limit, bound) if c is not None)


def _hit_length_problem(config: Config, hit: int, ceiling: tuple[int, int]) -> str | None:
    num_tokens, most = ceiling
    if not 0 <= hit <= most:
        return f"hit {hit} outside 0..{most}"
    if hit % config.alignment_tokens:
        return f"hit {hit} is not a multiple of the alignment {config.alignment_tokens}"
    hashed = (num_tokens // config.resolved_hash_block_size) * config.resolved_hash_block_size
    if hit > hashed and not any(g.kind == "chunked_local" for g in config.groups):
        return f"hit {hit} exceeds the {hashed} hashed tokens"
    return None


@transition(
    "I13",
    "a hit serves only the requester's own prefix: each hit block carries the key of the "
    "request's salt, extra keys and tokens up to that block (so salts, LoRA adapters, "
    "multimodal inputs and embeddings isolate, and collisions show)",
    covers=("bugs #16", "bugs #17", "bugs #18", "bugs #19"),
)
def hits_match_prefix(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    op, result = ctx.op, ctx.result
    if op["op"] != "get_computed_blocks" or not isinstance(result, dict) or "error" in result:
        return None
    rid, hit = op["request_id"], result["num_computed_tokens"]
    tokens = after.requests[rid].tokens
    for g, (group, ids) in enumerate(zip(ctx.config.groups, result["block_ids"])):
        bs = group.block_size
        for j, b in enumerate(ids):
            if b == 0:
                continue
            end = min((j + 1) * bs, hit)
            # A key may cover more of the block than the hit does (an EAGLE drop inside the
            # block), but only the requester's own tokens, and no more than the block holds.
            if not any(
                key[0] == g and end <= len(key[2]) <= (j + 1) * bs
                and key[2] == tokens[: len(key[2])]
                and key[1] == _identity(ctx, rid, len(key[2]), tokens)
                for key in _keys_of(after, b)
            ):
                return (
                    f"{rid} (salt {ctx.requests[rid].cache_salt!r}) hit block {b} at group {g} "
                    f"position {j}, but the "
                    f"block does not hold that request's {end}-token prefix"
                )
    return None


@transition(
    "I14",
    "append-only tables: a running request's table entries never change, except replacement "
    "by the null block in window groups",
    covers=("I14", "bugs #26"),
)
def append_only(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    for rid, old in before.requests.items():
        new = after.requests.get(rid)
        if new is None:
            continue
        if new is old or new.tables == old.tables:
            continue
        for g, (t0, t1) in enumerate(zip(old.tables, new.tables)):
            if not t0 or t1 is None:
                continue
            if len(t1) < len(t0):
                return f"{rid}'s group-{g} table shrank from {len(t0)} to {len(t1)} blocks"
            window = ctx.config.groups[g].kind in _WINDOW_KINDS
            for j, (b0, b1) in enumerate(zip(t0, t1)):
                if b0 != b1 and not (window and b1 == 0):
                    return f"{rid}'s group-{g} table entry {j} changed from block {b0} to {b1}"
    return None


@invariant(
    "I15",
    "num_cached_block never exceeds the table's length",
    covers=("I15",),
)
def cached_prefix_bookkeeping(s: Snapshot, ctx: CheckContext) -> str | None:
    for rid, view in s.requests.items():
        if not any(view.num_cached_blocks):
            continue  # every count is None or 0, which no table length is below
        for g, (table, cached) in enumerate(zip(view.tables, view.num_cached_blocks)):
            if cached is not None and cached > len(table or ()):
                return f"{rid} group {g}: num_cached_block {cached} > {len(table or ())} blocks"
    return None


@invariant(
    "I16",
    "cleanup: a request that is not running has no table, num_cached_block or partial-hit "
    "record in any group, unless KV loaded for it: a load in flight, or a landed one it waits "
    "with",
    covers=("bugs #22",),
)
def cleanup(s: Snapshot, ctx: CheckContext) -> str | None:
    untracked = (None,) * len(ctx.config.groups)
    for rid, view in s.requests.items():
        if view.status == "RUNNING" or _holds_loaded_kv(s, ctx, rid, view):
            continue
        if not view.tables == view.num_cached_blocks == view.partial_hit == untracked:
            return f"{rid} is {view.status} but the manager still tracks it: {view.tables}"
    return None


@invariant(
    "I17",
    "status vs holdings: waiting and preempted requests have no computed tokens unless KV "
    "loaded for them; a running or KV-loading request's tables cover its computed tokens in "
    "every non-cross group",
    covers=("bugs #4", "bugs #20"),
)
def status_vs_holdings(s: Snapshot, ctx: CheckContext) -> str | None:
    for rid, view in s.requests.items():
        if view.status in ("WAITING", "PREEMPTED") and view.num_computed_tokens and (
            not any(view.tables)
        ):
            return f"{rid} is {view.status} with {view.num_computed_tokens} computed tokens"
        if view.status not in ("RUNNING", "WAITING_FOR_REMOTE_KVS") and not (
            _holds_loaded_kv(s, ctx, rid, view) and view.num_computed_tokens
        ):
            continue
        for g, group in enumerate(ctx.config.groups):
            needed = cdiv(view.num_computed_tokens, group.block_size)
            if group.kind not in _FIXED_KINDS and len(view.tables[g] or ()) < needed:
                return (
                    f"{rid} computed {view.num_computed_tokens} tokens but holds "
                    f"{len(view.tables[g] or ())} group-{g} blocks (needs {needed})"
                )
    return None


def _holds_loaded_kv(s: Snapshot, ctx: CheckContext, rid: str, view: Any) -> bool:
    """KV connector holdings (docs/spec.md §13.2): a load in flight (the request waiting for
    it or aborted meanwhile), or, on a connector config, a landed load the request waits with
    (its computed tokens may be 0: a one-token prompt recomputes its token)."""
    return rid in s.loads or (ctx.config.kv_connector
                              and view.status in ("WAITING", "PREEMPTED"))


@invariant(
    "C1",
    "KV loads: a request waiting for remote KV has a load in flight; a request with a load in "
    "flight is waiting for it or finished; a finished request whose load ended holds no block",
    covers=("spec §13.2", "bugs #22"),
)
def kv_loads(s: Snapshot, ctx: CheckContext) -> str | None:
    for rid, view in s.requests.items():
        loading = rid in s.loads
        if view.status == "WAITING_FOR_REMOTE_KVS" and not loading:
            return f"{rid} waits for remote KV but no load is in flight for it"
        if loading and view.status not in ("WAITING_FOR_REMOTE_KVS",) and not (
            view.status.startswith("FINISHED")
        ):
            return f"{rid} is {view.status} while its KV load is in flight"
        if view.status.startswith("FINISHED") and not loading and any(
            t for t in view.tables if t
        ):
            return f"{rid} is {view.status}, its load ended, yet it holds {view.tables}"
    return None


@invariant(
    "S1",
    "state groups: a running request holds the state block of its last computed token and "
    "its speculative blocks after it",
    covers=("spec §11",),
)
def state_blocks_held(s: Snapshot, ctx: CheckContext) -> str | None:
    for g, group in enumerate(ctx.config.groups):
        if group.kind != "mamba":
            continue
        for rid, view in s.requests.items():
            n = view.num_computed_tokens
            if view.status != "RUNNING" or not n:
                continue
            if n < 0:
                return f"{rid} is running with {n} computed tokens"
            table = view.tables[g] or ()
            last = (n - 1) // group.block_size
            if last >= len(table) or table[last] == 0:
                return f"{rid} group {g}: the state after token {n - 1} (position {last}) is not held"
            needed = cdiv(n, group.block_size) + group.num_speculative_blocks
            if len(table) < needed:
                return (
                    f"{rid} group {g}: {len(table)} state blocks, needs {needed} "
                    f"({group.num_speculative_blocks} speculative)"
                )
    return None


@invariant(
    "EO1",
    "encoder-only groups take no KV cache: no request's table in such a group holds a block",
    covers=("spec §12.4",),
)
def encoder_only_holds_nothing(s: Snapshot, ctx: CheckContext) -> str | None:
    groups = [g for g, group in enumerate(ctx.config.groups) if group.kind == "encoder_only"]
    if not groups:
        return None
    for rid, view in s.requests.items():
        for g in groups:
            if view.tables[g]:
                return f"{rid} group {g} is encoder-only but holds blocks {list(view.tables[g])}"
    return None


@transition(
    "I18",
    "window nulls: after an allocation, every position of a window group below "
    "skipped(settled tokens)//bs holds the null block",
    covers=("bugs #2", "bugs #3"),
)
def window_nulls(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    for rid, start, _ in scheduled_writes(before, after, ctx):
        view = after.requests.get(rid)
        if view is None or view.status != "RUNNING":
            continue
        settled = min(start - _in_flight_tokens(before, ctx, rid), ctx.config.max_model_len)
        for g, group in enumerate(ctx.config.groups):
            if group.kind not in _WINDOW_KINDS or not view.tables[g]:
                continue
            table = view.tables[g]
            upto = min(skipped_tokens(group, settled) // group.block_size, len(table))
            live = [j for j in range(upto) if table[j] != 0]
            if live:
                return (
                    f"{rid} group {g}: position {live[0]} still holds block {table[live[0]]} "
                    f"although {skipped_tokens(group, settled)} tokens are out of the window"
                )
    return None


def _in_flight_tokens(before: Snapshot, ctx: CheckContext, rid: str) -> int:
    """Tokens of rid still in flight when a step op allocates (docs/spec.md §7.1): none for a
    step that first completes every step in flight."""
    if ctx.op["op"] != "step" or not ctx.op.get("in_flight"):
        return 0
    return sum(n for _, _, scheduled in before.in_flight for r, n in scheduled if r == rid)


@transition(
    "I19",
    "reset_prefix_cache succeeds iff no non-null block is held, and leaves no key anywhere",
    covers=("bugs #23",),
)
def reset_rule(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    if ctx.op["op"] != "reset_prefix_cache" or not isinstance(ctx.result, bool):
        return None
    # With reset_running_requests the scheduler first preempts every running request.
    state = after if ctx.op.get("reset_running_requests") else before
    held = [b for b in range(1, state.num_blocks) if state.ref_cnt[b] > 0]
    if ctx.result == bool(held):
        return f"reset_prefix_cache returned {ctx.result} with held blocks {held[:8]}"
    if ctx.result and (after.cache or after.extra_keys or any(after.block_keys)):
        return "reset_prefix_cache returned True but keys remain"
    return None


@invariant(
    "H2",
    "block hashes are the documented ones: every request's hashes equal the target's "
    "documented hash function applied to its tokens and extra keys (a router's view, "
    "harness/router_hash.py), so event and lookup hashes mean what a router computes",
    covers=("spec §2.3",),
)
def documented_hashes(s: Snapshot, ctx: CheckContext) -> str | None:
    mismatches = ctx.observations.hash_mismatches
    return mismatches[0] if mismatches else None
