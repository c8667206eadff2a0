"""Failing synchronous KV loads drawn under both `kv_load_failure_policy`s (docs/spec.md
§13.3): the built-in `connector` ("recompute") and its "fail" twin draw them, and kvfuzz's
driver and the model agree on each example, I11 included."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvfuzz.core.configs import builtin_config
from kvfuzz.fuzz.campaign import run_example
from kvfuzz.harness.executor import run_trace


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_connector_examples_draw_failing_synchronous_loads(policy):
    base = builtin_config("connector")
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
    assert failing
