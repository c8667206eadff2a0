"""A second connector offer for a request that kept a landed load, on vLLM's own Scheduler
(docs/spec.md §13.2 step 1: such a request is offered no other load). A 1-token prompt loaded
whole keeps its block, and vLLM takes its only token back to compute (0 computed tokens), so
vLLM's Scheduler looks it up and asks the connector again (`scheduler.py:1149`, 0.34.0); kvfuzz's
connector offers nothing there, as NIXL triggers one transfer a request."""

from __future__ import annotations

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.harness.executor import Execution
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]


@pytest.mark.parametrize("target", ["vllm-scheduler", "vllm-async-scheduler"])
def test_a_request_that_kept_a_landed_load_is_offered_no_other_three_way(target):
    """The campaign's 4-op trace on `mistral_connector`, then steps: the second offer loads
    nothing on vLLM's Scheduler, kvfuzz's driver and the model, and the request computes its
    token in the block the load left it and finishes."""
    ex = Execution(BUILTIN["mistral_connector"][1], "scheduler", ("kvcache", target))
    ex.apply({"op": "add_request", "request_id": "r", "prompt": [0], "max_tokens": 1})
    assert ex.apply({"op": "load_remote", "request_id": "r", "num_external_tokens": 1}) == {
        "hit": 0, "external": 1, "diverged": False}
    assert ex.apply({"op": "finish_load", "request_id": "r"}) == 0
    assert ex.apply({"op": "load_remote", "request_id": "r", "num_external_tokens": 2}) is None
    assert ex.apply({"op": "load_remote", "request_id": "r", "num_external_tokens": 1,
                     "sync": True}) is None
    assert ex.state.waiting == ("r",)
    assert ex.apply({"op": "step"})["scheduled"] == [["r", 1, 0]]
    assert ex.state.requests["r"].status.startswith("FINISHED")
