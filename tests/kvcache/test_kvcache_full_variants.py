"""Full-attention variants (docs/spec.md §12): MLA, sink full attention and R-SWA are managed as
full attention; R-SWA also releases the blocks between the prompt and its decode window."""

from __future__ import annotations

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import ConfigError
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.kvcache import (
    CircularBufferSpec,
    FullAttentionManager,
    FullAttentionSpec,
    MLAAttentionSpec,
    RSWAManager,
    RSWASpec,
    SinkFullAttentionSpec,
)

from kvcache_testkit import free_ids, make_manager, make_request, table_ids


def test_rswa_releases_the_gap_between_prompt_and_window():
    """bs 2, window 2, a 3-token prompt: the prompt's blocks are positions 0-1 (tokens 0-3).
    With 8 tokens computed the window starts at 6, so position 2 (tokens 4-5) is released;
    position 3 (tokens 6-7) stays."""
    manager = make_manager(12, RSWASpec(block_size=2, rswa_window=2))
    assert isinstance(manager.coordinator.single_type_managers[0], RSWAManager)
    request = make_request("r", [1, 2, 3], 2, max_tokens=8)
    assert manager.allocate_slots(request, 3) is not None
    request.num_computed_tokens = 3
    for token in range(5):
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    assert table_ids(manager, "r") == [[1, 2, 3, 4]]
    request.append_output_token_ids(9)
    assert manager.allocate_slots(request, 1) is not None
    assert table_ids(manager, "r") == [[1, 2, 0, 4, 5]]
    assert 3 in free_ids(manager.block_pool)


@pytest.mark.parametrize("spec", [MLAAttentionSpec(block_size=4),
                                  SinkFullAttentionSpec(block_size=4, sink_len=8)])
def test_mla_and_sink_are_full_attention(spec):
    manager = make_manager(8, spec)
    assert type(manager.coordinator.single_type_managers[0]) is FullAttentionManager


def test_sink_len_must_be_whole_blocks_to_build_a_manager():
    spec = SinkFullAttentionSpec(block_size=4, sink_len=6)  # built, as vLLM builds it
    with pytest.raises(ValueError, match="sink_len 6 must be a multiple of block_size 4"):
        make_manager(8, spec)


@pytest.mark.parametrize(
    "group, needle",
    [
        (GroupConfig("sink_full", 4, sink_len=6), "sink_len 6 must be a multiple of block_size 4"),
        (GroupConfig("sink_full", 4), "sink_len must be an int"),
        (GroupConfig("rswa", 4), "rswa_window must be an int"),
        (GroupConfig("full", 4, rswa_window=4), "rswa_window on a 'full' group"),
    ],
)
def test_config_refuses_bad_variants(group, needle):
    with pytest.raises(ConfigError) as err:
        Config(8, (group,))
    assert needle in str(err.value)


def test_full_and_mla_are_two_spec_groups_looked_up_together():
    """MLA is another spec: its blocks are looked up as a second full-attention spec group."""
    manager = make_manager(16, MLAAttentionSpec(block_size=4), RSWASpec(block_size=4,
                                                                       rswa_window=4))
    groups = manager.coordinator.attention_groups
    assert len(groups) == 2 and all(g.is_full for g in groups)


@pytest.mark.parametrize("name", ["mla", "full_mla", "sink_full", "rswa", "full_rswa",
                                  "full_ring"])
def test_variant_configs_run_clean_on_kvcache_and_the_model(name):
    ops = []
    for i in range(2):
        ops += [{"op": "add_request", "request_id": f"r{i}", "prompt": [0, 1, 2, i],
                 "max_tokens": 6},
                {"op": "allocate_slots", "request_id": f"r{i}", "num_new_tokens": 4}]
    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                             "config": BUILTIN[name][1].to_dict(),
                             "ops": [{"op": "add_request", "request_id": "s", "prompt": [0, 1, 2],
                                      "max_tokens": 6}] + [{"op": "step", "sample": 1}] * 8})
    assert run_trace(trace, ["kvcache"]).passed
    api = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "api",
                           "config": BUILTIN[name][1].to_dict(), "ops": ops})
    assert run_trace(api, ["kvcache"]).passed


def test_circular_buffer_claims_one_ring_block_for_the_request_lifetime():
    """Full (bs 4) + ring (bs 8): the ring takes one block at the first allocation and none after;
    the lookup returns nothing for it and it never gets a key."""
    manager = make_manager(16, FullAttentionSpec(block_size=4), CircularBufferSpec(block_size=8))
    request = make_request("r", list(range(9)), 4, max_tokens=8)
    assert manager.allocate_slots(request, 9) is not None
    assert [len(t) for t in table_ids(manager, "r")] == [3, 1]
    request.num_computed_tokens = 9
    request.append_output_token_ids(1)
    assert manager.allocate_slots(request, 1) is not None
    assert [len(t) for t in table_ids(manager, "r")] == [3, 1]
    manager.cache_blocks(request, 10)  # more tokens than the ring's 8 slots: not misuse
    twin = make_request("t", list(range(9)), 4)
    blocks, hit = manager.get_computed_blocks(twin)[:2]
    assert hit == 8 and blocks.get_block_ids()[1] == []


def test_rings_alone_cannot_cache():
    with pytest.raises(ConfigError, match="requires at least one cacheable group"):
        Config(8, (GroupConfig("circular_buffer", 4), GroupConfig("circular_buffer", 8)))
