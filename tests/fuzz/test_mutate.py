"""`kvfuzz mutate`: a killed and an equivalent (surviving) mutant of kvcache, the source restored
byte for byte, and the usage errors."""

import hashlib
import importlib.util
import json

import pytest

from kvfuzz.fuzz import mutate
from kvfuzz.fuzz.cli import main

pytest.importorskip("cosmic_ray", reason="kvfuzz mutate needs kvfuzz[mutate]")


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_killed_and_a_surviving_mutant_and_the_source_restored():
    (path,) = mutate.resolve("kvcache", ["block_pool.py"])
    before = _digest(path)
    found = mutate.mutants([path])
    lines = path.read_text().splitlines()
    first = 1 + lines.index("        first = (num_cached_blocks + 1) * scale - 1")
    # `(num_cached_blocks - 1) * scale - 1` files a registration's blocks under wrong keys.
    killed = next(m for m in found if m.line == first
                  and m.operator == "core/ReplaceBinaryOperator_Add_Sub")
    # `type(hashes) == BlockHashListWithBlockSize` is `type(hashes) is ...` (a type compares
    # by identity; in a lookup): an equivalent mutant.
    lookup = 1 + lines.index("        if type(block_hashes) is BlockHashListWithBlockSize:")
    equivalent = next(m for m in found if m.line == lookup
                      and m.operator == "core/ReplaceComparisonOperator_Is_Eq")
    (factory,) = mutate.resolve("kvcache", ["kv_cache_coordinator.py"])
    gate = 1 + factory.read_text().splitlines().index("    if enable_partial_hash_hits and (")
    # `if not enable_partial_hash_hits and (...)`: no single-group manager can be built.
    raises = next(m for m in mutate.mutants([factory])
                  if m.line == gate and m.operator == "core/AddNot")
    seen = []
    # One config: 60 examples over every built-in pair would be one minimal example each.
    report = mutate.run(mutate.Report("kvcache", 60, 0, len(found), configs=("full",)),
                        [killed, equivalent, raises], timeout=240,
                        on_result=lambda i, n, r: seen.append(_digest(path)))
    assert _digest(path) == before
    assert seen == [before] * 3  # restored after each mutant, not only at the end
    assert not path.with_name(path.name + mutate.BACKUP).exists()
    first, second, third = report.results
    assert first.outcome == mutate.KILLED and first.check, first
    assert second.outcome == mutate.SURVIVED and "== BlockHashListWithBlockSize" in second.diff, second
    assert third.outcome == mutate.KILLED and third.check == mutate.ERROR, third
    assert "ValueError" in third.detail
    # A check of results or state saw the wrong keys; the unbuildable manager only raised.
    assert first.semantic_check and not first.by_exception_alone, first
    assert third.semantic_check is None and third.by_exception_alone
    assert report.score() == 2 / 3
    data = report.as_json()
    assert data["by_file"][str(path)]["killed"] == 1
    assert data["by_check"] == {first.check: 1, mutate.ERROR: 1}
    assert data["by_exception_alone"] == 1


def test_the_baseline_passes_and_only_statements_it_ran_outside_annotations_are_eligible():
    (path,) = mutate.resolve("kvcache", ["kv_cache_manager.py"])
    found = mutate.mutants([path])
    check, lines = mutate.baseline("kvcache", 10, 0, [path], timeout=240)
    assert check is None and lines[str(path)]
    kept = mutate.eligible(found, lines)
    assert 0 < len(kept) < len(found)
    assert mutate.eligible(found, {str(path): set()}) == []  # nothing ran: nothing to mutate
    signature = 1 + path.read_text().splitlines().index(
        "        self, request: Request, max_cache_hit_length: int | None = None")
    in_annotation = [m for m in found if m.line == signature]
    assert in_annotation and not set(in_annotation) & set(
        mutate.eligible(found, {str(path): set(range(1, 10_000))}))


