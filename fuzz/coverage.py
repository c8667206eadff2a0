"""Behaviour coverage for the Hypothesis engine: which kinds of outcome a campaign has seen.

A feature is (level, config, op, outcome class): an allocation that returned None, adopted a
hit or raised; a lookup that hit fully, partly or not at all; a step that preempted, finished,
copied. The count of distinct features is the "coverage" a campaign reports (the atheris engine
reports libFuzzer's edge coverage instead).
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


def behaviour_features(execution: Any) -> set[tuple[Any, ...]]:
    """The features of one execution (its ops and the reference's results)."""
    level, config = execution.level, execution.config.name
    return {
        (level, config, op["op"], *outcome_class(op, result))
        for op, result in zip(execution.trace.ops, execution.results)
    }
