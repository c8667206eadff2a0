"""The harness of test_vllm_suite.py, without vLLM: the strict comparison reports every surprise,
the checked-in lists agree with each other, and a stand-in for a name kvcache lacks fails
wherever it is used."""

from __future__ import annotations

import pytest
import suite_plugin
from test_vllm_suite import CATEGORIES, HERE, compare, expected_failures, table

A, B, C = ("tests/v1/core/test_a.py::test_one", "tests/v1/core/test_a.py::test_two",
           "tests/v1/core/prefix_cache/test_b.py::test_three[x y]")
LISTED = {B: ("lacking", "kvcache lacks X")}


def _report(**outcomes: str) -> dict:
    tests = {test: {"outcome": outcome, "why": "E"} for test, outcome in outcomes.items()}
    return {"tests": tests, "collection_errors": {}}


def test_as_expected_is_no_surprise_and_counts_per_file():
    surprises, counts = compare([A, B, C], _report(**{A: "passed", B: "failed", C: "passed"}),
                                LISTED)
    assert surprises == []
    assert counts["tests/v1/core/test_a.py"] == {"vllm": 2, "kvcache": 1, "lacking": 1}
    assert "prefix_cache/test_b.py" in table(counts)


@pytest.mark.parametrize("outcomes, words", [
    ({A: "failed", B: "failed", C: "passed"}, "failed: " + A),  # an unlisted failure
    ({A: "passed", B: "passed", C: "passed"}, "passes, but listed as lacking"),  # planted pass
    ({A: "passed", B: "failed"}, "not run: " + C),  # its file did not import
])
def test_each_surprise_is_reported(outcomes, words):
    surprises, _ = compare([A, B, C], _report(**outcomes), LISTED)
    assert len(surprises) == 1 and words in surprises[0], surprises


def test_a_listed_test_vllm_does_not_pass_is_a_surprise():
    surprises, _ = compare([A, C], _report(**{A: "passed", C: "passed"}), LISTED)
    assert surprises == [f"listed but not passing on vLLM: {B}"]


def test_the_checked_in_lists_agree():
    for path in HERE.glob("expected-failures-*.toml"):
        version = path.stem.removeprefix("expected-failures-")
        passing = (HERE / f"vllm-{version}-passing.txt").read_text().splitlines()
        assert len(passing) == len(set(passing))
        expected = expected_failures(version)
        assert set(expected) <= set(passing)
        assert {category for category, _ in expected.values()} <= set(CATEGORIES)
        assert all(reason for _, reason in expected.values())


def test_a_stand_in_fails_where_it_is_used(monkeypatch):
    missing = suite_plugin.lacking("vllm.v1.core.kv_cache_utils.init_none_hash")
    for use in (lambda: missing(print), lambda: isinstance(1, missing), lambda: list(missing)):
        with pytest.raises(LookupError, match="kvcache lacks vllm.v1.core.kv_cache_utils.init"):
            use()
    assert missing[int] is missing and (missing | None) is missing  # in annotations
    monkeypatch.setattr(suite_plugin, "_collecting", True)
    assert missing.LBNHC.__qualname__.endswith("init_none_hash.LBNHC")
    monkeypatch.setattr(suite_plugin, "_collecting", False)
    with pytest.raises(AttributeError, match="kvcache lacks"):
        missing.LBNHC  # noqa: B018


def test_a_lenient_module_reads_and_writes_the_module_and_stands_in_only_while_collecting(
        monkeypatch):
    import types

    module = types.ModuleType("kvfuzz.kvcache.fake")
    module.present = 1
    lenient = suite_plugin._Lenient("vllm.v1.core.fake", module)
    assert lenient.present == 1
    lenient.present = 2
    assert module.present == 2
    monkeypatch.setattr(suite_plugin, "_collecting", True)
    assert lenient.absent.__qualname__ == "vllm.v1.core.fake.absent"
    monkeypatch.setattr(suite_plugin, "_collecting", False)
    with pytest.raises(AttributeError):
        lenient.absent  # noqa: B018
    patch = pytest.MonkeyPatch()  # vLLM's tests monkeypatch module attributes
    patch.setattr(lenient, "present", 5)
    assert module.present == 5
    patch.undo()
    assert module.present == 2


