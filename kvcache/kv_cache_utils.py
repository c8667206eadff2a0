"""Blocks, the free-block queue, block hashing and the hash views shared by every layer."""

from __future__ import annotations

import functools
import hashlib
import math
import os
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NewType, overload

if TYPE_CHECKING:
    from kvfuzz.kvcache.kv_cache_interface import KVCacheConfig
    from kvfuzz.kvcache.request import Request

BlockHash = NewType("BlockHash", bytes)
"""A block hash: the bytes a hash function gave for a whole token prefix (a SHA-256 digest by
default, see `get_request_block_hasher`; 16 bytes from vLLM's xxhash functions)."""

BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
"""A map key, vLLM's format: the block hash bytes, then the group id as 4 big-endian bytes.
The suffix has one length, so a key splits the same way whatever the hash's length."""

GROUP_ID_LEN = 4
"""Bytes of a key's group-id suffix."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(a // -b)


def check_positive_int(name: str, value: object) -> None:
    """Raise ValueError naming `value` unless it is an int > 0 (bools are not counts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@functools.cache
def group_id_suffix(group_id: int) -> bytes:
    """The bytes a key appends to a block hash: the group id, 4 bytes big-endian (memoized:
    there are only a few groups and every key needs them)."""
    return group_id.to_bytes(GROUP_ID_LEN, "big", signed=False)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Pack a key without building a tuple; identical content in two groups never collides."""
    return BlockHashWithGroupId(block_hash + group_id_suffix(group_id))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-GROUP_ID_LEN])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-GROUP_ID_LEN:], "big", signed=False)


ExternalBlockHash = bytes | int
"""A block hash as KV events publish it: its bytes, or an int (`maybe_convert_block_hash`)."""


def maybe_convert_block_hash(hash_bytes: BlockHash) -> ExternalBlockHash:
    """vLLM's (kv_cache_utils.py:86-89): the hash's last 8 bytes as an unsigned big-endian
    int, or the bytes themselves where VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is "0" (its
    default is "1")."""
    if not int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")):
        return hash_bytes
    return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)


def check_cache_keys(request: Request) -> None:
    """ValueError unless the request's first and last block hashes are bytes (a request's
    hashes come from one hasher), the only hashes a key can be made of: an int hash (Python's
    `hash`) cannot key a block in vLLM either, whose `make_block_hash_with_group_id` raises
    TypeError on it (vllm/v1/core/kv_cache_utils.py:73)."""
    hashes = request.block_hashes
    if hashes:
        for block_hash in (hashes[0], hashes[-1]):
            if type(block_hash) is not bytes:
                raise ValueError(
                    f"request {request.request_id!r}: block hash {block_hash!r} is not bytes: "
                    "kvcache caches blocks under the bytes of a hash function (as vLLM's "
                    "keys, which cannot be made of an int)"
                )


class KVCacheBlock:
    """Metadata of one physical block; the free-queue links live on the block itself."""

    # What free and allocation touch comes first: right after the object header (whose
    # reference count every read of the block writes), so that more often one cache line
    # holds it all. A finished request's blocks are usually out of the CPU cache.
    __slots__ = (
        "ref_cnt",
        "_hashed",
        "prev_free_block",
        "next_free_block",
        "is_null",
        "block_id",
        "_block_hash",
        "_block_hash_num_tokens",
    )

    def __init__(self, block_id: int, ref_cnt: int = 0, *, is_null: bool = False) -> None:
        """vLLM's `block_id`, `ref_cnt` and `is_null`; the key and links start unset."""
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self._block_hash: BlockHashWithGroupId | None = None
        self._block_hash_num_tokens: int | None = None
        # Whether the block has a primary key (`_block_hash is not None`). Tested instead of the
        # key: reading the key writes its reference count, a cache miss per block in
        # free_blocks, while True and False stay in the CPU cache.
        self._hashed = False
        # Owned by FreeKVCacheBlockQueue: both set iff the block is linked in it.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = is_null

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """The primary key, set only while the block is registered in the hash map."""
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        """Length of the prefix the primary key fingerprints."""
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: BlockHashWithGroupId, num_tokens: int | None = None) -> None:
        if self._block_hash is not None:
            raise RuntimeError(f"block {self.block_id} already has a primary hash key")
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens
        self._hashed = True

    def reset_hash(self) -> None:
        self._block_hash = None
        self._block_hash_num_tokens = None
        self._hashed = False

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self._block_hash!r}, "
            f"block_hash_num_tokens={self._block_hash_num_tokens}, "
            f"prev_free_block={prev_id}, next_free_block={next_id})"
        )


