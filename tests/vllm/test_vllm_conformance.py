"""The installed vLLM (0.32–0.34 or a checkout) against kvcache and the reference model, through the one executor.

Three-way: every op runs on kvcache, on vLLM (target `vllm`) and on the model; each target's
result, probes and snapshot are compared with the model's and every registered invariant runs
on both (the docs/spec.md §9 worked examples are in test_worked_examples.py). Target `vllm`
tolerates only the named `KNOWN_DEVIATIONS` (each documented in docs/findings/);
`vllm-strict` tolerates nothing and replays the findings. API misuse, which vLLM does not
validate, is pinned case by case in `MISUSE`.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.fuzz.shrink import shrink_trace
from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import BUILTIN
from kvfuzz.harness.build import BUILD, ToleratedBuild
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.core.trace import Trace, normalize_op
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.vllm_api import VllmUnsupported, load_vllm
from kvfuzz.harness.vllm_target import (
    KNOWN_DEVIATIONS,
    OP_FEATURES,
    KnownDeviation,
    VllmSide,
    build_vllm_manager,
    vllm_available,
)
from kvfuzz.fuzz.machines import machine_for

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not vllm_available(),
        reason="no vLLM this adapter drives is importable here: run `bash ci/install-vllm.sh "
        "[VERSION]` and use the python it prints",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
FINDINGS = ROOT / "docs" / "findings"
THREE_WAY = ("kvcache", "vllm")


def _add(rid: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **fields}


PROMPT10 = list(range(100, 110))


def test_scheduler_level_drives_vllm_through_the_kvcache_driver():
    config = BUILTIN["full"][1].replace(num_blocks=10)
    ex = Execution(config, "scheduler", THREE_WAY)
    for i in range(4):
        ex.apply(_add(f"r{i}", PROMPT10 if i % 2 else list(range(12)), max_tokens=3))
    outcomes = [ex.apply({"op": "step"}) for _ in range(12)]
    assert any(out["preempted"] for out in outcomes)
    assert any(hit for out in outcomes for _, _, hit in out["scheduled"])
    assert any(out["finished"] for out in outcomes)


@pytest.mark.parametrize("name, vllm_groups", [("bert", 0), ("colqwen3_5", 3)])
def test_encoder_only_layers_form_no_vllm_group(name, vllm_groups):
    """vLLM builds no group for encoder-only layers (docs/spec.md §12.4); its tables are spread
    over the config's groups, the encoder-only one empty while the request runs."""
    ex = Execution(BUILTIN[name][1], "scheduler", THREE_WAY)
    vllm_side = ex.targets[1].side
    assert len(vllm_side.manager.coordinator.single_type_managers) == vllm_groups
    ex.apply(_add("r", list(range(12)), max_tokens=2))
    ex.apply({"op": "step", "sample": 1})
    tables = [t.snapshot.requests["r"].tables for t in ex.targets]
    assert tables[0] == tables[1] and tables[0][0] == ()
    assert len(tables[0]) == vllm_groups + 1


@pytest.mark.parametrize("name, retention", [("gemma3_retention", 6), ("gemma3_retention", -4),
                                             ("full", 8), ("qwen3_5_retention", 12)])
def test_vllm_refuses_retention_as_the_config_does(name, retention):
    """vLLM's own coordinator refuses the retention intervals the config loader refuses, with
    the same message (docs/spec.md §4.9.2)."""
    from kvfuzz.core.errors import ConfigError
    from kvfuzz.harness import vllm_target

    good = BUILTIN[name][1]
    with pytest.raises(ConfigError) as ours:
        Config.from_dict({**good.to_dict(), "prefix_cache_retention_interval": retention})
    unchecked = object.__new__(Config)  # past our validation, to reach vLLM's
    for field in dataclasses.fields(Config):
        object.__setattr__(unchecked, field.name, getattr(good, field.name))
    object.__setattr__(unchecked, "prefix_cache_retention_interval", retention)
    with pytest.raises(ValueError) as theirs:
        vllm_target.build_vllm_manager(unchecked)
    assert str(theirs.value) == str(ours.value)


# ----- the state machines over every built-in config and level, three-way -----

