"""`skip_reading_prefix_cache` drawn at the scheduler level (a request asking for prompt
logprobs, docs/spec.md §6.3): the knob `skip_reading`, kvfuzz's driver and the model."""

from __future__ import annotations

import random
from collections import Counter

from kvfuzz.core.configs import builtin_config
from kvfuzz.fuzz.generator import SchedulerRules, Swarm
from kvfuzz.fuzz.strategies import BytesChoices
from kvfuzz.harness.executor import Execution, run_trace


def _skipping(swarm: Swarm, seeds: range) -> Counter:
    """How many requests the scheduler-level rules add skipping the cache, and not, on `full`;
    each example replays on kvcache and the model."""
    counts: Counter = Counter()
    for seed in seeds:
        execution = Execution(builtin_config("full"), "scheduler", ("kvcache",))
        rules = SchedulerRules(execution, BytesChoices(random.Random(seed).randbytes(4096)),
                               swarm=swarm)
        rules.start()
        for _ in range(60):
            if not rules.run_one():
                break
        counts.update(op["skip_reading_prefix_cache"] for op in execution.trace.ops
                      if op["op"] == "add_request")
        assert run_trace(execution.trace, ["kvcache"]).passed
    return counts


def test_scheduler_requests_skip_reading_the_cache_unless_the_swarm_leaves_it_out():
    drawn = _skipping(Swarm(), range(12))
    assert drawn[True] and drawn[False] > drawn[True]
    assert not _skipping(Swarm(frozenset({"skip_reading"})), range(6))[True]


def _add(rid: str, prompt: list[int], **fields: object) -> dict[str, object]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, "max_tokens": 1, **fields}


def test_a_request_skipping_the_cache_computes_its_cached_prefix_again():
    """r0's first block is cached when r1 arrives: r1 reads it (hit 4), r2, which skips
    reading, computes all its tokens; kvfuzz's driver and the model agree."""
    prompt = [1, 2, 0, 1, 0, 3, 0, 2]
    execution = Execution(builtin_config("full"), "scheduler", ("kvcache",))
    execution.apply(_add("r0", prompt[:4]))
    execution.apply({"op": "step"})
    execution.apply(_add("r1", prompt))
    execution.apply(_add("r2", prompt, skip_reading_prefix_cache=True))
    assert execution.apply({"op": "step"})["scheduled"] == [["r1", 4, 4], ["r2", 8, 0]]
