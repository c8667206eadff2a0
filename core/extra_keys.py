"""Extra hash keys by value (docs/spec.md §2.3): what besides its tokens a cached prefix stands for.

A request may carry a LoRA adapter (name, id and path), multimodal inputs (identifier, offset, length),
prompt embeddings (one value per prompt position; -1 marks a position that holds a token id) and a
cache salt. Per hash block [s, e) the extra keys are, in vLLM's order: the LoRA adapter (its
name and path, as vLLM 0.34 keys it: the id does not enter the key), every
multimodal input overlapping the block with its offset relative to s, the salt (block 0 only),
the block's slice of the embeddings with their token-id mask. `prefix_identity` gives the values
a key's prefix stands for; two prefixes may share a block only when their identities and tokens
are equal. Nothing here hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MmInput = tuple[int, int, int]
"""(identifier, offset, length) of one multimodal input in prompt positions."""


@dataclass(frozen=True)
class Extras:
    """A request's extra-key inputs, as its add_request op gave them."""

    lora_name: str | None = None
    lora_id: int | None = None
    lora_path: str | None = None
    mm_inputs: tuple[MmInput, ...] = ()
    prompt_embeds: tuple[int, ...] | None = None

    @classmethod
    def of_op(cls, op: dict[str, Any]) -> Extras | None:
        """The extras of an add_request op, or None when it has none (a plain request)."""
        embeds = op.get("prompt_embeds")
        extras = cls(
            op.get("lora_name"),
            op.get("lora_id"),
            op.get("lora_path"),
            tuple(tuple(m) for m in op.get("mm_inputs") or ()),  # type: ignore[misc]
            None if embeds is None else tuple(embeds),
        )
        return None if extras == _NONE else extras

    def block_keys(self, salt: str | None, start: int, end: int) -> tuple[Any, ...]:
        """The tagged extra keys of hash block [start, end), by value, in vLLM's order."""
        keys: list[Any] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, lora_path(self.lora_id, self.lora_path)))
        for ident, offset, length in self.mm_inputs:
            if offset < end and start < offset + length:
                keys.append(("mm", ident, offset - start))
        if start == 0 and salt:
            keys.append(("cache_salt", salt))
        if self.prompt_embeds is not None:
            keys.append(("prompt_embeds", self.prompt_embeds[start:end]))
        return tuple(keys)


_NONE = Extras()


def lora_path(lora_id: int | None, path: str | None) -> str:
    """The adapter's path: as given, else the default path of its id (`/kvfuzz/lora/ID`)."""
    return path if path is not None else f"/kvfuzz/lora/{lora_id}"


def prefix_identity(salt: str | None, extras: Extras | None, num_tokens: int, hbs: int,
                    lookahead: int = 0) -> Any:
    """What a prefix of num_tokens tokens (a multiple of hbs) stands for besides its tokens:
    the salt alone (None for none) when no block of it has another extra key (a plain request
    and one whose adapter, inputs or embeddings lie beyond the prefix look alike), else every
    hash block's extra keys (of the block and the `lookahead` tokens after it, §5.7)."""
    if extras is None:
        return salt or None
    blocks = tuple(
        extras.block_keys(salt, s, s + hbs + lookahead)
        for s in range(0, num_tokens - num_tokens % hbs, hbs)
    )
    if all(key[0] == "cache_salt" for keys in blocks for key in keys):
        return salt or None
    return ("extras",) + blocks


def key_identity(salt: str | None, extras: Extras | None, tokens: Sequence[int],
                 num_tokens: int, hbs: int, lookahead: int) -> Any:
    """The identity of a content key (core/snapshot.py) for the prefix of num_tokens of
    `tokens`: `prefix_identity`, and with a hash lookahead L (docs/spec.md §5.7)
    `("ahead", that, the L tokens after the prefix)`, which its hash covers too."""
    ident = prefix_identity(salt, extras, num_tokens, hbs, lookahead)
    if not lookahead:
        return ident
    return ("ahead", ident, tuple(tokens[num_tokens:num_tokens + lookahead]))


def extras_problem(extras: Extras | None, prompt: list[int], mm_lengths: dict[int, int]) -> str | None:
    """Why these extras are not valid for this prompt (docs/traces.md), or None. `mm_lengths`
    holds the length each multimodal identifier had before (one identifier, one length);
    it is updated when the extras are valid."""
    if extras is None:
        return None
    if (extras.lora_name is None) != (extras.lora_id is None):
        return "lora_name and lora_id come together"
    if extras.lora_id is not None and extras.lora_id < 1:
        return f"lora_id must be >= 1, got {extras.lora_id}"
    if extras.lora_path is not None and (extras.lora_name is None or not extras.lora_path):
        return f"lora_path needs lora_name and lora_id and is not empty, got {extras.lora_path!r}"
    end = 0
    for m in extras.mm_inputs:
        if len(m) != 3:
            return f"an mm input is [identifier, offset, length], got {list(m)!r}"
        ident, offset, length = m
        if ident < 0 or length < 1 or offset < end or offset + length > len(prompt):
            return (f"mm input {list(m)!r}: needs identifier >= 0, length >= 1, inputs sorted "
                    f"and apart, inside the {len(prompt)}-token prompt")
        if mm_lengths.get(ident, length) != length:
            return f"mm identifier {ident} had length {mm_lengths[ident]}, now {length}"
        end = offset + length
    embeds = extras.prompt_embeds
    if embeds is not None:
        if len(embeds) != len(prompt):
            return f"prompt_embeds has {len(embeds)} values for a {len(prompt)}-token prompt"
        if any(v < -1 for v in embeds):
            return "prompt_embeds values must be >= -1 (-1: a token position)"
        if any(v >= 0 and t != 0 for v, t in zip(embeds, prompt)):
            return "an embedding position's prompt token must be the placeholder 0"
    for ident, _, length in extras.mm_inputs:
        mm_lengths[ident] = length
    return None