class KVCacheBlockCopy(NamedTuple):
    src_block_id: int
    dst_block_id: int


def null_head_len(blocks: Sequence[KVCacheBlock], null_block: KVCacheBlock | None = None) -> int:
    """Length of the leading run of null blocks, e.g. a sliding-window table's skipped prefix
    (vLLM's signature and rule: a null after a held block is not in the run).

    All nulls are one shared object, so the run is counted by identity at C speed; only a
    table with a null after a held block takes the slow path.
    """
    if not blocks:
        return 0
    if null_block is None:
        if not blocks[0].is_null:
            return 0
        null_block = blocks[0]
    elif blocks[0] is not null_block:
        return 0
    count = blocks.count(null_block)
    if blocks[count - 1] is null_block and blocks[:count].count(null_block) == count:
        return count
    return next(i for i, block in enumerate(blocks) if block is not null_block)


def null_prefix_len(blocks: Sequence[KVCacheBlock], null_block: KVCacheBlock) -> int:
    """`null_head_len` of a table whose nulls are all in its head, as every table kvcache's
    managers build that starts with one (windows and chunks null blocks from the front; a
    Mamba align table takes its own path). One count, at C speed: a finished request's blocks are out of the CPU cache, and reading any
    of them would miss it.
    """
    if not blocks or blocks[0] is not null_block:
        return 0
    return blocks.count(null_block)


def _link_run(blocks: Sequence[KVCacheBlock]) -> None:
    """Link consecutive blocks to each other, first to last (the ends stay open)."""
    for prev, block in zip(blocks, blocks[1:]):
        prev.next_free_block = block
        block.prev_free_block = prev


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (head is reused first).

    Threaded through the blocks' own link fields between two sentinels, so removal from the
    middle is O(1) and no list node is ever allocated. Ordering policy belongs to the pool,
    which decides where freed blocks are inserted.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first n blocks in order; ValueError (nothing changed) unless 0 <= n <= free."""
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(f"popleft_n({n!r}): the queue holds {self.num_free_blocks} blocks")
        if n == 0:
            return []
        head = self.fake_free_list_head
        ret = []
        block = head.next_free_block
        for _ in range(n):
            ret.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on block {block.block_id}, which is not free")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def remove_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """`remove` each block; all must be distinct and free (the caller checked)."""
        num_removed = 0
        for block in blocks:
            prev, nxt = block.prev_free_block, block.next_free_block
            prev.next_free_block = nxt  # type: ignore[union-attr]
            nxt.prev_free_block = prev  # type: ignore[union-attr]
            block.prev_free_block = block.next_free_block = None
            num_removed += 1
        self.num_free_blocks -= num_removed

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link blocks at the tail, keeping their order (nothing changed when the tail sentinel
        has lost its link: an AssertionError, as vLLM's)."""
        if blocks:
            assert self.fake_free_list_tail.prev_free_block is not None, (
                "the tail sentinel of the free queue has no previous block")
            _link_run(blocks)
            self.append_chain(blocks[0], blocks[-1], len(blocks))

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link blocks at the head, keeping their order (blocks[0] becomes the head)."""
        if blocks:
            _link_run(blocks)
            self.prepend_chain(blocks[0], blocks[-1], len(blocks))

    def prepend_chain(self, first: KVCacheBlock, last: KVCacheBlock, num_blocks: int) -> None:
        """Splice at the head a run of `num_blocks` blocks already linked first to last."""
        head = self.fake_free_list_head
        nxt = head.next_free_block
        head.next_free_block = first
        first.prev_free_block = head
        last.next_free_block = nxt
        nxt.prev_free_block = last  # type: ignore[union-attr]
        self.num_free_blocks += num_blocks

    def append_chain(self, first: KVCacheBlock, last: KVCacheBlock, num_blocks: int) -> None:
        """Splice at the tail a run of `num_blocks` blocks already linked first to last."""
        tail = self.fake_free_list_tail
        prev = tail.prev_free_block
        prev.next_free_block = first  # type: ignore[union-attr]
        first.prev_free_block = prev
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += num_blocks

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head-to-tail list; O(free blocks), a testing aid."""
        ret = []
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not tail:
            ret.append(block)
            block = block.next_free_block
        return ret


