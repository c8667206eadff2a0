"""Failing synchronous KV loads drawn where they are valid (docs/spec.md §13.3): under
"recompute" on the built-in `connector` and on a lone sliding window under either policy (the
"fail" policy on `connector` is tests/kvcache's), and kvfuzz's driver and the model agree on
each example, I11 included."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvfuzz.core.configs import builtin_config
from kvfuzz.fuzz.campaign import run_example
from kvfuzz.harness.executor import run_trace


def _failing(name: str, policy: str) -> int:
    base = builtin_config(name)
    config = base.replace(scheduler=dataclasses.replace(base.scheduler,
                                                        kv_load_failure_policy=policy))
    failing = 0
    for seed in range(40):
        example = run_example(random.Random(seed).randbytes(4096), config, "scheduler",
                              steps=40, targets=("kvcache",))
        if example is None:
            continue
        failing += sum(op["op"] == "load_remote" and op["num_loaded_tokens"] is not None
                       for op in example.trace.ops)
        assert run_trace(example.trace, ["kvcache"]).passed
    return failing


@pytest.mark.parametrize("name, policy", [("connector", "recompute"),
                                          ("mistral_connector", "fail"),
                                          ("mistral_connector", "recompute")])
def test_examples_draw_failing_synchronous_loads(name, policy):
    assert _failing(name, policy)
