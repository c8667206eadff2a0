"""Checks on KV cache events (docs/spec.md §3.10), for configs with kv_events.

A target's events are read as content (`KvEvent`) after every op; these checks hold each op's
events, and the replay a take_events op reports, against the target's own cache map.
"""

from __future__ import annotations

from kvfuzz.core.sides import take_events_result
from kvfuzz.core.snapshot import Snapshot, format_key
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
