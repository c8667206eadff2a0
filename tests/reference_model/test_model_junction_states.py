"""The model's junction states (docs/spec.md §11.3, `enable_mamba_shared_prefix_checkpoint`):
a prompt chunk stops at the request's junction itself and the state groups key the state
there, decided from the config alone."""

from __future__ import annotations

import dataclasses

import pytest
from rm_support import Runner

from kvfuzz.core.config import Config, GroupConfig


def _config(flag: bool) -> Config:
    """Full attention and a Mamba 'align' group of bs 8, hash blocks of 2, EAGLE, retention 16,
    budget 32."""
    return Config(60, (GroupConfig("full", 8), GroupConfig("mamba", 8, mamba_cache_mode="align")),
                  max_model_len=64, hash_block_size=2, use_eagle=True,
                  prefix_cache_retention_interval=16,
                  enable_mamba_shared_prefix_checkpoint=flag)


def _steps(config: Config) -> tuple[list, bool]:
    m = Runner(config, "scheduler")
    m.add("a", list(range(40)), max_tokens=1)
    steps = [m.run("step", sample=999)["scheduled"] for _ in range(3)]
    for rid, tail in (("b", range(200, 212)), ("c", range(300, 312))):
        m.add(rid, list(range(28)) + list(tail), max_tokens=1)
        steps.append(m.run("step", sample=999)["scheduled"])
        if rid == "b":
            view = m.snap.requests["b"]
            assert view.shared_prefix_boundary == 22
            state = view.tables[1]  # the state block holding 22 is the third
            junction_keyed = len(state) > 2 and m.snap.block_key_tokens[state[2]] == 22
    steps.append(m.run("step", sample=999)["scheduled"])
    return steps, junction_keyed


@pytest.mark.parametrize("flag, resumed, keyed", [
    (True, [[["b", 22, 0]], [["b", 2, 0]], [["b", 8, 0], ["c", 2, 22]]], True),
    (False, [[["b", 16, 0]], [["b", 16, 0], ["c", 16, 16]], [["b", 6, 0], ["c", 6, 0]]], False),
])
def test_a_sibling_resumes_at_the_junction_itself(flag, resumed, keyed):
    """`b` shares `a`'s first 28 tokens: its junction is 22 (full attention's hit less EAGLE's
    hash block; no state there). On, b's chunk stops at 22 and its state there is keyed, and
    `c` resumes at 22; off, b stops at 16 (the junction floored to blocks), and c hits 16."""
    steps, junction_keyed = _steps(_config(flag))
    assert steps[:3] == [[["a", 32, 0]], [["a", 6, 0]], [["a", 2, 0]]]
    assert steps[3:] == resumed and junction_keyed is keyed


def test_the_option_needs_eagle_groups():
    """Without EAGLE groups vLLM turns the option off: the model floors the junction."""
    config = dataclasses.replace(_config(True), use_eagle=False)
    assert not config.shared_prefix_checkpoints
    assert Runner(config, "scheduler").model.manager.layout.junction_states is False
