"""Every finding's plain vLLM test (docs/findings/vllm-tests/) on the installed vLLM and on
kvcache through the drop-in.

On vLLM a test must fail where the finding's release range includes the install (decided from
what the install offers, `kvfuzz.fuzz.finding_tests.expected_outcome`), skip itself where the
install lacks the API it needs, and pass elsewhere. Through the drop-in (`kvfuzz.dropin`),
where the same `vllm.v1.core` imports reach kvcache, every test must pass: kvcache takes the
vLLM signatures they call (`init_none_hash`, `get_request_block_hasher(size, sha256)`,
`Request(request_id, prompt_token_ids, sampling_params, pooling_params, ...)` with prompt
embeddings as a tensor, `MambaSpec(shapes=, dtypes=)`). Each side runs all tests in one pytest
subprocess, so each module imports a fresh vLLM.

A scheduler-level finding's test (016, 018, 022-025, 028-031, 035) drives vLLM's own Scheduler,
which imports names of `vllm.v1.core` that kvcache does not offer, so it does not run through
the drop-in: it must pass with the finding doc's fix applied to vLLM
(tests/vllm/proposed_fixes.py; 022's is the rule 0.33 added, and its test also passes unpatched
on 0.33 and 0.34, the first check; 025's likewise). 023's and 024's bugs are in vLLM's scheduler
and worker, which kvcache shares; 016's is in vLLM's recovery from a short KV load, which
kvcache's driver does otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

import pytest

from kvfuzz.fuzz.finding_tests import (
    FINDING_TESTS,
    FINDINGS_DIR,
    PROPOSED_FIXES,
    VLLM_TESTS_DIR,
    expected_outcome,
    vllm_test_path,
)
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable")]

_RUN = """
import sys
import pytest
{prelude}
sys.exit(pytest.main(sys.argv[1:]))
"""


def _scheduler_level(number: str) -> bool:
    return json.loads((FINDINGS_DIR / FINDING_TESTS[number]).read_text())["level"] == "scheduler"


def _outcomes(tmp_path: Path, prelude: str = "", numbers: Iterable[str] = FINDING_TESTS,
              options: tuple[str, ...] = ()) -> dict[str, tuple[str, str]]:
    """Run the finding tests in one subprocess; file stem -> (outcome, message)."""
    report = tmp_path / "report.xml"
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _RUN.format(prelude=prelude), "-q", "-p", "no:cacheprovider",
         *options, "--rootdir", str(VLLM_TESTS_DIR), "--confcutdir", str(VLLM_TESTS_DIR),
         f"--junitxml={report}", *(str(vllm_test_path(n)) for n in numbers)],
        capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path,
    )
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).iter("testcase"):
        stem = case.get("classname", "").rsplit(".", 1)[-1]
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = name, node.get("message", "")
                break
        outcomes[stem] = (outcome, message)
    return outcomes


def test_each_finding_test_fails_exactly_where_vllm_has_the_bug(tmp_path):
    from kvfuzz.harness.vllm_api import load_vllm

    api = load_vllm()
    outcomes = _outcomes(tmp_path)
    wrong = []
    for number in FINDING_TESTS:
        stem = vllm_test_path(number).stem
        got, message = outcomes.get(stem, ("not run", ""))
        want = expected_outcome(number, api)
        if got != want:
            wrong.append(f"{number} ({stem}): expected {want} on {api.describe()}, got {got}: "
                         f"{message[:300]}")
    assert not wrong, "\n".join(wrong)


def test_each_finding_test_passes_on_kvcache_through_the_drop_in(tmp_path):
    numbers = [n for n in FINDING_TESTS if not _scheduler_level(n)]
    outcomes = _outcomes(tmp_path, prelude="from kvfuzz.dropin import install\ninstall()",
                         numbers=numbers)
    wrong = [f"{stem}: {got}: {message[:300]}" for stem, (got, message) in outcomes.items()
             if got != "passed"]
    assert len(outcomes) == len(numbers), sorted(outcomes)
    assert not wrong, "\n".join(wrong)


def test_each_scheduler_bug_test_passes_with_its_proposed_fix(tmp_path):
    """016, 018, 022-025, 028-031 and 035 on vLLM with the fix their doc proposes
    (tests/vllm/proposed_fixes.py)."""
    outcomes = _outcomes(tmp_path, numbers=sorted(PROPOSED_FIXES),
                         options=("-p", "proposed_fixes"))
    wrong = [f"{stem}: {got}: {message[:300]}" for stem, (got, message) in outcomes.items()
             if got != "passed"]
    assert len(outcomes) == len(PROPOSED_FIXES), sorted(outcomes)
    assert not wrong, "\n".join(wrong)
