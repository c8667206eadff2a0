"""The kvfuzz command line: exit codes, files, determinism, plugins, interruption."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfuzz.fuzz.cli import main
from kvfuzz.core.trace import Trace
from kvfuzz.properties import REGISTRY

REPO = Path(__file__).resolve().parents[2]
UNDER_A_FILE = str(Path(__file__) / "sub")
"""A path no folder can be made at: one of its parents is a file."""


def test_run_against_kvcache_passes_and_writes_a_report(tmp_path, capsys):
    report = tmp_path / "r.json"
    code = main(["run", "--examples", "20", "--config", "full", "--seed", "3",
                 "--corpus", str(tmp_path / "c"), "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads(report.read_text())
    assert data["target"] == "kvcache" and data["examples"] == 20 and data["findings"] == []
    assert data["operations"] > 0 and data["coverage"] > 0 and data["invariant_checks"] > 0
    assert data["interrupted"] is False
    rows = data["by_config"]
    assert [(r["level"], r["config"], r["findings"]) for r in rows] == [
        ("api", "full", 0), ("scheduler", "full", 0)]
    assert sum(r["examples"] for r in rows) == 20
    assert sum(r["operations"] for r in rows) == data["operations"]
    assert "summary" in out and "ops/s" in out and "scheduler/full" in out
    assert "interrupted" not in out


def test_same_seed_same_examples(tmp_path):
    reports = []
    for i in range(2):
        path = tmp_path / f"r{i}.json"
        main(["run", "--examples", "20", "--config", "hybrid", "--seed", "7",
              "--corpus", str(tmp_path), "--json", str(path)])
        reports.append(json.loads(path.read_text()))
    keys = ("examples", "operations", "invariant_checks", "coverage")
    assert [r[k] for k in keys for r in reports[:1]] == [reports[1][k] for k in keys]


def test_workers_share_an_examples_budget(tmp_path):
    report = tmp_path / "r.json"
    code = main(["run", "--examples", "21", "--workers", "2", "--config", "full",
                 "--corpus", str(tmp_path / "c"), "--json", str(report)])
    assert code == 0
    data = json.loads(report.read_text())
    assert data["examples"] == 21 and data["workers"] == 2


def test_finding_exits_one_and_saves_a_named_shrunk_trace(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    code = main(["run", "--target", "bug:predictor-off-by-one", "--config", "full",
                 "--examples", "200", "--corpus", str(corpus)])
    assert code == 1
    files = sorted(corpus.glob("P1-*.json"))
    assert files, capsys.readouterr().out
    trace = Trace.load(files[0])
    assert trace.meta["check"] == "P1" and len(trace.ops) <= 10
    assert main(["replay", str(files[0])]) == 1
    assert main(["replay", str(files[0]), "--target", "kvcache"]) == 0


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["run", "--target", "nope"], "unknown target 'nope'"),
        (["run", "--config", "nope"], "unknown config 'nope'"),
        (["run", "--plugin", "no_such_plugin_module"], "no_such_plugin_module"),
        (["run", "--workers", "0"], "--workers"),
        (["run", "--data", "gpu"], "--data 'gpu'"),
        (["run", "--data", "cpu:int8"], "--data 'cpu:int8'"),
        (["run", "--engine", "atheris", "--database", "db"], "--database"),
        (["run", "--seconds", "0"], "--seconds must be > 0, got 0"),
        (["run", "--seconds", "-1"], "--seconds must be > 0, got -1"),
        (["run", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["run", "--config", "full", "--focus", "watermark"], "--focus 'watermark'"),
        (["run", "--focus", "allocate"], "--focus 'allocate' is neither"),
        (["shrink", "t.json", "--seconds", "0"], "--seconds must be > 0, got 0"),
        (["run", "--corpus", UNDER_A_FILE], f"--corpus {UNDER_A_FILE}"),
        (["run", "--json", f"{UNDER_A_FILE}/r.json"], f"--json {UNDER_A_FILE}/r.json"),
    ],
)
def test_usage_errors_exit_two_naming_the_value(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_the_database_replays_a_saved_failure_first(tmp_path):
    """One generated example (Hypothesis' simplest) misses the planted bug; with the database
    of an earlier run it is found again at once, whatever the seed, and a run with other
    options leaves the saved example alone."""
    db = tmp_path / "db"

    def run(*argv: str) -> int:
        return main(["run", "--config", "full", "--level", "api", "--corpus", str(tmp_path / "c"),
                     *argv])

    bug = ("--target", "bug:free-forgets-decrement")
    assert run(*bug, "--examples", "10", "--seed", "1", "--database", str(db)) == 1
    assert any(p.is_file() for p in db.rglob("*"))
    assert run(*bug, "--examples", "1", "--seed", "2") == 0
    assert run("--examples", "1", "--seed", "2", "--database", str(db)) == 0
    assert run(*bug, "--examples", "1", "--seed", "2", "--database", str(db)) == 1


def test_replay_rejects_malformed_and_wrong_version_files(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["replay", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "kvfuzz-trace", "version": 99, "level": "api",
                               "config": {}, "ops": []}))
    assert main(["replay", str(old)]) == 2
    assert "version 99" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["replay", "shrink", "export"])
def test_unreadable_trace_files_exit_two_naming_them(tmp_path, capsys, command):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    no_config = tmp_path / "no_config.json"
    no_config.write_text(json.dumps({"format": "kvfuzz-trace", "version": 1, "level": "api",
                                     "ops": []}))
    out = ["--pytest", str(tmp_path / "t.py")] if command == "export" else []
    for path, needle in ((binary, "not UTF-8 JSON"), (no_config, "missing field(s) 'config'"),
                         (tmp_path / "absent.json", "No such file"), (tmp_path, "Is a directory")):
        assert main([command, str(path), *out]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and needle in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.json", "no_config.json"]


def _long_failing_trace(tmp_path: Path) -> Path:
    ops = []
    for i in range(6):
        ops += [{"op": "add_request", "request_id": f"r{i}", "prompt": [i, 1, 2, 3, 4]},
                {"op": "allocate_slots", "request_id": f"r{i}", "num_new_tokens": 5},
                {"op": "free", "request_id": f"r{i}"}]
    data = {"format": "kvfuzz-trace", "version": 1, "level": "api",
            "config": {"num_blocks": 16, "groups": [{"kind": "full", "block_size": 4}]},
            "ops": ops, "meta": {"target": "bug:free-forgets-decrement"}}
    path = tmp_path / "long.json"
    path.write_text(json.dumps(data))
    return path


def test_shrink_and_export(tmp_path, capsys):
    path = _long_failing_trace(tmp_path)
    out = tmp_path / "min.json"
    assert main(["shrink", str(path), "--out", str(out)]) == 0
    small = Trace.load(out)
    assert len(small.ops) == 3 and small.meta["check"] == "P2"
    test_file = tmp_path / "test_regression.py"
    assert main(["export", str(out), "--pytest", str(test_file)]) == 0
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]
    assert subprocess.run(run, cwd=tmp_path, capture_output=True).returncode == 1
    assert main(["export", str(out), "--pytest", str(test_file), "--target", "kvcache"]) == 0
    assert subprocess.run(run, cwd=tmp_path, capture_output=True).returncode == 0


def test_listing_commands(capsys):
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    assert "kvcache" in out and "vllm" in out and "bug:salt-ignored" in out
    assert main(["invariants"]) == 0
    assert "P1" in capsys.readouterr().out
    assert main(["configs"]) == 0
    listing = capsys.readouterr().out
    assert "hybrid" in listing
    assert "gpt_oss_connector" in listing and "mistral_connector" in listing
    assert "nemotron_h_connector" in listing and "qwen3_5_connector" in listing
    assert "qwen3_next_eagle" in listing and "Qwen3-Next-shaped" in listing


def _forget_my_checks() -> None:
    """Undo the import of the plugin `my_checks`, as in a fresh process."""
    if "MY1" in REGISTRY:
        REGISTRY.remove("MY1")
    sys.modules.pop("my_checks", None)


@pytest.fixture
def my_checks(tmp_path, monkeypatch):
    """A plugin module `my_checks` on the path, with check MY1 (forgotten afterwards)."""
    (tmp_path / "my_checks.py").write_text(
        "from kvfuzz.properties import invariant\n\n"
        "@invariant('MY1', 'no request holds more than one block in group 0')\n"
        "def at_most_one(snapshot, ctx):\n"
        "    for rid, view in snapshot.requests.items():\n"
        "        if view.tables[0] and len(view.tables[0]) > 1:\n"
        "            return f'{rid} holds {len(view.tables[0])} blocks'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_checks"
    _forget_my_checks()


def test_a_plugin_finding_records_its_plugin_and_replays_exports_with_it(tmp_path, my_checks,
                                                                         capsys):
    """A finding records its plugins; replay, shrink and export import them only when passed
    (`--plugin` before or after FILE), else the recorded check is a usage error saying what to
    pass, never a silent pass; the exported test imports what export was given."""
    code = main(["run", "--plugin", my_checks, "--config", "full", "--examples", "50",
                 "--corpus", str(tmp_path / "c")])
    assert code == 1
    found = min((tmp_path / "c").glob("MY1-*.json"))
    assert Trace.load(found).meta["plugins"] == [my_checks]
    _forget_my_checks()
    capsys.readouterr()
    assert main(["replay", str(found), "--quiet"]) == 2
    assert f"pass `--plugin {my_checks}`" in capsys.readouterr().err
    assert main(["replay", "--plugin", my_checks, str(found), "--quiet"]) == 1
    _forget_my_checks()
    assert main(["shrink", str(found), "--plugin", my_checks,
                 "--out", str(tmp_path / "min.json")]) == 0
    assert Trace.load(tmp_path / "min.json").meta["plugins"] == [my_checks]
    test_file = tmp_path / "test_regression_my1.py"
    assert main(["export", "--plugin", my_checks, str(found), "--pytest", str(test_file)]) == 0
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(test_file)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=False)
    assert run.returncode == 1 and "[MY1]" in run.stdout, run.stdout + run.stderr
    _forget_my_checks()
    unrecorded = Trace.load(found)
    del unrecorded.meta["plugins"]
    bare = unrecorded.save(tmp_path / "bare.json")
    capsys.readouterr()
    for argv in (["replay"], ["shrink"], ["export", "--pytest", str(tmp_path / "t.py")]):
        assert main([argv[0], str(bare), *argv[1:]]) == 2
        err = capsys.readouterr().err
        assert "check 'MY1', which is not registered" in err and "--plugin MODULE" in err
    assert main(["replay", str(bare), "--plugin", my_checks, "--quiet"]) == 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_campaign_keeps_findings_and_summarises(tmp_path, sig):
    corpus = tmp_path / "corpus"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfuzz", "run", "--target", "bug:free-forgets-decrement",
         "--config", "full", "--seconds", "120", "--corpus", str(corpus),
         "--json", str(tmp_path / "r.json")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(corpus.glob("*.json")):
        time.sleep(0.5)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "summary" in out and "findings" in out and list(corpus.glob("P2-*.json"))
    assert "interrupted" in out and json.loads((tmp_path / "r.json").read_text())["interrupted"]


def test_data_checks_find_wrong_bytes_and_the_finding_replays_with_them(tmp_path, capsys):
    """`--data` adds D1/D2: a hit on the wrong block is caught by what the request reads, the
    saved trace records the data spec, and replay and export use it without being told."""
    corpus = tmp_path / "corpus"
    code = main(["run", "--target", "bug:hit-swaps-block", "--config", "full", "--level",
                 "scheduler", "--no-model", "--data", "--examples", "400", "--corpus",
                 str(corpus)])
    assert code == 1
    files = sorted(corpus.glob("D1-*.json"))
    assert files, capsys.readouterr().out
    assert Trace.load(files[0]).meta["data"] == "cpu"
    assert main(["replay", str(files[0]), "--quiet"]) == 1
    assert "[D1]" in capsys.readouterr().out
    assert main(["replay", str(files[0]), "--target", "kvcache", "--quiet"]) == 0
    test = tmp_path / "test_exported_d1.py"
    assert main(["export", str(files[0]), "--pytest", str(test)]) == 0
    assert "data='cpu'" in test.read_text() and "from kvfuzz.testing import replay_trace" in test.read_text()


def test_a_trace_recording_no_tolerate_replays_on_kvcache(capsys):
    """018's trace records `no_tolerate` for the vllm targets; kvcache, which documents no
    deviation, replays it without (exit 0); naming `--no-tolerate` for kvcache stays exit 2."""
    path = str(Path(__file__).resolve().parents[2] / "docs" / "findings"
               / "018-deferred-drain-group-order.json")
    assert main(["replay", path, "--target", "kvcache"]) == 0
    assert main(["replay", path, "--target", "kvcache", "--no-tolerate", "018"]) == 2
    assert "documents no deviation" in capsys.readouterr().err
