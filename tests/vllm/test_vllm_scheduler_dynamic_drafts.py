"""Dynamic speculative decoding on vLLM's AsyncScheduler (target `vllm-async-scheduler`,
docs/vllm.md "Dynamic speculative decoding"): `num_speculative_tokens_per_batch_size` makes
vLLM give a step's decoding requests the placeholder drafts its batch size looks up and pad no
admission; kvfuzz's driver on kvcache and the model play the same rule, three-way, and the
bug planted on that path is caught.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness import vllm_scheduler_target
from kvfuzz.harness.executor import Execution
from kvfuzz.harness.vllm_scheduler_target import _publishes_after_output, unsupported_reason
from kvfuzz.harness.vllm_target import vllm_available
from kvfuzz.kvcache.dynamic_drafts import dense_drafts

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

CONFIG = BUILTIN["dynamic_drafts"][1]
ASYNC_THREE_WAY = ("kvcache", "vllm-async-scheduler")
publishing = pytest.mark.skipif(
    not _publishes_after_output(True, False),
    reason="this vLLM's update_from_output caches nothing after an output (0.32): fixed and "
           "dynamic drafts are left out")


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


def _spec(ex: Execution) -> dict[str, int]:
    return {rid: len(r.spec_token_ids)
            for rid, r in ex.targets[1].side.vllm_scheduler.requests.items()}


@publishing
def test_a_steps_batch_size_sets_the_drafts_three_way():
    """vLLM's lookup ([0, 3, 2, 2, 0]) gives a batch of 1 three placeholders, of 2 and 3 two,
    of 4 none, as kvfuzz's driver and the model say (the executor compares `num_drafts`).
    Steps stay in flight on vLLM only with a connector (docs/vllm.md "Steps in flight"),
    which drafts exclude: tests/harness/test_dynamic_drafts.py plays them on kvcache."""
    ex = Execution(CONFIG, "scheduler", ASYNC_THREE_WAY)
    assert ex.targets[1].side.vllm_scheduler.dynamic_sd_lookup == [0, 3, 2, 2, 0]
    ex.apply(_add("a", list(range(6)), max_tokens=20))
    ex.apply({"op": "step"})
    assert _spec(ex) == {"a": 3}
    assert ex.apply({"op": "step", "accept": 1})["scheduled"] == [["a", 4, 0]]
    ex.apply(_add("b", [3, 2, 1], max_tokens=20))
    ex.apply({"op": "step"})
    assert _spec(ex) == {"a": 2, "b": 2}
    ex.apply(_add("c", [1, 1, 1], max_tokens=20))
    ex.apply({"op": "step"})
    assert _spec(ex)["a"] == _spec(ex)["b"] == 2
    ex.apply(_add("d", [2, 2], max_tokens=20))
    for accept in (None, 0, 1, None, 2):
        ex.apply({"op": "step", "accept": accept})
    assert set(_spec(ex).values()) == {0}


@publishing
def test_no_admission_is_padded_three_way():
    """With the schedule set vLLM pads no one-token admission (`scheduler.py:1361-1363`)."""
    config = CONFIG.replace(use_eagle=False, scheduler=dataclasses.replace(
        CONFIG.scheduler, token_budget=32))
    ex = Execution(config, "scheduler", ASYNC_THREE_WAY)
    for op in (_add("a", list(range(9)), max_tokens=9), {"op": "step"}, {"op": "step"},
               _add("b", list(range(9)), max_tokens=3)):
        ex.apply(op)
    assert ["b", 1, 8] in ex.apply({"op": "step"})["scheduled"]


def test_the_dense_table_is_vllms():
    """kvfuzz's table (kvcache/dynamic_drafts.py) against vLLM's
    `build_dynamic_sd_schedule_lookup` on random valid schedules."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    rng = random.Random(0)
    for _ in range(300):
        ranges, start = [], 1
        for _ in range(rng.randint(1, 4)):
            end = start + rng.randint(0, 5)
            ranges.append((start, end, rng.randint(0, 6)))
            start = end + 1 + rng.randint(0, 3)
        rng.shuffle(ranges)
        most, cap = rng.randint(1, 24), rng.randint(1, 6)
        assert dense_drafts(ranges, most, cap) == build_dynamic_sd_schedule_lookup(
            [list(r) for r in ranges], vllm_max_batch_size=most,
            vllm_num_speculative_tokens=cap), (ranges, most, cap)


def test_a_vllm_without_the_field_leaves_the_config_out(monkeypatch):
    monkeypatch.setattr(vllm_scheduler_target, "_dynamic_drafts", lambda: False)
    reason = unsupported_reason(CONFIG, async_scheduling=True)
    assert reason and "SpeculativeConfig has no such field" in reason
    plain = CONFIG.replace(scheduler=dataclasses.replace(
        CONFIG.scheduler, num_speculative_tokens_per_batch_size=None))
    assert unsupported_reason(plain, async_scheduling=True) == unsupported_reason(
        BUILTIN["fixed_drafts"][1], async_scheduling=True)


@publishing
def test_the_zero_indexed_lookup_plant_is_caught(tmp_path, capsys):
    code = kvfuzz(["run", "--target", "vllm-scheduler-bug:dynamic-drafts-zero-indexed",
                   "--level", "scheduler", "--config", "dynamic_drafts", "--examples", "40",
                   "--max-findings", "1", "--corpus", str(tmp_path)])
    assert code == 1, capsys.readouterr().out
    assert list(tmp_path.glob("DIFF-state-dynamic_drafts-*.json"))
