"""Checks on KV cache events (docs/spec.md §3.10), for configs with kv_events.

A target's events are read as content (`KvEvent`) after every op; these checks hold each op's
events, and the replay a take_events op reports, against the target's own cache map.
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.sides import CachedReport, KvEvent, Observations, take_events_result
from kvfuzz.core.snapshot import CacheKey, Snapshot, format_key
from kvfuzz.properties.registry import CheckContext, transition


@transition(
    "EV1",
    "replaying every KV event from the start gives exactly the cache map's keys",
    covers=("spec §3.10",),
)
def events_replay_to_cache(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    if ctx.op["op"] != "take_events" or not isinstance(ctx.result, dict) or "error" in ctx.result:
        return None
    want = take_events_result(after.cache)["cached"]
    got = ctx.result["cached"]
    if got == want:
        return None
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    return (f"the events replay to {len(got)} cached keys, the cache map has {len(want)}: "
            f"cached but not replayed {missing[:2]}, replayed but not cached {extra[:2]}")


@transition(
    "EV2",
    "no BlockRemoved for a key another block still holds (a removal leaves it uncached "
    "unless a later event of the same op stores it again)",
    covers=("spec §3.10", "bugs #25"),
)
def no_removal_while_held(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    events = ctx.observations.kv_events
    for i, event in enumerate(events):
        if event.kind != "removed":
            continue
        for key in event.keys:
            restored = any(e.kind == "stored" and key in e.keys for e in events[i + 1:])
            if key in after.cache and not restored:
                return (f"BlockRemoved for {format_key(key)} while block(s) "
                        f"{list(after.cache[key])} still hold it")
    return None


@transition(
    "EV3",
    "each BlockStored chains on its parent: key i covers the parent's tokens plus (i+1) "
    "blocks of the event's token ids, all in the event's group",
    covers=("spec §3.10",),
)
def stored_events_chain(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    for event in ctx.observations.kv_events:
        if event.kind != "stored":
            continue
        parent = event.parent[2] if event.parent is not None else ()
        bs, start = event.block_size, len(parent)
        if len(event.token_ids) != len(event.keys) * bs:
            return (f"BlockStored of {len(event.keys)} block(s) of {bs} tokens carries "
                    f"{len(event.token_ids)} token ids")
        for i, key in enumerate(event.keys):
            want = parent + event.token_ids[: (i + 1) * bs]
            if key[0] != event.group or key[2] != want:
                return (f"BlockStored key {i} is {format_key(key)}, but its parent and token "
                        f"ids make the group-{event.group} prefix of {len(want)} tokens")
    return None


@transition(
    "EV4",
    "the op's event stream, in order with its duplicates, is exactly its cache map changes: "
    "replaying it from the holders of each key before the op (BlockStored: one more, "
    "BlockRemoved: none left, AllBlocksCleared: none anywhere) ends with the key's holders "
    "after the op; a key with none left was removed, and one still held was announced once "
    "per block that newly holds it (a copy lost unannounced excepted)",
    covers=("spec §3.10",),
)
def events_match_cache_changes(before: Snapshot, after: Snapshot,
                               ctx: CheckContext) -> str | None:
    if not ctx.observations.events_reported:
        return None
    events = split_reports(ctx.observations)[0]
    if not events and before.cache == after.cache:
        return None
    count: dict[CacheKey, int] = {}
    copies: dict[CacheKey, int] = {}  # holders the key had in the op, less its removals
    cleared = False

    def holders(key: CacheKey) -> int:
        if key not in count:
            count[key] = 0 if cleared else len(before.cache.get(key, ()))
            copies[key] = count[key]
        return count[key]

    stored: set[CacheKey] = set()
    extended: dict[CacheKey, int] = {}  # stored keys that a later BlockStored chains on
    for event in events:
        if event.kind == "cleared":
            cleared, count, copies = True, {}, {}
            continue
        if event.kind == "stored" and event.parent in stored:
            extended[event.parent] = extended.get(event.parent, 0) + 1
        for key in event.keys:
            held = holders(key)
            if event.kind == "stored":
                count[key] = held + 1
                copies[key] += 1
                stored.add(key)
            elif copies[key] == 0:
                return f"BlockRemoved for {format_key(key)}, which no block held"
            else:  # each evicted copy may announce it (vLLM, kvcache), never more often
                count[key] = 0
                copies[key] -= 1
    lost = ctx.observations.lost_copies
    # In the events' order, then the maps': a set's order would vary from run to run.
    for key in dict.fromkeys([*count, *before.cache, *after.cache]):
        # A state block (Mamba) drops a key it stored in the op as its request writes on, an
        # unannounced loss whenever another block keeps the key: only the lower bounds hold.
        moved_on = None if _is_state_group(ctx, key[0]) else extended.get(key, 0)
        problem = _holder_problem(key, holders(key), before, after, moved_on, lost.count(key))
        if problem:
            return problem
    return None


def _is_state_group(ctx: CheckContext, group: int) -> bool:
    groups = ctx.config.groups
    return 0 <= group < len(groups) and groups[group].kind == "mamba"


def _holder_problem(key: CacheKey, replayed: int, before: Snapshot, after: Snapshot,
                    moved_on: int | None, lost: int = 0) -> str | None:
    """Why `replayed` holders of `key` (the events replayed from the holders before the op)
    disagree with the cache map after it. A key's copy lost while another block holds it
    leaves without an event: each holder before or after may have lost it so, and so may each
    block that stored it in the op and moved on to a longer key chained on it (`moved_on`: a
    Mamba state's key advancing, a partial entry promoted), or that the target saw lose it
    while another block held it (`lost`: a copy stored and evicted in one op, e.g. a failed
    synchronous load), so the replay may exceed the holders after by as many. With one holder
    throughout, nothing chained on the key and no copy seen lost, nothing is lost
    unannounced. `moved_on` None: any number may have been lost so."""
    old, new = set(before.cache.get(key, ())), set(after.cache.get(key, ()))
    if replayed < len(new):
        return (f"block(s) {sorted(new - old) or sorted(new)} newly hold {format_key(key)}, "
                f"but the op's events announce {replayed} holder(s) of {len(new)}")
    if not new and replayed:
        return (f"{format_key(key)} left the cache map (held by {sorted(old)} before), but no "
                "BlockRemoved says so" if old else
                f"BlockStored for {format_key(key)}, which no block holds after the op")
    if replayed <= len(new) or moved_on is None:
        return None
    unannounced = len(old | new) + moved_on if len(old | new) + moved_on > 1 else 0
    if replayed > len(new) + unannounced + lost:
        return (f"{format_key(key)} is announced as stored {replayed - len(new)} time(s) more "
                f"than blocks newly hold it, with no BlockRemoved between (held by "
                f"{sorted(old)} before, {sorted(new)} after)")
    return None


def expected_extra_keys(key: CacheKey, block_size: int) -> tuple[Any, ...]:
    """What a BlockStored's extra keys must name for `key`'s last `block_size` tokens, read
    from the key's identity (core/extra_keys.py): the LoRA name, each multimodal input the
    window its hash covers overlaps as `(identifier, offset from the block's start)`, the salt
    on block 0; the embeddings' digest is left out (each target renders its own)."""
    ident, tokens = key[1], key[2]
    if isinstance(ident, tuple) and ident[0] == "ahead":
        ident = ident[1]
    start = len(tokens) - block_size
    if not isinstance(ident, tuple):
        return (ident,) if ident and start == 0 else ()
    blocks = ident[1:]
    hbs = len(tokens) // len(blocks)
    lora: list[Any] = []
    mm: list[Any] = []
    salt: list[Any] = []
    for j in range(start // hbs, len(blocks)):
        for extra in blocks[j]:
            if extra[0] == "lora" and not lora:
                lora.append(extra[1])
            elif extra[0] == "mm" and (extra[1], j * hbs + extra[2] - start) not in mm:
                mm.append((extra[1], j * hbs + extra[2] - start))
            elif extra[0] == "cache_salt" and start == 0:
                salt = [extra[1]]
    return (*lora, *mm, *salt)


@transition(
    "EV5",
    "each BlockStored names, per key, the extra keys of the block it covers (with its hash "
    "lookahead): the LoRA name, each multimodal input it overlaps with its offset in the "
    "block, the salt on block 0",
    covers=("spec §3.10",),
)
def stored_events_extra_keys(before: Snapshot, after: Snapshot,
                             ctx: CheckContext) -> str | None:
    for event in ctx.observations.kv_events:
        if event.kind != "stored" or not event.keys:
            continue
        got = event.extra_keys or ((),) * len(event.keys)
        if len(got) != len(event.keys):
            return (f"BlockStored of {len(event.keys)} key(s) carries {len(got)} extra-key "
                    "entries")
        for i, key in enumerate(event.keys):
            want = expected_extra_keys(key, event.block_size)
            if got[i] != want:
                return (f"BlockStored key {i} ({format_key(key)}) names extra keys "
                        f"{list(got[i])}, its block's are {list(want)}")
    return None


def split_reports(obs: Observations) -> tuple[list[KvEvent], list[CachedReport]]:
    """The op's events less the re-announcements its full-mode lookups owe (each report
    matched, in order, to the first unmatched BlockStored it describes exactly), and the
    reports no event matched."""
    events = list(obs.kv_events)
    missing = []
    for report in obs.cached_reports:
        match = next((i for i, e in enumerate(events) if _is_report(e, report)), None)
        if match is None:
            missing.append(report)
        else:
            del events[match]
    return events, missing


def _is_report(event: KvEvent, report: CachedReport) -> bool:
    return (event.kind == "stored" and (event.parent is None) == (report.first_block == 0)
            and event.group == report.group
            and event.block_size == report.block_size and len(event.keys) == report.num_blocks
            and event.token_ids == report.token_ids
            and (report.keys is None or event.keys == report.keys))


@transition(
    "EV6",
    "a lookup with a hit of a request in kv_cache_report_mode \"full\" re-announces the hit: "
    "per run of real blocks in a group's hit, one BlockStored of exactly those blocks (their "
    "keys, chained on the position before them, no parent at token 0, the group's block size, "
    "their tokens); null placeholders are not announced",
    covers=("spec §3.10",),
)
def hit_reported_in_full_mode(before: Snapshot, after: Snapshot,
                              ctx: CheckContext) -> str | None:
    if not ctx.observations.events_reported or not ctx.observations.cached_reports:
        return None
    missing = split_reports(ctx.observations)[1]
    if not missing:
        return None
    r = missing[0]
    start = r.first_block * r.block_size
    return (f"request {r.request_id!r}'s lookup hit {r.num_blocks} block(s) of group "
            f"{r.group} in kv_cache_report_mode \"full\", but no BlockStored of those blocks "
            f"(tokens [{start}, {start + r.num_blocks * r.block_size}), "
            f"{'no parent' if not start else 'chained on the block before'}) follows")
