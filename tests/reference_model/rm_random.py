"""Random API-level traces for the model's self-checks: plausible, mostly valid ops, sized from
the model's own lookup results and snapshots."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from harness.errors import InvalidTrace
from rm_support import Runner

BASE = [5, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3]


def random_prompt(rng: random.Random, max_len: int) -> list[int]:
    """A prompt sharing a prefix with other prompts more often than not."""
    n = rng.choice([rng.randint(1, max_len), rng.choice([16, 17, 20, 24, 33, 40]) % max_len + 1])
    shared = rng.choice([0, n, n, rng.randint(0, n), min(n, rng.choice([8, 16, 32]))])
    return [BASE[i % len(BASE)] + 10 * (i // len(BASE)) for i in range(shared)] + [
        rng.randint(0, 3) for _ in range(n - shared)
    ]


def _allocate(rng: random.Random, rid: str, room: int, use_lookup: bool) -> dict[str, Any]:
    """allocate_slots for up to `room` new tokens (rarely a misuse: -1)."""
    room = max(room, 0)
    return {
        "op": "allocate_slots",
        "request_id": rid,
        "num_new_tokens": rng.choice([rng.randint(0, room), room, room, -1 if rng.random() < 0.05 else room]),
        "use_lookup": use_lookup,
        "num_lookahead_tokens": rng.choice([0, 0, 0, 2, 5]),
        "full_sequence_must_fit": rng.random() < 0.3,
        "reserved_blocks": rng.choice([0, 0, 0, 1, 3]),
        "has_scheduled_reqs": rng.random() < 0.8,
        "num_encoder_tokens": rng.choice([0, 0, 0, 3, 9]),
    }


def _next_op(m: Runner, rng: random.Random, lookup: tuple[str, int] | None) -> dict[str, Any]:
    """The next op; after a lookup (request id, hit), usually the allocation that uses it."""
    snap = m.snap
    live = [r for r, v in snap.requests.items() if not v.status.startswith("FINISHED")]
    if lookup is not None and rng.random() < 0.9:
        rid, hit = lookup
        view = snap.requests[rid]
        return _allocate(rng, rid, view.num_tokens - view.num_computed_tokens - hit, True)
    max_len = m.model.layout.max_model_len
    kind = rng.choices(
        ["add", "lookup", "decode", "free", "cache", "evict", "reset", "copies", "ids"],
        weights=[2, 4, 5, 2, 1, 1, 0.2, 1, 0.5],
    )[0]
    if kind == "add" or not live:
        return {
            "op": "add_request",
            "request_id": f"r{len(snap.requests)}",
            "prompt": random_prompt(rng, min(max_len - 1, 48)),
            "cache_salt": rng.choice([None, None, None, "s"]),
            "skip_reading_prefix_cache": rng.random() < 0.1,
        }
    rid = rng.choice(live)
    view = snap.requests[rid]
    if kind == "lookup":
        return {"op": "get_computed_blocks", "request_id": rid}
    if kind == "decode":
        if view.num_computed_tokens == view.num_tokens and view.num_tokens < max_len:
            return {"op": "append_tokens", "request_id": rid, "tokens": [rng.randint(0, 3)]}
        return _allocate(rng, rid, view.num_tokens - view.num_computed_tokens, False)
    if kind == "free":
        return {"op": "free", "request_id": rid, "preempt": rng.random() < 0.7}
    if kind == "cache":
        return {"op": "cache_blocks", "request_id": rid}
    if kind == "evict":
        return {"op": "evict_blocks", "block_ids": [rng.randrange(snap.num_blocks)]}
    if kind == "reset":
        return {"op": "reset_prefix_cache"}
    if kind == "copies":
        return {"op": rng.choice(["take_kv_cache_block_copies", "release_copies"])}
    return {"op": "take_new_block_ids"}


def random_run(m: Runner, rng: random.Random, n_ops: int) -> Iterator[tuple[dict, Any]]:
    """Apply up to n_ops random ops to m (skipping invalid ones), yielding (op, result)."""
    lookup: tuple[str, int] | None = None
    for _ in range(n_ops):
        op = _next_op(m, rng, lookup)
        try:
            result = m.run(**op)
        except InvalidTrace:
            lookup = None
            continue
        lookup = None
        if op["op"] == "get_computed_blocks":
            lookup = (op["request_id"], result["num_computed_tokens"])
        yield op, result
