"""A check that returns neither None nor a message string (True, a list) is its plugin's
fault: exit 3 naming the check and its module, never a finding or a bad-input exit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PLUGIN = '''
from kvfuzz.properties import invariant


@invariant("BAD1", "returns {value} instead of None or a message")
def bad(snapshot, ctx):
    return {value}
'''


@pytest.mark.parametrize("value", ["True", "['a', 'b']", "[]"])
def test_a_check_returning_a_non_string_is_named(tmp_path: Path, value: str) -> None:
    (tmp_path / "bad_checks.py").write_text(PLUGIN.format(value=value))
    run = subprocess.run(
        [sys.executable, "-m", "kvfuzz", "run", "--plugin", "bad_checks", "--config", "full",
         "--level", "api", "--examples", "5", "--corpus", str(tmp_path / "c")],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path),
                                                                       str(REPO)])},
        capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 3, out
    assert "check BAD1 (from bad_checks" in out and f"it returned {eval(value)!r}" in out
    assert not list((tmp_path / "c").glob("*.json"))
