"""Recurrent-state (Mamba) groups, mamba_cache_mode "none" (docs/spec.md §11): worked examples in
kvcache and the model, and the refusals kvcache, the config and the trace loader share."""

from __future__ import annotations

import json

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import ConfigError
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main
from kvfuzz.harness.executor import run_trace
from kvfuzz.kvcache import FullAttentionSpec, MambaSpec

from kvcache_testkit import free_ids, make_manager, make_request, table_ids

REASON = "Mamba prefix caching requires mamba_cache_mode='align'"


def test_state_blocks_follow_the_last_computed_token():
    """bs 4, one speculative block: 5 slots + 4 draft slots take 3 blocks; once 5 tokens are
    computed the state of token 4 lives in position 1, so position 0 is released."""
    manager = make_manager(8, MambaSpec(block_size=4, num_speculative_blocks=1),
                           enable_caching=False)
    request = make_request("r", [1, 2, 3, 4, 5, 6], 4)
    free_before = manager.block_pool.get_num_free_blocks()
    assert manager.allocate_slots(request, 5) is not None
    assert manager.block_pool.get_num_free_blocks() == free_before - 3
    assert table_ids(manager, "r") == [[1, 2, 3]]
    request.num_computed_tokens = 5
    assert manager.allocate_slots(request, 1) is not None
    assert table_ids(manager, "r") == [[0, 2, 3]]
    assert 1 in free_ids(manager.block_pool)


def test_hybrid_attention_and_state_groups_share_the_pool():
    manager = make_manager(12, FullAttentionSpec(block_size=4), MambaSpec(block_size=8),
                           enable_caching=False)
    request = make_request("r", list(range(9)), 8)
    assert manager.allocate_slots(request, 9) is not None
    assert [len(t) for t in table_ids(manager, "r")] == [3, 2]


def test_a_hybrid_free_queues_each_group_tail_first_and_later_groups_ahead():
    """Caching off, every released block goes to the queue head, group after group, each
    table tail first: the last group's blocks end up first (the no-cache coordinator releases
    all tables in one run that must give this queue)."""
    manager = make_manager(12, FullAttentionSpec(block_size=4), MambaSpec(block_size=8),
                           enable_caching=False)
    request = make_request("r", list(range(9)), 8)
    assert manager.allocate_slots(request, 9) is not None
    full, state = table_ids(manager, "r")
    free_before = free_ids(manager.block_pool)
    manager.free(request)
    assert free_ids(manager.block_pool) == state[::-1] + full[::-1] + free_before


def test_new_attention_blocks_are_recorded_for_zeroing_beside_a_state_group():
    """vLLM zeroes new attention blocks when state groups share the pool; state blocks are not
    listed."""
    manager = make_manager(12, FullAttentionSpec(block_size=4), MambaSpec(block_size=8),
                           enable_caching=False)
    request = make_request("r", list(range(9)), 8)
    blocks = manager.allocate_slots(request, 9)
    assert manager.take_new_block_ids() == list(blocks.get_block_ids()[0])
    alone = make_manager(12, FullAttentionSpec(block_size=4), enable_caching=False)
    assert alone.allocate_slots(make_request("r", list(range(9)), 4), 9) is not None
    assert alone.take_new_block_ids() == []


def test_kvcache_refuses_prefix_caching_without_align():
    with pytest.raises(ValueError, match=REASON.replace("(", r"\(").replace(")", r"\)")):
        make_manager(8, MambaSpec(block_size=4))


def test_spec_refuses_a_mode_vllm_does_not_have():
    with pytest.raises(ValueError, match="mamba_cache_mode must be one of"):
        MambaSpec(block_size=4, mamba_cache_mode="all")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(groups=(GroupConfig("full", 4), GroupConfig("mamba", 4))), REASON),
        (dict(groups=(GroupConfig("mamba", 4, mamba_cache_mode="all"),),
              enable_caching=False), "mamba_cache_mode must be one of"),
        (dict(groups=(GroupConfig("mamba", 4, num_speculative_blocks=-1),),
              enable_caching=False), "num_speculative_blocks"),
        (dict(groups=(GroupConfig("full", 4, num_speculative_blocks=1),)), "mamba settings"),
    ],
)
def test_config_refuses_what_vllm_refuses(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        Config(8, **kwargs)
    assert needle in str(err.value)


def test_trace_loader_refuses_a_caching_state_group_and_exits_two(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({
        "format": "kvfuzz-trace", "version": 1, "level": "api",
        "config": {"num_blocks": 8, "groups": [{"kind": "full", "block_size": 4},
                                               {"kind": "mamba", "block_size": 4}]},
        "ops": []}))
    assert main(["replay", str(path)]) == 2
    assert REASON in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


@pytest.mark.parametrize("name", ["mamba", "jamba", "nemotron_h", "qwen3_5",
                                  "mamba_small_blocks"])
def test_state_configs_run_clean_on_kvcache_and_the_model(name):
    config = BUILTIN[name][1]
    ops = []
    for i in range(3):
        ops += [{"op": "add_request", "request_id": f"r{i}", "prompt": [i, 1, 2, 3, 4, 5],
                 "max_tokens": 3},
                {"op": "allocate_slots", "request_id": f"r{i}", "num_new_tokens": 6}]
    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "api",
                             "config": config.to_dict(), "ops": ops})
    assert run_trace(trace, ["kvcache"]).passed