def _cannot_build(name: str) -> str | None:
    """Why the installed vLLM cannot build built-in config `name` (docs/findings/012), if so."""
    if not vllm_available():
        return None
    try:
        return get_target("vllm").cannot_build(BUILTIN[name][1])
    except VllmUnsupported as exc:  # an option this vLLM lacks: a usage error, skipped here
        return str(exc)


for _name in BUILTIN:
    _reason = _cannot_build(_name)
    for _level in ("api", "scheduler"):
        _machine = machine_for(
            _level,
            targets=THREE_WAY,
            allow_misuse=False,
            config_names=(_name,),
            name=f"Vllm{_level.title()}Machine_{_name}",
        )
        _case = _machine.TestCase
        if _reason is not None:
            _case = pytest.mark.skip(reason=f"this vLLM cannot build {_name}: {_reason}")(_case)
        globals()[f"Test{_machine.__name__}"] = _case


# ----- known deviations: tolerated by `vllm`, reproduced by `vllm-strict` -----

def _finding_traces() -> list[Path]:
    """The findings of vLLM's manager (those only vLLM's own Scheduler shows, recorded on a
    `vllm-scheduler` or `vllm-async-scheduler` target, are tests/vllm/test_vllm_scheduler.py's)."""
    return sorted(p for p in FINDINGS.glob("[0-9][0-9][0-9]-*.json")
                  if not Trace.load(p).meta.get("target", "").startswith(
                      ("vllm-scheduler", "vllm-async-scheduler")))


def test_every_finding_has_its_document_and_replay_command():
    traces = _finding_traces()
    assert traces
    for path in traces:
        doc = path.with_suffix(".md")
        assert doc.exists(), doc
        text = doc.read_text()
        assert f"kvfuzz replay docs/findings/{path.name}" in text, doc
        assert "docs/spec.md §" in text and ".py:" in text, f"{doc} names no spec section or vLLM line"


def _unsupported_features(trace: Trace) -> list[str]:
    """The optional ops and fields of `trace` that the installed vLLM lacks."""
    api = load_vllm()
    used = {op["op"] for op in trace.ops} | {k for op in trace.ops for k, v in op.items()
                                              if v not in (None, False)}
    return [name for name, feature in OP_FEATURES.items() if name in used and not api.has(feature)]


def _deviation_of(path: Path) -> KnownDeviation | None:
    doc = f"docs/findings/{path.with_suffix('.md').name}"
    return next((d for d in KNOWN_DEVIATIONS if d.finding == doc), None)


@pytest.mark.parametrize("path", _finding_traces(), ids=lambda p: p.stem)
def test_finding_replays_on_vllm_strict_and_passes_on_kvcache(path, monkeypatch):
    """A finding of a release range replays on those releases and passes on the others.

    Where another documented deviation of the installed release fails the trace first on
    `vllm-strict` (021 on 0.32 frees a table with nulls, which 007 miscounts), the finding's
    own deviation must be what fails it once every other one is tolerated.
    """
    trace = Trace.load(path)
    assert run_trace(trace, ["kvcache"]).passed
    deviation = _deviation_of(path)
    needs = _unsupported_features(trace)
    if needs:  # a finding of a newer release: a usage error here, never a finding
        with pytest.raises(VllmUnsupported, match="|".join(needs)):
            run_trace(trace, ["vllm-strict"])
        return
    if trace.meta["check"] == BUILD:  # vLLM cannot build this config: found before any op
        result = run_trace(trace, ["vllm-strict"])
        assert (result.finding.check, result.finding.step) == (BUILD, -1)
        assert result.finding.message.startswith(trace.meta["message"])
        with pytest.raises(ToleratedBuild, match=deviation.id):
            run_trace(trace, ["vllm"])
        return
    result = run_trace(trace, ["vllm-strict"])
    if deviation is not None and not deviation.applies(load_vllm()):
        assert result.passed, f"{path.name} fails outside vLLM {deviation.releases}"
        return
    assert result.finding is not None
    if result.finding.check != trace.meta["check"] and deviation is not None:
        first = result.finding.check
        others = tuple(d for d in KNOWN_DEVIATIONS if d is not deviation)
        monkeypatch.setattr(VllmSide, "known_deviations", others)
        without_own = run_trace(trace, ["vllm"])
        monkeypatch.setattr(VllmSide, "known_deviations", others + (deviation,))
        assert run_trace(trace, ["vllm"]).passed, f"{first} is no documented deviation"
        result = without_own
        assert result.finding is not None
    assert result.finding.check == trace.meta["check"]
    assert result.finding.step == len(trace.ops) - 1


