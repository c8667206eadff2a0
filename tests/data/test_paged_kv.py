"""The paged KV layer (kvcache.paged_kv): writes, copies and gathers through block tables,
paged attention against dense attention, on every device/dtype of conftest.py."""

import subprocess
import sys

import pytest
import torch

from kvfuzz.kvcache.paged_kv import PagedKVCache, dense_attention, slot_mapping, tolerance

TABLE = [9, 3, 12, 5]
"""A scattered block table: positions 0-3 live in block 9, 4-7 in block 3, ..."""


def _cache(device_dtype, num_kv_heads=2) -> PagedKVCache:
    device, dtype = device_dtype
    return PagedKVCache(16, 4, num_kv_heads, 8, device=device, dtype=dtype)


def _kv(n: int, cache: PagedKVCache, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, cache.key_cache.shape[2], cache.key_cache.shape[3])
    return (torch.randn(shape, generator=g).to(cache.device, cache.dtype),
            torch.randn(shape, generator=g).to(cache.device, cache.dtype))


def test_slot_mapping_is_block_times_size_plus_offset():
    slots = slot_mapping(torch.tensor(TABLE), torch.arange(3, 10), 4)
    assert slots.tolist() == [39, 12, 13, 14, 15, 48, 49]


def test_write_then_gather_is_the_identity_through_the_table(device_dtype):
    cache = _cache(device_dtype)
    key, value = _kv(14, cache)
    cache.write(TABLE, 0, key[:6], value[:6])
    cache.write(TABLE, 6, key[6:], value[6:])
    got_k, got_v = cache.gather(TABLE, 2, 14)
    assert torch.equal(got_k, key[2:]) and torch.equal(got_v, value[2:])
    assert torch.equal(cache.key_cache[3, 1], key[5])
    assert not cache.key_cache[[0, 1, 2]].any(), "blocks outside the table were written"


def test_copy_blocks_copies_whole_blocks_reading_sources_first(device_dtype):
    cache = _cache(device_dtype)
    key, value = _kv(8, cache)
    cache.write([1, 2], 0, key, value)
    cache.copy_blocks([(1, 2), (2, 3)])
    assert torch.equal(cache.key_cache[2], key[:4]) and torch.equal(cache.value_cache[3], value[4:])


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_paged_attention_equals_dense_within_tolerance(device_dtype, kv_heads):
    cache = _cache(device_dtype, kv_heads)
    key, value = _kv(14, cache)
    cache.write(TABLE, 0, key, value)
    query = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(cache.device,
                                                                           cache.dtype)
    paged = cache.attention(query, TABLE, 3, 14)
    dense = dense_attention(query, key[3:], value[3:])
    rtol, atol = tolerance(cache.dtype)
    assert paged.dtype == cache.dtype and paged.shape == (4, 8)
    torch.testing.assert_close(paged, dense, rtol=rtol, atol=atol)
    assert not torch.allclose(paged, dense_attention(query, key[4:], value[4:]), rtol=rtol,
                              atol=atol), "attention does not depend on the positions read"


@pytest.mark.parametrize("table, end, message", [
    ([1], 5, "does not reach position 4"),
    ([1, 16], 5, "names a block outside 0..15"),
])
def test_slots_refuse_tables_that_do_not_fit(table, end, message):
    with pytest.raises(IndexError, match=message):
        _cache(("cpu", torch.float32)).slots(table, 0, end)


def test_uneven_head_sharing_and_unknown_dtypes_are_refused():
    with pytest.raises(ValueError, match="3 query heads"):
        dense_attention(torch.zeros(3, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match="no attention tolerance"):
        tolerance(torch.int8)


def test_importing_the_harness_does_not_import_torch():
    code = ("import sys, kvfuzz.kvcache, kvfuzz.properties, kvfuzz.harness.executor, "
            "kvfuzz.harness.mutants, kvfuzz.fuzz.cli; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
