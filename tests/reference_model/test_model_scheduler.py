"""Scheduler level: the driver of docs/traces.md (docs/spec.md §7) run through step/abort/finish ops."""

from __future__ import annotations

import dataclasses

import pytest
from rm_support import Runner, config, full, swa

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import InvalidTrace
from kvfuzz.reference_model.requests import Request


def sched(num_blocks: int, *groups, **scheduler) -> Runner:
    return Runner(config(num_blocks, *(groups or (full(4),)), scheduler=scheduler), "scheduler")


def step(m: Runner, sample: int = 0) -> dict:
    return m.run("step", sample=sample)


def test_chunked_prefill_then_decode():
    m = sched(16, token_budget=8)
    m.add("r", list(range(20)))
    assert m.snap.waiting == ("r",)
    assert step(m)["scheduled"] == [["r", 8, 0]]
    assert m.snap.running == ("r",) and m.snap.requests["r"].num_computed_tokens == 8
    assert step(m)["scheduled"] == [["r", 8, 0]]
    assert step(m, sample=1)["scheduled"] == [["r", 4, 0]]
    view = m.snap.requests["r"]
    assert (view.num_computed_tokens, view.num_tokens) == (20, 21)
    assert step(m)["scheduled"] == [["r", 1, 0]]
    assert m.snap.requests["r"].tables == ((1, 2, 3, 4, 5, 6),)


def test_without_chunked_prefill_a_long_prompt_waits():
    m = sched(16, token_budget=8, chunked_prefill=False)
    m.add("long", list(range(20)))
    m.add("short", [1, 2])
    assert step(m) == {"scheduled": [], "preempted": [], "finished": [], "copies": []}
    assert m.snap.waiting == ("long", "short")


def test_finish_by_max_tokens_frees_blocks():
    m = sched(16)
    m.add("r", [10, 11, 12, 13], max_tokens=2)
    assert step(m, sample=1) == {
        "scheduled": [["r", 4, 0]],
        "preempted": [],
        "finished": [],
        "copies": [],
    }
    assert m.snap.requests["r"].num_tokens == 5
    assert step(m, sample=2) == {
        "scheduled": [["r", 1, 0]],
        "preempted": [],
        "finished": ["r"],
        "copies": [],
    }
    s = m.snap
    view = s.requests["r"]
    assert view.status == "FINISHED_LENGTH_CAPPED" and view.tables == (None,)
    assert view.num_tokens == 6 and s.running == ()
    # Block 2 (tokens 4-5) is uncached -> head; block 1 cached -> tail.
    assert s.free_queue == (2,) + tuple(range(3, 16)) + (1,)


def test_sampled_token_follows_the_rule():
    m = sched(16, vocab_size=7)
    m.add("r", [1, 2, 3])
    step(m, sample=5)  # samples (5 + 3) % 7 = 1
    assert step(m)["scheduled"] == [["r", 1, 0]]  # caches block [1, 2, 3, 1]
    m.run("abort", request_id="r")
    m.add("q", [1, 2, 3, 1, 0])
    m.add("other", [1, 2, 3, 2, 0])
    assert step(m)["scheduled"] == [["q", 1, 4], ["other", 5, 0]]


def fcfs_pressure(policy: str) -> Runner:
    """a (priority 5), then b (0) and c (1); 7 usable blocks, all used after step 1."""
    m = sched(8, policy=policy)
    m.add("a", list(range(8)), priority=5)
    assert step(m)["scheduled"] == [["a", 8, 0]]
    m.add("b", list(range(100, 108)), priority=0)
    m.add("c", list(range(200, 208)), priority=1)
    assert step(m)["scheduled"] == [["a", 1, 0], ["b", 8, 0], ["c", 8, 0]]
    s = m.snap
    assert s.running == ("a", "b", "c") and s.num_free_blocks == 0
    return m


def test_fcfs_preempts_the_last_running_request():
    m = fcfs_pressure("fcfs")
    assert step(m) == {
        "scheduled": [["a", 1, 0], ["b", 1, 0]],
        "preempted": ["c"],
        "finished": [],
        "copies": [],
    }
    s = m.snap
    assert s.running == ("a", "b") and s.waiting == ("c",)
    c = s.requests["c"]
    assert (c.status, c.num_computed_tokens, c.tables) == ("PREEMPTED", 0, (None,))
    assert s.requests["b"].tables == ((4, 5, 7),)  # c's blocks were cached: tail 7, 6
    assert s.free_queue == (6,)


def test_priority_preempts_the_least_important_even_if_already_scheduled():
    m = fcfs_pressure("priority")
    assert step(m) == {
        "scheduled": [["b", 1, 0], ["c", 1, 0]],
        "preempted": ["a"],
        "finished": [],
        "copies": [],
    }
    s = m.snap
    assert s.running == ("b", "c") and s.waiting == ("a",)
    # a's blocks freed tail first: 3 uncached -> head, 2 and 1 cached -> tail; b takes 3, c 2.
    assert s.requests["b"].tables == ((4, 5, 3),)
    assert s.requests["c"].tables == ((6, 7, 2),)
    assert s.free_queue == (1,)


