"""A router's view of block hashes (docs/spec.md §2.3), for check H2.

A KV-aware router, or vLLM's frontend handing `Request(block_hashes=)` over, computes a
request's block hashes itself from the tokens and the extra-key inputs, with the hash function
the engine documents. `HashAudit` does the same for every request a target made, written here
from the documentation alone (no code of the target's), and compares: a target whose hashes are
self-consistent but not the documented ones (extra keys `()` where the documentation says None,
a field left out of every key alike) keeps every other check green, and a router that trusts the
documentation never hits its cache.

Two documented schemes:

- `vllm_chain`: `H((parent or NONE_HASH, tuple of the block's tokens, extra keys or None))`,
  NONE_HASH = `H(seed)`, with H one of vLLM's `prefix_caching_hash_algo` functions (SHA-256 or
  xxHash-128 over pickle or canonical CBOR). Extra keys, in order: `("lora", name, path)`,
  `("mm", identifier, offset - start)` per overlapping input, `("cache_salt", salt)` on block
  0, `("prompt_embeds", SHA-256 of the block's rows)`; None when there are none. With a hash
  lookahead L (docs/spec.md §5.7) the extra keys become `(keys of the block and the L tokens
  after it, *those tokens)`.
- `kvcache_chain`: SHA-256 of `parent || u32 hbs || tokens as u64 LE || extras`, the extras
  tagged and length-prefixed as kvcache documents (`get_request_block_hasher`), with a
  lookahead L over the block and the L tokens after it, then `0x05 || u32 L || those tokens`.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

from kvfuzz.core.extra_keys import Extras, lora_path

BlockChain = Callable[..., bytes]
"""(parent hash or None for block 0, the block's tokens, its start, salt, extras, the tokens
after the block its hash covers: `ahead`, empty without a lookahead) -> hash."""


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    import cbor2  # vLLM's dependency, present wherever vLLM is

    return cbor2.dumps(value, canonical=True)


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # optional in vLLM too

    return xxhash.xxh3_128_digest(data)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


VLLM_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda value: _sha256(_pickled(value)),
    "sha256_cbor": lambda value: _sha256(_cbor(value)),
    "xxhash": lambda value: _xxh3_128(_pickled(value)),
    "xxhash_cbor": lambda value: _xxh3_128(_cbor(value)),
}
"""vLLM's documented `prefix_caching_hash_algo` choices, by name."""


class Unverifiable(Exception):
    """The router cannot recompute this request's hashes (an input it does not see)."""


def vllm_chain(seed: str, hash_function: str = "sha256",
               embeds_rows: Callable[[Extras, int, int], bytes] | None = None,
               lookahead: int = 0) -> BlockChain:
    """vLLM's documented chain; `embeds_rows` gives the bytes of a block's prompt-embedding rows
    (None: unverifiable); `lookahead`: num_hash_lookahead_tokens."""
    fn = VLLM_HASH_FUNCTIONS[hash_function]
    root = fn(seed)

    def extra_keys(salt: str | None, extras: Extras | None, start: int,
                   end: int) -> tuple[Any, ...] | None:
        keys: list[Any] = []
        if extras is not None and extras.lora_name is not None:
            keys.append(("lora", extras.lora_name, lora_path(extras.lora_id, extras.lora_path)))
        for ident, offset, length in extras.mm_inputs if extras is not None else ():
            if offset < end and start < offset + length:
                keys.append(("mm", f"mm-{ident}", offset - start))
        if start == 0 and salt:
            keys.append(("cache_salt", salt))
        if extras is not None and extras.prompt_embeds is not None:
            if embeds_rows is None:
                raise Unverifiable("prompt embeddings")
            keys.append(("prompt_embeds", _sha256(embeds_rows(extras, start, end))))
        return tuple(keys) or None

    def chain(parent: bytes | None, tokens: Sequence[int], start: int, salt: str | None,
              extras: Extras | None, ahead: Sequence[int] = ()) -> bytes:
        end = start + len(tokens)
        if lookahead:
            return fn((parent or root, tuple(tokens),
                       (extra_keys(salt, extras, start, end + lookahead), *ahead)))
        return fn((parent or root, tuple(tokens), extra_keys(salt, extras, start, end)))

    return chain


