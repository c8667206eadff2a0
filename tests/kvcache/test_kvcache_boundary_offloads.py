"""The boundary states a Mamba 'align' group offers a KV connector (vLLM 0.34's
`KVCacheManager.take_boundary_state_offloads`), and the settable retention interval."""

from __future__ import annotations

from kvfuzz.kvcache import FullAttentionSpec, MambaSpec

from kvcache_testkit import make_manager, make_request

STATE = MambaSpec(block_size=8, mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
                  prefill_checkpoint_alignment=2)


def _manager():
    return make_manager(20, FullAttentionSpec(block_size=8), STATE, hash_block_size=2)


def test_a_cached_state_is_offered_once_with_its_exact_block():
    """test_kvcache_mamba_checkpoint's worked example: 13 tokens in one chunk leave the state
    after 12 in block 3, keyed there; that block is offered, and draining empties the offer."""
    manager = _manager()
    a = make_request("a", list(range(13)), 2)
    manager.allocate_slots(a, 13)
    assert manager.take_boundary_state_offloads() == {"a": [(1, 3, 12)]}
    assert manager.take_boundary_state_offloads() == {}
    a.num_computed_tokens = 13
    assert manager.finalize_partial_tail_offloads(a) == []  # no sub-block prompt tail


def test_an_offer_not_taken_is_withdrawn_when_the_request_frees():
    manager = _manager()
    a = make_request("a", list(range(13)), 2)
    manager.allocate_slots(a, 13)
    manager.free(a)
    assert manager.take_boundary_state_offloads() == {}


def test_setting_the_coordinators_retention_interval_sets_every_groups():
    manager = _manager()
    manager.coordinator.retention_interval = 0
    assert [m.retention_interval for m in manager.coordinator.single_type_managers] == [0, 0]
