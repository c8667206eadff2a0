"""The vLLM adapter's probe on installs it cannot drive: exit 2 naming what was found and what is
supported, never a traceback or a finding. Each case is a small fake `vllm` package put first on
PYTHONPATH, so these run without vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_GOOD_REQUEST = """
class RequestStatus(int):
    WAITING = 0
class Request:
    def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params,
                 arrival_time=0.0, cache_salt=None, priority=0, block_hasher=None):
        pass
"""


_SPECS = ("KVCacheConfig", "KVCacheGroupSpec", "FullAttentionSpec", "SlidingWindowSpec",
          "ChunkedLocalAttentionSpec", "CrossAttentionSpec")
_GOOD_MANAGER = """
class KVCacheManager:
    def __init__(self, kv_cache_config, max_model_len, scheduler_block_size=None,
                 hash_block_size=None, max_in_flight_tokens=None, enable_caching=True,
                 use_eagle=False, watermark=0.0):
        pass
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, num_lookahead_tokens=0, num_encoder_tokens=0,
                       full_sequence_must_fit=False, reserved_blocks=0,
                       has_scheduled_reqs=False):
        pass
""" + "".join(f"    def {m}(self, *a): pass\n" for m in (
    "get_computed_blocks", "free", "cache_blocks", "evict_blocks", "reset_prefix_cache",
    "take_new_block_ids", "take_kv_cache_block_copies", "get_block_ids"))


def _fake_vllm(root: Path, request: str = _GOOD_REQUEST, init: str = "",
               manager: str = _GOOD_MANAGER) -> Path:
    files = {
        "vllm/__init__.py": '__version__ = "9.9.9"\n' + init,
        "vllm/sampling_params.py": "class SamplingParams: pass\n",
        "vllm/utils/__init__.py": "",
        "vllm/utils/hashing.py": "def sha256(x): return b''\n",
        "vllm/v1/__init__.py": "",
        "vllm/v1/request.py": request,
        "vllm/v1/kv_cache_interface.py": "".join(f"class {n}: pass\n" for n in _SPECS),
        "vllm/v1/core/__init__.py": "",
        "vllm/v1/core/kv_cache_manager.py": manager,
        "vllm/v1/core/kv_cache_utils.py": "def get_request_block_hasher(*a): pass\n",
        "vllm/v1/core/kv_cache_coordinator.py": "def partial_hash_hits_enabled(): pass\n",
        "vllm/v1/core/block_pool.py": "class BlockPool: pass\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _run(fake: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(fake)}
    return subprocess.run([sys.executable, "-m", "kvfuzz", *argv], capture_output=True, text=True,
                          env=env, timeout=120, cwd=fake)


@pytest.mark.parametrize("case, expected", [
    ("new required argument",
     "vLLM 9.9.9: Request() takes a new required argument kv_hints; kvfuzz supports vLLM 0.32–0.34"),
    ("argument gone", "vLLM 9.9.9: Request() no longer takes the argument cache_salt"),
    ("module broken", "vLLM 9.9.9: importing vllm.v1.core.kv_cache_manager raised RuntimeError"),
    ("vllm broken", "importing vLLM failed: RuntimeError: no CUDA and no CPU backend"),
    ("method missing", "vLLM 9.9.9: KVCacheManager has no method get_computed_blocks()"),
])
def test_an_install_the_adapter_cannot_drive_exits_2_saying_what_it_found(tmp_path, case,
                                                                            expected):
    request, init, manager = _GOOD_REQUEST, "", _GOOD_MANAGER
    if case == "method missing":
        manager = manager.replace("get_computed_blocks", "renamed_get_computed_blocks")
    elif case == "new required argument":
        request = request.replace("pooling_params,", "pooling_params, kv_hints,")
    elif case == "argument gone":
        request = request.replace("cache_salt=None, ", "")
    elif case == "vllm broken":
        init = "raise RuntimeError('no CUDA and no CPU backend')\n"
    fake = _fake_vllm(tmp_path, request, init, manager)
    if case == "module broken":
        (fake / "vllm/v1/core/kv_cache_manager.py").write_text("raise RuntimeError('abi')\n")
    out = _run(fake, "run", "--target", "vllm", "--seconds", "1", "--corpus",
               str(tmp_path / "corpus"))
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "corpus").exists()


def test_replaying_on_an_unsupported_install_exits_2_too(tmp_path):
    fake = _fake_vllm(tmp_path, _GOOD_REQUEST.replace("pooling_params,", "pooling_params, y,"))
    finding = Path(__file__).resolve().parents[2] / "docs/findings/001-empty-window-entry.json"
    out = _run(fake, "replay", str(finding), "--target", "vllm")
    assert out.returncode == 2, out.stderr
    assert "takes a new required argument y" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_fake_install_unchanged_passes_the_probe(tmp_path):
    """The control: each case above fails only by what it changes in the fake."""
    pytest.importorskip("torch")  # the probe ends by naming torch's float16
    fake = _fake_vllm(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", "from kvfuzz.harness.vllm_api import load_vllm; "
         "print(load_vllm().version)"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(fake)},
        timeout=120, cwd=fake)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "9.9.9"