@pytest.mark.parametrize("deviation", KNOWN_DEVIATIONS, ids=lambda d: d.name)
def test_known_deviation_is_tolerated_only_where_documented(deviation):
    doc = ROOT / deviation.finding
    assert doc.exists() and deviation.name in doc.read_text()
    trace = Trace.load(doc.with_suffix(".json"))
    if _unsupported_features(trace):
        pytest.skip(f"the trace of {deviation.name} needs a newer vLLM")
    if deviation.unbuildable is not None:  # the side is never built: the config is left out
        assert run_trace(trace, ["kvcache"]).passed
        with pytest.raises(ToleratedBuild, match=deviation.label):
            run_trace(trace, ["kvcache", "vllm"])
        return
    sides: list[VllmSide] = []

    def vllm(config: Config, level: str) -> VllmSide:
        sides.append(VllmSide(config, level))
        return sides[-1]

    assert run_trace(trace, ["kvcache", vllm]).passed
    if not deviation.applies(load_vllm()):
        assert deviation.name not in sides[0].tolerated
        return
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


# ----- API misuse: vLLM validates only a zero token count -----

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
    "2 negative num_external_computed_tokens": (
        _A + [{"op": "allocate_slots", "request_id": "a", "num_new_tokens": 1,
               "num_external_computed_tokens": -3}],
        "DIFF-result", {"block_ids": [[]]}, "015"),
    "2 external tokens for a running request": (
        _A + [{"op": "allocate_slots", "request_id": "a", "num_new_tokens": 4},
              {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 1,
               "num_external_computed_tokens": 4}],
        "DIFF-result", {"block_ids": [[2, 3]]}, "015"),
    "3 running request adopts a lookup": (
        _B_RUNNING_WITH_HIT + [{"op": "allocate_slots", "request_id": "b", "num_new_tokens": 1,
                                "use_lookup": True}],
        "DIFF-result", {"error": "AssertionError"}, "003"),
    "4 free of an untracked request (valid: a no-op everywhere)": (
        _A + [{"op": "free", "request_id": "a"}], None, None, "004"),
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


EVICT_FIRST = [
    _add("a", list(range(1, 18))),
    {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 17},
    _add("b", [7] * 9),
    {"op": "allocate_slots", "request_id": "b", "num_new_tokens": 9},
    {"op": "free", "request_id": "b"},
    {"op": "free_deferred", "request_id": "a"},
    {"op": "release_deferred", "evict_first": True},
    _add("c", list(range(1, 18))),
    {"op": "get_computed_blocks", "request_id": "c"},
    {"op": "allocate_slots", "request_id": "c", "num_new_tokens": 1, "use_lookup": True},
    _add("d", [9] * 30),
    {"op": "allocate_slots", "request_id": "d", "num_new_tokens": 30},
]


