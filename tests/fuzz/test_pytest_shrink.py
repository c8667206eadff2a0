"""A state machine's failure under pytest is as small as the CLI's: kvfuzz's shrinker cuts the
trace, the file saved is the one `kvfuzz run` would save, the report is short (Hypothesis'
Draw lines only with -v) and the header names the profile, plugins and database."""

import os
import subprocess
import sys
import time
from pathlib import Path

from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main

TEST = """
from kvfuzz.testing import machine_for

TestBug = machine_for("api", targets=("bug:free-forgets-decrement",),
                      config_names=("full",)).TestCase
"""


def _pytest(where: Path, *args: str) -> subprocess.CompletedProcess:
    (where / "test_bug.py").write_text(TEST)
    env = {**os.environ, "KVFUZZ_PROFILE": "ci"}
    env.pop("PYTEST_ADDOPTS", None)
    for name in ("CI", "BUILD_NUMBER"):  # under CI pytest's summary repeats the whole report
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "test_bug.py", *args], cwd=where, env=env, capture_output=True,
                          text=True, timeout=300)


def test_planted_bug_fails_short_through_pytest(tmp_path: Path) -> None:
    start = time.monotonic()
    run = _pytest(tmp_path)
    seconds = time.monotonic() - start
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "kvfuzz: profile ci, plugins (none), database None" in out
    assert "Draw 1:" not in out
    assert "[P2]" in out and "Traceback" not in out and "def _fail" not in out
    assert len(out.splitlines()) < 60, out
    saved = sorted((tmp_path / ".hypothesis" / "kvfuzz-findings").glob("*.json"))
    assert len(saved) == 1 and saved[0].name.startswith("P2-full-")
    trace = Trace.load(saved[0])
    assert trace.meta["target"] == "bug:free-forgets-decrement"
    assert trace.meta["shrunk"] is True and trace.meta["check"] == "P2"
    assert f"{len(trace.ops)}-op trace saved to" in out
    # As short as `kvfuzz shrink` makes it: shrinking it again takes nothing off.
    assert main(["shrink", str(saved[0]), "--out", str(tmp_path / "again.json")]) == 0
    assert len(Trace.load(tmp_path / "again.json").ops) == len(trace.ops) <= 4
    print(f"pytest path: failed and shrunk to {len(trace.ops)} ops in {seconds:.1f} s")


def test_draw_lines_with_verbose(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "-v")
    assert run.returncode == 1
    assert "Draw 1:" in run.stdout + run.stderr
