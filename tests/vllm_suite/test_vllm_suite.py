"""vLLM's own KV-core tests, unchanged, against kvcache dropped in for `vllm.v1.core`.

The installed vLLM release's test files (`FILES`, from its source distribution:
`bash ci/fetch-vllm-sdist.sh VERSION`, or KVFUZZ_VLLM_SDIST=DIR) run in a pytest of their own,
in place, with suite_plugin.py installing `kvfuzz.dropin`. Of the tests that pass on vLLM itself
(`vllm-VERSION-passing.txt`, written by a run with KVFUZZ_SUITE_TARGET=vllm), each must pass on
kvcache unless `expected-failures-VERSION.toml` lists it, with a category and a reason; a listed
test must fail. Either surprise fails this test, naming each one. The per-file counts are
printed (`pytest -s` shows them).

    "$py" -m pytest -m vllm tests/vllm_suite -s       # $py: the venv of ci/install-vllm.sh

`regenerate.py` rewrites the expected failures from a run (new ones for a person to categorise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path
from typing import IO

import pytest

from kvfuzz.harness.vllm_target import vllm_available

HERE = Path(__file__).resolve().parent
FILES = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_prompt_block_hash_vectors.py",
    "tests/v1/core/prefix_cache",
)
HANGING = "test_nixl_hisparse_full_block_import_keeps_a_writable_tail"
"""Left out of every run: on vLLM itself it waits, in C, on a NIXL transfer that never comes
offline (the plugin's timeout cannot stop it), so it never passes here."""
CATEGORIES = {
    "hisparse": "vLLM's HiSparse layout and connector, which kvcache does not implement",
    "dcp-pcp": "decode and prefill context parallelism (DCP/PCP), which kvcache does not implement",
    "engine": "the engine around the manager: memory planning, worker tensors, the Scheduler, "
              "metrics; kvcache is the manager only",
    "misuse": "misuse kvcache refuses on purpose where vLLM's test builds the state itself "
              "(docs/vllm.md, the drop-in's misuse differences)",
    "lacking": "a vLLM shape kvcache does not have yet (a name, parameter or field)",
}


def _installed_version() -> str:
    from importlib.metadata import version

    return version("vllm")


def _sdist(version: str) -> Path | None:
    where = os.environ.get("KVFUZZ_VLLM_SDIST")
    path = Path(where) if where else Path.home() / ".cache/kvfuzz/sdist" / f"vllm-{version}"
    return path if (path / "tests/v1/core").is_dir() else None


def run_suite(sdist: Path, target: str, out: Path, log: IO[bytes]) -> dict:
    """vLLM's files in their own pytest on `target` (kvcache or vllm), its output to `log`;
    the plugin's report."""
    env = dict(os.environ, KVFUZZ_SUITE_TARGET=target, KVFUZZ_SUITE_OUT=str(out),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               PYTHONDONTWRITEBYTECODE="1", VLLM_LOGGING_LEVEL="ERROR")
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:kvfuzz", "-p", "no:cacheprovider",
         "-p", "suite_plugin", "--noconftest", "--continue-on-collection-errors",
         "-k", f"not {HANGING}", *FILES],
        cwd=sdist, env=env, stdout=log, stderr=subprocess.STDOUT, check=False,
    )
    return json.loads(out.read_text())


def listed(version: str) -> dict[str, tuple[str, str]]:
    """test id -> (category, reason), as expected-failures-VERSION.toml lists them (none
    without the file), whatever the category."""
    path = HERE / f"expected-failures-{version}.toml"
    groups = tomllib.loads(path.read_text()).get("group", []) if path.exists() else []
    out: dict[str, tuple[str, str]] = {}
    for group in groups:
        for test in group["tests"]:
            assert test not in out, f"{test} listed twice"
            out[test] = (group["category"], group["reason"])
    return out


def expected_failures(version: str) -> dict[str, tuple[str, str]]:
    """`listed`, every category one of CATEGORIES (regenerate.py lists a new failure under one
    that is not, for a person to categorise)."""
    out = listed(version)
    for test, (category, _) in out.items():
        assert category in CATEGORIES, f"{test}: category {category!r} (categorise it)"
    return out


def compare(passing_on_vllm: list[str], report: dict,
            expected: dict[str, tuple[str, str]]) -> tuple[list[str], dict[str, Counter]]:
    """The surprises (an unlisted test that does not pass, a listed one that passes, a listed
    one vLLM does not pass) and the per-file counts."""
    surprises = [f"listed but not passing on vLLM: {t}" for t in expected
                 if t not in set(passing_on_vllm)]
    counts: dict[str, Counter] = {}
    for test in passing_on_vllm:
        result = report["tests"].get(test, {"outcome": "not run",
                                            "why": _collection_error(report, test)})
        count = counts.setdefault(test.partition("::")[0], Counter())
        count["vllm"] += 1
        passed = result["outcome"] == "passed"
        count["kvcache"] += passed
        if test in expected:
            count[expected[test][0]] += 1
            if passed:
                surprises.append(f"passes, but listed as {expected[test][0]}: {test}")
        elif not passed:
            surprises.append(f"{result['outcome']}: {test}: {result.get('why', '')}")
    return surprises, counts


def _collection_error(report: dict, test: str) -> str:
    path = test.partition("::")[0]
    return report["collection_errors"].get(path, "not collected")


def table(counts: dict[str, Counter]) -> str:
    columns = ["vllm", "kvcache", *CATEGORIES]
    rows = [f"{'file':58} " + " ".join(f"{c:>8}" for c in columns)]
    total: Counter = Counter()
    for path in sorted(counts):
        total.update(counts[path])
        rows.append(f"{path.removeprefix('tests/v1/core/'):58} "
                    + " ".join(f"{counts[path][c]:>8}" for c in columns))
    rows.append(f"{'total':58} " + " ".join(f"{total[c]:>8}" for c in columns))
    return "\n".join(rows)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllms_own_kv_core_tests_on_kvcache(tmp_path):
    if not vllm_available():
        pytest.skip("vLLM is not installed (bash ci/install-vllm.sh)")
    version = _installed_version()
    passing = HERE / f"vllm-{version}-passing.txt"
    if not passing.exists():
        pytest.skip(f"no list of vLLM {version}'s passing tests in {HERE}")
    sdist = _sdist(version)
    if sdist is None:
        pytest.skip(f"no source distribution of vLLM {version}: bash ci/fetch-vllm-sdist.sh "
                    f"{version} (or KVFUZZ_VLLM_SDIST=DIR)")
    with open(tmp_path / "pytest.log", "wb") as log:
        report = run_suite(sdist, "kvcache", tmp_path / "report.json", log)
    surprises, counts = compare(passing.read_text().splitlines(), report,
                                expected_failures(version))
    print(f"\nvLLM {version}'s own KV-core tests on kvcache (those vLLM passes)\n{table(counts)}")
    assert not surprises, "\n".join([*surprises, f"(the run's output: {tmp_path / 'pytest.log'})"])
