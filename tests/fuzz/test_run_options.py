"""`kvfuzz run`'s stopping options and live line: `--max-findings`, the status of an
interrupted run (`--interrupted-exit`, CI=true), a progress line within 80 columns with an ETA,
and the defaults `--help` states."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvfuzz.fuzz.cli import _Progress, _parser, main

REPO = Path(__file__).resolve().parents[2]


def test_max_findings_stops_the_campaign(tmp_path: Path) -> None:
    argv = ["run", "--target", "bug:free-forgets-decrement", "--config", "full", "--level",
            "api", "--examples", "3000", "--corpus", str(tmp_path / "c"), "--json",
            str(tmp_path / "r.json")]
    assert main([*argv, "--max-findings", "1"]) == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert len(report["findings"]) == 1 and report["examples"] < 3000
    assert main([*argv[:-4], "--max-findings", "0"]) == 2
    assert main([*argv[:-4], "--interrupted-exit", "256"]) == 2


@pytest.mark.parametrize("extra, env, status", [
    ([], {}, 0), ([], {"CI": "true"}, 2), (["--interrupted-exit", "5"], {"CI": "true"}, 5),
])
def test_interrupted_run_without_finding(tmp_path: Path, extra: list, env: dict,
                                         status: int) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "CI"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfuzz", "run", "--config", "full", "--seconds", "120",
         "--corpus", str(tmp_path / "c"), *extra],
        cwd=tmp_path, env={**environ, **env, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == status, out
    assert "interrupted" in out and "findings           0" in out


def _stats(examples: int) -> SimpleNamespace:
    return SimpleNamespace(pairs_done=lambda: 94, pairs={i: 0 for i in range(94)},
                           operations=12_345_678, examples=examples,
                           features=set(range(12345)), findings=[1] * 12, edges=0)


def test_progress_line_fits_80_columns_with_eta() -> None:
    by_examples = _Progress(None, examples=200_000)
    by_examples.start -= 999.0
    line = by_examples.line(_stats(100_000))
    assert len(line) <= 80 and " eta " in line, line
    eta = float(line.split(" eta ")[1].split("s")[0])
    assert 990 <= eta <= 1010
    by_time = _Progress(3600.0)
    by_time.start -= 999.0
    line = by_time.line(_stats(999_999))
    assert len(line) <= 80 and " left " in line, line


def test_help_states_defaults() -> None:
    run = _parser()._subparsers._group_actions[0].choices["run"].format_help()
    for option in ("--steps", "--workers", "--level", "--max-findings", "--interrupted-exit",
                   "--html"):
        assert option in run
    assert "(default: 40)" in run and "(default: 1)" in run and "(default: both)" in run
    export = _parser()._subparsers._group_actions[0].choices["export"].format_help()
    assert "replay_trace" in export and "the test module to write" in export
