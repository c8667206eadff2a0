"""Finding 029 tolerated on vLLM's own Scheduler: blocks a failing synchronous KV load left
invalid stay keyed (under "recompute" while their requests rewrite them; under "fail" a
sharer's, computed in that step on the invalid KV).

vLLM's `_handle_invalid_blocks` evicts, only under "fail", each request's blocks from the
first invalid one it marked on (0.34.0 `scheduler.py:3907-3911`, 0.33.0 `:3759`, 0.32.0
`:3412`); a request whose invalid blocks another marked keeps the blocks it computed in the
step keyed. kvfuzz's driver and the model evict, under either policy, every affected request's
blocks from its rolled-back computed tokens on (docs/spec.md §13.3). Target `vllm-scheduler`
undoes exactly that difference after each `_handle_invalid_blocks` and names the requests it
did so for; `vllm-scheduler-strict` and `--no-tolerate 029` report it.
"""

from __future__ import annotations

from typing import Any

RECOMPUTED_KEYED = "recompute-failed-blocks-keyed"
"""The deviation's name (docs/findings/029-recompute-failed-blocks-keyed.md)."""


def evict_rewritten_blocks(scheduler: Any, tolerated: set[str]) -> None:
    """After vLLM's Scheduler handled a step's invalid blocks, the blocks of each affected
    running request from its computed tokens on lose their keys, as in kvfuzz's driver; the
    ids of the requests that left such a block keyed go into `tolerated`."""
    handle = scheduler._handle_invalid_blocks

    def handle_invalid_blocks(invalid_block_ids: set[int], *args: Any, **kwargs: Any
                              ) -> set[str]:
        affected = handle(invalid_block_ids, *args, **kwargs)
        running = {request.request_id for request in scheduler.running} & affected
        if not running:
            return affected
        manager = scheduler.kv_cache_manager
        null = manager.block_pool.null_block.block_id
        rewritten: set[int] = set()
        for request_id in running:
            (block_ids,) = manager.get_block_ids(request_id)
            start = scheduler.requests[request_id].num_computed_tokens // scheduler.block_size
            rewritten.update(b for b in block_ids[start:] if b != null)
        if any(manager.block_pool.blocks[b].block_hash is not None for b in rewritten):
            tolerated.update(running)
        manager.evict_blocks(rewritten)
        return affected

    scheduler._handle_invalid_blocks = handle_invalid_blocks
