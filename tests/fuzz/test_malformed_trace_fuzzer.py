"""Our own fuzzer over the trace format: Hypothesis mutates a valid trace (a node replaced by an
odd JSON value, a key dropped or added, bytes of the file flipped, cut or spliced) and the CLI
replays the file. The claim: no traceback and an exit code in {0, 1, 2} for any input; a
`version` that is not the integer 1 (`true`, `1.0`) is exit 2; `export` writes a test only for
a trace that `replay` takes, and only under a name that is a Python module (else exit 2).

KVFUZZ_MALFORMED_EXAMPLES sets the number of inputs (default 150); the counts of the last run
(inputs tried, exits by code) are printed at the end of the test (`pytest -s`).
"""

import json
import os
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from kvfuzz.core.config_file import load_config_file
from kvfuzz.core.errors import ConfigError
from kvfuzz.fuzz.cli import main

VALID = {
    "format": "kvfuzz-trace", "version": 1, "level": "api",
    "config": {"name": "full", "num_blocks": 8, "watermark": 0.0, "none_hash_seed": "s",
               "groups": [{"kind": "full", "block_size": 4}],
               "scheduler": {"token_budget": 8, "policy": "fcfs"}},
    "ops": [
        {"op": "add_request", "request_id": "r0", "prompt": [1, 2, 3, 4, 5], "cache_salt": "x"},
        {"op": "get_computed_blocks", "request_id": "r0"},
        {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 5},
        {"op": "append_tokens", "request_id": "r0", "tokens": [6]},
        {"op": "cache_blocks", "request_id": "r0", "num_computed_tokens": 4},
        {"op": "evict_blocks", "block_ids": [1]},
        {"op": "free", "request_id": "r0"},
    ],
    "meta": {"check": "P2", "target": "kvcache", "plugins": [], "seed": 3},
}

ODD_INTS = st.sampled_from([0, 1, -1, 2, 2 ** 31, 2 ** 32, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1,
                            2 ** 64, -(2 ** 63) - 1, 10 ** 7, 131_072, 131_073, 2 ** 24 + 1])
ODD_VERSIONS = st.sampled_from([True, False, 1.0, 1, "1", 2, 0, None, 1.5, [1]])
MODULE_NAMES = st.sampled_from(["t.py"] * 6 + ["test_x\u00b2.py", "1t.py", "class.py", "t-x.py",
                                               "t.txt"])
ODD_STRINGS = st.sampled_from(["", "\ud800", "a\udfffb", "free", "full", "meta", "cuda:float16",
                               "cpu:float64", "evil_plugin", "kvfuzz-trace", "scheduler", "r0",
                               "x" * 1000, "\x00", "é"])
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), ODD_INTS,
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                   ODD_STRINGS)
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4) | ODD_STRINGS, inner,
                                                 max_size=3)), max_leaves=6)


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    """Every path to a node of the document."""
    out = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*path, i))
    return out


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    doc = json.loads(json.dumps(VALID))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        kind = draw(st.sampled_from(["leaf", "leaf", "replace", "drop", "add", "nest",
                                     "repeat", "version"]))
        node = doc
        for key in path:
            node = node[key]
        if kind == "leaf":  # an odd value of the same kind: the trace often stays valid
            if isinstance(node, bool):
                doc = _set(doc, path, not node)
            elif isinstance(node, int):
                doc = _set(doc, path, draw(ODD_INTS | st.integers(-3, 40)))
            elif isinstance(node, str):
                doc = _set(doc, path, draw(ODD_STRINGS))
        elif kind == "replace":
            doc = _set(doc, path, draw(VALUES))
        elif kind == "drop" and path:
            parent = doc
            for key in path[:-1]:
                parent = parent[key]
            del parent[path[-1]]
        elif kind == "add" and isinstance(node, dict):
            node[draw(st.text(max_size=6) | ODD_STRINGS)] = draw(VALUES)
        elif kind == "nest":
            doc = _set(doc, path, _nested(node, draw(st.integers(1, 40))))
        elif kind == "repeat" and isinstance(node, list) and node:
            node.extend(node * draw(st.integers(1, 50)))
        elif kind == "version" and isinstance(doc, dict):  # a replaced root is none
            doc["version"] = draw(ODD_VERSIONS)
    text = json.dumps(doc, allow_nan=True, ensure_ascii=draw(st.booleans()))
    raw = text.encode("utf-8", errors="surrogatepass")
    for _ in range(draw(st.integers(0, 2))):  # byte-level damage
        i = draw(st.integers(0, len(raw)))
        how = draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip" and i < len(raw):
            raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
        elif how == "cut":
            raw = raw[:i] + raw[i + draw(st.integers(1, 16)):]
        else:
            raw = raw[:i] + draw(st.sampled_from([b"[", b"{", b"]", b'"', b"\\", b"NaN",
                                                  b"1e999", b"\xff", b"\xed\xa0\x80", b"-"])) \
                + raw[i:]
    return raw


def _nested(node: Any, depth: int) -> Any:
    for _ in range(depth):
        node = [node]
    return node


COUNTS: Counter = Counter()
CONFIG_COUNTS: Counter = Counter()


