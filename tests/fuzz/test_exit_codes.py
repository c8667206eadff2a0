"""Exit codes that never lie: 2 for bad input naming the value, 3 for a check, adapter or
plugin that raises (a short message, the traceback in a log file or with --debug), never a
traceback, and a closed stdout does not change the code."""

import json
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main
from kvfuzz.harness.executor import Execution, Finding

@pytest.mark.parametrize("source, needle", [
    ("x = (\n", "SyntaxError: '(' was never closed (broken_plugin.py, line 1)"),
    ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("import no_such_dependency\n", "No module named 'no_such_dependency'"),
])
def test_a_plugin_that_raises_on_import_exits_three_naming_it(tmp_path, monkeypatch, capsys,
                                                              source, needle):
    """A plugin that is there but raises is a plugin error (3), in two lines, the traceback in
    a log file; nothing is written."""
    (tmp_path / "broken_plugin.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["run", "--plugin", "broken_plugin", "--corpus", str(tmp_path / "c")]) == 3
    err = capsys.readouterr().err
    assert "plugin 'broken_plugin' (while importing it) raised" in err and needle in err
    assert "Traceback" not in err and len(err.splitlines()) == 2
    log = next(tmp_path.glob("kvfuzz-traceback-*.log")).read_text()
    assert log.startswith("Traceback") and needle.split(":")[0] in log
    assert not (tmp_path / "c").exists()


def test_a_plugin_that_is_not_there_is_a_usage_error(capsys):
    assert main(["invariants", "--plugin", "no_such_plugin_module"]) == 2
    assert "cannot import plugin 'no_such_plugin_module'" in capsys.readouterr().err


TRACE = Trace(Config(8, (GroupConfig("full", 4),), name="full"), "api", [
    {"op": "add_request", "request_id": "r0", "prompt": [1, 2, 3, 4, 5]},
    {"op": "get_computed_blocks", "request_id": "r0"},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 5},
])


def _kvfuzz(tmp_path: Path, *argv: str, shell_tail: str = "",
            pythonpath: bool = True) -> subprocess.CompletedProcess:
    """`python -m kvfuzz` in a fresh process, in tmp_path, with tmp_path importable (plugins)
    if `pythonpath`."""
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    if pythonpath:
        env["PYTHONPATH"] = str(tmp_path)
    cmd = [sys.executable, "-m", "kvfuzz", *argv]
    if shell_tail:
        return subprocess.run(" ".join(map(repr, cmd)) + shell_tail, shell=True, cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120,
                              executable="/bin/bash")
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_check_failing_on_the_initial_state_is_a_finding_reported_without_an_op():
    from kvfuzz.harness.executor import Counterexample, run_trace
    from kvfuzz.properties.registry import Check

    always = Check("INIT1", "fails at once", "state", lambda snap, ctx: "broken from the start")
    with pytest.raises(Counterexample) as caught:
        Execution(TRACE.config, "api", checks=[always])
    finding: Finding = caught.value.finding
    report = finding.report()
    assert finding.step == -1 and "[INIT1] the initial state on kvcache" in report
    assert "trace up to no op" in report and "op:" not in report
    result = run_trace(TRACE, checks=[always])
    assert result.finding is not None and result.finding.check == "INIT1"


CHECKS_PLUGIN = '''
from kvfuzz.properties import invariant

@invariant("TYPO1", "a check with a typo")
def typo(snapshot, ctx):
    return undefined_name

@invariant("INIT2", "a check that fails on the initial state")
def at_once(snapshot, ctx):
    return "never holds"
'''


def test_a_check_that_raises_exits_three_naming_it_and_one_failing_at_once_exits_one(tmp_path):
    TRACE.save(tmp_path / "t.json")
    (tmp_path / "typo_plugin.py").write_text(CHECKS_PLUGIN.split("@invariant(\"INIT2\"")[0])
    (tmp_path / "init_plugin.py").write_text(
        "from kvfuzz.properties import invariant\n" + CHECKS_PLUGIN.split("return undefined_name")[1])
    done = _kvfuzz(tmp_path, "replay", "--plugin", "typo_plugin", "t.json")
    assert done.returncode == 3, done.stderr
    assert "check TYPO1 (from typo_plugin, at the initial state on kvcache) raised NameError: " \
        "name 'undefined_name' is not defined" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 2
    log = Path(done.stderr.split("the traceback is in ")[1].split(";")[0])
    assert "undefined_name" in log.read_text() and log.parent == tmp_path
    debug = _kvfuzz(tmp_path, "--debug", "replay", "--plugin", "typo_plugin", "t.json")
    assert debug.returncode == 3 and "Traceback (most recent call last)" in debug.stderr
    init = _kvfuzz(tmp_path, "replay", "--plugin", "init_plugin", "t.json")
    assert init.returncode == 1, init.stderr
    assert "[INIT2] the initial state on kvcache: never holds" in init.stdout
    assert init.stderr == ""


