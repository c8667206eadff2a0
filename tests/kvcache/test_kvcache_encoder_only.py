"""Encoder-only attention (docs/spec.md §12.4): a group that takes no KV cache, in a config
with prefix caching and chunked prefill off, as vLLM runs such models."""

from __future__ import annotations

import pytest

from kvfuzz.core.config import Config, GroupConfig, SchedulerConfig
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import ConfigError
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.kvcache import EncoderOnlyAttentionManager, EncoderOnlyAttentionSpec, MambaSpec

from kvcache_testkit import make_manager, make_request, table_ids


def test_encoder_only_group_never_holds_a_block():
    """Beside a state group (bs 16, ColQwen3.5-like) the encoder-only group gets an empty
    table, predicts 0 and leaves the pool untouched; freeing returns the state block only."""
    manager = make_manager(8, MambaSpec(block_size=16), EncoderOnlyAttentionSpec(block_size=4),
                           enable_caching=False)
    assert isinstance(manager.coordinator.single_type_managers[1], EncoderOnlyAttentionManager)
    request = make_request("r", list(range(12)), 4)
    assert manager.allocate_slots(request, 12) is not None
    assert [len(t) for t in table_ids(manager, "r")] == [1, 0]
    assert manager.block_pool.get_num_free_blocks() == 6
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == 7


def test_encoder_only_refuses_prefix_caching():
    with pytest.raises(ValueError, match="bidirectional attn do not support prefix caching"):
        make_manager(8, EncoderOnlyAttentionSpec(block_size=4))


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"enable_caching": True},
         "encoder_only group needs enable_caching false: Pooling models with bidirectional "
         "attn do not support prefix caching."),
        ({"scheduler": SchedulerConfig()},
         "encoder_only group needs scheduler.chunked_prefill false: Pooling models with "
         "bidirectional attn do not support chunked prefill."),
    ],
)
def test_config_refuses_what_vllm_refuses_encoder_only_models(changes, needle):
    with pytest.raises(ConfigError) as err:
        BUILTIN["bert"][1].replace(**changes)
    assert needle in str(err.value)


def test_config_file_refuses_caching_with_encoder_only():
    data = {"num_blocks": 8, "groups": [{"kind": "encoder_only", "block_size": 4}],
            "scheduler": {"chunked_prefill": False}}
    with pytest.raises(ConfigError, match="enable_caching false"):
        Config.from_dict(data)
    assert Config.from_dict({**data, "enable_caching": False}).groups == (
        GroupConfig("encoder_only", 4),)


@pytest.mark.parametrize("name", ["bert", "colqwen3_5"])
def test_encoder_only_configs_run_clean_on_kvcache_and_the_model(name):
    ops = [{"op": "add_request", "request_id": f"r{i}", "prompt": [0, 1, 2, i] * 3,
            "max_tokens": 4} for i in range(3)]
    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                             "config": BUILTIN[name][1].to_dict(),
                             "ops": ops + [{"op": "step", "sample": 1}] * 8})
    result = run_trace(trace, ["kvcache"])
    assert result.passed, result.finding
