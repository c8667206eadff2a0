"""vLLM 0.33.0 against kvcache and the reference model, through the one executor.

Three-way: every op runs on kvcache, on vLLM (target `vllm`) and on the model; each target's
result, probes and snapshot are compared with the model's and every registered invariant runs
on both. Target `vllm` tolerates only the named `KNOWN_DEVIATIONS` (each documented in
docs/findings/); `vllm-strict` tolerates nothing and replays the findings. API misuse, which
vLLM does not validate, is pinned case by case in `MISUSE`.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fuzz.cli import main as kvfuzz
from fuzz.shrink import shrink_trace
from harness.config import Config, GroupConfig
from harness.configs import BUILTIN
from harness.executor import Execution, run_trace
from harness.trace import Trace
from harness.vllm_target import KNOWN_DEVIATIONS, VllmSide, vllm_available
from properties.machines import machine_for

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not vllm_available(),
        reason="vLLM 0.33.0 is not importable here: run `bash ci/install-vllm.sh` and use the "
        "python it prints",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
FINDINGS = ROOT / "docs" / "findings"
THREE_WAY = ("kvcache", "vllm")


def _full(bs: int) -> GroupConfig:
    return GroupConfig("full", bs)


def _swa(bs: int, window: int) -> GroupConfig:
    return GroupConfig("sliding_window", bs, sliding_window=window)


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


def _lookup(ex: Execution, rid: str) -> dict[str, Any]:
    return ex.apply({"op": "get_computed_blocks", "request_id": rid})


def _alloc(ex: Execution, rid: str, n: int, **fields: Any) -> Any:
    return ex.apply({"op": "allocate_slots", "request_id": rid, "num_new_tokens": n, **fields})


def _admit(ex: Execution, rid: str, n: int | None = None, **fields: Any) -> Any:
    """Lookup, then allocate the rest of the prompt (or n tokens) with the hit."""
    hit = _lookup(ex, rid)["num_computed_tokens"]
    tokens = ex.state.requests[rid].num_tokens - hit if n is None else n
    return _alloc(ex, rid, tokens, use_lookup=True, **fields)


def _table(ex: Execution, rid: str, group: int = 0) -> tuple[int, ...] | None:
    return ex.state.requests[rid].tables[group]


# ----- SPEC.md §9 worked examples E1-E9, three-way -----

PROMPT10 = list(range(100, 110))


def test_e1_e2_sharing_release_order_and_evictable_hits():
    ex = Execution(Config(10, (_full(4),)), "api", THREE_WAY)
    for rid in ("a", "b", "c", "d"):
        ex.apply(_add(rid, PROMPT10 if rid != "d" else list(range(28))))
    assert _admit(ex, "a") == {"block_ids": [[1, 2, 3]]}
    assert _lookup(ex, "b") == {"block_ids": [[1, 2]], "num_computed_tokens": 8}
    assert _alloc(ex, "b", 2, use_lookup=True) == {"block_ids": [[4]]}
    ex.apply({"op": "free", "request_id": "a"})
    ex.apply({"op": "free", "request_id": "b"})
    assert ex.state.free_queue == (4, 3, 5, 6, 7, 8, 9, 2, 1)
    # E2: the only free blocks are c's hit blocks; adopting them costs capacity.
    assert _admit(ex, "d") == {"block_ids": [[4, 3, 5, 6, 7, 8, 9]]}
    assert _admit(ex, "c") is None
    assert ex.state.free_queue == (2, 1)
    ex.apply({"op": "free", "request_id": "d"})
    assert _admit(ex, "c") == {"block_ids": [[9]]}
    assert _table(ex, "c") == (1, 2, 9)


def test_e3_sliding_window_hit():
    ex = Execution(Config(16, (_swa(4, 8),), max_model_len=64), "api", THREE_WAY)
    ex.apply(_add("a", list(range(16))))
    ex.apply(_add("b", list(range(16))))
    _admit(ex, "a")
    a_table = _table(ex, "a")
    hit = _lookup(ex, "b")
    assert hit == {"block_ids": [[0, a_table[1], a_table[2]]], "num_computed_tokens": 12}
    _alloc(ex, "b", 4, use_lookup=True)
    assert _table(ex, "b")[:3] == (0, a_table[1], a_table[2])


def test_e4_chunked_local_null_prefix_hit():
    ex = Execution(Config(12, (GroupConfig("chunked_local", 4, attention_chunk_size=8),)),
                   "api", THREE_WAY)
    ex.apply(_add("a", list(range(17))))
    assert _lookup(ex, "a") == {"block_ids": [[0, 0, 0, 0]], "num_computed_tokens": 16}
    _alloc(ex, "a", 1, use_lookup=True)
    assert len(_table(ex, "a")) == 5


def test_e5_watermark_applies_to_admission_only():
    ex = Execution(Config(100, (_full(4),), max_model_len=512, watermark=0.05), "api", THREE_WAY)
    ex.apply(_add("filler", list(range(364))))
    ex.apply(_add("r", list(range(1000, 1016))))
    ex.apply(_add("w", list(range(2000, 2012))))
    _alloc(ex, "filler", 364)
    _alloc(ex, "r", 4)
    assert ex.state.num_free_blocks == 7
    assert _alloc(ex, "w", 12, has_scheduled_reqs=True) is None  # 3 + 5 > 7
    assert _alloc(ex, "r", 12) is not None  # running: 3 <= 7
    assert _alloc(ex, "w", 12, has_scheduled_reqs=False) is not None


def test_e6_hybrid_fixed_point():
    ex = Execution(Config(64, (_full(32), _swa(16, 16)), max_model_len=256), "api", THREE_WAY)
    prompt = list(range(112))
    ex.apply(_add("a", prompt))
    ex.apply(_add("b", prompt))
    _admit(ex, "a")
    assert _lookup(ex, "b")["num_computed_tokens"] == 96
    ex.apply({"op": "evict_blocks", "block_ids": [_table(ex, "a", 1)[5]]})
    hit = _lookup(ex, "b")
    assert hit["num_computed_tokens"] == 64
    assert [len(ids) for ids in hit["block_ids"]] == [2, 4]


def test_e7_e8_salt_isolation_and_reset_refusal():
    ex = Execution(Config(16, (_full(4),)), "api", THREE_WAY)
    ex.apply(_add("a", PROMPT10, cache_salt="a"))
    ex.apply(_add("b", PROMPT10, cache_salt="b"))
    _admit(ex, "a")
    assert _lookup(ex, "b")["num_computed_tokens"] == 0
    assert ex.apply({"op": "reset_prefix_cache"}) is False
    ex.apply({"op": "free", "request_id": "a"})
    assert ex.apply({"op": "reset_prefix_cache"}) is True
    ex.apply(_add("c", PROMPT10, cache_salt="a"))
    assert _lookup(ex, "c")["num_computed_tokens"] == 0


def test_e9_partial_hit_and_copy_on_write():
    config = Config(200, (_full(32), _swa(16, 16)), max_model_len=256, partial_hits=True)
    ex = Execution(config, "api", THREE_WAY)
    prompt = list(range(90))
    ex.apply(_add("p", prompt))
    ex.apply(_add("q", prompt))
    assert _admit(ex, "p") == {"block_ids": [[1, 2, 3], [4, 5, 6, 7, 8, 9]]}
    assert _lookup(ex, "q") == {"block_ids": [[1, 2, 3], [0, 0, 0, 0, 8]],
                                "num_computed_tokens": 80}
    assert _alloc(ex, "q", 10, use_lookup=True) == {"block_ids": [[10], [11]]}
    assert ex.state.requests["q"].tables == ((1, 2, 10), (0, 0, 0, 0, 8, 11))
    assert ex.state.pending_copies == ((3, 10),)
    assert ex.apply({"op": "take_kv_cache_block_copies"}) == [[3, 10]]
    assert ex.apply({"op": "take_new_block_ids"}) == [10]
    assert ex.state.ref_cnt[3] == 2 and ex.state.ref_cnt[10] == 2
    ex.apply({"op": "release_copies"})
    assert ex.state.ref_cnt[3] == 1 and ex.state.ref_cnt[10] == 1


def test_scheduler_level_drives_vllm_through_the_kvcache_driver():
    config = BUILTIN["full"][1].replace(num_blocks=10)
    ex = Execution(config, "scheduler", THREE_WAY)
    for i in range(4):
        ex.apply(_add(f"r{i}", PROMPT10 if i % 2 else list(range(12)), max_tokens=3))
    outcomes = [ex.apply({"op": "step"}) for _ in range(12)]
    assert any(out["preempted"] for out in outcomes)
    assert any(hit for out in outcomes for _, _, hit in out["scheduled"])
    assert any(out["finished"] for out in outcomes)


# ----- the state machines over every built-in config and level, three-way -----

for _name in BUILTIN:
    for _level in ("api", "scheduler"):
        _machine = machine_for(
            _level,
            targets=THREE_WAY,
            allow_misuse=False,
            config_names=(_name,),
            name=f"Vllm{_level.title()}Machine_{_name}",
        )
        globals()[f"Test{_machine.__name__}"] = _machine.TestCase


# ----- known deviations: tolerated by `vllm`, reproduced by `vllm-strict` -----

def _finding_traces() -> list[Path]:
    return sorted(FINDINGS.glob("[0-9][0-9][0-9]-*.json"))


def test_every_finding_has_its_document_and_replay_command():
    traces = _finding_traces()
    assert traces
    for path in traces:
        doc = path.with_suffix(".md")
        assert doc.exists(), doc
        text = doc.read_text()
        assert f"kvfuzz replay docs/findings/{path.name}" in text, doc
        assert "SPEC" in text and ".py:" in text, f"{doc} names no SPEC section or vLLM line"


@pytest.mark.parametrize("path", _finding_traces(), ids=lambda p: p.stem)
def test_finding_replays_on_vllm_strict_and_passes_on_kvcache(path):
    trace = Trace.load(path)
    assert run_trace(trace, ["kvcache"]).passed
    result = run_trace(trace, ["vllm-strict"])
    assert result.finding is not None and result.finding.check == trace.meta["check"]
    assert result.finding.step == len(trace.ops) - 1


@pytest.mark.parametrize("deviation", KNOWN_DEVIATIONS, ids=lambda d: d.name)
def test_known_deviation_is_tolerated_only_where_documented(deviation):
    doc = ROOT / deviation.finding
    assert doc.exists() and deviation.name in doc.read_text()
    trace = Trace.load(doc.with_suffix(".json"))
    sides: list[VllmSide] = []

    def vllm(config: Config, level: str) -> VllmSide:
        sides.append(VllmSide(config, level))
        return sides[-1]

    assert run_trace(trace, ["kvcache", vllm]).passed
    assert sides[0].tolerated[deviation.name], "the finding trace no longer shows the deviation"


def test_empty_window_entry_of_a_running_request_is_not_tolerated():
    """The tolerance covers requests that are not running; a running one keeps its entry."""
    trace = Trace.load(FINDINGS / "001-empty-window-entry.json")
    ex = Execution(trace.config, trace.level, ["vllm"])
    for op in trace.ops:
        ex.apply(op)
    side = ex.targets[0].side
    snapshot = side.snapshot()
    request = side.requests["b"]
    request.status = side.request_status.RUNNING
    running = side.snapshot()
    assert snapshot.requests["b"].tables == (None,)
    assert running.requests["b"].tables == ((),)


# ----- API misuse: vLLM 0.33.0 validates only a zero token count -----

_A = [_add("a", PROMPT10)]
_A_RUNNING = _A + [{"op": "allocate_slots", "request_id": "a", "num_new_tokens": 10}]
_B_RUNNING_WITH_HIT = _A_RUNNING + [
    _add("b", PROMPT10),
    {"op": "allocate_slots", "request_id": "b", "num_new_tokens": 1},
    {"op": "append_tokens", "request_id": "b", "tokens": [1] * 8},
    {"op": "get_computed_blocks", "request_id": "b"},
]

MISUSE: dict[str, tuple[list[dict[str, Any]], str | None, Any, str]] = {
    # name: (ops, the misuse op last), check that fails on vLLM (None: vLLM agrees),
    # vLLM's result for a DIFF-result, finding.
    "1 num_new_tokens 0 with nothing to adopt": (
        _A + [{"op": "allocate_slots", "request_id": "a", "num_new_tokens": 0}],
        None, None, ""),
    "2 negative num_new_tokens (waiting)": (
        _A + [{"op": "allocate_slots", "request_id": "a", "num_new_tokens": -1}],
        "DIFF-result", {"block_ids": [[]]}, "002"),
    "2 negative num_new_tokens (running)": (
        _A_RUNNING + [{"op": "allocate_slots", "request_id": "a", "num_new_tokens": -1}],
        "DIFF-result", {"block_ids": [[]]}, "002"),
    "2 negative num_lookahead_tokens": (
        _A + [{"op": "allocate_slots", "request_id": "a", "num_new_tokens": 1,
               "num_lookahead_tokens": -5}],
        "I17", None, "002"),
    "2 negative reserved_blocks": (
        _A + [{"op": "allocate_slots", "request_id": "a", "num_new_tokens": 1,
               "reserved_blocks": -1}],
        "DIFF-result", {"block_ids": [[1]]}, "002"),
    "2 negative num_encoder_tokens": (
        _A + [{"op": "allocate_slots", "request_id": "a", "num_new_tokens": 1,
               "num_encoder_tokens": -1}],
        "DIFF-result", {"block_ids": [[1]]}, "002"),
    "3 running request adopts a lookup": (
        _B_RUNNING_WITH_HIT + [{"op": "allocate_slots", "request_id": "b", "num_new_tokens": 1,
                                "use_lookup": True}],
        "DIFF-result", {"error": "AssertionError"}, "003"),
    "4 free of an untracked request": (
        _A + [{"op": "free", "request_id": "a"}], "DIFF-result", None, "004"),
    "5 cache_blocks of an untracked request": (
        _A + [{"op": "cache_blocks", "request_id": "a", "num_computed_tokens": 8}],
        "I15", None, "005"),
    "5 cache_blocks with n < 0": (
        _A_RUNNING + [{"op": "cache_blocks", "request_id": "a", "num_computed_tokens": -1}],
        "DIFF-result", None, "005"),
    "5 cache_blocks beyond the table": (
        _A_RUNNING + [{"op": "append_tokens", "request_id": "a", "tokens": list(range(10))},
                      {"op": "cache_blocks", "request_id": "a", "num_computed_tokens": 16}],
        "I15", None, "005"),
    "6 evict_blocks with a negative id": (
        _A_RUNNING + [{"op": "evict_blocks", "block_ids": [-15]}], "DIFF-result", None, "006"),
    "6 evict_blocks with an id >= N": (
        _A_RUNNING + [{"op": "evict_blocks", "block_ids": [16]}],
        "DIFF-result", {"error": "AssertionError"}, "006"),
}


@pytest.mark.parametrize("name", MISUSE)
def test_misuse_difference_is_as_documented(name):
    ops, check, vllm_result, finding = MISUSE[name]
    trace = Trace(BUILTIN["full"][1], "api", ops)
    assert run_trace(trace, ["kvcache"]).passed
    result = run_trace(trace, ["vllm"])
    if check is None:
        assert result.passed
        return
    assert result.finding is not None
    assert (result.finding.check, result.finding.step) == (check, len(ops) - 1)
    if check == "DIFF-result":
        assert result.finding.message.startswith(f"vllm returned {vllm_result!r}")
    doc = next(FINDINGS.glob(f"{finding}-*.md"))
    assert name[2:] in doc.read_text(), f"{doc.name} does not list the case {name[2:]!r}"


# ----- a bug planted in vLLM is caught by the invariants, model off -----

def _predictor_plus_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    original = SingleTypeKVCacheManager.get_num_blocks_to_allocate
    monkeypatch.setattr(SingleTypeKVCacheManager, "get_num_blocks_to_allocate",
                        lambda self, *a, **k: original(self, *a, **k) + 1)


def _free_forgets_last(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.block_pool import BlockPool

    original = BlockPool.free_blocks
    monkeypatch.setattr(BlockPool, "free_blocks",
                        lambda self, blocks: original(self, list(blocks)[:-1]))


@pytest.mark.parametrize("plant, check", [(_predictor_plus_one, "P1"), (_free_forgets_last, "P2")],
                         ids=["predictor-plus-one", "free-forgets-last"])
def test_bug_planted_in_vllm_is_caught(monkeypatch, plant, check):
    plant(monkeypatch)
    trace = Trace(BUILTIN["full"][1], "api", _A_RUNNING + [{"op": "free", "request_id": "a"}])
    result = run_trace(trace, ["vllm"], model=False)
    assert result.finding is not None and result.finding.check == check
    shrunk = shrink_trace(trace, ["vllm"], model=False, seconds=10)
    assert shrunk.finding.check == check
    assert run_trace(shrunk.trace, ["vllm"], model=False).finding.check == check


# ----- the command line with --target vllm -----

def test_cli_run_replay_and_shrink_with_vllm(tmp_path):
    corpus = tmp_path / "corpus"
    assert kvfuzz(["run", "--target", "vllm", "--examples", "20", "--config", "full",
                   "hybrid", "--corpus", str(corpus)]) == 0
    finding = FINDINGS / "001-empty-window-entry.json"
    assert kvfuzz(["replay", str(finding), "--target", "vllm", "--quiet"]) == 0
    assert kvfuzz(["replay", str(finding), "--target", "vllm-strict", "--quiet"]) == 1
    out = tmp_path / "min.json"
    assert kvfuzz(["shrink", str(finding), "--target", "vllm-strict", "--out", str(out),
                   "--seconds", "10"]) == 0
    assert run_trace(Trace.load(out), ["vllm-strict"]).finding.check == "I16"
