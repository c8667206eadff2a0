"""Spec-decode drafts at the scheduler level: kvfuzz's driver (kvcache.scheduler) and the
model's, against docs/traces.md "The driver (step)": drafts scheduled with a running request,
the rejected ones rolled back, the accepted ones appended before the sampled token, a stop
among them uncomputing the rest; the trace fields `draft` and `accept` and their bounds.

Block size 4, caching off, budget 32 unless noted; values worked out by hand in the comments.
"""

from __future__ import annotations

import json

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import InvalidTrace
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.fuzz.generator import has_drafter
from kvfuzz.harness.executor import Execution
from kvfuzz.kvcache import FullAttentionSpec, Scheduler
from kvcache_testkit import make_manager, make_request, table_ids

BS = 4


def driver(**options: object) -> Scheduler:
    m = make_manager(16, FullAttentionSpec(block_size=BS), max_model_len=64,
                     enable_caching=False)
    return Scheduler(m, max_model_len=64, **{"token_budget": 32, "max_running": 4,
                                             **options})  # type: ignore[arg-type]


def sample(request: object) -> int:
    return 1000


def test_rejected_drafts_are_rolled_back_and_their_blocks_stay():
    s = driver()
    r = make_request("a", list(range(6)), BS, max_tokens=9)
    s.add_request(r)
    s.step(sample, propose=lambda request: [7, 8, 9])  # prefill 6, sample: 7 tokens
    assert (r.num_computed_tokens, r.num_tokens, r.spec_token_ids) == (6, 7, [7, 8, 9])
    out = s.step(sample, accept=1)
    # 1 + 3 drafts scheduled (positions 6..9: 3 blocks); 2 rejected: computed 10 - 2 = 8;
    # the kept draft 7 and the sampled 1000 appended: 9 tokens.
    assert out.scheduled == [("a", 4, 0)]
    assert (r.num_computed_tokens, r.num_tokens) == (8, 9)
    assert list(r.all_token_ids[6:]) == [1000, 7, 1000]
    assert r.spec_token_ids == []  # no proposal this step
    assert len(table_ids(s.manager, "a")[0]) == 3  # the table stays as long as the drafts
    assert s.step(sample).scheduled == [("a", 1, 0)]


def test_drafts_cut_by_the_budget_and_a_stop_among_the_kept_ones():
    s = driver(token_budget=3)
    r = make_request("a", [1, 2], BS, max_tokens=3)
    s.add_request(r)
    s.step(sample, propose=lambda request: [5, 6, 7, 8])
    # Budget 3: 1 + 2 of the 4 drafts, both kept. Output tokens 1000 (the prefill's), 5, then
    # 6 reaches max_tokens 3: the sampled token after it is dropped and uncomputed.
    out = s.step(sample)
    assert out.scheduled == [("a", 3, 0)] and out.finished == ["a"]
    assert list(r.all_token_ids) == [1, 2, 1000, 5, 6]
    assert r.num_computed_tokens == r.num_tokens - 1


@pytest.mark.parametrize("config", ["eagle", "watermark", "eagle_hybrid"])
def test_model_and_kvcache_agree_on_hand_made_spec_steps(config):
    ex = Execution(BUILTIN[config][1], "scheduler", ("kvcache",))
    ex.apply({"op": "add_request", "request_id": "a", "prompt": list(range(6)), "max_tokens": 9})
    ex.apply({"op": "add_request", "request_id": "b", "prompt": list(range(50, 59)),
              "max_tokens": 3})
    for op in ({"op": "step", "draft": 3}, {"op": "step", "accept": 1, "draft": 4, "sample": 5},
               {"op": "step", "accept": 0, "draft": 2}, {"op": "step", "draft": 4},
               {"op": "step", "accept": 2}, {"op": "step"}):
        ex.apply(op)
    assert ex.state.requests["a"].status == "FINISHED_LENGTH_CAPPED"


def test_drafts_are_generated_only_where_a_drafter_is():
    assert has_drafter(BUILTIN["eagle"][1]) and has_drafter(BUILTIN["watermark"][1])
    assert not has_drafter(BUILTIN["full"][1])
    assert has_drafter(BUILTIN["fixed_drafts"][1])
    # State groups: drafted only where the data checks do not run (tests/harness/test_fixed_drafts.py).
    assert has_drafter(BUILTIN["qwen3_next_eagle"][1])


@pytest.mark.parametrize("field, value", [("draft", -1), ("accept", -2), ("draft", 65)])
def test_a_bad_draft_count_is_an_invalid_trace(field, value, tmp_path, capsys):
    ops = [{"op": "add_request", "request_id": "a", "prompt": [1]},
           {"op": "step", field: value}]
    with pytest.raises(InvalidTrace, match=f"{field} {value}"):
        _apply(ops)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(Trace(BUILTIN["eagle"][1], "scheduler", ops, {}).to_dict()))
    assert kvfuzz(["replay", str(path)]) == 2
    assert f"{field} {value}" in capsys.readouterr().err


def _apply(ops: list[dict]) -> None:
    ex = Execution(BUILTIN["eagle"][1], "scheduler", ("kvcache",))
    for op in ops:
        ex.apply(op)


def test_a_non_int_draft_is_malformed(tmp_path, capsys):
    trace = Trace(BUILTIN["eagle"][1], "scheduler", [{"op": "step", "draft": "3"}], {})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace.to_dict()))
    assert kvfuzz(["replay", str(path)]) == 2
    assert "draft must be an int" in capsys.readouterr().err