def test_priority_waiting_queue_is_sorted():
    m = sched(16, policy="priority", max_running=1)
    m.add("x", [1], priority=2)
    m.add("y", [2], priority=0)
    m.add("z", [3], priority=2)
    m.add("w", [4], priority=1)
    assert m.snap.waiting == ("y", "w", "x", "z")


def test_fcfs_preempted_request_goes_to_the_front_and_is_readmitted():
    m = sched(5)
    m.add("a", list(range(8)))
    m.add("b", list(range(100, 108)))
    step(m)
    m.add("late", [9])
    out = step(m)
    assert out["preempted"] == ["b"] and out["scheduled"] == [["a", 1, 0]]
    assert m.snap.waiting == ("b", "late")
    m.run("abort", request_id="a")
    out = step(m)
    # b recomputes: its first block survived (cached, free) -> hit 4.
    assert out["scheduled"][0] == ["b", 5, 4]
    assert m.snap.running[0] == "b"


def test_abort_and_finish_waiting_and_running():
    m = sched(16, max_running=1)
    m.add("run", list(range(5)))
    m.add("wait", list(range(50, 55)))
    step(m)
    s = m.snap
    assert s.running == ("run",) and s.waiting == ("wait",) and s.num_free_blocks == 13
    assert m.run("abort", request_id="wait") is None
    s = m.snap
    assert s.waiting == () and s.requests["wait"].status == "FINISHED_ABORTED"
    assert m.run("finish", request_id="run") is None
    s = m.snap
    assert s.running == () and s.requests["run"].status == "FINISHED_STOPPED"
    assert s.num_free_blocks == 15 and s.requests["run"].tables == (None,)
    before = m.snap
    m.run("abort", request_id="run")  # already finished: no-op
    assert m.snap == before
    with pytest.raises(InvalidTrace):
        m.run("abort", request_id="nobody")


def test_scheduler_step_reports_and_releases_copy_on_write():
    m = Runner(
        config(
            200, full(32), swa(16, 16), hash_block_size=16, partial_hits=True,
            scheduler={"token_budget": 128},
        ),
        "scheduler",
    )
    prompt = list(range(90))
    m.add("P", prompt)
    assert step(m)["scheduled"] == [["P", 90, 0]]
    m.add("Q", prompt)
    assert step(m) == {
        "scheduled": [["P", 1, 0], ["Q", 10, 80]],
        "preempted": [],
        "finished": [],
        "copies": [[3, 10]],
    }
    s = m.snap
    assert s.pending_copies == () and s.retained_copies == () and s.new_block_ids == ()
    assert s.ref_cnt[3] == 1 and s.ref_cnt[10] == 1
    assert s.requests["Q"].tables == ((1, 2, 10), (0, 0, 0, 0, 8, 11))


def test_watermark_ignored_for_first_admission_into_idle_engine():
    m = sched(10, token_budget=64)
    m2 = Runner(config(10, full(4), watermark=0.5), "scheduler")  # 5 watermark blocks
    for runner in (m, m2):
        runner.add("a", list(range(24)))  # 6 blocks of 9
        runner.add("b", [1])
    assert step(m)["scheduled"] == [["a", 24, 0], ["b", 1, 0]]
    # a ignores the watermark (nothing running); b then needs 1 + 5 > 3 free.
    assert step(m2)["scheduled"] == [["a", 24, 0]]
    assert m2.snap.waiting == ("b",)


def test_priority_victim_scheduled_this_step_gives_its_budget_back():
    m = sched(10, policy="priority", token_budget=16)  # 9 usable blocks
    m.add("a", list(range(24)), priority=5)
    assert step(m)["scheduled"] == [["a", 16, 0]]
    m.add("b", list(range(100, 104)), priority=0)
    m.add("d", list(range(200, 240)), priority=1)
    assert step(m)["scheduled"] == [["a", 8, 0], ["b", 4, 0], ["d", 4, 0]]
    assert m.snap.num_free_blocks == 1
    # a takes the last block; b then needs one: victim a (scheduled: its 1 token returns to
    # the budget), b takes a's uncached block 9, d gets 15 = 16 - 1 tokens.
    assert step(m) == {
        "scheduled": [["b", 1, 0], ["d", 15, 0]],
        "preempted": ["a"],
        "finished": [],
        "copies": [],
    }
    assert m.snap.requests["b"].tables == ((7, 9),)
    assert m.snap.requests["d"].tables == ((8, 6, 5, 4, 3),)


