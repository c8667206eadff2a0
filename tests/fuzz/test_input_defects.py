"""Smaller input defects of the CLI: shrink says why a trace is invalid, a campaign leaves no
./.hypothesis behind, files are written with the umask's permissions, --plugin before FILE."""

import os
import stat
import subprocess
import sys

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main

CONFIG = Config(8, (GroupConfig("full", 4),), name="full")


def test_shrink_says_why_a_trace_is_invalid_or_how_else_it_fails(tmp_path, capsys):
    Trace(CONFIG, "api", [{"op": "allocate_slots", "request_id": "ghost", "num_new_tokens": 4}],
          {"check": "P2"}).save(tmp_path / "invalid.json")
    assert main(["shrink", str(tmp_path / "invalid.json")]) == 2
    err = capsys.readouterr().err
    assert "the trace is invalid, so there is nothing to shrink: step 0 (allocate_slots)" in err
    Trace(CONFIG, "api", [{"op": "add_request", "request_id": "r0", "prompt": [1]}],
          {"check": "P2"}).save(tmp_path / "passes.json")
    assert main(["shrink", str(tmp_path / "passes.json")]) == 2
    assert "the trace does not fail P2: it passes all 1 ops" in capsys.readouterr().err


def test_a_campaign_leaves_no_hypothesis_folder_and_files_follow_the_umask(tmp_path,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = os.umask(0o002)
    try:
        code = main(["run", "--target", "bug:free-forgets-decrement", "--config", "full",
                     "--level", "api", "--examples", "10", "--corpus", "c", "--json", "r.json"])
        Trace.load(next((tmp_path / "c").glob("*.json"))).save(tmp_path / "t.json")
        assert main(["export", "t.json", "--pytest", "test_t.py"]) == 0
    finally:
        os.umask(old)
    assert code == 1
    assert not (tmp_path / ".hypothesis").exists()
    for path in (*(tmp_path / "c").glob("*.json"), tmp_path / "r.json", tmp_path / "t.json",
                 tmp_path / "test_t.py"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o664, path


def test_a_campaign_process_writes_no_hypothesis_folder_where_it_runs(tmp_path):
    """In a fresh process (Hypothesis' home is fixed at its first use): its own files go to
    kvfuzz's cache folder, not ./.hypothesis."""
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, "-m", "kvfuzz", "run", "--config", "full", "--examples", "60",
         "--corpus", "c"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / ".hypothesis").exists()
    assert (tmp_path / "cache" / "kvfuzz" / "hypothesis").is_dir()
