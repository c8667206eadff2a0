"""The hash map's segments (docs/spec.md §2.4.1). Built-in configs hold at most 64 hashes per
request, one segment; with segments of 3 hashes their requests cross segment boundaries at
every block size, so the state machines check the filing and the runs across boundaries
against the reference model on every built-in shape."""

from __future__ import annotations

import pytest
from hypothesis import settings

from kvfuzz.core.configs import BUILTIN
from kvfuzz.fuzz.machines import machine_for
from kvfuzz.kvcache import block_pool
from kvcache_testkit import dump_pool, make_request


@pytest.fixture
def short_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_pool, "SEGMENT_LEN", 3)


@pytest.mark.parametrize("level", ["api", "scheduler"])
def test_short_segments_agree_with_the_model(short_segments: None, level: str) -> None:
    machine = machine_for(level, config_names=tuple(BUILTIN),
                          name=f"ShortSegments{level.title()}Machine")
    machine.TestCase.settings = settings(max_examples=300, stateful_step_count=30,
                                         database=None, deadline=None, derandomize=True)
    machine.TestCase("runTest").runTest()


def test_eviction_drops_an_emptied_segment(short_segments: None) -> None:
    pool = block_pool.BlockPool(12, enable_caching=True, hash_block_size=2)
    request = make_request("r", list(range(16)), 2)
    blocks = pool.get_new_blocks(4)
    # Blocks of 4 tokens: keys at hashes 1, 3, 5, 7, in segments [0, 3), [3, 6), [6, 9).
    pool.cache_full_blocks(request, blocks, 0, 4, 4, 0)
    segments = pool.cached_block_hash_to_block._segments
    assert [len(s) - 1 for s in segments.values()] == [1, 2, 1]  # keys, past each head
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(7 + 2)  # the seven never-used blocks, then the last two released
    assert [len(s) - 1 for s in segments.values()] == [1, 1]
    dump_pool(pool)
    pool.get_new_blocks(2)
    assert [len(s) - 1 for s in segments.values()] == [0]  # the root stays
    dump_pool(pool)