ADAPTER_PLUGIN = '''
from kvfuzz.harness.targets import register_target

def broken(config, level):
    raise RuntimeError("adapter cannot build")

register_target("broken-adapter", "raises when built", broken)
'''


def test_an_adapter_that_raises_exits_three_naming_the_target(tmp_path):
    TRACE.save(tmp_path / "t.json")
    (tmp_path / "adapter_plugin.py").write_text(ADAPTER_PLUGIN)
    done = _kvfuzz(tmp_path, "replay", "--plugin", "adapter_plugin", "--target",
                   "broken-adapter", "t.json")
    assert done.returncode == 3, done.stderr
    assert "target 'broken-adapter' (building its manager for config 'full') raised " \
        "RuntimeError: adapter cannot build" in done.stderr
    run = _kvfuzz(tmp_path, "run", "--plugin", "adapter_plugin", "--target", "broken-adapter",
                  "--examples", "2", "--config", "full", "--level", "api")
    assert run.returncode == 3 and "adapter cannot build" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_a_closed_stdout_changes_neither_the_exit_code_nor_the_quiet_stderr(tmp_path):
    long = Trace(TRACE.config, "api", [{"op": "reset_prefix_cache"}] * 3000)
    long.save(tmp_path / "t.json")
    done = _kvfuzz(tmp_path, "replay", "t.json", shell_tail=" | head -1; exit ${PIPESTATUS[0]}")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("replaying t.json")


@pytest.mark.parametrize("engine", [
    ["--workers", "2"],
    pytest.param(["--engine", "atheris"], marks=pytest.mark.skipif(
        importlib.util.find_spec("atheris") is None, reason="atheris is not installed")),
], ids=["workers", "atheris"])
def test_a_check_that_raises_in_a_worker_exits_three_naming_it(tmp_path, engine):
    """A worker (--workers, or an atheris worker) sends its error to the parent, which exits 3
    as one process would, and no worker outlives it."""
    (tmp_path / "late_typo.py").write_text(
        "from kvfuzz.properties import invariant\n@invariant('TYPO2', 'a late typo')\n"
        "def typo(snapshot, ctx):\n    if ctx.step > 2:\n        return undefined_name\n")
    done = _kvfuzz(tmp_path, "run", "--plugin", "late_typo", *engine, "--examples",
                   "30", "--config", "full", "--level", "api")
    assert done.returncode == 3, done.stderr
    assert "check TYPO2 (from late_typo, at step 3 on kvcache) raised NameError: name " \
        "'undefined_name' is not defined" in done.stderr
    log = Path(done.stderr.split("the traceback is in ")[1].split(";")[0]).read_text()
    assert "the worker's traceback" in log and "undefined_name" in log


PICKY_PLUGIN = '''
from kvfuzz.harness.kvcache_target import KvcacheSide
from kvfuzz.harness.targets import register_target

def picky(config, level):
    if config.name == "watermark":
        raise TypeError("no watermark here")
    return KvcacheSide(config, level)

register_target("picky", "kvcache, except that it cannot build the watermark config", picky)
'''


def test_a_builtin_config_the_target_cannot_build_is_left_out_and_said(tmp_path):
    """A campaign over the built-in configs runs the others and names the one left out (as
    `--target vllm` leaves out sink_full, docs/findings/012); named, it is exit 3."""
    (tmp_path / "picky_plugin.py").write_text(PICKY_PLUGIN)
    run = _kvfuzz(tmp_path, "run", "--plugin", "picky_plugin", "--target", "picky",
                  "--examples", "60", "--level", "api", "--json", "r.json")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "config watermark left out: target picky cannot build it here (TypeError: no " \
        "watermark here)" in run.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert "watermark" not in report["configs"] and "full" in report["configs"]
    assert report["configs_left_out"] == {"watermark": "TypeError: no watermark here"}
    named = _kvfuzz(tmp_path, "run", "--plugin", "picky_plugin", "--target", "picky",
                    "--examples", "2", "--config", "watermark", "--level", "api")
    assert named.returncode == 3 and "no watermark here" in named.stderr, named.stderr
