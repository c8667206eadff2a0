"""`ci/install-vllm.sh PATH` on a vLLM source tree, with a stand-in venv python that records
what the script asks of it (the real install runs in ci/workflows/vllm.yml, job `source-tree`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_FAKE_PYTHON = r"""#!/usr/bin/env bash
# A venv python: `-m pip ...` is logged; `-c CODE` answers the script's import probes.
here=$(dirname "$0")
if [ "$1" = "-m" ]; then
  echo "VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-} ${*:2}" >> "$here/pip.log"
  case " $* " in *" -e "*) touch "$here/installed" ;; esac
  exit 0
fi
if [ "$1" = "-c" ]; then
  case "$2" in
    *"import torch"*) exit 0 ;;
    *"import kvfuzz"*|*"import einops"*) exit 0 ;;
    *"import vllm"*) [ -e "$here/installed" ]; exit ;;
  esac
fi
exit 0
"""


def _source_tree(root: Path) -> Path:
    """The shape of an unpacked release sdist: setup.py, PKG-INFO and the vllm package."""
    (root / "vllm" / "v1" / "core").mkdir(parents=True)
    (root / "setup.py").write_text("")
    (root / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\n")
    return root


def test_a_source_tree_replaces_vllm_in_a_venv_with_torch_and_keeps_the_rest(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(_FAKE_PYTHON)
    python.chmod(0o755)
    tree = _source_tree(tmp_path / "vllm-0.34.0")
    out = subprocess.run(["bash", str(REPO / "ci" / "install-vllm.sh"), str(tree)],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, KVFUZZ_VLLM_VENV=str(venv)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == str(python)
    assert "keeping its torch and dependencies" in out.stderr
    pip = (venv / "bin" / "pip.log").read_text().splitlines()
    assert pip[0] == "VLLM_TARGET_DEVICE= pip uninstall -q -y vllm"
    assert pip[-1].startswith("VLLM_TARGET_DEVICE=empty pip install")
    assert pip[-1].endswith(f"--no-deps --no-build-isolation -e {tree}")
    assert not any("torch" in line for line in pip), pip  # the venv's torch is kept
    assert venv.exists() and python.exists()
