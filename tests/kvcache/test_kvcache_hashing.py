"""Block hashing (docs/spec.md §2.3): chaining, seed, salt, coarse views, determinism."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfuzz.kvcache import Request, get_request_block_hasher
from kvfuzz.kvcache.kv_cache_utils import (
    BlockHashListWithBlockSize,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    none_hash,
    resolve_block_hashes,
)


def _hashes(tokens, hbs=4, salt=None, seed="s"):
    return Request("r", list(tokens), cache_salt=salt,
                   block_hasher=get_request_block_hasher(hbs, seed)).block_hashes


def test_only_full_blocks_are_hashed():
    assert len(_hashes(range(11))) == 2
    assert len(_hashes(range(12))) == 3
    assert _hashes(range(3)) == []
    assert Request("r", [1, 2, 3, 4]).block_hashes == []


def test_block_zero_encoding_is_the_documented_one():
    tokens = [7, 8, 9, 10]
    expected = hashlib.sha256(
        none_hash("s") + struct.pack("<I", 4) + struct.pack("<4Q", *tokens)
    ).digest()
    assert _hashes(tokens) == [expected]
    assert none_hash("s") == hashlib.sha256(b"s").digest()


def test_chaining_each_hash_fingerprints_the_whole_prefix():
    a = _hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = _hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]
    c = _hashes([1, 2, 3, 4, 5, 6, 7, 9])
    assert a[0] == c[0] and a[1] != c[1]
    assert a[1] == hashlib.sha256(
        a[0] + struct.pack("<I", 4) + struct.pack("<4Q", 5, 6, 7, 8)
    ).digest()


def test_token_boundaries_are_unambiguous():
    assert _hashes([256, 0, 0, 0]) != _hashes([0, 1, 0, 0])
    assert _hashes([2**32, 0, 0, 0]) != _hashes([0, 1, 0, 0])
    assert _hashes([1, 2, 3, 4], hbs=4)[0] != _hashes([1, 2, 3, 4], hbs=2)[1]


def test_seed_changes_every_hash():
    a, b = _hashes(range(8), seed="x"), _hashes(range(8), seed="y")
    assert a[0] != b[0] and a[1] != b[1]


def test_default_seed_honours_pythonhashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    default = none_hash()
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert none_hash() == hashlib.sha256(b"42").digest() != default
    assert none_hash("explicit") == hashlib.sha256(b"explicit").digest()


def test_salt_enters_block_zero_only_and_isolates_chains():
    plain = _hashes(range(8))
    empty = _hashes(range(8), salt="")
    salted = _hashes(range(8), salt="tenant")
    other = _hashes(range(8), salt="other")
    assert empty == plain
    assert not set(salted) & set(plain) and not set(salted) & set(other)
    assert salted[1] == hashlib.sha256(
        salted[0] + struct.pack("<I", 4) + struct.pack("<4Q", 4, 5, 6, 7)
    ).digest()


@given(
    prompt=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40),
    chunks=st.lists(st.lists(st.integers(0, 2**20), min_size=1, max_size=9), max_size=5),
    hbs=st.sampled_from([1, 2, 3, 4, 16]),
    salt=st.one_of(st.none(), st.text(max_size=4)),
)
def test_incremental_hashing_equals_hashing_all_at_once(prompt, chunks, hbs, salt):
    hasher = get_request_block_hasher(hbs, "s")
    grown = Request("g", prompt, cache_salt=salt, block_hasher=hasher)
    for chunk in chunks:
        grown.append_output_token_ids(chunk)
    whole = Request("w", list(grown.all_token_ids), cache_salt=salt, block_hasher=hasher)
    assert grown.block_hashes == whole.block_hashes
    assert len(whole.block_hashes) == whole.num_tokens // hbs


def test_coarse_view_is_the_fine_hash_at_each_block_end():
    fine = _hashes(range(20), hbs=2)
    view = BlockHashListWithBlockSize(fine, 2, 6)
    assert len(fine) == 10 and len(view) == 3
    assert list(view) == [fine[2], fine[5], fine[8]]
    assert view[1] == fine[5] and view[-1] == fine[8]
    assert view[0:2] == [fine[2], fine[5]] and isinstance(view[0:2], list)
    with pytest.raises(IndexError):
        view[3]
    coarse = _hashes(range(20), hbs=6)
    assert coarse[0] != view[0]


def test_coarse_view_grows_with_the_request():
    request = Request("r", list(range(3)), block_hasher=get_request_block_hasher(2, "s"))
    view = resolve_block_hashes(request.block_hashes, 2, 4)
    assert len(view) == 0
    request.append_output_token_ids([3, 4, 5, 6, 7])
    assert len(view) == 2 and view[1] == request.block_hashes[3]
    assert resolve_block_hashes(request.block_hashes, 2, 2) is request.block_hashes
    assert resolve_block_hashes(view, 2, 4) is view


def test_key_packing_is_vllms_format():
    h = bytes(range(32))
    key = make_block_hash_with_group_id(h, 258)
    assert key == h + b"\x00\x00\x01\x02"
    assert get_block_hash(key) == h and get_group_id(key) == 258


def test_bad_hash_block_size_is_rejected():
    with pytest.raises(ValueError, match="0"):
        get_request_block_hasher(0)


def test_frontend_hashes_are_continued_and_truncated_as_vllm_does():
    """vLLM 0.34's Request(block_hashes=) and truncate_block_hashes, on kvcache's Request."""
    hasher = get_request_block_hasher(4, "s")
    plain = Request("a", list(range(14)), block_hasher=hasher)
    for n in range(len(plain.block_hashes) + 1):
        given = Request("b", list(range(14)), block_hasher=hasher,
                        block_hashes=plain.block_hashes[:n])
        assert given.block_hashes == plain.block_hashes
    given.append_output_token_ids([1, 2])
    assert len(given.block_hashes) == 4
    given.truncate_block_hashes(4, num_hash_lookahead_tokens=5)
    assert given.block_hashes == plain.block_hashes[:2]
    with pytest.raises(ValueError, match="block_hashes must be None or a list"):
        Request("c", [1], block_hashes="h")
