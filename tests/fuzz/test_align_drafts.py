"""Drafts steered across a Mamba "align" block end, then rejected (kvfuzz.fuzz.align_drafts):
the positions that steer, configs without an align group left as they were, and generated
examples that make the shape, valid and replayable."""

from __future__ import annotations

import random

from kvfuzz.core.configs import builtin_config
from kvfuzz.core.snapshot import RequestView
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.align_drafts import align_block_size, crosses_block_end
from kvfuzz.fuzz.generator import run_example
from kvfuzz.harness.executor import run_trace


def _running(computed: int, left: int = 1) -> list[tuple[str, RequestView]]:
    return [("r", RequestView("RUNNING", computed, computed + left, (), (), ()))]


def test_the_block_size_is_the_align_groups():
    assert align_block_size(builtin_config("qwen3_next_eagle")) == 8
    assert align_block_size(builtin_config("eagle")) == 0  # no state group: draws as before
    assert align_block_size(builtin_config("hybrid")) == 0


def test_a_decoding_request_1_to_most_minus_1_short_of_a_block_end_steers():
    """After the step samples, computed + 2 tokens: 3 drafts cross the end at 8 from 6 and 7
    (1 and 2 short), not from 8 (none short) or 5 (3 short: the drafts reach the end)."""
    steers = [c for c in range(16) if crosses_block_end(8, _running(c), 3)]
    assert steers == [4, 5, 12, 13]
    assert [c for c in range(16) if crosses_block_end(8, _running(c), 2)] == [5, 13]
    assert not any(crosses_block_end(8, _running(c), 1) for c in range(16))
    assert not any(crosses_block_end(0, _running(c), 3) for c in range(16))
    assert not crosses_block_end(8, _running(4, left=5), 3)  # still prefilling


def test_generated_examples_make_the_shape_and_replay():
    """On `qwen3_next_eagle` (block 8, 1 to 3 draft blocks) examples run the steered pair: the
    most drafts, then a step that rejects them and proposes none; each passes on kvcache
    against the model and its trace replays (11 of 60 seeds; 2 with uniform draws alone)."""
    shaped = 0
    for seed in range(60):
        data = random.Random(seed).randbytes(24 * 40 + 64)
        execution = run_example(data, builtin_config("qwen3_next_eagle"), "scheduler",
                                steps=40, targets=("kvcache",))
        assert execution is not None
        ops = execution.trace.ops
        most = execution.trace.config.max_drafts
        if any(a.get("draft") == most and a.get("accept") == 0 and b.get("accept") == 0
               and not b.get("draft") for a, b in zip(ops, ops[1:])):
            shaped += 1
            trace = Trace.from_dict(execution.trace.to_dict())
            assert run_trace(trace, ["kvcache"]).passed
    assert shaped >= 8, shaped
