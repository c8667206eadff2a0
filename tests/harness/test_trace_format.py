"""The trace file format: round trips, and a clear error naming the bad value otherwise."""

import json

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import ConfigError, TraceFormatError
from kvfuzz.core.trace import Trace

GOOD = {
    "format": "kvfuzz-trace",
    "version": 1,
    "level": "api",
    "config": {"num_blocks": 8, "groups": [{"kind": "full", "block_size": 4}]},
    "ops": [{"op": "add_request", "request_id": "a", "prompt": [1, 2, 3]}],
}


def test_round_trip_through_a_file(tmp_path):
    trace = Trace.from_dict(GOOD)
    path = trace.save(tmp_path / "t.json")
    again = Trace.load(path)
    assert again.ops == trace.ops and again.config == trace.config
    assert again.ops[0]["max_tokens"] == 16  # defaults filled on load
    assert "max_tokens" not in json.loads(path.read_text())["ops"][0]  # and left out on save


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_configs_round_trip(name):
    config = BUILTIN[name][1]
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"format": "other"}, "'other'"),
        ({"version": 2}, "version 2"),
        ({"level": "layer9"}, "'layer9'"),
        ({"extra": 1}, "'extra'"),
        ({"ops": {}}, "ops must be a list"),
        ({"ops": [{"op": "explode"}]}, "'explode'"),
        ({"ops": [{"op": "add_request", "request_id": "a"}]}, "'prompt'"),
        ({"ops": [{"op": "add_request", "request_id": "a", "prompt": [1], "colour": 1}]},
         "'colour'"),
        ({"ops": [{"op": "allocate_slots", "request_id": "a", "num_new_tokens": "3"}]}, "'3'"),
        ({"ops": [{"op": "step"}]}, "'step'"),
        ({"config": {"num_blocks": 1, "groups": [{"kind": "full", "block_size": 4}]}},
         "num_blocks"),
        ({"config": {"num_blocks": 8, "groups": [{"kind": "ring", "block_size": 4}]}}, "'ring'"),
        ({"config": {"num_blocks": 8, "groups": [{"kind": "full", "block_size": 4}],
                     "colour": 1}}, "'colour'"),
    ],
)
def test_malformed_traces_name_the_bad_value(change, needle):
    with pytest.raises(TraceFormatError) as err:
        Trace.from_dict({**GOOD, **change})
    assert needle in str(err.value)


def test_bad_json_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"format": "kvfuzz-trace",\n "version": 1,,}')
    with pytest.raises(TraceFormatError, match="line 2"):
        Trace.load(path)


def test_missing_file_is_a_format_error(tmp_path):
    with pytest.raises(TraceFormatError, match="cannot read"):
        Trace.load(tmp_path / "nope.json")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(groups=(GroupConfig("full", 4), GroupConfig("cross", 4))), "cross"),
        (dict(groups=(GroupConfig("full", 4),), hash_block_size=2), "hash_block_size 2"),
        (dict(groups=(GroupConfig("full", 6), GroupConfig("full", 4)), hash_block_size=4),
         "block_size 6"),
        (dict(groups=(GroupConfig("chunked_local", 4, attention_chunk_size=8),),
              use_eagle=True), "use_eagle"),
        (dict(groups=(GroupConfig("full", 4),), partial_hits=True), "partial_hits"),
        (dict(groups=(GroupConfig("full", 4),), watermark=-0.5), "-0.5"),
        (dict(groups=(GroupConfig("sliding_window", 4),)), "sliding_window"),
    ],
)
def test_config_errors_name_the_setting(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        Config(8, **kwargs)
    assert needle in str(err.value)


def test_derived_sizes():
    hybrid = BUILTIN["hybrid"][1]
    assert (hybrid.scheduler_block_size, hybrid.resolved_hash_block_size,
            hybrid.alignment_tokens) == (8, 4, 8)
    partial = BUILTIN["partial_hits"][1]
    assert partial.alignment_tokens == 4
    no_cache = Config(8, (GroupConfig("full", 8), GroupConfig("full", 4)), enable_caching=False)
    assert no_cache.resolved_hash_block_size == 8
