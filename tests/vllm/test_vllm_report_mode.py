"""kv_cache_report_mode "full" on the installed vLLM: its lookups re-announce the blocks a hit
reuses as EV6 expects, and a re-announcement planted short in vLLM itself is caught.

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

# Built-in `events_tenants` (blocks of 4): a salted LoRA request with an input over [3, 9)
# caches 3 blocks and finishes; b, with the same salt, adapter and input, shares its first 10
# tokens, so its lookup hits 2 blocks and re-announces them with their extra keys (EV5).
TENANT = {"cache_salt": "x", "lora_name": "l", "lora_id": 2, "mm_inputs": [[0, 3, 6]]}
A = {"op": "add_request", "request_id": "a", "prompt": list(range(1, 14)), **TENANT}
B = {"op": "add_request", "request_id": "b", "prompt": list(range(1, 11)) + [50], **TENANT}
LEVELS = {
    "api": [A, {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 13},
            {"op": "free", "request_id": "a"}, B,
            {"op": "get_computed_blocks", "request_id": "b"},
            {"op": "allocate_slots", "request_id": "b", "num_new_tokens": 3, "use_lookup": True},
            {"op": "take_events"}],
    "scheduler": [A, {"op": "step"}, {"op": "step"}, {"op": "finish", "request_id": "a"}, B,
                  {"op": "step"}, {"op": "step"}],
}


def _trace(level: str = "api") -> Trace:
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": level,
                            "config": BUILTIN["events_tenants"][1].to_dict(),
                            "ops": LEVELS[level]})


@pytest.mark.parametrize("level", ["api", "scheduler"])
def test_vllm_reannounces_a_full_mode_hit_as_ev6_expects(level):
    result = run_trace(_trace(level), ["vllm", "kvcache"])
    assert result.passed, result.finding


@pytest.mark.parametrize("drop, check", [(None, "EV6"), (1, "EV4")],
                         ids=["dropped", "one-block-short"])
def test_vllm_reannouncement_planted_wrong_is_caught(monkeypatch, drop, check):
    """None re-announced: only EV6 sees it; one block short: an announcement of a block that
    no lookup owes, which EV4 sees first."""
    import vllm.v1.core.block_pool as block_pool

    original = block_pool.BlockPool.emit_cached_block_events

    def planted(self: Any, request: Any, num_cached_blocks: int, *args: Any) -> None:
        if drop is not None:
            original(self, request, num_cached_blocks - drop, *args)

    monkeypatch.setattr(block_pool.BlockPool, "emit_cached_block_events", planted)
    found = run_trace(_trace(), ["vllm"]).finding
    assert found is not None and found.check == check, found


def test_kvcache_pools_announce_a_hit_with_vllms_signature():
    """kvcache's vLLM-named `emit_cached_block_events` takes vLLM's arguments, nothing more (its
    per-run form is `emit_hit_block_events`)."""
    import inspect

    from vllm.v1.core.block_pool import BlockPool

    from kvfuzz.kvcache.block_pool import BlockPool as KvcachePool
    from kvfuzz.kvcache.kv_events import EventfulBlockPool

    theirs = list(inspect.signature(BlockPool.emit_cached_block_events).parameters)
    for pool in (KvcachePool, EventfulBlockPool):
        assert list(inspect.signature(pool.emit_cached_block_events).parameters) == theirs
