"""Step 8 of allocate_slots left out when it would change nothing (docs/spec.md §6.4): nothing
predicted, no hits, groups that all grow by the base rule and tables that have the slots."""

from __future__ import annotations

from typing import Any

import pytest

from kvfuzz.kvcache import (
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    SlidingWindowSpec,
)

from kvcache_testkit import make_manager, make_request, table_ids


def _count_growth(manager: KVCacheManager) -> list[int]:
    """Count the coordinator's allocate_new_blocks calls (one entry per call)."""
    calls: list[int] = []
    original = manager.coordinator.allocate_new_blocks

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    manager.coordinator.allocate_new_blocks = counted  # type: ignore[method-assign]
    return calls


def _decode(manager: KVCacheManager, request: Any, steps: int) -> None:
    for token in range(steps):
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1


@pytest.mark.parametrize("specs", [
    (FullAttentionSpec(block_size=4),),
    (FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=4, sliding_window=4)),
])
def test_a_decode_step_that_needs_no_block_leaves_the_growth_out(specs):
    """bs 4, a 6-token prompt in 2 blocks: of 8 decode steps (tokens 6-13) only the ones that
    reach tokens 8 and 12 need a block, so only those two call allocate_new_blocks; the tables
    come out as with every call made."""
    tables = []
    for every_call in (False, True):
        manager = make_manager(16, *specs)
        if every_call:
            manager.coordinator.covers = lambda *args: False  # type: ignore[method-assign]
        request = make_request("r", [1, 2, 3, 4, 5, 6], 4, max_tokens=16)
        assert manager.allocate_slots(request, 6) is not None
        request.num_computed_tokens = 6
        calls = _count_growth(manager)
        _decode(manager, request, 8)
        assert len(calls) == (8 if every_call else 2)
        if not every_call:  # 4 blocks of 4 tokens: 16 slots
            assert manager.coordinator.covers("r", 16)
            assert not manager.coordinator.covers("r", 17)
        tables.append(table_ids(manager, "r"))
    assert tables[0] == tables[1]
    assert [len(ids) for ids in tables[0]] == [4] * len(specs)


@pytest.mark.parametrize("specs", [
    (FullAttentionSpec(block_size=4), MambaSpec(block_size=4)),
    (FullAttentionSpec(block_size=4), CircularBufferSpec(block_size=8)),
])
def test_groups_with_their_own_growth_rule_are_called_every_step(specs):
    """A state group and a ring grow by rules of their own (in align mode a state group's growth
    nulls positions and moves draft blocks): every step calls the growth."""
    manager = make_manager(32, *specs, enable_caching=False)
    request = make_request("r", [1, 2, 3, 4, 5, 6], 4, max_tokens=16)
    assert manager.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 6
    calls = _count_growth(manager)
    _decode(manager, request, 8)
    assert len(calls) == 8
    assert not manager.coordinator.covers("r", 1)


def test_a_call_adopting_hits_always_grows():
    """A second request adopting a held 8-token prefix and nothing more: nothing is predicted
    and its new table has the slots, but hits can bring a partial hit's copy, which the growth
    makes, so the call is made."""
    manager = make_manager(16, FullAttentionSpec(block_size=4))
    tokens = list(range(1, 10))
    first = make_request("a", tokens, 4)
    assert manager.allocate_slots(first, 9) is not None
    second = make_request("b", tokens, 4)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(second)
    assert num_hit_tokens == 8
    calls = _count_growth(manager)
    assert manager.allocate_slots(second, 0, num_hit_tokens, hits) is not None
    assert calls == [1]
    assert manager.coordinator.covers("b", 8)
    assert table_ids(manager, "b") == [table_ids(manager, "a")[0][:2]]


def test_cross_attention_tables_are_never_read_as_covering():
    """A cross-attention table grows to the encoder's tokens, not to the slots: a 4-token
    decoder table and a 16-token encoder table do not make 4 slots covered."""
    manager = make_manager(16, FullAttentionSpec(block_size=4), CrossAttentionSpec(block_size=4),
                           enable_caching=False)
    request = make_request("r", [1, 2, 3, 4], 4, max_tokens=4)
    assert manager.allocate_slots(request, 4, num_encoder_tokens=16) is not None
    assert [len(ids) for ids in table_ids(manager, "r")] == [1, 4]
    assert not manager.coordinator.covers("r", 4)