# ----- block hashing -----

KVCACHE_NONE_HASH_SEED = "kvcache-none-hash"
"""The fixed seed of kvcache's own chain (hashers built without a hash function): SHA-256
collision resistance does not depend on a secret seed, and a fixed one lets separate processes
agree. Isolation between tenants is the cache salt's job."""

_TOKEN_COUNT = struct.Struct("<I")
_SALT_TAG, _LORA_TAG, _MM_TAG, _EMBEDS_TAG = b"\x01", b"\x02", b"\x03", b"\x04"
_LOOKAHEAD_TAG = b"\x05"
_I64 = struct.Struct("<q")


def _kvcache_seed(seed: str | None = None) -> str:
    """The seed of kvcache's own chain: an explicit one wins, then PYTHONHASHSEED, then
    `KVCACHE_NONE_HASH_SEED`."""
    if seed is not None:
        return seed
    return os.environ.get("PYTHONHASHSEED", KVCACHE_NONE_HASH_SEED)


def none_hash(seed: str | None = None) -> BlockHash:
    """The parent hash of block 0 of every chain of kvcache's own hashers."""
    return BlockHash(hashlib.sha256(_kvcache_seed(seed).encode()).digest())


# ----- vLLM's block hashing, for hashers built with one of vLLM's hash functions -----

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM 0.34's seed of its none hash for a collision-resistant hash function
(vllm/v1/core/kv_cache_utils.py:112)."""

NON_CRYPTO_HASH_FUNCTIONS = frozenset({("vllm.utils.hashing", "xxhash"),
                                       ("vllm.utils.hashing", "xxhash_cbor")})
"""(module, name) of vLLM's hash functions that are not collision resistant, whose none hash
must stay secret (vLLM's `_NON_CRYPTO_HASH_FUNCTIONS`, kv_cache_utils.py:115): named, not
imported, so that kvcache runs without vLLM."""

NONE_HASH: BlockHash | None = None
"""The parent of block 0 for hashers built with a hash function: `init_none_hash` sets it."""
_NONE_HASH_SEED: str | None = None


def is_non_crypto_hash_function(hash_fn: Callable[[Any], bytes]) -> bool:
    """Whether `hash_fn` is vLLM's xxhash or xxhash_cbor."""
    key = (getattr(hash_fn, "__module__", None), getattr(hash_fn, "__name__", None))
    return key in NON_CRYPTO_HASH_FUNCTIONS


def resolve_none_hash_seed(hash_fn: Callable[[Any], bytes]) -> str:
    """vLLM's (kv_cache_utils.py:121-134): PYTHONHASHSEED if set, else fresh random bytes for
    a non-cryptographic hash function (its collision resistance depends on a secret seed),
    else `DEFAULT_NONE_HASH_SEED`, which processes share."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if is_non_crypto_hash_function(hash_fn):
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """vLLM's: NONE_HASH = hash_fn(seed), the seed from `resolve_none_hash_seed`
    (kv_cache_utils.py:150-162)."""
    global NONE_HASH, _NONE_HASH_SEED
    _NONE_HASH_SEED = resolve_none_hash_seed(hash_fn)
    NONE_HASH = BlockHash(hash_fn(_NONE_HASH_SEED))


def get_none_hash_seed() -> str:
    """The seed `init_none_hash` used (`DEFAULT_NONE_HASH_SEED` before it ran)."""
    return DEFAULT_NONE_HASH_SEED if _NONE_HASH_SEED is None else _NONE_HASH_SEED


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """vLLM's block hash: `hash_function((parent, tokens as a tuple, extra_keys))`, the parent
    of block 0 being NONE_HASH."""
    if not parent_block_hash:
        if NONE_HASH is None:
            raise RuntimeError("init_none_hash(hash_fn) has not been called")
        parent_block_hash = NONE_HASH
    return BlockHash(
        hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys))
    )


def _mm_span(feature: Any) -> tuple[int, int]:
    """(offset, length) of a multimodal input: kvcache's MultiModalFeature or vLLM's
    MultiModalFeatureSpec (whose `mm_position` holds them)."""
    position = getattr(feature, "mm_position", feature)
    return position.offset, position.length


def tensor_data(tensor: Any) -> memoryview:
    """A tensor's raw data as a uint8 memoryview, its elements in row-major order (vLLM's
    vllm/v1/utils.py:794-814, which the prompt embeddings' digest hashes)."""
    import torch  # only a tensor gets here, so torch is installed

    flat = tensor.detach().flatten().cpu().contiguous().view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def _embeds_digest(request: Request, start: int, end: int) -> bytes:
    """SHA-256 of the prompt embeddings of positions [start, end): kvcache's int per position
    as u64 LE, a tensor's `tensor_data`; memoized on the request per range, as vLLM's."""
    memo = getattr(request, "_prompt_embeds_per_block_hashes", None)
    digest = memo.get((start, end)) if memo is not None else None
    if digest is None:
        values = request.prompt_embeds[start:end]
        data = array("q", values).tobytes() if isinstance(values, list) else tensor_data(values)
        digest = hashlib.sha256(data).digest()
        if memo is not None:
            memo[(start, end)] = digest
    return digest


def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """vLLM's extra keys of block [start, end) and the next multimodal index: the LoRA
    adapter's `("lora", name, path)`, `("mm", identifier, offset from start)` for each input
    overlapping the block from `start_mm_idx` on (-1: the last), `("cache_salt", salt)` on block 0,
    `("prompt_embeds", SHA-256 of the block's embeddings)`; None when there are none.

    Unlike vLLM 0.34 (docs/findings/010), a mixed prompt's token-id mask is keyed too, as
    `("prompt_is_token_ids", mask bytes)` after the embeddings' key.
    """
    keys: list[Any] = []
    lora = request.lora_request
    if lora:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    mm_idx = start_mm_idx
    features = request.mm_features
    if features and sum(_mm_span(features[-1])) > start_token_idx:
        if mm_idx < 0:
            mm_idx += len(features)
        while mm_idx < len(features):
            offset, length = _mm_span(features[mm_idx])
            if offset >= end_token_idx:
                break
            if offset + length > start_token_idx:
                keys.append(("mm", features[mm_idx].identifier, offset - start_token_idx))
                if offset + length > end_token_idx:
                    break
            mm_idx += 1
    if start_token_idx == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    embeds = request.prompt_embeds
    if embeds is not None:
        keys.append(("prompt_embeds", _embeds_digest(request, start_token_idx, end_token_idx)))
        mask = request.prompt_is_token_ids
        if mask is not None:
            keys.append(("prompt_is_token_ids", bytes(mask[start_token_idx:end_token_idx])))
    return (tuple(keys) if keys else None), mm_idx


def untag_extra_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """One block's extra keys as KV events publish them: each without its tag, a multimodal
    key keeping `(identifier, offset)`."""
    if keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)


