"""Reading a target's KV cache events (docs/spec.md §3.10) as content, and replaying them.

kvcache and vLLM name their events and fields alike (`BlockStored.block_hashes`,
`parent_block_hash`, `token_ids`, `block_size`, `group_idx`; `BlockRemoved`;
`AllBlocksCleared`; `extra_keys`, read by value). Hashes are read as content keys through the
side's `KeyTranslator`.
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.sides import KvEvent
from kvfuzz.core.snapshot import CacheKey
from kvfuzz.harness.reading import KeyTranslator, packed_key


def _key(keys: KeyTranslator, block_hash: Any, group: int) -> CacheKey:
    return keys.key(packed_key(block_hash, group))


def _by_value(entry: Any) -> tuple[Any, ...]:
    """One block's untagged extra keys as the checks compare them: digests and masks (bytes)
    dropped, a multimodal identifier `mm-i` (as both targets name input i) read back as i."""
    kept: list[Any] = []
    for key in entry or ():
        if isinstance(key, (bytes, bytearray)):
            continue
        if isinstance(key, tuple) and isinstance(key[0], str) and key[0].startswith("mm-"):
            key = (int(key[0][3:]), *key[1:])
        kept.append(tuple(key) if isinstance(key, (tuple, list)) else key)
    return tuple(kept)


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
        None if event.extra_keys is None else tuple(_by_value(e) for e in event.extra_keys),
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

