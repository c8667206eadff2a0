"""Finding 028 tolerated on vLLM's own Scheduler: under the "recompute" policy, the blocks a
failing synchronous KV load left invalid stay keyed while their requests rewrite them.

vLLM's `_handle_invalid_blocks` evicts an affected request's blocks from its first invalid one
on only under "fail" (0.34.0 `scheduler.py:3907-3911`, 0.33.0 `:3759`, 0.32.0 `:3412`); under
"recompute" the requests roll back and run on, rewriting blocks that keep their keys (vLLM's
issue #49250). kvfuzz's driver and the model evict, under "recompute", every affected request's
blocks from its rolled-back computed tokens on (docs/spec.md §13.3). Target `vllm-scheduler`
undoes exactly that difference after each `_handle_invalid_blocks` and names the requests it
did so for; `vllm-scheduler-strict` and `--no-tolerate 028` report it.
"""

from __future__ import annotations

from typing import Any

RECOMPUTED_KEYED = "recompute-failed-blocks-keyed"
"""The deviation's name (docs/findings/028-recompute-failed-blocks-keyed.md)."""


def evict_rewritten_blocks(scheduler: Any, tolerated: set[str]) -> None:
    """After vLLM's Scheduler handled a step's invalid blocks under "recompute", the blocks
    each affected running request rewrites (from its computed tokens on) lose their keys, as
    in kvfuzz's driver; their request ids go into `tolerated`."""
    handle = scheduler._handle_invalid_blocks

    def handle_invalid_blocks(invalid_block_ids: set[int], *args: Any, **kwargs: Any
                              ) -> set[str]:
        affected = handle(invalid_block_ids, *args, **kwargs)
        if not scheduler.recompute_kv_load_failures or not affected:
            return affected
        manager = scheduler.kv_cache_manager
        null = manager.block_pool.null_block.block_id
        rewritten: set[int] = set()
        for request_id in affected:
            (block_ids,) = manager.get_block_ids(request_id)
            start = scheduler.requests[request_id].num_computed_tokens // scheduler.block_size
            rewritten.update(b for b in block_ids[start:] if b != null)
        if any(manager.block_pool.blocks[b].block_hash is not None for b in rewritten):
            tolerated.update(affected)
        manager.evict_blocks(rewritten)
        return affected

    scheduler._handle_invalid_blocks = handle_invalid_blocks