def to_event_extra_keys(
    extra_keys: Iterable[tuple[Any, ...] | None] | None,
) -> list[tuple[Any, ...] | None] | None:
    """vLLM's (kv_cache_utils.py:674-700): each block's `untag_extra_keys`, None for no
    blocks."""
    if not extra_keys:
        return None
    return [untag_extra_keys(keys) for keys in extra_keys] or None


def frontend_block_hashes(request: Any, prefix_hash_config: Any) -> list[BlockHash] | None:
    """vLLM's (kv_cache_utils.py:1037-1057): the prompt block hashes a frontend sent with an
    engine request, or None (the engine hashes the prompt) when it sent none, the engine does
    not hash (no config), or their count is not the number of prompt blocks whose lookahead
    tokens exist, `max(prompt tokens - lookahead, 0) // hash block size`."""
    block_hashes = request.block_hashes
    if block_hashes is None or prefix_hash_config is None:
        return None
    prompt = request.prompt_token_ids
    hashed_tokens = max((0 if prompt is None else len(prompt))
                        - prefix_hash_config.num_lookahead_tokens, 0)
    if len(block_hashes) != hashed_tokens // prefix_hash_config.hash_block_size:
        return None
    return block_hashes


BlockHashOf = Callable[["Request", Any, int, int], Any]
"""(request, parent hash or None, block start, block end) -> the block's hash."""


