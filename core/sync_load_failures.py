"""Where a synchronous KV load that fails is valid in a trace (docs/spec.md §13.3).

A `load_remote {sync: true, num_loaded_tokens: k}` loads only the first k of its external
tokens validly; the worker reports the blocks it did not fill in the output of the step that
admits the request. vLLM takes such a report by block ids on one KV cache group only (several
groups: `RuntimeError`, 0.34.0 `scheduler.py:3863-3872`; a request-level `failed_recving`
passes over a running request, `:3839-3852`): the model, kvfuzz's driver and the targets take
it on one full-attention, MLA or sliding-window group under either policy, outside steps in
flight. On a window, where the rollback point's window reaches the table's leading nulls
(finding 016's shape), "recompute" preempts the request instead of resuming it there.
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config

FAILING_KINDS = ("full", "mla", "sliding_window")
"""The group kinds a failing synchronous load is valid on, under either policy."""

SEVERAL_GROUP_FAILURES = "several_group_sync_failures"
"""The optional trace shape (a target's `offers`) of a failing synchronous load on several
groups, which vLLM's Scheduler cannot take (docs/findings/031)."""


def sync_failure_refusal(config: Config, op: Any) -> str | None:
    """Why the `load_remote` op's `num_loaded_tokens` is invalid on `config`, or None."""
    loaded = op["num_loaded_tokens"]
    if loaded is None:
        return None
    if not op["sync"]:
        return ("load_remote: num_loaded_tokens is for a synchronous load (sync: true); an "
                "asynchronous load says it in finish_load")
    if loaded < 0:
        return f"load_remote: num_loaded_tokens must be >= 0 or null, got {loaded}"
    if not fails_sync_loads(config):
        return ("load_remote: a synchronous load that fails (num_loaded_tokens) is valid on a "
                "config whose KV cache groups are all full attention, MLA or sliding windows "
                f"(docs/spec.md §13.3), not on {config.name!r}")
    return None


def fails_sync_loads(config: Config) -> bool:
    """Whether a synchronous load may fail on `config`: every group of `FAILING_KINDS`."""
    return all(g.kind in FAILING_KINDS for g in config.groups)


def several_groups(config: Config) -> bool:
    """Whether a failing synchronous load on `config` spans several KV cache groups, which
    vLLM's Scheduler cannot take (docs/findings/031)."""
    return fails_sync_loads(config) and len(config.groups) > 1
