#!/usr/bin/env bash
# Install a vLLM release's v1 KV cache manager into a venv outside the repository, CPU only, and
# make that venv able to run kvfuzz and its tests against it (`--target vllm`, `pytest -m vllm`).
#
#   bash ci/install-vllm.sh [VERSION]     VERSION: 0.32.0, 0.33.0 or 0.34.0 (default: 0.34.0)
#
#   1. vLLM: torch 2.13.0 (CPU), vllm==VERSION --no-deps, then the pure-Python set in
#      vllm-cpu-requirements.txt (the same for every supported release; about 70 s, 2.1 GB).
#      Reused when it already imports that version.
#   2. kvfuzz: this checkout with `pip install --no-deps -e`, plus pyproject.toml's
#      [project] dependencies and its [test] extra, at CI's versions (ci/constraints.txt).
#      Reused when an import probe finds this checkout and every requirement satisfied, so a
#      second run is a fast no-op; a fresh clone elsewhere re-points the editable install.
#
# Prints the venv's python path on the last line; e.g.
#   py=$(bash ci/install-vllm.sh 0.33.0 | tail -n 1) && "$py" -m pytest -m vllm tests/vllm -q
#
#   KVFUZZ_VLLM_VENV  where the venv lives (default: ~/.cache/kvfuzz/vllm-VERSION)
# A development checkout of vLLM is installed by hand instead (docs/vllm.md, "A development
# checkout"); kvfuzz probes what any install offers, not its version.
set -euo pipefail
supported=(0.32.0 0.33.0 0.34.0)
version=${1:-${supported[-1]}}
case " ${supported[*]} " in
  *" $version "*) ;;
  *) echo "install-vllm.sh: unsupported vLLM version '$version'; supported: ${supported[*]}" >&2
     exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
venv=${KVFUZZ_VLLM_VENV:-$HOME/.cache/kvfuzz/vllm-$version}
py="$venv/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check)
probe="import vllm, vllm.v1.core.kv_cache_manager, vllm.v1.request, vllm.v1.kv_cache_interface
assert vllm.__version__ == '$version', vllm.__version__"
if [ -x "$py" ] && "$py" -c "$probe" 2>/dev/null; then
  echo "vLLM $version venv reused: $venv" >&2
else
  echo "installing vLLM $version (CPU, --no-deps) into $venv (about 70 s, 2.1 GB)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "${pip[@]}" torch==2.13.0 numpy
  "${pip[@]}" --no-deps "vllm==$version"
  "${pip[@]}" --no-deps -r "$here/vllm-cpu-requirements.txt"
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
