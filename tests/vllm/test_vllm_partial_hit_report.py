"""Finding 036 on the installed vLLM: a kv_cache_report_mode "full" hit that ends inside a block
(partial_hits) is re-announced under the block's full key, which no block holds (EV4), or, when
the request has no full block there, crashes the lookup (IndexError); kvcache announces the
partial entry and passes both traces.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.vllm_api import VllmUnsupported
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

FINDINGS = Path(__file__).resolve().parents[2] / "docs/findings"
SHORT = Path(__file__).resolve().parents[1] / "traces"


@pytest.mark.parametrize("path, check", [
    (FINDINGS / "036-partial-hit-reported-as-full.json", "EV4"),
    (SHORT / "036-partial-hit-reported-as-full-short.json", "I10")], ids=["api", "scheduler"])
def test_vllm_reannounces_a_partial_hit_as_a_full_block(path, check):
    trace = Trace.load(path)
    assert run_trace(trace, ["kvcache"]).passed
    try:
        found = run_trace(trace, ["vllm", "kvcache"]).finding
    except VllmUnsupported as exc:  # e.g. 0.32 has no prefix_cache_hit_limit
        pytest.skip(str(exc))
    assert found is not None and found.check == check and found.target == "vllm", found
