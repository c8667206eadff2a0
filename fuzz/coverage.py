"""Behaviour coverage for the Hypothesis engine: which kinds of outcome a campaign has seen.

A feature is (level, config, op, outcome class): an allocation that returned None, adopted a
hit or raised; a lookup that hit fully, partly or not at all; a step that preempted, finished,
copied. The count of distinct features is the "coverage" a campaign reports (the atheris engine
reports libFuzzer's edge coverage instead).

Besides the outcome classes, `StateProbe` names what the state did around each op, as features
(level, config, "reached", NAME): a cached block evicted, a block left a window (a null block in
a windowed group's table), the pool ran dry; `behaviour_features` adds a lookup that hit up to
its request's `prefix_cache_hit_limit`. `kvfuzz.fuzz.report` turns all of them into the named
behaviours a campaign reached, and those it never reached.
"""

from __future__ import annotations

from typing import Any


def _bucket(n: int) -> int:
    return n if n < 3 else 3


def outcome_class(op: dict[str, Any], result: Any) -> tuple[Any, ...]:
    """A coarse, finite description of what an op did."""
    if isinstance(result, dict) and "error" in result:
        return ("error", result["error"])
    name = op["op"]
    if name == "allocate_slots":
        if result is None:
            return ("none", op["use_lookup"], op["full_sequence_must_fit"])
        taken = sum(len(g) for g in result["block_ids"])
        return ("blocks", op["use_lookup"], _bucket(taken), op["num_lookahead_tokens"] > 0)
    if name == "get_computed_blocks":
        hit = result["num_computed_tokens"]
        nulls = sum(1 for g in result["block_ids"] for b in g if b == 0)
        return ("hit", _bucket(hit // 4), nulls > 0)
    if name == "step":
        return (
            _bucket(len(result["scheduled"])),
            bool(result["preempted"]),
            bool(result["finished"]),
            bool(result["copies"]),
            any(hit for _, _, hit in result["scheduled"]),
        )
    if name in ("reset_prefix_cache", "take_kv_cache_block_copies", "take_new_block_ids"):
        return (bool(result),)
    if name == "free":
        return (op["preempt"],)
    return ()


REACHED = "reached"
"""The op field of a state behaviour's feature."""
WINDOW_KINDS = ("sliding_window", "chunked_local")
"""Group kinds whose tables hold null blocks for the tokens outside the window."""


def behaviour_features(execution: Any) -> set[tuple[Any, ...]]:
    """The features of one execution (its ops and the reference's results)."""
    level, config = execution.level, execution.config.name
    features = {
        (level, config, op["op"], *outcome_class(op, result))
        for op, result in zip(execution.trace.ops, execution.results)
    }
    if _hit_limit_met(execution):
        features.add((level, config, REACHED, "hit_limit"))
    return features


def _hit_limit_met(execution: Any) -> bool:
    """A lookup hit at least the request's prefix_cache_hit_limit less one block."""
    limits: dict[str, int] = {}
    step = max(execution.config.block_sizes)
    for op, result in zip(execution.trace.ops, execution.results):
        if op["op"] == "add_request" and op.get("prefix_cache_hit_limit") is not None:
            limits[op["request_id"]] = op["prefix_cache_hit_limit"]
        elif op["op"] == "get_computed_blocks" and op["request_id"] in limits:
            hit = result.get("num_computed_tokens", 0) if isinstance(result, dict) else 0
            if 0 < hit and hit + step > limits[op["request_id"]]:
                return True
    return False


class StateProbe:
    """Collects the state behaviours of a run's ops (`observe` after each op, given the
    reference's snapshot before it)."""

    def __init__(self) -> None:
        self.features: set[tuple[Any, ...]] = set()

    def observe(self, execution: Any, before: Any) -> None:
        after, config = execution.state, execution.config
        where = (execution.level, config.name, REACHED)
        if after.num_free_blocks == 0:
            self.features.add((*where, "pool_dry"))
        if before.block_keys != after.block_keys and execution.trace.ops[-1]["op"] != \
                "reset_prefix_cache" and any(
                    old is not None and new != old
                    for old, new in zip(before.block_keys, after.block_keys)):
            self.features.add((*where, "eviction"))
        windows = [g for g, group in enumerate(config.groups) if group.kind in WINDOW_KINDS]
        if windows and any(view.tables[g] and 0 in view.tables[g]
                           for view in after.requests.values() for g in windows):
            self.features.add((*where, "window_exit"))

    def take(self) -> set[tuple[Any, ...]]:
        """The features observed since the last call."""
        taken, self.features = self.features, set()
        return taken
