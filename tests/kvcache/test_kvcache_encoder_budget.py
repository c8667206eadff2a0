"""The encoder budget and encoder cache of multimodal inputs (docs/spec.md §7.2): kvfuzz's driver
(kvcache/encoder_cache.py) and the model (reference_model/encoder.py) in lockstep, and the config
fields that bound them.

Inputs `[identifier, offset, length]`; an input's output is `length` embeddings.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import ConfigError
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import Execution, run_trace


def _tenants(**scheduler: object):
    config = BUILTIN["tenants"][1]
    return config.replace(scheduler=dataclasses.replace(
        config.scheduler, **{"token_budget": 16, **scheduler}))


def _add(rid: str, prompt: list[int], **fields: object) -> dict[str, object]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, "max_tokens": 2, **fields}


def test_the_budget_cuts_a_chunk_before_the_input_it_cannot_take():
    """Budget 3, cache 4. Step 1: a's input 0 (2 embeddings) takes 2 of the budget; its input 1
    (3) does not fit the 1 left, so a's chunk stops at 6, where input 1 starts; b's input 1 at
    1 does not fit either: b gets 1 token. After the step a has computed past input 0, whose
    entry turns evictable. Step 2: a's input 1 needs 3 of the cache's 4 with 2 taken: the
    evictable entry goes; b's input 1 is then a hit and its chunk takes the 10 tokens left."""
    ex = Execution(_tenants(), "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(12)), mm_inputs=[[0, 2, 2], [1, 6, 3]]))
    ex.apply(_add("b", list(range(20, 32)), mm_inputs=[[1, 1, 3]]))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 6, 0], ["b", 1, 0]]
    cache = ex.targets[0].side.scheduler.encoder_cache
    assert list(cache.unreferenced) == ["mm-0"] and cache.free_slots == 2
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 6, 0], ["b", 10, 0]]
    # Both computed past input 1 in that step: its entry stays cached, evictable.
    assert set(cache.holders) == {"mm-1"} and list(cache.unreferenced) == ["mm-1"]


def test_a_referenced_entry_holds_the_cache_and_an_input_at_the_chunk_start_waits():
    """Cache 3, no budget, 8 tokens a step. a's first chunk computes its input 1 (3 embeddings,
    the whole cache), which a holds until it computes past it. Step 2: b's input 0 (2) does
    not fit beside it, and starts where b's chunk starts: nothing comes before it, b schedules
    nothing. After step 2 a has computed past its input: step 3 evicts it for b's."""
    ex = Execution(_tenants(encoder_budget=None, encoder_cache_size=3, token_budget=8),
                   "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(12)), mm_inputs=[[1, 6, 3]]))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 8, 0]]
    ex.apply(_add("b", list(range(50, 60)), mm_inputs=[[0, 0, 2]]))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 4, 0]]
    cache = ex.targets[0].side.scheduler.encoder_cache
    assert list(cache.unreferenced) == ["mm-1"] and cache.free_slots == 0
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 1, 0], ["b", 7, 0]]
    assert set(cache.holders) == {"mm-0"} and cache.free_slots == 1


def test_without_chunked_prefill_the_encoder_does_not_split_a_prompt():
    """Chunked prefill off: a prompt the budget would cut is passed over whole (its hits let go),
    and a request behind it is admitted."""
    ex = Execution(_tenants(encoder_budget=3, encoder_cache_size=None, chunked_prefill=False),
                   "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(12)), mm_inputs=[[0, 2, 2], [1, 6, 3]]))
    ex.apply(_add("b", list(range(30, 34))))
    assert ex.apply({"op": "step"})["scheduled"] == [["b", 4, 0]]
    assert not ex.targets[0].side.scheduler.encoder_cache.inputs


def test_unbounded_encoder_keeps_the_driver_as_it_was():
    """Neither bound set: no encoder bookkeeping, no cut."""
    ex = Execution(_tenants(encoder_budget=None, encoder_cache_size=None), "scheduler",
                   ("kvcache",))
    ex.apply(_add("a", list(range(12)), mm_inputs=[[0, 2, 2], [1, 6, 3]]))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 12, 0]]
    assert ex.targets[0].side.scheduler.encoder_cache is None


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3"])
def test_a_bad_encoder_bound_is_refused_naming_it(value):
    for name in ("encoder_budget", "encoder_cache_size"):
        with pytest.raises(ConfigError, match=f"scheduler.{name} must be an int in \\[1, "):
            _tenants(**{name: value})


BAD_FILE = """
num_blocks = 8
extra_keys = true
groups = [{kind = "full", block_size = 4}]
scheduler = {encoder_cache_size = 0}
"""


def test_a_bad_encoder_bound_in_a_config_file_exits_2(tmp_path, capsys):
    """Nothing runs, nothing is written; the message names the field and the value."""
    path = tmp_path / "encoder.toml"
    path.write_text(BAD_FILE)
    code = kvfuzz(["run", "--config-file", str(path), "--corpus", str(tmp_path / "corpus")])
    err = capsys.readouterr().err
    assert code == 2 and "scheduler.encoder_cache_size must be an int in [1, " in err
    assert "got 0" in err and not (tmp_path / "corpus").exists()


