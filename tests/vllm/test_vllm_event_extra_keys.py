"""EV5 on the installed vLLM: its BlockStored events name each block's extra keys (LoRA name,
multimodal inputs with offsets, salt) as the key's identity implies, and a corruption of them
planted in vLLM itself is caught.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

from typing import Any

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

# Built-in `events` with extra keys on; blocks of 4: a salted LoRA request with an input over
# [3, 9), then a plain one sharing nothing (its events name no extra keys).
OPS = [
    {"op": "add_request", "request_id": "a", "prompt": list(range(1, 14)),
     "cache_salt": "x", "lora_name": "l", "lora_id": 2, "mm_inputs": [[0, 3, 6]]},
    {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 13},
    {"op": "add_request", "request_id": "b", "prompt": [7] * 9},
    {"op": "allocate_slots", "request_id": "b", "num_new_tokens": 9},
    {"op": "take_events"},
]
CONFIG = {**BUILTIN["events"][1].to_dict(), "extra_keys": True}


def _trace(**config: Any) -> Trace:
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "api",
                            "config": {**CONFIG, **config}, "ops": OPS})


@pytest.mark.parametrize("lookahead", [0, 2])
def test_vllm_events_name_the_extra_keys_ev5_expects(lookahead):
    """With a hash lookahead each entry covers the block and the tokens after it (§5.7)."""
    from kvfuzz.harness.vllm_api import load_vllm

    if lookahead and "hash_lookahead" not in load_vllm().features:
        pytest.skip("this vLLM does not hash ahead")
    result = run_trace(_trace(num_hash_lookahead_tokens=lookahead), ["vllm", "kvcache"])
    assert result.passed, result.finding


def test_vllm_with_its_blocks_extra_keys_reversed_is_caught(monkeypatch):
    import vllm.v1.core.block_pool as block_pool

    original = block_pool.to_event_extra_keys

    def reversed_keys(extra_keys: Any) -> Any:
        return original(list(extra_keys or ())[::-1])

    monkeypatch.setattr(block_pool, "to_event_extra_keys", reversed_keys)
    found = run_trace(_trace(), ["vllm"]).finding
    assert found is not None and found.check == "EV5", found