_U32, _I64 = struct.Struct("<I"), struct.Struct("<q")


def _text(value: str) -> bytes:
    data = value.encode()
    return _U32.pack(len(data)) + data


def kvcache_chain(seed: str, lookahead: int = 0) -> BlockChain:
    """kvcache's documented chain (kv_cache_utils.get_request_block_hasher's docstring);
    `lookahead`: num_hash_lookahead_tokens."""
    root = _sha256(seed.encode())

    def extras_bytes(salt: str | None, extras: Extras | None, start: int, end: int) -> bytes:
        salted = b"\x01" + _text(salt) if start == 0 and salt else b""
        if extras is None:
            return salted
        out = b""
        if extras.lora_name is not None:
            out += (b"\x02" + _text(extras.lora_name)
                    + _text(lora_path(extras.lora_id, extras.lora_path)))
        for ident, offset, length in extras.mm_inputs:
            if offset < end and start < offset + length:
                out += b"\x03" + _text(f"mm-{ident}") + _I64.pack(offset - start)
        out += salted
        if extras.prompt_embeds is not None:
            rows = extras.prompt_embeds[start:end]
            out += (b"\x04" + _U32.pack(len(rows))
                    + struct.pack(f"<{len(rows)}q", *(max(v, 0) for v in rows))
                    + bytes(v < 0 for v in rows))
        return out

    def chain(parent: bytes | None, tokens: Sequence[int], start: int, salt: str | None,
              extras: Extras | None, ahead: Sequence[int] = ()) -> bytes:
        body = _U32.pack(len(tokens)) + struct.pack(f"<{len(tokens)}Q", *tokens)
        end = start + len(tokens) + lookahead
        tail = (b"\x05" + _U32.pack(lookahead) + struct.pack(f"<{len(ahead)}Q", *ahead)
                if lookahead else b"")
        return _sha256((parent or root) + body + extras_bytes(salt, extras, start, end) + tail)

    return chain


class HashAudit:
    """Each request's hashes, recomputed block by block as the request grows (the router's own
    chain, never the target's hashes), compared with what the target's Request holds."""

    def __init__(self, chain: BlockChain, hash_block_size: int, lookahead: int = 0) -> None:
        self._chain = chain
        self._hbs = hash_block_size
        self._lookahead = lookahead
        self._expected: dict[str, list[bytes]] = {}
        self._skipped: set[str] = set()
        self._audited: dict[str, int] = {}

    def audited(self, request_id: str) -> int:
        """How many of the request's hashes were found right (a list that only grows, so an
        equal length needs no new audit)."""
        return self._audited.get(request_id, 0)

    def audit(self, request_id: str, hashes: Sequence[Any], tokens: Sequence[int],
              salt: str | None, extras: Extras | None) -> str | None:
        """Why the request's hashes differ from the router's, or None (also when the router
        cannot see an input of it)."""
        expected = self._expected.setdefault(request_id, [])
        if request_id in self._skipped:
            return None
        hbs, lookahead = self._hbs, self._lookahead
        try:
            while len(expected) < len(hashes) and (len(expected) + 1) * hbs + lookahead <= len(
                    tokens):
                k = len(expected)
                end = (k + 1) * hbs
                expected.append(self._chain(expected[-1] if expected else None,
                                            tokens[k * hbs:end], k * hbs, salt, extras,
                                            tokens[end:end + lookahead]))
        except Unverifiable:
            self._skipped.add(request_id)
            return None
        for k in range(self.audited(request_id), len(hashes)):
            got = hashes[k]
            if k >= len(expected):
                return (f"{request_id} holds {len(hashes)} block hashes for "
                        f"{len(tokens)} tokens of {hbs}")
            if bytes(got) != expected[k]:
                return (f"{request_id}'s hash {k} (tokens {k * hbs}..{(k + 1) * hbs - 1}) is "
                        f"{bytes(got)[:6].hex()}…, the documented hash function gives "
                        f"{expected[k][:6].hex()}…")
        self._audited[request_id] = len(hashes)
        return None
