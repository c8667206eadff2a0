"""`kvfuzz` is the only import root: folders of a user's project named like kvfuzz's parts,
first on the path, change nothing (tests/packaging/test_wheel.py does the same from a wheel)."""

import os
import subprocess
import sys

SHADOWS = ("properties", "fuzz", "harness", "kvcache", "reference_model", "core")


def test_shadowing_folders_are_never_imported(tmp_path):
    for name in SHADOWS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('user {name}/')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "kvfuzz", "targets"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0 and "bug:salt-ignored" in run.stdout, run.stderr
    code = ("import sys, kvfuzz.fuzz.cli, kvfuzz.testing, kvfuzz.harness.mutants\n"
            f"bare = sorted(set(sys.modules) & set({SHADOWS!r}))\n"
            "sys.exit(f'imported {bare}' if bare else 0)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr


def test_a_shadowing_folder_would_be_seen(tmp_path):
    """The check above can fail: the same folder, imported by its bare name, breaks."""
    (tmp_path / "properties").mkdir()
    (tmp_path / "properties" / "__init__.py").write_text("raise ImportError('user properties/')\n")
    run = subprocess.run([sys.executable, "-c", "import properties"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                         text=True, check=False)
    assert run.returncode == 1 and "user properties/" in run.stderr