def test_a_file_left_mutated_by_a_killed_run_is_restored_from_its_backup():
    (path,) = mutate.resolve("kvcache", ["block_pool.py"])
    original = path.read_bytes()
    backup = path.with_name(path.name + mutate.BACKUP)
    backup.write_bytes(original)
    try:
        path.write_bytes(original + b"\n# left by a run killed with SIGKILL\n")
        with mutate.guarded([path]):
            assert path.read_bytes() == original
    finally:
        path.write_bytes(original)
        backup.unlink(missing_ok=True)
    assert not backup.exists()


@pytest.mark.parametrize("argv, needle", [
    (["--paths", "no_such_file.py"], "no_such_file.py"),
    (["--paths", "block_pool.py", "--examples", "0"], "--examples"),
    (["--paths", "block_pool.py", "--config", "no_such_config"], "no_such_config"),
    (["--target", "vllm", "--paths", "block_pool.py"], None),
])
def test_usage_errors_exit_two(capsys, argv, needle):
    if needle is None and importlib.util.find_spec("vllm") is None:
        needle = "vllm"
    elif needle is None:
        pytest.skip("vLLM installed: its block_pool.py is a real path")
    assert main(["mutate", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_without_cosmic_ray_exit_two_with_the_install_line(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cosmic_ray" else real(name, *a))
    assert main(["mutate", "--paths", "block_pool.py"]) == 2
    assert "pip install 'kvfuzz[mutate]'" in capsys.readouterr().err


def test_slices_are_disjoint_and_together_the_sample():
    (path,) = mutate.resolve("kvcache", ["block_pool.py"])
    drawn = mutate.sample(mutate.mutants([path]), 23, 5)
    parts = [mutate.part(drawn, i, 4) for i in range(1, 5)]
    assert sorted(len(p) for p in parts) == [5, 6, 6, 6]
    assert sorted((m for p in parts for m in p), key=drawn.index) == drawn
    assert mutate.part(drawn, 1, 1) == drawn


def test_every_mutant_names_the_class_and_function_around_it():
    (path,) = mutate.resolve("kvcache", ["block_pool.py"])
    lines = path.read_text().splitlines()
    first = 1 + lines.index("        first = (num_cached_blocks + 1) * scale - 1")
    (m, *_) = [m for m in mutate.mutants([path]) if m.line == first]
    assert m.scope.startswith("BlockPool.") and m.scope.count(".") == 1, m.scope


def test_a_saved_baseline_is_reused_only_under_the_same_key(tmp_path):
    (path,) = mutate.resolve("kvcache", ["block_pool.py"])
    file, calls = tmp_path / "baseline.json", []
    found = mutate.mutants([path])[:3]

    def compute():
        calls.append(1)
        return found, None, {str(path): {3, 1, 2}}

    key = mutate.baseline_key("kvcache", 300, 37, [path], ())
    assert mutate.saved_baseline(file, key, compute) == (found, None, {str(path): {1, 2, 3}})
    assert mutate.saved_baseline(file, key, compute) == (found, None, {str(path): {1, 2, 3}})
    assert len(calls) == 1
    other = mutate.baseline_key("kvcache", 300, 38, [path], ())
    mutate.saved_baseline(file, other, compute)
    assert len(calls) == 2


def test_a_report_cut_short_resumes_with_its_measured_mutants(tmp_path):
    (path,) = mutate.resolve("kvcache", ["block_pool.py"])
    first, second = mutate.sample(mutate.mutants([path]), 2, 1)
    report = mutate.Report("kvcache", 300, 37, 2, ("full",), (2, 5))
    report.results = [mutate.Result(first, mutate.KILLED, "I10", 1.5, "diff", "detail")]
    file = tmp_path / "report.json"
    file.write_text(json.dumps(report.as_json()))
    assert mutate.resumed(mutate.Report("kvcache", 300, 37, 2, ("full",), (2, 5)),
                          file) == report.results
    with pytest.raises(mutate.MutateError, match="seed, slice"):
        mutate.resumed(mutate.Report("kvcache", 300, 1, 2, ("full",), (1, 5)), file)


@pytest.mark.parametrize("argv, needle", [
    (["--paths", "block_pool.py", "--slice", "3/2"], "3/2"),
    (["--paths", "block_pool.py", "--slice", "x"], "'x'"),
    (["--paths", "block_pool.py", "--resume"], "--resume"),
])
def test_bad_slices_and_a_resume_without_report_exit_two(capsys, argv, needle):
    assert main(["mutate", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_resuming_another_runs_report_exits_two_before_any_campaign(tmp_path, capsys, monkeypatch):
    file = tmp_path / "report.json"
    file.write_text(json.dumps(mutate.Report("kvcache", 300, 1, 0).as_json()))
    monkeypatch.setattr(mutate, "baseline", lambda *a, **k: pytest.fail("a campaign ran"))
    argv = ["mutate", "--paths", "block_pool.py", "--seed", "2", "--report", str(file), "--resume"]
    assert main(argv) == 2
    assert "seed" in capsys.readouterr().err


def test_lines_keep_only_the_mutants_in_their_ranges():
    (path,) = mutate.resolve("kvcache", ["block_pool.py"])
    found = mutate.mutants([path])
    lines = sorted({m.line for m in found})
    first, last = lines[len(lines) // 3], lines[len(lines) // 2]
    (span,) = mutate.line_ranges([path], [("block_pool.py", first, last)])
    kept = mutate.within(found, [span])
    assert kept and all(first <= m.line <= last for m in kept)
    assert len(kept) == sum(first <= m.line <= last for m in found) < len(found)


@pytest.mark.parametrize("argv, needle", [
    (["--paths", "block_pool.py", "--lines", "kv_cache_manager.py:1-9"], "kv_cache_manager.py"),
    (["--paths", "block_pool.py", "--lines", "block_pool.py:9-3"], "'block_pool.py:9-3'"),
    (["--paths", "block_pool.py", "--lines", "block_pool.py"], "'block_pool.py'"),
])
def test_lines_outside_the_paths_or_malformed_exit_two(capsys, monkeypatch, argv, needle):
    monkeypatch.setattr(mutate, "baseline", lambda *a, **k: pytest.fail("a campaign ran"))
    assert main(["mutate", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_rerun_takes_the_mutants_an_earlier_report_lists_wherever_it_was_installed(tmp_path):
    (path,) = mutate.resolve("kvcache", ["block_pool.py"])
    found = mutate.mutants([path])
    killed, survived = mutate.sample(found, 2, 3)
    report = mutate.Report("kvcache", 300, 37, 2)
    report.results = [mutate.Result(killed, mutate.KILLED, "I10"),
                      mutate.Result(survived, mutate.SURVIVED)]
    data = report.as_json()
    for row in data["results"]:  # the measure ran in another copy of the package
        row["path"] = "/elsewhere/site-packages/kvcache/" + path.name
    file = tmp_path / "earlier.json"
    file.write_text(json.dumps(data))
    assert mutate.listed("kvcache", found, [file]) == sorted(
        [killed, survived], key=lambda m: (m.path, m.line, m.operator, m.occurrence))
    assert mutate.listed("kvcache", found, [file], survivors=True) == [survived]
    data["results"][0]["line"] += 1  # the source changed since
    file.write_text(json.dumps(data))
    with pytest.raises(mutate.MutateError, match="changed since"):
        mutate.listed("kvcache", found, [file])


@pytest.mark.parametrize("argv, needle", [
    (["--paths", "block_pool.py", "--survivors"], "--survivors"),
    (["--paths", "block_pool.py", "--rerun", "no_such_report.json"], "no_such_report.json"),
    (["--paths", "block_pool.py", "--rerun", "r.json", "--sample", "3"], "--sample"),
])
def test_bad_reruns_exit_two_before_any_campaign(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.json").write_text(json.dumps(mutate.Report("kvcache", 300, 1, 0).as_json()))
    monkeypatch.setattr(mutate, "baseline", lambda *a, **k: pytest.fail("a campaign ran"))
    assert main(["mutate", *argv]) == 2
    assert needle in capsys.readouterr().err