@settings(max_examples=int(os.environ.get("KVFUZZ_MALFORMED_EXAMPLES", "150")), deadline=None,
          database=None, suppress_health_check=list(HealthCheck))
@given(raw=documents(), command=st.sampled_from(["replay", "shrink", "export"]),
       module=MODULE_NAMES)
def _fuzz(tmp_path_factory, capsys, raw: bytes, command: str, module: str) -> None:
    folder = tmp_path_factory.mktemp("m")
    path = folder / "t.json"
    path.write_bytes(raw)
    out = folder / module
    extra = {"replay": ["--quiet"], "shrink": ["--seconds", "2", "--out", str(folder / "o.json")],
             "export": ["--pytest", str(out)]}[command]
    code = main([command, str(path), *extra])
    err = capsys.readouterr().err
    COUNTS["inputs"] += 1
    COUNTS[f"exit {code}"] += 1
    assert code in (0, 1, 2), f"exit {code} for {raw[:300]!r}: {err}"
    assert "Traceback" not in err, err
    if _odd_version(raw):
        assert code == 2, f"version accepted: {raw[:300]!r}"
        COUNTS["odd version, exit 2"] += 1
    if command != "export":
        return
    if not (out.suffix == ".py" and out.stem.isidentifier() and out.stem != "class"):
        assert code == 2 and not out.exists(), f"exported under {module!r}"
        COUNTS["not a module name, exit 2"] += 1
    elif code == 0:  # what export takes, replay takes, and the test it wrote compiles
        compile(out.read_text(), str(out), "exec")
        assert main(["replay", str(path), "--quiet"]) in (0, 1), capsys.readouterr().err
        COUNTS["exported, replayed"] += 1
    capsys.readouterr()


def _odd_version(raw: bytes) -> bool:
    """Whether `raw` is a JSON object whose version is anything but the integer 1."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return False
    return isinstance(doc, dict) and not (type(doc.get("version")) is int
                                          and doc.get("version") == 1)


def test_no_malformed_trace_gives_a_traceback_or_an_exit_outside_0_1_2(tmp_path_factory, capsys):
    COUNTS.clear()
    _fuzz(tmp_path_factory, capsys)
    with capsys.disabled():
        print(f"\nmalformed-trace fuzzer: {COUNTS['inputs']} inputs, " + ", ".join(
            f"{key} {COUNTS[key]}" for key in sorted(COUNTS) if key != "inputs"))
    assert COUNTS["exit 2"] > 0 and COUNTS["exit 0"] + COUNTS["exit 1"] > 0


@settings(max_examples=int(os.environ.get("KVFUZZ_MALFORMED_EXAMPLES", "150")), deadline=None,
          database=None, suppress_health_check=list(HealthCheck))
@given(raw=documents(), toml=st.booleans())
def _fuzz_config_files(tmp_path_factory, raw: bytes, toml: bool) -> None:
    """The trace's config, mutated, as a --config-file (TOML when the JSON text still parses)."""
    folder = tmp_path_factory.mktemp("c")
    try:
        config = json.loads(raw)["config"]
        text = _toml(config) if toml else json.dumps(config, allow_nan=True)
        data = text.encode("utf-8", errors="surrogatepass")
    except (ValueError, KeyError, TypeError):
        data, toml = raw, False
    path = folder / ("c.toml" if toml else "c.json")
    path.write_bytes(data)
    try:
        load_config_file(path)
        CONFIG_COUNTS["accepted"] += 1
    except ConfigError:
        CONFIG_COUNTS["ConfigError (exit 2)"] += 1
    CONFIG_COUNTS["inputs"] += 1


def _toml(value: Any) -> str:
    """A config object as TOML: scalars, then [scheduler], then [[groups]] (other shapes raise
    TypeError and go in as JSON)."""
    if not isinstance(value, dict):
        raise TypeError
    lines, tables = [], []
    for key, item in value.items():
        if isinstance(item, dict):
            tables.append(f"[{json.dumps(key)}]\n" + _toml(item))
        elif isinstance(item, list) and item and all(isinstance(g, dict) for g in item):
            tables += [f"[[{json.dumps(key)}]]\n" + _toml(g) for g in item]
        else:
            lines.append(f"{json.dumps(key)} = {_scalar(item)}")
    return "\n".join(lines + tables) + "\n"


def _scalar(item: Any) -> str:
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, float) and item != item:
        return "nan"
    if isinstance(item, float) and item in (float("inf"), float("-inf")):
        return "inf" if item > 0 else "-inf"
    if isinstance(item, list):
        return "[" + ", ".join(map(_scalar, item)) + "]"
    if item is None or isinstance(item, dict):
        raise TypeError
    return json.dumps(item, ensure_ascii=False)


def test_no_malformed_config_file_raises_anything_but_a_config_error(tmp_path_factory):
    CONFIG_COUNTS.clear()
    _fuzz_config_files(tmp_path_factory)
    print(f"\nmalformed config-file fuzzer: {dict(CONFIG_COUNTS)}")
    assert CONFIG_COUNTS["accepted"] > 0 and CONFIG_COUNTS["ConfigError (exit 2)"] > 0
