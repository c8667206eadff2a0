"""Resumed requests steered onto a block-end checkpoint (kvfuzz.fuzz.resumed_checkpoints): on a
config with prefill checkpoint blocks, samples, preemptions and admissions make a request with
outputs re-prefilled in one chunk whose checkpoint is a block end, not the prompt's; a config
without checkpoint blocks draws exactly as before."""

from __future__ import annotations

import random

from kvfuzz.core.configs import builtin_config
from kvfuzz.fuzz import resumed_checkpoints
from kvfuzz.fuzz.generator import run_example
from kvfuzz.fuzz.strategies import BytesChoices
from kvfuzz.harness.executor import Counterexample

import kvfuzz.harness.mutants  # noqa: F401  (registers the bug:NAME targets)

CONFIGS = ("qwen3_5_checkpoint", "nemotron_h_checkpoint", "qwen3_next_checkpoint")


class NoDecisions:
    def below(self, n: int) -> int:
        raise AssertionError("a config without checkpoint blocks took a decision")


class _View:
    def __init__(self, tokens: int, status: str = "RUNNING") -> None:
        self.num_tokens = tokens
        self.status = status


def test_a_resumed_chunk_ends_where_its_checkpoint_is_a_block_end():
    """qwen3_5_checkpoint: state blocks of 8, hash blocks of 2 (sub-block hits), no EAGLE, so a
    chunk ending at `e` checkpoints at `(e - 1) // 2 * 2`; a 6-token prompt's own is 4."""
    points = resumed_checkpoints.checkpoints(builtin_config("qwen3_5_checkpoint"))
    assert (points.block_size, points.unit, points.alignment) == (8, 2, 2)
    assert points.position(9) == 8 and points.position(6) == 4
    assert points.resumed_chunk(0, 6, 10) == 9  # ends at the prefill end, 9: checkpoint 8
    assert points.resumed_chunk(0, 6, 9) == 9  # the prefill end 8 checkpoints at 6: the end
    assert points.resumed_chunk(0, 6, 12) is None  # 11 and 12 checkpoint at 10
    assert points.resumed_chunk(8, 6, 10) is None  # past the checkpoint
    assert points.resumed_chunk(0, 9, 10) is None  # the prompt's own checkpoint
    assert points.resumed_chunk(0, 14, 18) == 17  # 16, two blocks on
    assert points.resumed_chunk(8, 14, 18) == 9  # from a hit on the first block
    assert points.resumed_chunk(10, 14, 18) is None  # its column is the initial state's
    eagle = resumed_checkpoints.checkpoints(builtin_config("qwen3_next_checkpoint"))
    assert eagle.drop_eagle and eagle.position(10) == 8  # EAGLE steps down one hash block
    assert eagle.resumed_chunk(0, 6, 11) == 10


def test_samples_preemptions_and_admissions_are_steered_to_it():
    points = resumed_checkpoints.checkpoints(builtin_config("qwen3_5_checkpoint"))
    assert resumed_checkpoints.outputs(BytesChoices(bytes([1])), points, _View(6), 6, 50) == 3
    assert resumed_checkpoints.outputs(BytesChoices(bytes([0])), points, _View(6), 6, 50) is None
    views = [("a", _View(9)), ("b", _View(12)), ("c", _View(6))]
    prompts = {"a": 6, "b": 6, "c": 6}
    preempted = resumed_checkpoints.to_preempt(BytesChoices(bytes([1])), points, views, prompts)
    assert [rid for rid, _ in preempted] == ["a"]
    waiting = [(rid, _View(v.num_tokens, "PREEMPTED")) for rid, v in views]
    waiting.append(("d", _View(9, "WAITING")))
    resumed = resumed_checkpoints.to_resume(BytesChoices(bytes([1])), points, waiting,
                                            {**prompts, "d": 6})
    assert [rid for rid, _ in resumed] == ["a"]


def test_a_config_without_checkpoint_blocks_takes_no_decision_more():
    for name in ("full", "qwen3_5_align", "qwen3_next_eagle"):
        assert resumed_checkpoints.checkpoints(builtin_config(name)) is None
    views = [("a", _View(9, "PREEMPTED"))]
    assert resumed_checkpoints.outputs(NoDecisions(), None, views[0][1], 6, 50) is None
    assert resumed_checkpoints.to_preempt(NoDecisions(), None, views, {"a": 6}) == []
    assert resumed_checkpoints.to_resume(NoDecisions(), None, views, {"a": 6}) == []


def _found(seeds: range) -> int:
    found = 0
    for config in CONFIGS:
        for seed in seeds:
            try:
                run_example(random.Random(seed).randbytes(24 * 40 + 64), builtin_config(config),
                            "api", steps=40, targets=("bug:resumed-checkpoint-dropped",))
            except Counterexample:
                found += 1
    return found


def test_steering_finds_the_dropped_resumed_checkpoint_plant_in_more_examples(monkeypatch):
    """vLLM 0.34.0's survivor S31 (`position % bs == 0` → `*`: a block-end checkpoint that is
    not the prompt's is dropped), planted in kvcache: found in 17 of 120 API examples of the
    three checkpoint configs without retention with steering (beside the checkpoint-length and
    checkpoint-split draws of `boundaries`), none without (seeds 0-39)."""
    assert _found(range(40)) >= 12
    monkeypatch.setattr(resumed_checkpoints, "checkpoints", lambda config: None)
    assert _found(range(40)) < 6
