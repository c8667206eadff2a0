"""Reading a target's KV cache events (docs/spec.md §3.10) as content, and replaying them.

kvcache and vLLM name their events and fields alike (`BlockStored.block_hashes`,
`parent_block_hash`, `token_ids`, `block_size`, `group_idx`; `BlockRemoved`;
`AllBlocksCleared`). Hashes are read as content keys through the side's `KeyTranslator`.
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.sides import KvEvent
from kvfuzz.core.snapshot import CacheKey
from kvfuzz.harness.reading import KeyTranslator


def _key(keys: KeyTranslator, block_hash: Any, group: int) -> CacheKey:
    return keys.key(bytes(block_hash) + group.to_bytes(4, "big"))


def read_event(event: Any, keys: KeyTranslator) -> KvEvent:
    """One event of either implementation as a `KvEvent`."""
    kind = type(event).__name__
    if kind == "AllBlocksCleared":
        return KvEvent("cleared")
    group = event.group_idx or 0
    hashes = tuple(_key(keys, h, group) for h in event.block_hashes)
    if kind == "BlockRemoved":
        return KvEvent("removed", group, hashes)
    parent = event.parent_block_hash
    return KvEvent(
        "stored", group, hashes, None if parent is None else _key(keys, parent, group),
        tuple(event.token_ids), event.block_size,
    )


class EventReplay:
    """The cache keys a consumer that saw every event from the start believes are cached."""

    def __init__(self) -> None:
        self.cached: set[CacheKey] = set()

    def apply(self, event: KvEvent) -> None:
        if event.kind == "cleared":
            self.cached.clear()
        elif event.kind == "stored":
            self.cached.update(event.keys)
        else:
            self.cached.difference_update(event.keys)

