"""Shared-prefix junctions (docs/spec.md §6.3, §7, §11.3): the scheduler driver writes each
lookup's junction into the request, vLLM's `Request` as kvcache's; kvcache, the installed
vLLM and the reference model then stop a Mamba chunk and keep blocks there alike."""

from __future__ import annotations

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.harness.executor import Execution
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

SHARED = list(range(28))


@pytest.mark.parametrize("name, b_scheduled, junction, c_hit", [
    # Full attention hits 24 of b's shared 28, the state groups nothing: junction 24. b's
    # first chunk stops there (not at the budget's 32) and its state blocks ending at 24 keep
    # their keys under retention 16, so c hits 24.
    ("qwen3_5_retention", ["b", 24, 0], 24, 24),
    # Full attention hits 28, the window 16 (a segment end): junction 28. The window blocks
    # ending at 28 keep their keys under retention 16, so c hits 28.
    ("gemma3_retention", ["b", 24, 16], 28, 28),
])
def test_a_sibling_keeps_the_junction_on_every_side(name, b_scheduled, junction, c_hit):
    """`a` caches 40 tokens; `b` and then `c` share its first 28."""
    ex = Execution(BUILTIN[name][1], "scheduler", ("kvcache", "vllm"))

    def add(rid: str, prompt: list[int]) -> None:
        ex.apply({"op": "add_request", "request_id": rid, "prompt": prompt, "max_tokens": 1})

    def step() -> list[list[object]]:
        return ex.apply({"op": "step"})["scheduled"]

    def run(rid: str) -> None:
        while ex.model.requests[rid].status == "RUNNING":
            step()

    add("a", list(range(40)))
    step()
    run("a")
    add("b", SHARED + list(range(200, 212)))
    assert step() == [b_scheduled]
    for side in (ex.model, *(target.side for target in ex.targets)):
        assert side.requests["b"].shared_prefix_boundary == junction
    run("b")
    add("c", SHARED + list(range(300, 312)))
    assert [hit for rid, _, hit in step() if rid == "c"] == [c_hit]