def _chained_hasher(
    hash_block_size: int, lookahead: int, hash_block: BlockHashOf
) -> Callable[[Request], list[BlockHash]]:
    """A request block hasher: `hash_block` over each block whose `lookahead` tokens after it
    exist, each chained on the one before."""

    def request_block_hasher(request: Request) -> list[BlockHash]:
        block_hashes = request.block_hashes
        start = len(block_hashes) * hash_block_size
        last = request.num_tokens - lookahead
        parent = block_hashes[-1] if block_hashes else None
        new_hashes: list[BlockHash] = []
        while start + hash_block_size <= last:
            parent = hash_block(request, parent, start, start + hash_block_size)
            new_hashes.append(parent)
            start += hash_block_size
        return new_hashes

    request_block_hasher.hash_block_size = hash_block_size  # type: ignore[attr-defined]
    return request_block_hasher


def _vllm_block_hasher(
    hash_block_size: int, hash_fn: Callable[[Any], bytes], num_hash_lookahead_tokens: int
) -> Callable[[Request], list[BlockHash]]:
    """vLLM 0.34's hasher (kv_cache_utils.py:949-1020): `hash_block_tokens` over each full block
    with `generate_block_hash_extra_keys`; with a lookahead L, a block is hashed once the L
    tokens after it exist, its extra keys becoming `(keys of block + L tokens, *those tokens)`."""
    lookahead = num_hash_lookahead_tokens

    def hash_block(request: Request, parent: Any, start: int, end: int) -> BlockHash:
        tokens = request.all_token_ids
        if lookahead:
            keys, _ = generate_block_hash_extra_keys(request, start, end + lookahead, 0)
            extra: tuple[Any, ...] | None = (keys, *tokens[end : end + lookahead])
        else:
            extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
        return hash_block_tokens(hash_fn, parent, tokens[start:end], extra)

    return _chained_hasher(hash_block_size, lookahead, hash_block)


def _salt_extra(cache_salt: str) -> bytes:
    encoded = cache_salt.encode()
    return _SALT_TAG + _TOKEN_COUNT.pack(len(encoded)) + encoded


def _text(value: str) -> bytes:
    encoded = value.encode()
    return _TOKEN_COUNT.pack(len(encoded)) + encoded


def block_extra_keys(request: Request, start: int, end: int) -> bytes:
    """The tagged, length-prefixed extra keys of hash block [start, end), in vLLM's order:
    the LoRA adapter (name and path, as vLLM 0.34), each multimodal input overlapping the block (identifier and
    offset from start), the cache salt (block 0 only), the block's prompt embeddings with their
    token-id mask. Tags keep one kind of key from reading as another."""
    parts = []
    lora = request.lora_request
    if lora is not None:
        parts += (_LORA_TAG, _text(lora.lora_name), _text(lora.lora_path))
    for mm in request.mm_features:
        offset, length = _mm_span(mm)
        if offset < end and start < offset + length:
            parts += (_MM_TAG, _text(mm.identifier), _I64.pack(offset - start))
    if start == 0 and request.cache_salt:
        parts.append(_salt_extra(request.cache_salt))
    embeds = request.prompt_embeds
    if embeds is not None:
        values = embeds[start:end]
        mask = request.prompt_is_token_ids
        parts += (_EMBEDS_TAG, _TOKEN_COUNT.pack(len(values)), array("q", values).tobytes())
        if mask is not None:
            parts.append(bytes(mask[start : start + len(values)]))
    return b"".join(parts)


def has_extra_keys(request: Request) -> bool:
    """Whether any block of the request has extra keys besides the salt."""
    return bool(
        request.lora_request is not None or request.mm_features
        or request.prompt_embeds is not None
    )


