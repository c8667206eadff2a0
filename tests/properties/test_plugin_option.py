"""A user's invariant module named on the pytest command line runs in the state machines."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

MACHINE = str(Path(__file__).with_name("test_state_machines.py")) + "::TestApiMachine_full"
PLUGIN = '''
from kvfuzz.properties import invariant


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


PROFILE_PROBE = '''
from kvfuzz.testing import machine_for


def test_profile():
    settings = machine_for("api", config_names=("full",)).TestCase.settings
    print("max_examples", settings.max_examples, "database", settings.database is not None)
'''


@pytest.mark.parametrize("args, env, expected", [
    ((), {"CI": "true"}, "max_examples 60 database False"),
    ((), {"CI": ""}, "max_examples 20 database True"),
    (("--kvfuzz-profile", "nightly"), {"CI": "true"}, "max_examples 2000 database True"),
    ((), {"KVFUZZ_PROFILE": "nightly"}, "max_examples 2000 database True"),
])
def test_the_kvfuzz_profile_sizes_the_machines(tmp_path, args, env, expected):
    """`ci` where CI is set, `dev` (with a database) elsewhere, or the one named."""
    (tmp_path / "test_probe.py").write_text(PROFILE_PROBE)
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "KVFUZZ_PROFILE")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_probe.py",
         *args], cwd=tmp_path, env={**base, **env}, capture_output=True, text=True, timeout=600,
        check=False)
    assert run.returncode == 0 and expected in run.stdout, run.stdout + run.stderr


def test_an_unknown_profile_is_a_usage_error(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROFILE_PROBE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "test_probe.py"], cwd=tmp_path,
                         env={**os.environ, "KVFUZZ_PROFILE": "weekly"}, capture_output=True,
                         text=True, timeout=600, check=False)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "KVFUZZ_PROFILE='weekly' is not a kvfuzz profile" in run.stderr
