"""`--config-file`: a user's model shape, in TOML or JSON, validated like a trace's config,
fuzzed as given by `kvfuzz run` and by the state machines (`kvfuzz.testing`); the examples of
docs/configs.md are shipped files that each run a tiny campaign."""

import json
from pathlib import Path

import pytest
from hypothesis import settings

from kvfuzz import shipped
from kvfuzz.core.config_file import load_config_file
from kvfuzz.core.errors import ConfigError
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main
from kvfuzz.testing import machine_for_config_file

EXAMPLES = sorted((Path(__file__).parents[2] / "docs" / "configs").iterdir())


def test_the_examples_are_shipped_and_shown_in_docs_configs_md():
    page = shipped("docs") / "configs.md"
    text = page.read_text()
    assert [p.name for p in EXAMPLES] == sorted(p.name for p in (shipped("docs") / "configs")
                                                .iterdir())
    for example in EXAMPLES:
        assert example.read_text().strip() in text, example.name


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_each_example_runs_a_tiny_campaign(tmp_path, capsys, example):
    config = load_config_file(example)
    code = main(["run", "--config-file", str(example), "--examples", "4", "--level", "api",
                 "--corpus", str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"api/{config.name}" in out and "1 configs" in out


SHAPE = """# not built in: block size 16, a chunked-local group beside full attention
name = "my-model"
num_blocks = 48
max_model_len = 256
enable_caching = false

[[groups]]
kind = "full"
block_size = 16

[[groups]]
kind = "chunked_local"
block_size = 16
attention_chunk_size = 32
"""


def test_a_users_config_file_fuzzes_a_shape_not_built_in(tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text(SHAPE)
    code = main(["run", "--config-file", str(path), "--target", "bug:free-forgets-decrement",
                 "--examples", "20", "--level", "api", "--corpus", str(tmp_path / "c")])
    assert code == 1, capsys.readouterr().out
    found = next((tmp_path / "c").glob("*-my-model-*.json"))
    trace = Trace.load(found)
    assert trace.config.block_sizes == (16, 16) and trace.config.name == "my-model"
    assert trace.config.groups[1].attention_chunk_size == 32  # run as given, not varied


def test_a_config_file_and_a_trace_config_get_the_same_messages(tmp_path, capsys):
    bad = {"num_blocks": 8, "groups": [{"kind": "full", "block_size": 2 ** 32}]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    (tmp_path / "bad.toml").write_text("num_blocks = 8\nwatermark = nan\n[[groups]]\n"
                                       "kind = 'full'\nblock_size = 4\n")
    (tmp_path / "typo.toml").write_text("num_block = 8\n")
    trace = {"format": "kvfuzz-trace", "version": 1, "level": "api", "config": bad, "ops": []}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    message = "groups[0].block_size must be an int in [1, 16777216], got 4294967296"
    for argv in (["run", "--config-file", str(tmp_path / "bad.json")],
                 ["replay", str(tmp_path / "t.json")]):
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    assert main(["run", "--config-file", str(tmp_path / "bad.toml")]) == 2
    assert "watermark must be a number in [0, 1], got nan" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown field.*'num_block'"):
        load_config_file(tmp_path / "typo.toml")
    (tmp_path / "full.toml").write_text(SHAPE.replace('"my-model"', '"full"'))
    assert main(["run", "--config-file", str(tmp_path / "full.toml")]) == 2
    assert "its name 'full' is already taken (by a built-in config)" in capsys.readouterr().err


@pytest.mark.parametrize("knob, bad, good, allowed", [
    ("kv_load_failure_policy", "retry", "fail", "('recompute', 'fail')"),
    ("in_flight_sampling", "skip", "wait", "('placeholders', 'wait')"),
])
def test_a_bad_scheduler_rule_exits_2_naming_it(knob, bad, good, allowed, tmp_path, capsys):
    (tmp_path / "p.toml").write_text("num_blocks = 8\nkv_connector = true\n[[groups]]\n"
                                     "kind = 'full'\nblock_size = 4\n[scheduler]\n"
                                     f"{knob} = '{bad}'\n")
    assert main(["run", "--config-file", str(tmp_path / "p.toml"), "--corpus",
                 str(tmp_path / "c")]) == 2
    assert (f"scheduler.{knob} must be one of {allowed}, got '{bad}'"
            in capsys.readouterr().err)
    assert not (tmp_path / "c").exists()
    (tmp_path / "p.toml").write_text((tmp_path / "p.toml").read_text().replace(bad, good))
    assert getattr(load_config_file(tmp_path / "p.toml").scheduler, knob) == good


def test_a_hash_lookahead_with_the_eagle_drop_exits_2_naming_both(tmp_path, capsys):
    """A pairing vLLM's Scheduler never builds (it clears the drop when it hashes ahead,
    sched/scheduler.py:342-345 in 0.34.0) is bad input; without the drop the file runs."""
    mtp = (Path(__file__).parents[2] / "docs" / "configs" / "deepseek-v3-mtp.toml").read_text()
    path = tmp_path / "mtp.toml"
    path.write_text("use_eagle = true\n" + mtp)
    assert main(["run", "--config-file", str(path), "--corpus", str(tmp_path / "c")]) == 2
    assert ("use_eagle with num_hash_lookahead_tokens 2: vLLM never builds"
            in capsys.readouterr().err)
    assert not (tmp_path / "c").exists()
    path.write_text(mtp)
    assert not load_config_file(path).use_eagle


def test_a_state_machine_runs_a_config_file_as_given(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(SHAPE)
    seen = []
    machine = machine_for_config_file(path, "api")
    machine.on_execution = seen.append
    machine.TestCase.settings = settings(max_examples=3, stateful_step_count=5, deadline=None,
                                         database=None)
    machine.TestCase().runTest()
    assert seen and all(e.config == load_config_file(path) for e in seen)


def test_replay_runs_a_trace_on_a_config_file_instead_of_its_own(tmp_path, capsys):
    ops = [{"op": "add_request", "request_id": "r0", "prompt": list(range(20))},
           {"op": "get_computed_blocks", "request_id": "r0"},
           {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 20}]
    Trace(load_config_file(EXAMPLES[0]), "api", ops).save(tmp_path / "t.json")
    (tmp_path / "mine.toml").write_text(SHAPE)
    assert main(["replay", str(tmp_path / "t.json"), "--config-file",
                 str(tmp_path / "mine.toml")]) == 0
    out = capsys.readouterr().out
    assert "config 'my-model'" in out and '"block_ids": [[1, 2], [3, 4]]' in out
