"""Configs generated over the knob space (fuzz/config_space.py) and the campaign's generated
pairs (`kvfuzz run --generated-configs`)."""

import json

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.config_file import too_small_pool
from kvfuzz.core.configs import BUILTIN, builtin_config
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.campaign import Campaign, CampaignOptions
from kvfuzz.fuzz.cli import main
from kvfuzz.fuzz.config_space import (CROSS_FEATURES, GENERATED, config_features,
                                      cross_features, generated_config, generated_variants,
                                      is_generated)
from kvfuzz.harness.executor import run_trace


def test_a_seed_gives_one_config_valid_as_a_config_file():
    for seed in range(300):
        config = generated_config(seed)
        assert config == generated_config(seed)
        assert Config.from_dict(config.to_dict()) == config  # what --config-file builds
        assert too_small_pool(config) is None
    assert len({generated_config(s).to_dict().__repr__() for s in range(50)}) == 50


def test_every_cross_feature_combination_is_generated_and_half_are_not_built_in():
    reached = set()
    for seed in range(2000):
        reached |= cross_features(generated_config(seed))
    assert reached == set(CROSS_FEATURES)
    built_in = set().union(*(cross_features(builtin_config(n)) for n in BUILTIN))
    assert len(set(CROSS_FEATURES) - built_in) >= len(CROSS_FEATURES) // 2


def test_cross_features_name_what_a_config_has():
    full, window = GroupConfig("full", 4), GroupConfig("sliding_window", 2, sliding_window=8)
    assert cross_features(Config(16, (full,))) == set()
    assert cross_features(Config(16, (full, window), use_eagle=True)) == {
        "eagle_window_below_alignment"}
    assert "eagle_window_below_alignment" not in cross_features(
        Config(16, (full, window)))
    twins = (full, GroupConfig("full", 4, eagle=True))
    assert cross_features(Config(16, twins)) == {"merged_groups_eagle_on_one"}
    mamba = GroupConfig("mamba", 1, mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
                        prefill_checkpoint_alignment=1)
    both = cross_features(Config(16, (full, mamba), hash_block_size=1, kv_events=True))
    assert {"mamba_align_block_off_alignment", "one_token_checkpoint_hbs_1"} <= both


def test_generated_pairs_run_a_config_per_batch_and_replay_exactly(tmp_path):
    options = CampaignOptions(target="bug:free-forgets-decrement", seconds=None, examples=30,
                              seed=2, configs=(), generated=True, corpus=tmp_path / "c",
                              max_findings=1, shrink_seconds=5)
    stats = Campaign(options).run()
    assert {p[1] for p in stats.pairs} == {GENERATED}
    finding = stats.findings[0]
    assert finding.config == GENERATED and finding.check == "P2"
    trace = Trace.load(finding.file)
    assert trace.config.name.startswith("gen-") and trace.config.name in stats.generated
    assert not run_trace(trace, ["bug:free-forgets-decrement"]).passed
    assert run_trace(trace, ["kvcache"]).passed
    again = Campaign(CampaignOptions(**{**options.__dict__, "corpus": tmp_path / "d"})).run()
    assert again.generated == stats.generated
    assert Trace.load(again.findings[0].file).to_json() == trace.to_json()


def test_the_summary_and_json_list_the_generated_configs(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["run", "--config", "full", "--level", "api", "--generated-configs",
                 "--examples", "24", "--corpus", str(tmp_path / "c"),
                 "--json", str(report)]) == 0
    out = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["generated_configs"] and all(n.startswith("gen-")
                                             for n in data["generated_configs"])
    assert f"generated configs  {len(data['generated_configs'])}" in out
    assert "api/generated" in out and data["options"]["generated"] is True
    assert main(["run", "--engine", "atheris", "--generated-configs", "--examples", "5",
                 "--corpus", str(tmp_path / "c")]) == 2
    assert "--generated-configs needs --engine hypothesis" in capsys.readouterr().err


def test_a_finding_on_a_generated_config_names_the_smallest_config_that_still_fails(tmp_path):
    options = CampaignOptions(target="bug:free-forgets-decrement", seconds=None, examples=40,
                              seed=5, configs=(), generated=True, corpus=tmp_path / "c",
                              max_findings=1, shrink_seconds=20)
    stats = Campaign(options).run()
    trace = Trace.load(stats.findings[0].file)
    assert trace.config.name in stats.generated and stats.generated[trace.config.name]
    assert is_generated(trace.config) and config_features(trace.config) == 0
    assert not run_trace(trace, ["bug:free-forgets-decrement"]).passed


def test_generated_variants_drop_groups_and_features():
    config = Config(16, (GroupConfig("full", 4), GroupConfig("full", 4, eagle=True)),
                    name="gen-00000001", use_eagle=True, kv_events=True, watermark=0.1)
    assert config_features(config) == 5
    variants = generated_variants(config)
    assert {"use_eagle": False} in variants and {"kv_events": False} in variants
    assert {"watermark": 0.0} in variants
    assert {"groups": (GroupConfig("full", 4),)} in variants
    assert not is_generated(builtin_config("full"))
