"""`enable_mamba_shared_prefix_checkpoint` on target `vllm` (docs/spec.md §11.3): the installed
vLLM's manager is built with it where it takes it (a capability probe), and a config that sets
it on a vLLM without it exits 2 naming the option, or is left out of a campaign."""

from __future__ import annotations

import dataclasses

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution
from kvfuzz.harness.vllm_api import load_vllm
from kvfuzz.harness.vllm_target import build_vllm_manager, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable "
                       "here: run `bash ci/install-vllm.sh [VERSION]` and use the python it prints"),
]

needs_option = pytest.mark.skipif(
    not load_vllm().has("shared_prefix_checkpoint") if vllm_available() else True,
    reason="the installed vLLM has no enable_mamba_shared_prefix_checkpoint")

SIBLINGS = Config(60, (GroupConfig("full", 8), GroupConfig("mamba", 8, mamba_cache_mode="align")),
                  name="siblings", max_model_len=64, hash_block_size=2, use_eagle=True,
                  prefix_cache_retention_interval=16, enable_mamba_shared_prefix_checkpoint=True)
"""Full attention and a Mamba 'align' group of bs 8, hash blocks of 2, EAGLE, retention 16."""


def _add(rid: str, prompt: list[int]) -> dict:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, "max_tokens": 1}


@needs_option
@pytest.mark.parametrize("target", ["vllm", "vllm-scheduler"])
def test_a_sibling_resumes_at_the_junction_three_way(target):
    """`b` shares the first 28 of `a`'s 40 tokens (junction 22): its chunk stops at 22 and the
    state there is keyed, so `c` resumes at 22, on vLLM (driven by kvfuzz's driver, and by its
    own Scheduler) as on kvcache and the model."""
    ops = [_add("a", list(range(40))), {"op": "step"}, {"op": "step"}, {"op": "step"},
           _add("b", list(range(28)) + list(range(200, 212))), {"op": "step"},
           _add("c", list(range(28)) + list(range(300, 312))), {"op": "step"}, {"op": "step"}]
    ex = Execution(SIBLINGS, "scheduler", ("kvcache", target))
    for op in ops:
        ex.apply(op)
    assert [r["scheduled"] for r in ex.results if isinstance(r, dict)][3:] == [
        [["b", 22, 0]], [["b", 2, 0]], [["b", 8, 0], ["c", 2, 22]]]


@needs_option
def test_the_option_reaches_vllms_manager():
    assert build_vllm_manager(BUILTIN["qwen3_next_junction"][1]).mamba_shared_prefix_checkpoint
    off = dataclasses.replace(BUILTIN["qwen3_next_junction"][1],
                              enable_mamba_shared_prefix_checkpoint=False)
    assert not build_vllm_manager(off).mamba_shared_prefix_checkpoint


def test_the_option_on_a_vllm_without_it_exits_2_or_is_left_out(monkeypatch, tmp_path, capsys):
    import kvfuzz.harness.vllm_api as vllm_api

    api = load_vllm()
    monkeypatch.setattr(vllm_api, "_API", dataclasses.replace(
        api, features=api.features - {"shared_prefix_checkpoint"}))
    path = tmp_path / "t.json"
    Trace(BUILTIN["qwen3_next_junction"][1], "api", [_add("a", list(range(10)))]).save(path)
    assert kvfuzz(["replay", str(path), "--target", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "the config sets enable_mamba_shared_prefix_checkpoint," in err
    assert f"target vllm (vLLM {api.version}) lacks it" in err
    from kvfuzz.fuzz.buildable import probe_configs
    from kvfuzz.harness.targets import get_target

    kept = probe_configs(lambda config: get_target("vllm").build(config, "api"),
                         ("qwen3_next_junction", "full"), lambda n: BUILTIN[n][1], set())
    assert kept.kept == ("full",)
    assert "enable_mamba_shared_prefix_checkpoint" in kept.left_out["qwen3_next_junction"]