def test_the_plant_that_gives_each_request_the_whole_budget_is_caught():
    """bug:encoder-budget-per-request: b's input 1 gets the whole budget although a's inputs
    spent 2 of its 3 (the cache unbounded): the driver schedules b's chunk past 1, the model
    does not."""
    config = _tenants(encoder_cache_size=None)
    ops = [_add("a", list(range(12)), mm_inputs=[[0, 2, 2], [1, 6, 3]]),
           _add("b", list(range(20, 32)), mm_inputs=[[1, 1, 3]]), {"op": "step"}]
    trace = Trace(level="scheduler", config=config, ops=ops)
    assert run_trace(trace, ["kvcache"]).passed
    finding = run_trace(trace, ["bug:encoder-budget-per-request"]).finding
    assert finding is not None and finding.check == "DIFF-result"


ASYNC_OPS = [_add("r6", [2, 3, 0, 0], mm_inputs=[[1, 1, 3]]), {"op": "step"},
             _add("r7", [2, 3, 0, 1, 1, 2, 3, 3, 0], mm_inputs=[[0, 4, 2], [1, 6, 3]],
                  max_tokens=1), {"op": "step"}]
"""r6's input (3 embeddings, the whole cache) ends where its prompt does, so its first step
both computes past it and samples; r7's input 0 needs the room r6's entry holds."""


@pytest.mark.parametrize("async_scheduling, r7", [(False, 6), (True, 4)])
def test_under_async_scheduling_an_output_keeps_the_inputs_its_own_sample_covers(
        async_scheduling, r7):
    """Cache 3. Synchronous: step 1's output lets r6's entry go (4 computed, no placeholder),
    step 2 evicts it for r7's input 0 and stops r7 before its input 1 (6 tokens). Under
    `async_scheduling` the output's own sample is still a placeholder when the inputs are
    released (4 − 1 < 4): r6 keeps its entry until step 2's output, and r7 stops before its
    input 0 (4 tokens). kvfuzz's driver and the model agree on both."""
    ex = Execution(_tenants(encoder_budget=None, encoder_cache_size=3,
                            async_scheduling=async_scheduling), "scheduler", ("kvcache",))
    results = [ex.apply(op) for op in ASYNC_OPS]
    assert results[3]["scheduled"] == [["r6", 1, 0], ["r7", r7, 0]]
    cache = ex.targets[0].side.scheduler.encoder_cache
    assert list(cache.unreferenced) == (["mm-1"] if async_scheduling else ["mm-0"])


def test_under_async_scheduling_a_prefill_chunk_releases_what_it_computed_past():
    """A chunk that does not reach the prompt's end samples nothing: no placeholder holds its
    inputs back, under async scheduling too (a's input 0 ends at 4, its first chunk at 8)."""
    ex = Execution(_tenants(encoder_budget=None, encoder_cache_size=6, token_budget=8,
                            async_scheduling=True), "scheduler", ("kvcache",))
    ex.apply(_add("a", list(range(12)), mm_inputs=[[0, 2, 2], [1, 9, 3]]))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 8, 0]]
    assert list(ex.targets[0].side.scheduler.encoder_cache.unreferenced) == ["mm-0"]


def test_a_bad_async_scheduling_value_is_refused_naming_it():
    with pytest.raises(ConfigError, match="scheduler.async_scheduling must be true or false"):
        _tenants(async_scheduling=1)


def _cross(num_encoder: dict[str, int], cache_size: int | None = None) -> Execution:
    config = BUILTIN["cross"][1]
    if cache_size is not None:
        config = config.replace(scheduler=dataclasses.replace(
            config.scheduler, encoder_budget=24, encoder_cache_size=cache_size))
    ex = Execution(config, "scheduler", ("kvcache",))
    for i, (rid, tokens) in enumerate(num_encoder.items()):
        ex.apply(_add(rid, list(range(10 * i, 10 * i + 6)), num_encoder_tokens=tokens,
                      max_tokens=3))
    return ex


def test_an_encoder_decoder_input_takes_the_step_budget_when_its_request_starts():
    """`cross` (budget 12): a's encoder input (10) leaves 2, so b's (5) waits, passed over,
    and c's (2) is admitted behind it; next step b's input has the whole budget, and a and c,
    decoding, take none of it. kvfuzz's driver and the model agree."""
    ex = _cross({"a": 10, "b": 5, "c": 2})
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 6, 0], ["c", 6, 0]]
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 1, 0], ["c", 1, 0], ["b", 6, 0]]


def test_an_encoder_decoder_input_longer_than_the_budget_never_runs():
    """An input of 13 against a budget of 12 waits for good (vLLM sizes the budget at least to
    the model's largest input, so its generators draw none longer)."""
    ex = _cross({"a": 13, "b": 1})
    for _ in range(3):
        assert ["a", 6, 0] not in ex.apply({"op": "step"})["scheduled"]
    assert ex.state.requests["a"].status == "WAITING"


def test_an_encoder_decoder_input_holds_its_cache_room_until_its_first_output_once():
    """A cache of 12 under a budget of 24 (finding 030): a's input (8) and b's (5) do not fit
    together, so b waits one step; a's room comes back once, after its first output, not again
    after each later one: c's (9) and d's (9) do not fit together either. kvfuzz's driver and
    the model agree."""
    ex = _cross({"a": 8, "b": 5}, cache_size=12)
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 6, 0]]
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 1, 0], ["b", 6, 0]]
    for i, rid in enumerate(("c", "d"), start=2):
        ex.apply(_add(rid, list(range(10 * i, 10 * i + 6)), num_encoder_tokens=9, max_tokens=3))
    assert ex.apply({"op": "step"})["scheduled"] == [["a", 1, 0], ["b", 1, 0], ["c", 6, 0]]
