"""Paths that used to lie or lose work (issue 40): a check or plugin raising SystemExit or
KeyboardInterrupt is exit 3 naming it, a corpus that refuses a finding mid-run keeps it, and a
check's name cannot hide its finding file."""

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfuzz.fuzz import findings
from kvfuzz.fuzz.cli import main


def _kvfuzz(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfuzz", *argv], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path),
                               "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("raised", ["SystemExit(0)", "SystemExit", "KeyboardInterrupt"])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_check_raising_a_base_exception_exits_three_naming_it(tmp_path, raised, workers):
    (tmp_path / "quitter.py").write_text(
        "from kvfuzz.properties import invariant\n@invariant('QUIT1', 'quits')\n"
        f"def quit(snapshot, ctx):\n    if ctx.step > 2:\n        raise {raised}\n")
    done = _kvfuzz(tmp_path, "run", "--plugin", "quitter", "--workers", workers, "--examples",
                   "20", "--config", "full", "--level", "api", "--json", "r.json")
    assert done.returncode == 3, done.stdout + done.stderr
    name = raised.split("(")[0]
    assert f"check QUIT1 (from quitter, at step 3 on kvcache) raised {name}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_plugin_raising_keyboard_interrupt_on_import_exits_three(tmp_path):
    (tmp_path / "stopper.py").write_text("raise KeyboardInterrupt\n")
    done = _kvfuzz(tmp_path, "run", "--plugin", "stopper", "--examples", "2")
    assert done.returncode == 3 and "plugin 'stopper' (while importing it)" in done.stderr, \
        done.stderr


def test_a_corpus_that_refuses_a_finding_mid_run_keeps_it(tmp_path, monkeypatch, capsys):
    """A full disk stands in: the finding is printed in full, kept in the --json report and in
    a fallback folder, and the run exits 1 saying where it is."""
    corpus = tmp_path / "corpus"
    real = findings.save_finding

    def full_disk(trace, directory):
        if Path(directory) == corpus:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(trace, directory)

    monkeypatch.setattr(findings, "save_finding", full_disk)
    monkeypatch.setattr(findings.tempfile, "tempdir", str(tmp_path / "tmp"))
    code = main(["run", "--target", "bug:free-forgets-decrement", "--config", "full", "--level",
                 "api", "--examples", "50", "--corpus", str(corpus), "--json",
                 str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 1, out
    [finding] = json.loads((tmp_path / "r.json").read_text())["findings"]
    assert "No space left on device" in finding["corpus_error"]
    kept = Path(finding["file"])
    assert kept.parent == tmp_path / "tmp" / "kvfuzz-findings" and kept.exists()
    assert json.loads(kept.read_text())["ops"] == finding["trace"]["ops"]
    assert f"NOT in the corpus (cannot write in {corpus}: No space left on device): kept in " \
        f"{kept}" in out
    assert json.dumps(finding["trace"]["ops"])[1:-1] in out
    assert main(["replay", str(kept), "--quiet"]) == 1
    kept.unlink()  # only the report holds it now: merge writes it into the merged corpus
    assert main(["merge", str(tmp_path / "r.json"), "--corpus", str(tmp_path / "merged")]) == 1
    [merged] = (tmp_path / "merged").glob("*.json")
    assert json.loads(merged.read_text())["ops"] == finding["trace"]["ops"]


def test_a_check_named_like_a_hidden_file_is_saved_where_a_glob_sees_it(tmp_path):
    (tmp_path / "hidden_check.py").write_text(
        "from kvfuzz.properties import invariant\n@invariant('.hidden', 'never holds')\n"
        "def never(snapshot, ctx):\n    return 'never holds' if ctx.step >= 0 else None\n")
    done = _kvfuzz(tmp_path, "run", "--plugin", "hidden_check", "--examples", "5", "--config",
                   "full", "--level", "api")
    assert done.returncode == 1, done.stdout + done.stderr
    [saved] = (tmp_path / "kvfuzz-corpus").glob("*.json")
    assert saved.name.startswith("hidden-full-")


VALID_TRACE = {"format": "kvfuzz-trace", "version": 1, "level": "api",
               "config": {"num_blocks": 8, "groups": [{"kind": "full", "block_size": 4}]},
               "ops": [{"op": "add_request", "request_id": "A", "prompt": [1, 2, 3]},
                       {"op": "free", "request_id": "A"}]}


@pytest.mark.parametrize("version", [True, 1.0])
def test_a_version_that_only_equals_one_is_refused(tmp_path, capsys, version):
    (tmp_path / "t.json").write_text(json.dumps({**VALID_TRACE, "version": version}))
    assert main(["replay", str(tmp_path / "t.json")]) == 2
    assert f"unsupported trace version {version!r}" in capsys.readouterr().err


def test_export_refuses_a_trace_replay_rejects_and_a_name_that_is_no_module(tmp_path, capsys):
    bad = {**VALID_TRACE, "ops": [*VALID_TRACE["ops"], {"op": "free", "request_id": "B"}]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert main(["replay", str(tmp_path / "bad.json")]) == 2
    assert main(["export", str(tmp_path / "bad.json"), "--pytest",
                 str(tmp_path / "test_bad.py")]) == 2
    assert "request 'B' was not added; nothing exported" in capsys.readouterr().err
    assert not (tmp_path / "test_bad.py").exists()
    (tmp_path / "ok.json").write_text(json.dumps(VALID_TRACE))
    for name in ("test_x\u00b2.py", "1test.py", "class.py", "test.txt"):
        assert main(["export", str(tmp_path / "ok.json"), "--pytest", str(tmp_path / name)]) == 2
        assert "not a Python module name" in capsys.readouterr().err
        assert not (tmp_path / name).exists()
    assert main(["export", str(tmp_path / "ok.json"), "--pytest",
                 str(tmp_path / "test_ok.py")]) == 0
