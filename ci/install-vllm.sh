#!/usr/bin/env bash
# Install vLLM 0.33.0's v1 KV cache manager into a venv outside the repository, CPU only, and
# make that venv able to run kvfuzz and its tests against it (`--target vllm`, `pytest -m vllm`).
#
#   1. vLLM: torch 2.13.0 (CPU), vllm==0.33.0 --no-deps, then the pure-Python set in
#      vllm-0.33.0-cpu-requirements.txt (about 70 s, 2.1 GB). Reused when it already imports.
#   2. kvfuzz: this checkout with `pip install --no-deps -e`, plus pyproject.toml's
#      [project] dependencies and its [test] extra, at CI's versions (ci/constraints.txt).
#      Reused when an import probe finds this checkout and every requirement satisfied, so a
#      second run is a fast no-op; a fresh clone elsewhere re-points the editable install.
#
# Prints the venv's python path on the last line; e.g.
#   py=$(bash ci/install-vllm.sh | tail -n 1) && "$py" -m pytest -m vllm tests/vllm -q
#
#   KVFUZZ_VLLM_VENV  where the venv lives (default: ~/.cache/kvfuzz/vllm-0.33.0)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
venv=${KVFUZZ_VLLM_VENV:-$HOME/.cache/kvfuzz/vllm-0.33.0}
py="$venv/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check)
probe='import vllm.v1.core.kv_cache_manager, vllm.v1.request, vllm.v1.kv_cache_interface'
if [ -x "$py" ] && "$py" -c "$probe" 2>/dev/null; then
  echo "vLLM 0.33.0 venv reused: $venv" >&2
else
  echo "installing vLLM 0.33.0 (CPU, --no-deps) into $venv (about 70 s, 2.1 GB)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" --no-deps vllm==0.33.0
  "${pip[@]}" --no-deps -r "$here/vllm-0.33.0-cpu-requirements.txt"
  "$py" -c "$probe"
fi

# kvfuzz's requirements, read from pyproject.toml: [project] dependencies + the [test] extra.
requirements() {
  "$py" - "$repo/pyproject.toml" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
EOF
}
# Succeeds when this checkout is the kvfuzz the venv imports and every requirement is met.
kvfuzz_ready() {
  # Run from / so that the checkout is found only through the installed package.
  requirements | (cd / && "$py" -c '
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from packaging.requirements import Requirement
import importlib, tomllib
import kvfuzz
if Path(kvfuzz.__file__).resolve().parent.parent != Path(sys.argv[1]):
    sys.exit(1)
# An editable install made from an older pyproject.toml may miss a part: import them all.
pyproject = tomllib.loads((Path(sys.argv[1]) / "pyproject.toml").read_text())
for part in pyproject["tool"]["setuptools"]["package-dir"]:
    if part not in ("kvfuzz.ci", "kvfuzz.docs"):
        importlib.import_module(part)
for line in sys.stdin.read().splitlines():
    req = Requirement(line)
    try:
        if not req.specifier.contains(version(req.name), prereleases=True):
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
' "$repo") 2>/dev/null
}
if kvfuzz_ready; then
  echo "kvfuzz and its test requirements already installed in $venv" >&2
else
  echo "installing kvfuzz (editable, $repo) and its test requirements into $venv" >&2
  mapfile -t reqs < <(requirements)
  "${pip[@]}" -c "$here/constraints.txt" "${reqs[@]}"
  "${pip[@]}" --no-deps -e "$repo"
  kvfuzz_ready
fi
echo "$py"