def get_request_block_hasher(
    hash_block_size: int,
    caching_hash_fn: Callable[[Any], bytes] | str | None = None,
    num_hash_lookahead_tokens: int = 0,
    *,
    none_hash_seed: str | None = None,
) -> Callable[[Request], list[BlockHash]]:
    """A callback returning the hashes of the request's newly completed hash blocks.

    Given one of vLLM's hash functions (`vllm.utils.hashing.sha256`, ...) as vLLM's callers
    pass it, it hashes as vLLM 0.34 does (`_vllm_block_hasher`, after `init_none_hash`), with
    `num_hash_lookahead_tokens`. Without one it hashes as follows, from `none_hash_seed` (or a
    string in the second place).

    Block k hashes `parent || u32 token count || tokens as u64 LE || extras` with SHA-256,
    where parent is hash k-1 (the none hash for k = 0): fixed-width fields make the encoding
    unambiguous, and chaining makes each hash fingerprint the whole prefix. A plain request's
    only extra key is the cache salt, tagged and length-prefixed, on block 0 only, when
    non-empty; a request with a LoRA adapter, multimodal inputs or prompt embeddings appends
    `block_extra_keys` to every block. With a lookahead L (MTP / draft, docs/spec.md §5.7) a
    block is hashed once the L tokens after it exist, and both its extras and a tagged tail
    cover them: `parent || u32 count || tokens || block_extra_keys(block + L tokens) || 0x05
    || u32 L || the L tokens as u64 LE` (the extras' salt too, as for a plain request).
    """
    check_positive_int("hash_block_size", hash_block_size)
    if not isinstance(num_hash_lookahead_tokens, int) or num_hash_lookahead_tokens < 0:
        raise ValueError(f"num_hash_lookahead_tokens must be an int >= 0, "
                         f"got {num_hash_lookahead_tokens!r}")
    num_hash_lookahead_tokens = int(num_hash_lookahead_tokens)  # vLLM's tests pass bools
    if isinstance(caching_hash_fn, str):  # kvcache's older positional seed
        caching_hash_fn, none_hash_seed = None, caching_hash_fn
    if caching_hash_fn is not None:
        if not callable(caching_hash_fn):
            raise ValueError(f"caching_hash_fn must be callable, got {caching_hash_fn!r}")
        return _vllm_block_hasher(hash_block_size, caching_hash_fn, num_hash_lookahead_tokens)
    if num_hash_lookahead_tokens:
        return _lookahead_block_hasher(hash_block_size, none_hash(none_hash_seed),
                                       num_hash_lookahead_tokens)
    root = none_hash(none_hash_seed)
    header = _TOKEN_COUNT.pack(hash_block_size)
    stride = 8 * hash_block_size
    sha256 = hashlib.sha256

    def request_block_hasher(request: Request) -> list[BlockHash]:
        block_hashes = request.block_hashes
        start = len(block_hashes) * hash_block_size
        end = request.num_tokens // hash_block_size * hash_block_size
        if end <= start:
            return []
        data = array("Q", request.all_token_ids[start:end]).tobytes()
        parent = block_hashes[-1] if block_hashes else root
        new_hashes: list[BlockHash] = []
        if has_extra_keys(request):
            for first in range(start, end, hash_block_size):
                parts = [parent, header, data[(first - start) * 8 : (first - start) * 8 + stride],
                         block_extra_keys(request, first, first + hash_block_size)]
                parent = sha256(b"".join(parts)).digest()  # type: ignore[assignment]
                new_hashes.append(parent)
            return new_hashes
        salt = request.cache_salt
        for offset in range(0, len(data), stride):
            message = parent + header + data[offset : offset + stride]
            if salt and start + offset == 0:
                message += _salt_extra(salt)
            # A BlockHash: calling the NewType would cost a Python call per block.
            parent = sha256(message).digest()  # type: ignore[assignment]
            new_hashes.append(parent)
        return new_hashes

    # What it returns are SHA-256 digests by construction: Request leaves them unchecked.
    request_block_hasher.yields_digests = True  # type: ignore[attr-defined]
    # Request calls it only once a block of this many tokens has completed.
    request_block_hasher.hash_block_size = hash_block_size  # type: ignore[attr-defined]
    return request_block_hasher


def _lookahead_block_hasher(
    hash_block_size: int, root: bytes, lookahead: int
) -> Callable[[Request], list[BlockHash]]:
    """kvcache's chain with a lookahead (`get_request_block_hasher`'s docstring)."""
    header = _TOKEN_COUNT.pack(hash_block_size)
    tail_header = _LOOKAHEAD_TAG + _TOKEN_COUNT.pack(lookahead)

    def hash_block(request: Request, parent: Any, start: int, end: int) -> BlockHash:
        tokens = request.all_token_ids
        return hashlib.sha256(b"".join((  # type: ignore[return-value]
            parent or root, header, array("Q", tokens[start:end]).tobytes(),
            block_extra_keys(request, start, end + lookahead), tail_header,
            array("Q", tokens[end : end + lookahead]).tobytes(),
        ))).digest()

    hasher = _chained_hasher(hash_block_size, lookahead, hash_block)
    hasher.yields_digests = True  # type: ignore[attr-defined]
    return hasher


