"""kvfuzz as a user gets it: a wheel built from this checkout, installed into a fresh venv that
already holds a newer Hypothesis and pytest, used from a directory with folders of its own named
like kvfuzz's parts.

The venv comes from PyPI (hypothesis 6.170, pytest), as a new user's would; the test is skipped
where PyPI cannot be reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NEWER_HYPOTHESIS = "hypothesis>=6.170,<6.171"
SHADOWS = ("properties", "fuzz", "harness", "kvcache", "reference_model", "core")

MY_CHECKS = '''
from pathlib import Path

from kvfuzz.properties import invariant


@invariant("MY1", "no request holds more than 64 blocks in group 0")
def at_most_64(snapshot, ctx):
    Path("my_checks_ran").touch()
    for rid, view in snapshot.requests.items():
        if view.tables[0] and len(view.tables[0]) > 64:
            return f"{rid} holds {len(view.tables[0])} blocks"
'''
MY_TEST = '''
from kvfuzz.testing import machine_for

TestKvcacheFull = machine_for("api", config_names=("full",)).TestCase
TestKvcacheDriven = machine_for("scheduler", config_names=("hybrid",)).TestCase
'''


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout (a build writes build/ into its source)."""
    source = tmp_path_factory.mktemp("source") / "kvfuzz"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".hypothesis", "build", "*.egg-info", "__pycache__", "kvfuzz-*"))
    out = tmp_path_factory.mktemp("wheel")
    built = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(out),
                  str(source)], cwd=out)
    assert built.returncode == 0, built.stdout + built.stderr
    # Every shipped data folder is a package of pyproject.toml's (setuptools warns otherwise).
    assert "would be ignored" not in built.stdout + built.stderr
    (path,) = out.glob("kvfuzz-*.whl")
    return path


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory, wheel) -> Path:
    """A venv with hypothesis 6.170 and pytest from PyPI, then the wheel (dependencies as pip
    resolves them)."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=venv.parent)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    first = _run([*pip, NEWER_HYPOTHESIS, "pytest"], cwd=venv.parent)
    if first.returncode != 0 and "No matching distribution" in first.stderr + first.stdout:
        pytest.skip(f"PyPI is not reachable: {first.stderr.strip()[-300:]}")
    assert first.returncode == 0, first.stdout + first.stderr
    installed = _run([*pip, str(wheel)], cwd=venv.parent)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


def _hypothesis_version(venv: Path) -> str:
    shown = _run([str(venv / "bin" / "python"), "-c",
                  "import hypothesis; print(hypothesis.__version__)"], cwd=venv.parent)
    return shown.stdout.strip()


@pytest.fixture
def user_dir(tmp_path) -> Path:
    """An empty project whose own folders share names with kvfuzz's parts, each of which
    breaks loudly if imported."""
    for name in SHADOWS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('the user folder {name}/ was imported')\n")
    (tmp_path / "my_checks.py").write_text(MY_CHECKS)
    (tmp_path / "test_my_manager.py").write_text(MY_TEST)
    return tmp_path


def _env(user_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFUZZ_", "PYTHON"))}
    return {**env, "PYTHONPATH": str(user_dir)}  # the shadowing folders come first


def test_the_wheel_has_one_import_root_and_ships_its_docs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    roots = {name.split("/")[0] for name in names}
    name, version = wheel.name.split("-")[:2]
    assert roots == {"kvfuzz", f"{name}-{version}.dist-info"}
    for shipped in ("kvfuzz/docs/spec.md", "kvfuzz/docs/bugs.md", "kvfuzz/ci/install-vllm.sh",
                    "kvfuzz/pytest_plugin.py"):
        assert shipped in names
    metadata = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    exact = [line for line in requires if "==" in line.partition(";")[0]]
    assert not exact, f"exact pins in the wheel's requirements: {exact}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvfuzz = kvfuzz.pytest_plugin" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_a_wheel_installs_beside_a_newer_hypothesis_and_works_from_a_shadowing_folder(
        user_venv, user_dir):
    before = _hypothesis_version(user_venv)
    assert before.startswith("6.170."), before
    bin_dir = user_venv / "bin"
    env = _env(user_dir)

    targets = _run([str(bin_dir / "kvfuzz"), "targets"], cwd=user_dir, env=env)
    assert targets.returncode == 0 and "bug:salt-ignored" in targets.stdout, targets.stderr
    version = _run([str(bin_dir / "kvfuzz"), "--version"], cwd=user_dir, env=env)
    assert version.returncode == 0 and f"hypothesis {before}" in version.stdout

    campaign = _run([str(bin_dir / "kvfuzz"), "run", "--seconds", "20", "--json", "r.json"],
                    cwd=user_dir, env=env)
    assert campaign.returncode == 0, campaign.stdout[-2000:] + campaign.stderr[-2000:]
    assert "findings           0" in campaign.stdout
    assert f'"hypothesis": "{before}"' in (user_dir / "r.json").read_text()

    suite = _run([str(bin_dir / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                  "--kvfuzz-plugin", "my_checks", "--kvfuzz-profile", "dev",
                  "test_my_manager.py"], cwd=user_dir, env=env)
    assert suite.returncode == 0, suite.stdout[-3000:] + suite.stderr[-2000:]
    assert "2 passed" in suite.stdout
    assert (user_dir / "my_checks_ran").exists(), "the plugin's invariant never ran"

    assert _hypothesis_version(user_venv) == before


def test_a_failing_user_invariant_fails_the_users_suite(user_venv, user_dir):
    (user_dir / "my_checks.py").write_text(MY_CHECKS.replace("> 64", ">= 1"))
    suite = _run([str(user_venv / "bin" / "python"), "-m", "pytest", "-q", "-p",
                  "no:cacheprovider", "--kvfuzz-plugin", "my_checks", "--kvfuzz-profile", "dev",
                  "test_my_manager.py"], cwd=user_dir, env=_env(user_dir))
    assert suite.returncode == 1, suite.stdout[-3000:] + suite.stderr[-2000:]
    assert "[MY1]" in suite.stdout


@pytest.mark.parametrize("args, names", [
    (["prove"], "pip install 'kvfuzz[fuzz]'"),
    (["run", "--engine", "atheris", "--seconds", "5"], "pip install 'kvfuzz[fuzz]'"),
    (["run", "--data", "--seconds", "5"], "pip install 'kvfuzz[torch]'"),
    (["run", "--target", "vllm", "--seconds", "5"], "target vllm needs vllm"),
])
def test_a_missing_extra_is_one_line_naming_it_before_any_banner(user_venv, user_dir, args,
                                                                 names):
    run = _run([str(user_venv / "bin" / "kvfuzz"), *args], cwd=user_dir, env=_env(user_dir))
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == "", run.stdout
    assert len(run.stderr.splitlines()) == 1 and names in run.stderr, run.stderr
    assert not (user_dir / "kvfuzz-corpus").exists()
