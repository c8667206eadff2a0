"""Dynamic speculative decoding: how many drafts a step's batch size gets.

vLLM's `SpeculativeConfig.num_speculative_tokens_per_batch_size` is a list of inclusive
batch-size ranges `(start, end, k)`; its Scheduler expands it once into a dense table indexed
by the number of requests a step schedules (docs/spec.md §7.3).
"""

from __future__ import annotations

from collections.abc import Sequence


def dense_drafts(ranges: Sequence[tuple[int, int, int]], max_batch_size: int,
                 max_drafts: int) -> list[int]:
    """The drafts for each batch size 1..`max_batch_size` (index 0 unused): a size inside a
    range takes its k, a size in a gap or past the last range the k of the range before it,
    every k capped at `max_drafts`. `ranges` are valid (sorted, disjoint, the first starts
    at 1: core/config.py checks them)."""
    table = [0] * (max_batch_size + 1)
    ordered = sorted(ranges)
    for i, (start, _, k) in enumerate(ordered):
        stop = ordered[i + 1][0] if i + 1 < len(ordered) else max_batch_size + 1
        for size in range(start, min(stop, max_batch_size + 1)):
            table[size] = min(k, max_drafts)
    return table
