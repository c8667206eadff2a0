"""Prompts steered to a 1-token state tail (kvfuzz.fuzz.state_tails): with hash blocks of 1 and a
Mamba "align" group, half the prompts are 2 tokens long, so the state at token 1 is keyed; every
other config draws exactly as before."""

from __future__ import annotations

import random

from kvfuzz.core.configs import builtin_config
from kvfuzz.fuzz import state_tails
from kvfuzz.fuzz.generator import run_example
from kvfuzz.fuzz.strategies import BytesChoices
from kvfuzz.harness.executor import Counterexample

import kvfuzz.harness.mutants  # noqa: F401  (registers the bug:NAME targets)


class NoDecisions:
    def below(self, n: int) -> int:
        raise AssertionError("a config without 1-token states took a decision")


def test_only_hash_blocks_of_one_beside_an_align_group_key_a_one_token_state():
    assert state_tails.keys_one_token_states(builtin_config("mamba_hbs1"))
    for name in ("full", "mamba_align", "qwen3_5_align", "mamba_small_blocks"):
        config = builtin_config(name)
        assert not state_tails.keys_one_token_states(config)
        assert state_tails.prompt_length(NoDecisions(), config) is None


def test_half_the_prompts_are_two_tokens_long():
    config = builtin_config("mamba_hbs1")
    assert state_tails.prompt_length(BytesChoices(bytes([1])), config) == 2
    assert state_tails.prompt_length(BytesChoices(bytes([0])), config) is None


def _found(seeds: range) -> int:
    found = 0
    for level in ("api", "scheduler"):
        for seed in seeds:
            try:
                run_example(random.Random(seed).randbytes(24 * 40 + 64),
                            builtin_config("mamba_hbs1"), level, steps=40,
                            targets=("bug:one-token-state-unkeyed",))
            except Counterexample:
                found += 1
    return found


def test_steering_finds_the_one_token_state_plant_in_more_examples(monkeypatch):
    """vLLM 0.34.0's survivor S6 (the partial tail's guard `num_tokens <= 0` → `<= 1`),
    planted in kvcache: found in 74 of 80 examples of `mamba_hbs1` (both levels, seeds 0-39)
    with steering, 5 without; here seeds 0-19."""
    assert _found(range(20)) >= 30
    monkeypatch.setattr(state_tails, "keys_one_token_states", lambda config: False)
    assert _found(range(20)) < 10
