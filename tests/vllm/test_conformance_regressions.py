"""Regressions from the vLLM conformance work: disagreements that ended as fixes.

Each trace runs on kvcache and the model everywhere, and three-way with the installed vLLM where it is
importable (`-m vllm`).
"""

from __future__ import annotations

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.harness.executor import Execution
from kvfuzz.harness.vllm_target import vllm_available

TARGETS = [
    pytest.param(("kvcache",), id="kvcache"),
    pytest.param(
        ("kvcache", "vllm"),
        id="three-way",
        marks=[pytest.mark.vllm,
               pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable")],
    ),
]


@pytest.mark.parametrize("targets", TARGETS)
def test_eagle_drop_inside_a_block_hits_a_block_keyed_past_the_hit(targets):
    """I13 used to demand a key for exactly the hit's tokens. With fine-grained hits and EAGLE,
    a 4-token hit is the 8-token full-attention block with its last hash unit dropped: the block
    carries the 8-token key of the requester's own prefix, and all three sides agree on it.
    """
    config = Config(8, (GroupConfig("full", 8), GroupConfig("sliding_window", 4, sliding_window=4)),
                    max_model_len=64, use_eagle=True, partial_hits=True)
    ex = Execution(config, "api", targets)
    for rid in ("a", "b"):
        ex.apply({"op": "add_request", "request_id": rid, "prompt": [0] * 8})
    ex.apply({"op": "allocate_slots", "request_id": "a", "num_new_tokens": 8})
    hit = ex.apply({"op": "get_computed_blocks", "request_id": "b"})
    assert hit == {"block_ids": [[1], [2]], "num_computed_tokens": 4}
    assert ex.state.block_keys[1] == (0, None, (0,) * 8)
    ex.apply({"op": "allocate_slots", "request_id": "b", "num_new_tokens": 4, "use_lookup": True})
    assert ex.apply({"op": "take_kv_cache_block_copies"}) == [[1, 4]]
