#!/usr/bin/env bash
# Fetch and unpack a vLLM release's source distribution from PyPI, without building it: vllm/
# and vLLM's own tests/ of exactly that release, which tests/vllm_suite runs against kvcache.
#
#   bash ci/fetch-vllm-sdist.sh [VERSION]     VERSION default: 0.34.0
#
# Cached under KVFUZZ_SDIST_DIR (default ~/.cache/kvfuzz/sdist): an unpacked vllm-VERSION/ there
# is reused as it is (no network), a downloaded vllm-VERSION.tar.gz is unpacked again. The file
# comes from PyPI's simple index (PIP_INDEX_URL where set) and is checked against the
# SHA-256 the index lists for it. Prints the unpacked directory on its last
# line, e.g.
#   sdist=$(bash ci/fetch-vllm-sdist.sh 0.34.0 | tail -n 1)
set -euo pipefail
version=${1:-0.34.0}
if ! [[ $version =~ ^[0-9]+(\.[0-9]+)*([a-z]+[0-9]*)?$ ]]; then
  echo "fetch-vllm-sdist.sh: '$version' is not a release version (e.g. 0.34.0)" >&2
  exit 2
fi
dest=${KVFUZZ_SDIST_DIR:-$HOME/.cache/kvfuzz/sdist}
out=$dest/vllm-$version
if [ ! -d "$out/tests" ]; then
  mkdir -p "$dest"
  python3 - "$version" "$dest" <<'PY'
import hashlib
import html
import os
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

version, dest = sys.argv[1], Path(sys.argv[2])
tarball = dest / f"vllm-{version}.tar.gz"
if not tarball.exists():
    # PyPI's simple index (PEP 503): one link per file, its SHA-256 in the fragment.
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/vllm/"
    with urllib.request.urlopen(index, timeout=120) as reply:
        page = reply.read().decode()
    links = [href for href in re.findall(r'href="([^"]+)"', page)
             if href.partition("#")[0].endswith("/" + tarball.name)]
    if not links:
        sys.exit(f"fetch-vllm-sdist.sh: {index} lists no {tarball.name}")
    url, _, fragment = html.unescape(links[0]).partition("#sha256=")
    url = urllib.parse.urljoin(index, url)
    partial = tarball.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=600) as reply, open(partial, "wb") as f:
        shutil.copyfileobj(reply, f)
    if hashlib.sha256(partial.read_bytes()).hexdigest() != fragment:
        partial.unlink()
        sys.exit(f"fetch-vllm-sdist.sh: {url} does not match the index's SHA-256")
    partial.rename(tarball)
# Unpack beside the cache and move into place, so a cut-off run leaves no half tree.
with tempfile.TemporaryDirectory(dir=dest) as tmp:
    with tarfile.open(tarball) as archive:
        archive.extractall(tmp, filter="data")
    (Path(tmp) / f"vllm-{version}").rename(dest / f"vllm-{version}")
PY
fi
echo "$out"
