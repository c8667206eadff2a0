"""Connector offers steered to a cached prompt: on a KV connector config, three scheduler-level
arrivals in four (when an earlier request exists) copy an earlier request's prompt, whole or
cut to whole attention blocks, and get a connector offer at once (docs/mutation.md, "Connector
offers on a cached prompt").

The per-group lookup of a hybrid model behind a connector (vLLM 0.34.0
kv_cache_manager.py:352-397, kv_cache_coordinator.py:943-985) meets cached blocks only when an
offered request's prompt shares whole blocks with a computed one, and the margin EAGLE's lookup
adds is capped at the prompt's whole hash blocks (:966-971): a copy or a block-aligned cut of a
computed prompt, offered before its admission. Uniform draws make that shape in few of the 2-5
examples the connector pairs get. A config without a connector takes not one decision more.
"""

from __future__ import annotations

from kvfuzz.core.config import Config
from kvfuzz.fuzz.strategies import Choices, between, flip, pick


def copy_block(config: Config) -> int:
    """The block a copy is cut to whole ones of: the first attention group's block size on a
    connector config, 0 (no steering) without a connector."""
    if not config.kv_connector:
        return 0
    attention = [g for g in config.groups if g.kind != "mamba"] or list(config.groups)
    return attention[0].block_size


def copied_prompt(choices: Choices, block: int,
                  earlier: list[tuple[int, ...]]) -> list[int] | None:
    """Three times in four (with a `block` and an earlier prompt): one of `earlier`, whole or
    cut to whole `block`s (at least one); else None, the draw as it was. Steering half the
    time found survivors #9 and #10 in fewer examples (docs/mutation.md)."""
    if not block or not earlier or not (flip(choices) or flip(choices)):
        return None
    source = pick(choices, earlier)
    blocks = between(choices, 0, len(source) // block)  # 0: the whole prompt
    return list(source[:blocks * block] if blocks else source)
