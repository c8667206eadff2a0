"""A trace is data: `replay`, `shrink` and `export` (and the exported test) import only the
plugins named with --plugin, show the recorded ones with the options to pass, and never make
the current directory importable."""

import subprocess
import sys
from pathlib import Path

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.trace import Trace

EVIL = "from pathlib import Path\nPath('pwned').write_text('ran')\n"
TRACE = Trace(Config(8, (GroupConfig("full", 4),), name="full"), "api", [
    {"op": "add_request", "request_id": "r0", "prompt": [1, 2, 3, 4, 5]},
    {"op": "get_computed_blocks", "request_id": "r0"},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 5},
], {"check": "P2", "plugins": ["evil_plugin", "venv.__main__"]})


def _kvfuzz(cwd: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfuzz", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "TMPDIR": str(cwd), **(env or {})})


def test_replay_shrink_export_of_a_trace_naming_a_module_in_the_cwd_import_nothing(tmp_path):
    (tmp_path / "evil_plugin.py").write_text(EVIL)
    TRACE.save(tmp_path / "t.json")
    before = set(tmp_path.iterdir())
    replay = _kvfuzz(tmp_path, "replay", "t.json")
    assert replay.returncode == 0, replay.stderr
    assert "the trace records plugin(s) evil_plugin, venv.__main__, not imported" in replay.stderr
    assert "pass `--plugin evil_plugin --plugin venv.__main__`" in replay.stderr
    shrink = _kvfuzz(tmp_path, "shrink", "t.json", "--seconds", "5")
    assert shrink.returncode == 2 and "the trace does not fail" in shrink.stderr, shrink.stderr
    export = _kvfuzz(tmp_path, "export", "t.json", "--pytest", "test_t.py")
    assert export.returncode == 0, export.stderr
    test = (tmp_path / "test_t.py").read_text()
    assert "It imports no plugin: none was passed at export time." in test
    assert "PLUGINS = ()" in test
    exported = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "test_t.py"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert "1 passed" in exported.stdout, exported.stdout
    new = {p.name for p in set(tmp_path.iterdir()) - before}
    assert new <= {"test_t.py", "__pycache__"}, new  # no pwned, no folder made by venv


def test_a_named_plugin_is_imported_and_the_exported_test_imports_it(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "evil_plugin.py").write_text(EVIL)
    TRACE.save(tmp_path / "t.json")
    env = {"PYTHONPATH": str(tmp_path / "lib")}
    replay = _kvfuzz(tmp_path, "replay", "--plugin", "evil_plugin", "t.json", env=env)
    assert replay.returncode == 0, replay.stderr
    assert "evil_plugin, not imported" not in replay.stderr and "venv.__main__" in replay.stderr
    assert (tmp_path / "pwned").read_text() == "ran"
    export = _kvfuzz(tmp_path, "export", "--plugin", "evil_plugin", "t.json", "--pytest",
                     "test_t.py", env=env)
    assert export.returncode == 0, export.stderr
    test = (tmp_path / "test_t.py").read_text()
    assert "It imports exactly the plugins passed at export time: evil_plugin." in test
    assert "PLUGINS = ('evil_plugin',)" in test


def test_a_recorded_check_of_an_unnamed_plugin_says_what_to_pass(tmp_path):
    Trace(TRACE.config, "api", TRACE.ops, {"check": "MY1", "plugins": ["my_checks"]}).save(
        tmp_path / "t.json")
    done = _kvfuzz(tmp_path, "replay", "t.json")
    assert done.returncode == 2
    assert "records a failure of check 'MY1', which is not registered: pass `--plugin " \
        "my_checks` (the plugins the trace records) if you trust them" in done.stderr