class BlockHashListWithBlockSize:
    """Lazy view of fine hashes at a coarser block size (a multiple of the hash block size).

    Element j is the fine hash at block j's end boundary: it already fingerprints the whole
    prefix, so no re-hashing is needed.
    """

    __slots__ = ("block_hashes", "scale_factor")

    def __init__(
        self, block_hashes: Sequence[BlockHash], hash_block_size: int, target_block_size: int
    ) -> None:
        assert target_block_size % hash_block_size == 0, (target_block_size, hash_block_size)
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    @overload
    def __getitem__(self, idx: int) -> BlockHash: ...

    @overload
    def __getitem__(self, idx: slice) -> list[BlockHash]: ...

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(idx, slice):
            coarse = range(*idx.indices(len(self)))
            if coarse.step < 0:
                return [self[i] for i in coarse]
            # Coarse index i is fine index (i + 1) * m - 1: one strided slice of the raw list.
            m = self.scale_factor
            start, stop = (coarse.start + 1) * m - 1, (coarse.stop + 1) * m - 1
            fine = self.block_hashes[start:stop : coarse.step * m]
            return fine if isinstance(fine, list) else list(fine)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]

    def __iter__(self) -> Iterator[BlockHash]:
        hashes, m = self.block_hashes, self.scale_factor
        for end in range(m - 1, len(hashes) - len(hashes) % m, m):
            yield hashes[end]


BlockHashList = Sequence[BlockHash]


def resolve_block_hashes(
    block_hashes: BlockHashList, hash_block_size: int, block_size: int, *,
    supports_fine_grained_hash_lookup: bool = False, alignment_tokens: int | None = None,
) -> BlockHashList:
    """The hashes viewed at `block_size`; the raw list itself when sizes are equal, or for a
    manager with fine-grained lookups when hits align to a hash unit inside its blocks
    (`alignment_tokens` below `block_size` and dividing it: partial hits on)."""
    if block_size == hash_block_size:
        return block_hashes
    if isinstance(block_hashes, BlockHashListWithBlockSize):
        assert block_hashes.scale_factor == block_size // hash_block_size
        return block_hashes
    if (supports_fine_grained_hash_lookup and alignment_tokens is not None
            and alignment_tokens < block_size and not block_size % alignment_tokens):
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


def resolve_kv_cache_block_sizes(
    kv_cache_config: KVCacheConfig, enable_caching: bool = True, hash_block_size: int | None = None
) -> tuple[int, int]:
    """(scheduler block size, hash block size) as docs/spec.md §0.3 derives them; not validated here.

    One group: both equal its block size. Several: the LCM of all block sizes, and the GCD of
    the prefix-cacheable ones (the LCM when caching is off). An explicit hash block size wins.
    """
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("a config with no KV cache groups has no block sizes to derive")
    sizes = [g.kv_cache_spec.block_size for g in groups]
    if len(groups) == 1:
        scheduler_block_size = sizes[0]
        default_hash = sizes[0]
    else:
        scheduler_block_size = math.lcm(*sizes)
        cacheable = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
        default_hash = math.gcd(*(cacheable or sizes)) if enable_caching else scheduler_block_size
    if hash_block_size is None:
        hash_block_size = default_hash
    return scheduler_block_size, hash_block_size


def resolve_cache_hit_alignment_tokens(
    kv_cache_config: KVCacheConfig, vllm_config: Any, scheduler_block_size: int,
    hash_block_size: int,
) -> int:
    """Where prefix-cache hits land, as the hybrid coordinator decides it (vLLM's name, for the
    workers that place Mamba checkpoints there): a hash block under fine-grained partial hits
    (`partial_hash_hits_enabled`), else a scheduler block; a scheduler block with caching off
    or one group. `vllm_config` is read for `cache_config.enable_prefix_caching` and
    `parallel_config.decode_context_parallel_size`, which must be 1 (kvcache has no DCP)."""
    # The rule sits with the coordinator, which imports this module.
    from kvfuzz.kvcache.kv_cache_coordinator import partial_hash_hits_enabled

    dcp_world_size = vllm_config.parallel_config.decode_context_parallel_size
    if dcp_world_size != 1:
        raise ValueError(
            f"kvcache does not implement decode context parallelism: "
            f"decode_context_parallel_size={dcp_world_size!r}"
        )
    groups = kv_cache_config.kv_cache_groups
    if not vllm_config.cache_config.enable_prefix_caching or len(groups) <= 1:
        return scheduler_block_size
    if partial_hash_hits_enabled([group.kv_cache_spec for group in groups], hash_block_size):
        return hash_block_size
    return scheduler_block_size
