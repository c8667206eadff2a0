"""Every class of malformed trace file is bad input: exit 2, a message naming the value, no
traceback (docs/traces.md, Bounds)."""

import json
import os
from pathlib import Path

import pytest

from kvfuzz.core.config import Config
from kvfuzz.core.errors import ConfigError
from kvfuzz.fuzz.cli import main

CONFIG = {"num_blocks": 8, "groups": [{"kind": "full", "block_size": 4}]}
ADD = {"op": "add_request", "request_id": "r0", "prompt": [1, 2, 3]}


def _trace(config=None, ops=None, meta=None) -> str:
    data = {"format": "kvfuzz-trace", "version": 1, "level": "api",
            "config": config or CONFIG, "ops": [ADD] if ops is None else ops}
    if meta is not None:
        data["meta"] = meta
    return json.dumps(data)


CASES = {
    "nesting": ("[" * 100_000 + "]" * 100_000, "nested 100000 deep"),
    "huge int": (_trace(ops=[{**ADD, "prompt": [1]}]).replace("[1]", "[" + "9" * 4301 + "]"),
                 "4301 digits"),
    "meta.check a list": (_trace(meta={"check": ["P2"]}), "meta.check must be a string, got ['P2']"),
    "op a list": (_trace(ops=[{"op": ["free"]}]), "unknown api-level op ['free']"),
    "meta.data an int": (_trace(meta={"data": 1}), "meta.data must be a string, got 1"),
    "meta a string": (_trace(meta="data"), "meta must be an object, got 'data'"),
    "meta.data a torch device not for data": (_trace(meta={"data": "meta"}),
                                              "run on cpu or cuda, not on 'meta'"),
    "block_size 2^32": (_trace(config={**CONFIG, "groups": [{"kind": "full",
                                                             "block_size": 2 ** 32}]}),
                        "groups[0].block_size must be an int in [1, 16777216], got 4294967296"),
    "watermark NaN": (_trace(config={**CONFIG, "watermark": float("nan")}), "NaN is not a JSON"),
    "watermark Infinity": (_trace(config={**CONFIG, "watermark": float("inf")}),
                           "Infinity is not a JSON"),
    "watermark 2": (_trace(config={**CONFIG, "watermark": 2}), "watermark must be a number in "
                    "[0, 1], got 2"),
    "surrogate request id": (_trace(ops=[{**ADD, "request_id": "\ud800"}]),
                             "ops[0].request_id '\\ud800' is not text"),
    "surrogate salt": (_trace(ops=[{**ADD, "cache_salt": "\udfff"}]),
                       "ops[0].cache_salt '\\udfff' is not text"),
    "surrogate none-hash seed": (_trace(config={**CONFIG, "none_hash_seed": "\ud83d"}),
                                 "none_hash_seed '\\ud83d' is not text"),
    "token 2^64": (_trace(ops=[{**ADD, "prompt": [2 ** 64]}]),
                   "prompt: token id an int of 65 bits exceeds 2147483647"),
    "token 2^31": (_trace(ops=[{**ADD, "prompt": [2 ** 31]}]),
                   "prompt: token id 2147483648 exceeds 2147483647"),
    "token -2^63-1": (_trace(ops=[{**ADD, "prompt": [-(2 ** 63) - 1]}]), "outside the i64 range"),
    "count 2^63": (_trace(ops=[ADD, {"op": "allocate_slots", "request_id": "r0",
                                     "num_new_tokens": 2 ** 63}]),
                   "num_new_tokens must be an i64, got 9223372036854775808"),
    "num_blocks 10^7": (_trace(config={**CONFIG, "num_blocks": 10 ** 7}),
                        "num_blocks must be an int in [2, 1048576], got 10000000"),
    "too many groups": (_trace(config={**CONFIG, "groups": [{"kind": "full", "block_size": 4}]
                                       * 17}), "groups lists 17 groups, at most 16"),
    "too many requests": (_trace(ops=[{**ADD, "request_id": f"r{i}"} for i in range(1025)]),
                          "ops add 1025 requests, at most 1024"),
    "huge LCM": (_trace(config={**CONFIG, "enable_caching": False, "groups": [
        {"kind": "full", "block_size": b} for b in (4093, 4091, 4099)]}),
        "the scheduler block size"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_malformed_trace_exits_two_naming_the_value(tmp_path, capsys, name):
    text, needle = CASES[name]
    path = tmp_path / "t.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    for argv in (["replay", str(path)], ["shrink", str(path), "--out", str(tmp_path / "o.json")],
                 ["export", str(path), "--pytest", str(tmp_path / "t.py")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_only_a_regular_file_of_bounded_size_is_read(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(16 * 1024 * 1024 + 1)
    for path, needle in ((fifo, "is not a regular file"), (Path("/dev/zero"), "is not a regular "
                         "file"), (big, "has 16777217 bytes: a trace file has at most 16777216")):
        assert main(["replay", str(path)]) == 2
        assert needle in capsys.readouterr().err


def test_the_config_bounds_hold_for_configs_built_in_python():
    with pytest.raises(ConfigError, match="watermark must be a number in"):
        Config.from_dict({**CONFIG, "watermark": float("nan")})
    with pytest.raises(ConfigError, match="name must be text"):
        Config.from_dict({**CONFIG, "name": "\udc80"})


def test_a_negative_token_is_an_invalid_op_where_it_stands(tmp_path, capsys):
    (tmp_path / "t.json").write_text(_trace(ops=[{**ADD, "prompt": [-1]}]))
    assert main(["replay", str(tmp_path / "t.json")]) == 2
    assert "step 0 (add_request): prompt has a negative token id: [-1]" in capsys.readouterr().err
