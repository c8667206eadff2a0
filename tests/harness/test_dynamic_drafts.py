"""Dynamic drafts (`scheduler.num_speculative_tokens_per_batch_size`, docs/spec.md §7.3): vLLM's
dynamic speculative decoding, played by kvfuzz's driver on kvcache and by the reference model.
A step's requests that sample get the placeholder drafts its batch size looks up, and no
admission is padded; the two agree step by step (the executor compares every result and
snapshot, `num_drafts` included)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kvfuzz.core.config import Config, ConfigError
from kvfuzz.core.configs import BUILTIN
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution
from kvfuzz.kvcache.dynamic_drafts import dense_drafts

CONFIG = BUILTIN["dynamic_drafts"][1]
"""Up to 3 drafts: a batch of 1 gets 3, of 2 or 3 gets 2 (3 is a gap), of 4 none."""


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


def _drafts(ex: Execution) -> dict[str, int]:
    return {rid: view.num_drafts for rid, view in ex.state.requests.items()}


def test_the_dense_table_fills_gaps_and_the_tail_and_caps_each_count():
    assert dense_drafts([(1, 1, 3), (2, 2, 2), (4, 4, 0)], 4, 3) == [0, 3, 2, 2, 0]
    assert dense_drafts([(1, 1, 3), (2, 2, 2), (4, 4, 0)], 6, 3) == [0, 3, 2, 2, 0, 0, 0]
    assert dense_drafts([(3, 5, 1), (1, 2, 5)], 4, 4) == [0, 4, 4, 1, 1]  # unsorted, capped
    assert dense_drafts([(1, 16, 3), (32, 128, 2)], 40, 3)[17:32] == [3] * 15


def test_a_steps_batch_size_sets_its_requests_drafts():
    ex = Execution(CONFIG, "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(6)), max_tokens=20))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 6, 0]]
    assert _drafts(ex) == {"a": 3}  # a batch of 1
    assert ex.apply({"op": "step", "accept": 1})["scheduled"] == [["a", 4, 0]]
    ex.apply(_add("b", [3, 2, 1], max_tokens=20))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 4, 0], ["b", 3, 0]]
    assert _drafts(ex) == {"a": 2, "b": 2}  # a batch of 2
    ex.apply(_add("c", [1, 1, 1], max_tokens=20))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 3, 0], ["b", 3, 0], ["c", 2, 0]]
    assert _drafts(ex) == {"a": 2, "b": 2, "c": 0}  # the gap at 3 carries 2; c still prefills
    ex.apply(_add("d", [2, 2], max_tokens=20))
    ex.apply({"op": "step"})  # the budget of 8 ends with c; d waits
    out = ex.apply({"op": "step", "accept": 0})
    assert len(out["scheduled"]) == 4 and set(_drafts(ex).values()) == {0}  # a batch of 4


def test_a_step_left_in_flight_places_the_drafts_of_its_own_batch():
    """Placed when the step launches: a batch of 2 in flight gives 2 each, and the later step
    of 1 request verifies them, then gives 3."""
    ex = Execution(CONFIG.replace(deferred_frees=True), "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(6)), max_tokens=20))
    ex.apply(_add("b", [3], max_tokens=1))
    ex.apply({"op": "step", "in_flight": True})
    assert _drafts(ex) == {"a": 2, "b": 2}
    ex.apply({"op": "complete_step"})
    assert ex.apply({"op": "step", "accept": 2})["scheduled"] == [["a", 3, 0]]
    assert _drafts(ex) == {"a": 3, "b": 0}


def test_no_admission_is_padded_to_the_drafts():
    """Fixed drafts pad an admission with one token left (a full hit) to 1 + K; dynamic
    drafts never do (vLLM 0.34.0 `scheduler.py:1361-1363`). Without EAGLE's dropped block
    and under a budget of 32, so that the hit leaves one token."""
    dynamic = CONFIG.replace(use_eagle=False, scheduler=dataclasses.replace(
        CONFIG.scheduler, token_budget=32))
    fixed = dynamic.replace(scheduler=dataclasses.replace(
        dynamic.scheduler, num_speculative_tokens_per_batch_size=None))
    for config, padded in ((dynamic, 1), (fixed, 4)):
        ex = Execution(config, "scheduler", ("kvcache",))
        for op in (_add("a", list(range(9)), max_tokens=9), {"op": "step"}, {"op": "step"},
                   _add("b", list(range(9)), max_tokens=3)):
            ex.apply(op)
        assert ["b", padded, 8] in ex.apply({"op": "step"})["scheduled"]


@pytest.mark.parametrize("ranges, named", [
    ([], "[]"), (3, "3"), ([[1, 2]], "[1, 2]"), ([[0, 2, 1]], "0"), ([[2, 3, 1]], "2"),
    ([[1, 3, 1], [3, 4, 1]], "[3, 4, 1]"), ([[1, 2, -1]], "-1"), ([[1, 2, True]], "True"),
    ([[3, 2, 1]], "3"),
])
def test_bad_schedules_are_refused_naming_the_value(ranges, named):
    data = {**CONFIG.to_dict(), "scheduler": {"num_speculative_tokens": 2,
                                              "num_speculative_tokens_per_batch_size": ranges}}
    with pytest.raises(ConfigError, match="num_speculative_tokens_per_batch_size") as err:
        Config.from_dict(data)
    assert named in str(err.value)


def test_a_schedule_needs_fixed_drafts():
    data = {**CONFIG.to_dict(), "scheduler": {"num_speculative_tokens_per_batch_size": [[1, 1, 2]]}}
    with pytest.raises(ConfigError, match="needs scheduler.num_speculative_tokens > 0"):
        Config.from_dict(data)


def test_a_bad_schedule_in_a_config_file_exits_2_naming_it(tmp_path, capsys):
    path = tmp_path / "bad.json"
    data = {**CONFIG.to_dict(), "scheduler": {"num_speculative_tokens": 2,
                                              "num_speculative_tokens_per_batch_size": [[2, 4, 1]]}}
    path.write_text(json.dumps(data))
    code = kvfuzz(["run", "--config-file", str(path), "--level", "scheduler", "--examples", "1"])
    assert code == 2
    assert "the first range must start at batch size 1, got 2" in capsys.readouterr().err
    assert not (tmp_path / "kvfuzz-corpus").exists()


def test_the_schedule_round_trips_through_json():
    again = Config.from_dict(json.loads(json.dumps(CONFIG.to_dict())))
    assert again == CONFIG
    assert again.scheduler.num_speculative_tokens_per_batch_size == ((1, 1, 3), (2, 2, 2),
                                                                     (4, 4, 0))