def test_evict_first_is_driven_where_vllm_has_it(tmp_path, capsys):
    """vLLM 0.34's `free_blocks(evict_first=True)`, three-way (F1 and I7 on each side); on a
    vLLM without it the trace is a usage error naming the argument and the target."""
    trace = Trace(BUILTIN["deferred"][1], "api", [])
    path = tmp_path / "evict-first.json"
    execution = Execution(trace.config, "api", ["kvcache"])
    for op in EVICT_FIRST:
        execution.apply(op)
    execution.trace.save(path)
    if load_vllm().has("free_evict_first"):
        assert run_trace(Trace.load(path), list(THREE_WAY)).passed
        assert kvfuzz(["replay", str(path), "--target", "vllm-strict", "--quiet"]) == 0
        return
    assert kvfuzz(["replay", str(path), "--target", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "evict_first" in err and "target vllm" in err, err


def test_frontend_block_hashes_are_the_ones_the_request_computes():
    """vLLM 0.34's `Request(block_hashes=)`: prompt hashes a frontend computed with the engine's
    hasher are the list the request computes itself, and hashing continues after them; the
    manager reads only `request.block_hashes`, so it cannot tell (docs/vllm.md, per release)."""
    api = load_vllm()
    if not api.has("frontend_hashes"):
        pytest.skip(f"vLLM {api.version} has no Request(block_hashes=)")
    side = VllmSide(BUILTIN["full"][1], "api")
    prompt = list(range(1, 40))
    plain = side.make_request(normalize_op(_add("a", prompt), "api"), 0.0)
    assert len(plain.block_hashes) >= 3

    def given(hashes: list[Any]) -> Any:
        return api["Request"]("b", prompt, api["SamplingParams"](max_tokens=8), None,
                              arrival_time=0.0, block_hasher=side._hasher, block_hashes=hashes)

    for n in (0, 1, len(plain.block_hashes)):
        request = given(list(plain.block_hashes[:n]))
        assert request.block_hashes == plain.block_hashes, n
        for r in (plain, request):
            r.append_output_token_ids([5] * 8)
        assert request.block_hashes == plain.block_hashes, n
        plain = side.make_request(normalize_op(_add("a", prompt), "api"), 0.0)


# ----- the KV connector ops on a vLLM without them -----

@pytest.mark.parametrize("op", [
    {"op": "load_remote", "request_id": "a", "num_external_tokens": 4},
    {"op": "finish_load", "request_id": "a"},
], ids=lambda op: op["op"])
def test_a_connector_op_on_a_vllm_without_it_exits_2_naming_op_and_target(
        monkeypatch, tmp_path, capsys, op):
    import dataclasses

    import kvfuzz.harness.vllm_api as vllm_api

    api = load_vllm()
    monkeypatch.setattr(vllm_api, "_API", dataclasses.replace(
        api, features=api.features - {"kv_connector"}))
    path = tmp_path / "t.json"
    Trace(BUILTIN["connector"][1], "scheduler", [_add("a", PROMPT10), op]).save(path)
    assert kvfuzz(["replay", str(path), "--target", "vllm"]) == 2
    err = capsys.readouterr().err
    assert f"the trace uses {op['op']}" in err
    assert f"target vllm (vLLM {api.version}) lacks it" in err


# ----- steps in flight (docs/spec.md §7.1) -----

IN_FLIGHT = [
    _add("a", list(range(1, 18)), max_tokens=2), _add("b", list(range(1, 10)), max_tokens=1),
    {"op": "step", "in_flight": True}, {"op": "abort", "request_id": "a"},
    {"op": "step", "in_flight": True}, {"op": "complete_step"}, {"op": "step"},
]


def test_steps_in_flight_three_way():
    """vLLM's pop_blocks_for_free and free_blocks, driven by the kvcache driver, agree with
    kvcache and the model while frees wait for steps in flight."""
    ex = Execution(BUILTIN["deferred"][1], "scheduler", THREE_WAY)
    for op in IN_FLIGHT[:4]:
        ex.apply(op)
    assert ex.state.in_flight and ex.state.deferred_frees
    for op in IN_FLIGHT[4:]:
        ex.apply(op)
    assert not ex.state.in_flight and not ex.state.deferred_frees


@pytest.mark.parametrize("name", ["PROMOTED", "MOVED"])
def test_in_flight_promotion_and_state_key_move_three_way(name):
    """A partial entry promoted, and a Mamba state block's keys moved to its copy, under a step
    in flight: vLLM does both as kvcache and the model do, and IF1 holds (generated-config
    campaign, seed 2; tests/properties/test_inflight.py)."""
    from tests.properties import test_inflight

    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                             "config": getattr(test_inflight, name),
                             "ops": getattr(test_inflight, f"{name}_OPS")})
    result = run_trace(trace, THREE_WAY)
    assert result.passed, result.finding


