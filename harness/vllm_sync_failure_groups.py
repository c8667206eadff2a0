"""Finding 031 tolerated on vLLM's own Scheduler: a failing synchronous KV load on a config
with several KV cache groups is not driven there.

vLLM's Scheduler cannot take the report: block ids raise `RuntimeError` with more than one
group (`_handle_invalid_blocks`, 0.34.0 `scheduler.py:3863-3872`, 0.33.0 `:3712-3721`, 0.32.0
`:3365-3374`), and the request-level `failed_recving` that error asks for is passed over for a
request already running (`_handle_failed_recving`, 0.34.0 `:3839-3852`), as a synchronous
load's is: the request runs on over blocks nothing filled. Nothing on the vLLM side can undo
that short of doing the rollback for it, so target `vllm-scheduler` leaves the shape out
(generators do not draw it; a trace with it is unsupported there), while
`vllm-scheduler-strict` and `--no-tolerate 031` drive it and report the difference.
"""

from __future__ import annotations

SEVERAL_GROUPS = "sync-failure-several-groups"
"""The deviation's name (docs/findings/031-sync-failure-several-groups.md)."""
