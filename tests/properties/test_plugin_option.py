"""A user's invariant module named on the pytest command line runs in the state machines."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

MACHINE = str(Path(__file__).with_name("test_state_machines.py")) + "::TestApiMachine_full"
PLUGIN = '''
from properties import invariant


@invariant("MYFAIL", "no request is ever added (planted to fail)")
def never_added(snapshot, ctx):
    if ctx.op["op"] == "add_request":
        return "a request was added"
'''


def _pytest(tmp_path: Path, *args: str, plugins_env: str = "") -> subprocess.CompletedProcess:
    """pytest on one state machine, in tmp_path (its .hypothesis/ lands there)."""
    (tmp_path / "my_failing_check.py").write_text(PLUGIN)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "KVFUZZ_PLUGINS": plugins_env}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", MACHINE, *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False,
    )


def test_a_named_plugin_invariant_fails_the_state_machine(tmp_path):
    run = _pytest(tmp_path, "--kvfuzz-plugin", "my_failing_check")
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout + run.stderr
    assert "[MYFAIL]" in run.stdout and "a request was added" in run.stdout


@pytest.mark.parametrize("how", ["option", "env"])
def test_an_unimportable_plugin_is_a_usage_error_naming_it(tmp_path, how):
    if how == "option":
        run = _pytest(tmp_path, "--kvfuzz-plugin", "my_failing_check", "--kvfuzz-plugin", "nope")
    else:
        run = _pytest(tmp_path, plugins_env="my_failing_check, nope")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "cannot import kvfuzz plugin 'nope'" in run.stderr