def test_steps_in_flight_on_a_vllm_without_deferred_frees_exit_2(monkeypatch, tmp_path, capsys):
    import kvfuzz.harness.vllm_api as vllm_api

    api = load_vllm()
    monkeypatch.setattr(vllm_api, "_API", dataclasses.replace(
        api, features=api.features - {"deferred_free"}))
    path = tmp_path / "t.json"
    Trace(BUILTIN["deferred"][1], "scheduler", [_add("a", PROMPT10),
                                                {"op": "step", "in_flight": True}]).save(path)
    assert kvfuzz(["replay", str(path), "--target", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "the trace uses in_flight" in err and "target vllm" in err


# ----- retention of Mamba "align" state checkpoints on a vLLM without it -----

@pytest.mark.parametrize("feature, option", [
    ("state_retention", "prefix_cache_retention_interval with a Mamba 'align' group"),
    ("retention", "prefix_cache_retention_interval"),
])
def test_state_retention_on_a_vllm_without_it_exits_2_naming_option_and_target(
        monkeypatch, tmp_path, capsys, feature, option):
    import kvfuzz.harness.vllm_api as vllm_api

    api = load_vllm()
    monkeypatch.setattr(vllm_api, "_API", dataclasses.replace(
        api, features=api.features - {feature}))
    path = tmp_path / "t.json"
    Trace(BUILTIN["qwen3_5_retention"][1], "api", [_add("a", PROMPT10)]).save(path)
    assert kvfuzz(["replay", str(path), "--target", "vllm"]) == 2
    err = capsys.readouterr().err
    assert f"the config sets {option}," in err
    assert f"target vllm (vLLM {api.version}) lacks it" in err


# ----- MTP / draft lookahead on a vLLM without it -----

@pytest.mark.parametrize("feature, option, name", [
    ("hash_lookahead", "num_hash_lookahead_tokens", "deepseek_v3_mtp"),
    ("prefill_lookahead", "num_prefill_lookahead", "deepseek_v3_mtp3"),
])
def test_lookahead_on_a_vllm_without_it_exits_2_or_is_left_out(
        monkeypatch, tmp_path, capsys, feature, option, name):
    import kvfuzz.harness.vllm_api as vllm_api

    api = load_vllm()
    if feature == "prefill_lookahead" and "hash_lookahead" not in api.features:
        pytest.skip(f"vLLM {api.version} lacks the hash lookahead too, which {name} sets")
    monkeypatch.setattr(vllm_api, "_API", dataclasses.replace(
        api, features=api.features - {feature}))
    path = tmp_path / "t.json"
    Trace(BUILTIN[name][1], "api", [_add("a", PROMPT10)]).save(path)
    assert kvfuzz(["replay", str(path), "--target", "vllm"]) == 2
    err = capsys.readouterr().err
    assert f"the config sets {option}," in err
    assert f"target vllm (vLLM {api.version}) lacks it" in err
    # Left out where not named (fuzz/buildable.py), the probe's answer is what decides it.
    from kvfuzz.fuzz.buildable import probe_configs
    from kvfuzz.harness.targets import get_target

    kept = probe_configs(lambda config: get_target("vllm").build(config, "api"),
                         (name, "full"), lambda n: BUILTIN[n][1], set())
    assert kept.kept == ("full",) and option in kept.left_out[name]


# ----- Mamba prefill checkpoint settings (read by vLLM only in "align" mode) -----

_CHECKPOINTED = Config(8, (GroupConfig("full", 4),
                           GroupConfig("mamba", 4, num_prefill_checkpoint_blocks=1,
                                       prefill_checkpoint_alignment=1)),
                       name="checkpointed_none", max_model_len=64, enable_caching=False)


def test_prefill_checkpoint_settings_reach_vllms_mamba_spec():
    spec = build_vllm_manager(_CHECKPOINTED).coordinator.single_type_managers[1].kv_cache_spec
    assert (spec.num_prefill_checkpoint_blocks, spec.prefill_checkpoint_alignment) == (1, 1)


def test_prefill_checkpoints_on_a_vllm_without_them_exit_2_naming_option_and_target(
        monkeypatch, tmp_path, capsys):
    import kvfuzz.harness.vllm_api as vllm_api

    api = load_vllm()
    monkeypatch.setattr(vllm_api, "_API", dataclasses.replace(
        api, features=api.features - {"prefill_checkpoints"}))
    path = tmp_path / "t.json"
    Trace(_CHECKPOINTED, "api", [_add("a", PROMPT10)]).save(path)
    assert kvfuzz(["replay", str(path), "--target", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "the config sets num_prefill_checkpoint_blocks," in err
    assert f"target vllm (vLLM {api.version}) lacks it" in err