def test_reloading_a_lenient_module_re_executes_the_module_keeping_its_classes(
        monkeypatch, tmp_path):
    import importlib
    import sys

    (tmp_path / "kvcache_fake_mod.py").write_text(
        "import os\nSEED = os.environ.get('FAKE_SEED')\nclass Block:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("kvcache_fake_mod")
    lenient = suite_plugin._Lenient("vllm_fake_mod", module)
    monkeypatch.setitem(sys.modules, "vllm_fake_mod", lenient)
    monkeypatch.setattr(sys, "meta_path", [suite_plugin._ReloadKvcache(), *sys.meta_path])
    block = module.Block
    monkeypatch.setenv("FAKE_SEED", "reloaded")
    assert importlib.reload(lenient) is lenient
    assert module.SEED == lenient.SEED == "reloaded"  # the module ran again, not vLLM's source
    assert module.Block is block
    assert module.__name__ == "kvcache_fake_mod"


RELOAD_THEN_HIT = """
import importlib, sys, types
import suite_plugin
import kvfuzz.kvcache.kv_cache_utils as utils
from kvfuzz.kvcache import BlockPool
from kvfuzz.kvcache.kv_cache_utils import make_block_hash_with_group_id

parent = types.ModuleType("vllmfake")
parent.__path__ = []
sys.modules["vllmfake"] = parent
sys.modules["vllmfake.kv_cache_utils"] = suite_plugin._Lenient("vllmfake.kv_cache_utils", utils)
sys.meta_path.insert(0, suite_plugin._ReloadKvcache())
importlib.reload(sys.modules["vllmfake.kv_cache_utils"])
pool = BlockPool(16, True, 2)
hashes = [bytes([i]) * 32 for i in range(4)]
for fine, block in zip((hashes[1], hashes[3]), pool.blocks[5:7]):
    pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(fine, 0), block)
view = utils.resolve_block_hashes(hashes, 2, 4)
print([b.block_id for b in pool.get_cached_block_run(view, 4, 0, 2, [0])[0]])
"""


def test_the_pool_reads_views_built_after_the_suites_reload_of_kv_cache_utils():
    """vLLM's none-hash tests reload kv_cache_utils; the plugin's reload keeps its classes, so
    the views `resolve_block_hashes` builds after it are of the class the pool bound at import
    and still read as views (run apart: the reload re-executes kvcache's module)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", RELOAD_THEN_HIT], capture_output=True,
                         text=True, check=True, env=env).stdout
    assert out.split() == ["[5,", "6]"]


def test_reloading_a_lenient_module_reruns_kvcaches_module(monkeypatch, tmp_path):
    import importlib
    import sys
    import types

    (tmp_path / "kvfake_utils.py").write_text("import os\nSEED = os.environ.get('KVFAKE')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVFAKE", "first")
    module = importlib.import_module("kvfake_utils")
    parent = types.ModuleType("vllmfake")
    parent.__path__ = []
    lenient = suite_plugin._Lenient("vllmfake.utils", module)
    monkeypatch.setitem(sys.modules, "kvfake_utils", module)
    monkeypatch.setitem(sys.modules, "vllmfake", parent)
    monkeypatch.setitem(sys.modules, "vllmfake.utils", lenient)
    monkeypatch.setenv("KVFAKE", "second")
    # Without the finder the reload looks the vLLM name up: here nothing, on the suite vLLM's
    # own file of that name.
    with pytest.raises(ModuleNotFoundError):
        importlib.reload(lenient)
    monkeypatch.setattr(sys, "meta_path", [suite_plugin._ReloadKvcache(), *sys.meta_path])
    assert importlib.reload(lenient) is lenient
    assert lenient.SEED == module.SEED == "second"
    assert module.__name__ == "kvfake_utils" and lenient.__name__ == "vllmfake.utils"


def test_regeneration_keeps_categories_and_marks_new_failures():
    from regenerate import NEW, regenerate

    old = {A: ("misuse", "refused on purpose"), B: ("lacking", "TypeError: f() lacks x"),
           C: ("lacking", "E")}
    report = _report(**{A: "failed", B: "failed", C: "passed"})
    report["tests"][B]["why"] = "AttributeError: g"
    assert regenerate([A, B, C], report, old) == {
        A: ("misuse", "refused on purpose"),  # a reason in words is kept
        B: ("lacking", "AttributeError: g"),  # a lacking test now stopped by another error
    }  # C passes: no longer listed
    assert regenerate([A], _report(**{A: "failed"}), {}) == {A: (NEW, "E")}
    # A lacking reason that names the error and says more is kept.
    old = {A: ("lacking", "E: the test reads X")}
    assert regenerate([A], _report(**{A: "failed"}), old) == {A: ("lacking", "E: the test reads X")}


def test_a_regenerated_list_reads_back_and_a_new_entry_must_be_categorised(monkeypatch, tmp_path):
    import test_vllm_suite
    import tomllib
    from regenerate import NEW, render

    entries = {A: ("lacking", 'KeyError: "x"'), B: (NEW, "E"), C: ("hisparse", "HiSparse")}
    text = render("9.9.9", entries)
    groups = tomllib.loads(text)["group"]
    assert [g["category"] for g in groups] == ["hisparse", "lacking", NEW]
    monkeypatch.setattr(test_vllm_suite, "HERE", tmp_path)
    (tmp_path / "expected-failures-9.9.9.toml").write_text(text)
    assert test_vllm_suite.listed("9.9.9") == entries
    with pytest.raises(AssertionError, match="categorise it"):
        expected_failures("9.9.9")


def test_a_regenerated_reason_leaves_out_what_differs_between_runs():
    from regenerate import stable

    assert stable("assert <X object at 0x7f0e72d3c6d0> == 1") == "assert <X object> == 1"
    assert stable("block hash -8549660974541118228 is not bytes") == (
        "block hash <int> is not bytes")
    assert stable("got 16 blocks") == "got 16 blocks"
