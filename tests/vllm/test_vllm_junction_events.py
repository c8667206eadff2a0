"""KV cache events of a shared-prefix junction (`qwen3_next_junction_events`): the partial
entry that keys a junction's state lies inside the prompt, so its BlockStored's parent is a hash
the request holds further hashes past. A vLLM that reads that parent two hash blocks too far (the
mutant `block_pool.py:600` `n - 2` → `n + 2` of docs/mutation.md) raises IndexError at a
prompt's last hash boundary, but names a wrong parent at a junction: EV3 sees it on a step where
vLLM did not raise, a kill no longer by its exception alone."""

from __future__ import annotations

from typing import Any

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.vllm_api import load_vllm
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable "
                       "here: run `bash ci/install-vllm.sh [VERSION]` and use the python it prints"),
]

PROMPT = [2, 3, 2, 1, 0, 1, 3, 2, 1, 3]
OPS = [
    {"op": "add_request", "request_id": "a", "prompt": PROMPT, "max_tokens": 1},
    # A sibling sharing a's whole prompt: the step stops it at the junction (token 10).
    {"op": "add_request", "request_id": "b", "prompt": [*PROMPT, 0, 3], "max_tokens": 1},
    {"op": "step"},
]


def _parent_two_blocks_late(self: Any, request: Any, num_tokens: int) -> tuple[Any, int]:
    n = num_tokens // self.hash_block_size
    return (request.block_hashes[n + 2] if n > 1 else None), (n - 1) * self.hash_block_size


@pytest.mark.skipif(not load_vllm().has("shared_prefix_checkpoint") if vllm_available()
                    else True, reason="the installed vLLM has no shared-prefix junctions")
def test_a_junction_partial_entry_names_the_parent_before_it(monkeypatch) -> None:
    from vllm.v1.core.block_pool import BlockPool

    if not hasattr(BlockPool, "_get_partial_block_parent_hash_and_start"):
        pytest.skip("the installed vLLM announces no partial entries")
    trace = Trace(BUILTIN["qwen3_next_junction_events"][1], "scheduler", OPS)
    assert run_trace(trace, ["vllm"]).finding is None
    monkeypatch.setattr(BlockPool, "_get_partial_block_parent_hash_and_start",
                        _parent_two_blocks_late)
    finding = run_trace(trace, ["vllm"]).finding
    assert finding is not None and finding.check == "EV3", finding
    assert finding.target_raised == ""
