"""Connector offers steered to a cached prompt (kvfuzz.fuzz.connector_offers): a connector
config's arrivals copy an earlier prompt, whole or cut to whole blocks, and get an offer at
once, so the per-group lookup behind a connector meets cached blocks; a config without a
connector draws exactly as before."""

from __future__ import annotations

from kvfuzz.core.configs import builtin_config
from kvfuzz.fuzz import connector_offers
from kvfuzz.fuzz.generator import run_example
from kvfuzz.fuzz.strategies import BytesChoices
from kvfuzz.harness.executor import run_trace
from tests.fuzz.test_boundaries import NoDecisions, _bytes
from tests.fuzz.test_boundaries import _found as found_in


def _found(plant: str, config: str, seeds: range) -> int:
    """Scheduler-level examples (one per seed) in which the plant is found."""
    return found_in(plant, config, "scheduler", seeds)


def test_only_connector_configs_copy():
    assert connector_offers.copy_block(builtin_config("full")) == 0
    assert connector_offers.copy_block(builtin_config("hybrid")) == 0
    assert connector_offers.copy_block(builtin_config("connector")) == 4
    assert connector_offers.copy_block(builtin_config("nemotron_h_connector")) == 8
    assert connector_offers.copied_prompt(NoDecisions(), 0, [(1, 2, 3)]) is None
    assert connector_offers.copied_prompt(NoDecisions(), 8, []) is None


def test_a_copy_is_an_earlier_prompt_whole_or_cut_to_whole_blocks():
    earlier = [tuple(range(20)), (7,) * 5]
    # flip (1: steer), pick the first prompt (0), then 0..2 whole blocks of 8 (0: the whole).
    copies = [connector_offers.copied_prompt(BytesChoices(bytes([1, 0, b])), 8, earlier)
              for b in range(3)]
    assert copies == [list(range(20)), list(range(8)), list(range(16))]
    assert connector_offers.copied_prompt(BytesChoices(bytes([0, 0])), 8, earlier) is None  # 1 in 4


def test_steered_examples_replay_and_pass_on_kvcache():
    for config in ("connector", "nemotron_h_connector", "qwen3_next_eagle_connector"):
        for seed in range(6):
            example = run_example(_bytes(seed), builtin_config(config), "scheduler", steps=40,
                                  targets=("kvcache",))
            again = run_example(_bytes(seed), builtin_config(config), "scheduler", steps=40,
                                targets=("kvcache",))
            assert example.trace.to_json() == again.trace.to_json()
            assert run_trace(example.trace, ["kvcache"]).passed


def test_steering_finds_the_per_group_lookup_survivors_plants(monkeypatch):
    """vLLM 0.34.0's survivors #9 (EAGLE's margin on every group) and #10 (its cap `len |
    hash block size`), planted in kvcache: 18 and 15 of 40 scheduler examples find them with
    steering, 1 and 4 without (seeds 0-39)."""
    assert _found("offer-margin-everywhere", "nemotron_h_connector", range(40)) >= 10
    assert _found("offer-margin-cap-or", "qwen3_next_eagle_connector", range(40)) >= 10
    monkeypatch.setattr(connector_offers, "copy_block", lambda config: 0)
    assert _found("offer-margin-everywhere", "nemotron_h_connector", range(40)) < 10
    assert _found("offer-margin-cap-or", "qwen3_next_eagle_connector", range(40)) < 10