def test_no_admission_in_a_step_that_preempted():
    m = sched(12, policy="priority", token_budget=64)  # 11 usable blocks
    m.add("a", [1, 2, 3, 4], priority=0)
    m.add("b", list(range(100, 136)), priority=5)
    assert step(m)["scheduled"] == [["a", 4, 0], ["b", 36, 0]]
    m.add("e", [7], priority=0)
    # a takes the last block; b preempts itself (priority: the loop continues, nothing left).
    assert step(m) == {
        "scheduled": [["a", 1, 0]],
        "preempted": ["b"],
        "finished": [],
        "copies": [],
    }
    assert m.snap.waiting == ("e", "b")  # sorted by (priority, arrival)
    assert step(m)["scheduled"] == [["a", 1, 0], ["e", 1, 0]]


def test_priority_self_preemption_continues_with_the_next_request():
    m = sched(5, full(8), policy="priority")  # 4 usable blocks of 8
    m.add("a", [1], priority=0)
    m.add("b", list(range(100, 115)), priority=5)
    assert step(m)["scheduled"] == [["a", 1, 0], ["b", 15, 0]]
    m.add("c", [2], priority=1)
    assert step(m)["scheduled"] == [["a", 1, 0], ["b", 1, 0], ["c", 1, 0]]
    assert m.snap.running == ("a", "b", "c") and m.snap.num_free_blocks == 0
    # b (the least important) needs a third block: it preempts itself; c is still served.
    assert step(m) == {
        "scheduled": [["a", 1, 0], ["c", 1, 0]],
        "preempted": ["b"],
        "finished": [],
        "copies": [],
    }


def test_a_sibling_stops_at_the_junction_and_its_state_there_is_kept():
    """qwen3_5_retention (full attention and three Mamba align groups of bs 8, hash blocks of
    2, retention 16), budget 32. `a`'s 40 tokens leave states at 32 and 38 only. `b` shares
    its first 28: full attention hits 24, the state groups nothing, so the lookup hits 0 with
    junction 24 (§6.3), which the driver keeps in `b`. Its first chunk stops there instead of
    at 32, and the state blocks ending at 24 keep their keys though 24 ends no segment (§11.3):
    `c`, sharing the same 28 tokens, hits 24."""
    m = Runner(BUILTIN["qwen3_5_retention"][1], "scheduler")
    m.add("a", list(range(40)), max_tokens=1)
    assert [step(m)["scheduled"] for _ in range(3)] == [[["a", 32, 0]], [["a", 6, 0]],
                                                        [["a", 2, 0]]]
    m.add("b", list(range(28)) + list(range(200, 212)), max_tokens=1)
    assert step(m)["scheduled"] == [["b", 24, 0]]
    view = m.snap.requests["b"]
    assert view.shared_prefix_boundary == 24
    assert all(m.snap.block_key_tokens[table[2]] == 24 for table in view.tables[1:])
    m.add("c", list(range(28)) + list(range(300, 312)), max_tokens=1)
    assert step(m)["scheduled"] == [["b", 8, 0], ["c", 8, 24]]


def test_the_model_floors_the_junction_to_blocks_from_the_chunk_start():
    """nemotron_h_checkpoint (bs 8, hash blocks of 4, checkpoint alignment 1): a 40-token
    prompt from token 4 exports its checkpoint mid-chunk and is left whole, unless its
    junction 30 lies inside: then it stops 24 tokens on, at 28 (§11.6)."""
    driver = Runner(BUILTIN["nemotron_h_checkpoint"][1], "scheduler").model.driver
    r = Request("r", list(range(40)), None, 0, 0.0, 1, False, 0, hbs=4, tokens=list(range(40)))
    assert driver.state_aligned(r, 36, 4) == 36
    r.shared_prefix_boundary = 30
    assert driver.state_aligned(r, 36, 4) == 24


@pytest.mark.parametrize("name, computed", [("connector", 4), ("gpt_oss_connector", 11)])
def test_the_fail_policy_fails_a_short_load_in_the_model_as_in_the_driver(name, computed):
    """`scheduler.kv_load_failure_policy = "fail"` (docs/spec.md §13.2): the model and kvfuzz's
    driver agree that a short load finishes its request FINISHED_ERROR, its blocks freed; its
    computed tokens stop at the first unfilled block on one group, else stay."""
    from kvfuzz.harness.executor import Execution

    base = BUILTIN[name][1]
    cfg = base.replace(scheduler=dataclasses.replace(base.scheduler,
                                                     kv_load_failure_policy="fail"))
    ex = Execution(cfg, "scheduler", ("kvcache",))
    ex.apply({"op": "add_request", "request_id": "s", "prompt": list(range(20, 31)),
              "max_tokens": 2})
    ex.apply({"op": "load_remote", "request_id": "s", "num_external_tokens": 11})
    assert ex.apply({"op": "finish_load", "request_id": "s", "num_loaded_tokens": 6}) == 0
    view = ex.state.requests["s"]
    assert view.status == "FINISHED_ERROR" and view.num_computed_tokens == computed
    assert not any(view.tables)
    ex.apply({"op": "step", "sample": 0})
