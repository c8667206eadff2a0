"""Where a synchronous KV load that fails is valid in a trace (docs/spec.md §13.3).

A `load_remote {sync: true, num_loaded_tokens: k}` loads only the first k of its external
tokens validly; the worker reports the blocks it did not fill in the output of the step that
admits the request. vLLM takes such a report by block ids on one KV cache group only (several
groups: `RuntimeError`, 0.34.0 `scheduler.py:3863-3872`; a request-level `failed_recving`
passes over a running request, `:3839-3852`), and a window's leading null blocks would put the
rollback point where its window reads blocks nothing loaded (finding 016's shape), which only
the "fail" policy never resumes from: the model, kvfuzz's driver and the targets take it on
one full-attention or MLA group under either policy, and on one sliding-window group under
"fail", outside steps in flight.
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config

FAILING_KINDS = ("full", "mla")
"""The lone group's kinds a failing synchronous load is valid on, under either policy."""

FAILING_KINDS_FAIL_ONLY = ("sliding_window",)
"""The lone group's kinds it is valid on under the "fail" policy only (no request resumes)."""


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
                "config with one KV cache group only: full attention or MLA, or a sliding "
                "window under kv_load_failure_policy \"fail\" (docs/spec.md §13.3), not on "
                f"{config.name!r}")
    return None


def fails_sync_loads(config: Config) -> bool:
    """Whether a synchronous load may fail on `config`: one group, of `FAILING_KINDS`, or of
    `FAILING_KINDS_FAIL_ONLY` under the "fail" policy."""
    if len(config.groups) != 1:
        return False
    kind = config.groups[0].kind
    return kind in FAILING_KINDS or (kind in FAILING_KINDS_FAIL_ONLY
                                     and config.scheduler.kv_load_failure_policy == "fail")
