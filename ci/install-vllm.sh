#!/usr/bin/env bash
# Install vLLM 0.33.0's v1 KV cache manager into a venv outside the repository, CPU only.
# Reuses the venv when it already imports. Prints the venv's python path on the last line.
#   KVFUZZ_VLLM_VENV  where the venv lives (default: ~/.cache/kvfuzz/vllm-0.33.0)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${KVFUZZ_VLLM_VENV:-$HOME/.cache/kvfuzz/vllm-0.33.0}
py="$venv/bin/python"
probe='import vllm.v1.core.kv_cache_manager, vllm.v1.request, vllm.v1.kv_cache_interface'
if [ -x "$py" ] && "$py" -c "$probe" 2>/dev/null; then
  echo "vLLM 0.33.0 venv reused: $venv" >&2
else
  echo "installing vLLM 0.33.0 (CPU, --no-deps) into $venv (about 70 s, 2.1 GB)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps vllm==0.33.0
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$here/vllm-0.33.0-cpu-requirements.txt"
  "$py" -c "$probe"
fi
echo "$py"
