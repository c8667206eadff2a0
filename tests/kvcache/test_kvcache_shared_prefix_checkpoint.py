"""`enable_mamba_shared_prefix_checkpoint` (docs/spec.md §11.3): vLLM 0.34's option, narrowed as
vLLM narrows it; with it a prompt chunk stops at the request's junction itself and the Mamba
'align' groups register the state there, so a sibling resumes at the junction."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvfuzz.core.config import Config
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import ConfigError
from kvfuzz.fuzz.cli import main
from kvfuzz.kvcache import FullAttentionSpec, KVCacheManager, MambaSpec
from kvfuzz.kvcache.kv_cache_utils import resolve_kv_cache_block_sizes
from kvfuzz.kvcache.scheduler import Scheduler
from kvfuzz.kvcache.single_type_kv_cache_manager import MambaManager

from kvcache_testkit import make_config, make_request


def _manager(flag: bool, *, eagle: bool = True, hbs: int = 2, num_prefill_lookahead: int = 0,
             retention: int | None = 16) -> KVCacheManager:
    """Full attention and a Mamba 'align' group of bs 8 (qwen3_5_retention's shape)."""
    config = dataclasses.replace(
        make_config(60, FullAttentionSpec(block_size=8),
                    MambaSpec(block_size=8, mamba_cache_mode="align")),
        prefix_cache_retention_interval=retention)
    sbs, hbs = resolve_kv_cache_block_sizes(config, True, hbs)
    return KVCacheManager(config, 1024, sbs, hbs, use_eagle=eagle,
                          num_prefill_lookahead=num_prefill_lookahead,
                          enable_mamba_shared_prefix_checkpoint=flag)


@pytest.mark.parametrize("changes, on", [
    ({}, True),
    ({"flag": False}, False),
    ({"eagle": False}, False),  # no EAGLE group
    ({"hbs": 8}, False),  # no sub-block hits
    ({"num_prefill_lookahead": 3}, False),  # multi-module MTP caches short of the chunk end
    ({"num_prefill_lookahead": 1}, True),
])
def test_the_option_is_narrowed_as_vllm_narrows_it(changes, on):
    manager = _manager(changes.pop("flag", True), **changes)
    assert manager.mamba_shared_prefix_checkpoint is on
    assert [s.shared_prefix_checkpoint for s in manager.coordinator.single_type_managers
            if isinstance(s, MambaManager)] == [on]


def _sibling_resumes(flag: bool) -> list:
    """`a` (40 tokens) leaves states at 32 and 38 only (retention 16, EAGLE). `b` shares its
    first 28: full attention hits 22 (EAGLE drops a hash block), the state group nothing, so
    b's junction is 22. `c` shares the same 28 tokens. The steps after `a`'s."""
    manager = _manager(flag)
    scheduler = Scheduler(manager, max_model_len=64, token_budget=32, max_running=4,
                          mamba_block_aligned_split=True, use_eagle=True)
    sample = lambda request: 999  # noqa: E731
    scheduler.add_request(make_request("a", list(range(40)), 2, max_tokens=1))
    assert [scheduler.step(sample).scheduled for _ in range(3)] == [
        [("a", 32, 0)], [("a", 6, 0)], [("a", 2, 0)]]
    steps = []
    for rid, tail in (("b", range(200, 212)), ("c", range(300, 312))):
        scheduler.add_request(make_request(rid, list(range(28)) + list(tail), 2, max_tokens=1))
        steps.append(scheduler.step(sample).scheduled)
        if rid == "b":
            assert scheduler.running[0].shared_prefix_boundary == 22
    steps.append(scheduler.step(sample).scheduled)
    return steps


def test_a_sibling_resumes_at_the_junction_itself():
    """On: b's first chunk stops at 22 itself and its state there is keyed, so c hits 22 (a
    step later: b's next allocation moves that state to its copy this step). Off: b stops at
    the junction floored to blocks (16), and c hits 16."""
    assert _sibling_resumes(True) == [[("b", 22, 0)], [("b", 2, 0)],
                                      [("b", 8, 0), ("c", 2, 22)]]
    assert _sibling_resumes(False) == [[("b", 16, 0)], [("b", 16, 0), ("c", 16, 16)],
                                       [("b", 6, 0), ("c", 6, 0)]]


def test_the_config_knob_is_validated(tmp_path, capsys):
    config = BUILTIN["qwen3_next_junction"][1]
    assert config.enable_mamba_shared_prefix_checkpoint and config.shared_prefix_checkpoints
    assert not dataclasses.replace(config, use_eagle=False).shared_prefix_checkpoints
    with pytest.raises(ConfigError, match="enable_mamba_shared_prefix_checkpoint must be true "
                                          "or false, got 1"):
        dataclasses.replace(config, enable_mamba_shared_prefix_checkpoint=1)
    shape = config.to_dict() | {"name": "mine", "enable_mamba_shared_prefix_checkpoint": "yes"}
    (tmp_path / "bad.json").write_text(json.dumps(shape))
    assert main(["run", "--config-file", str(tmp_path / "bad.json"), "--examples", "1"]) == 2
    assert ("enable_mamba_shared_prefix_checkpoint must be true or false, got 'yes'"
            in capsys.readouterr().err)
    assert Config.from_dict(config.to_dict()) == config


def test_the_split_stops_at_the_junction_within_the_prompt():
    """vLLM's `_mamba_block_aligned_split` with the option: J itself inside the prompt, J
    floored to blocks from the start past it (bs 8, hash blocks of 2, a 40-token prompt)."""
    from kvfuzz.kvcache.scheduler import mamba_block_aligned_split

    split = (0, 32, 40, 40, 8, 2, True, 32)
    assert mamba_block_aligned_split(*split, junction=22) == 16
    assert mamba_block_aligned_split(*split, junction=22, exact_junction=True) == 22
    resumed = (0, 32, 20, 40, 8, 2, True, 32)  # 20 prompt tokens, 20 outputs to replay
    assert mamba_block_aligned_split(*resumed, junction=22, exact_junction=True) == 16


def test_the_junction_is_keyed_only_inside_the_prompt_chunk_being_computed():
    """A chunk from 0 ending at the junction J = 22 keys the state there (inside block 2) when
    J ≤ P; with the option off, or with J past the prompt (a resumed request replaying its
    outputs), block 2 holds no key of 22. vLLM's `_cache_partial_tail_block` then has nothing
    more to key at 22."""
    for flag, prompt_len, keyed in ((True, 40, True), (False, 40, False), (True, 20, False)):
        manager = _manager(flag, retention=None)
        request = make_request("r", list(range(40)), 2, max_tokens=1)
        request.num_prompt_tokens = prompt_len
        request.shared_prefix_boundary = 22
        assert manager.allocate_slots(request, 22) is not None
        mamba = manager.coordinator.single_type_managers[1]
        assert (mamba.req_to_blocks["r"][2].block_hash_num_tokens == 22) is keyed
        assert mamba._cache_partial_tail_block(request, 22, retention_interval=None) is None
