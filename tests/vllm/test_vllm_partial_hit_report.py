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
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

FINDINGS = Path(__file__).resolve().parents[2] / "docs/findings"


@pytest.mark.parametrize("name, check", [("036-partial-hit-reported-as-full.json", "EV4"),
                                         ("036-partial-hit-reported-as-full-short.json", "I10")])
def test_vllm_reannounces_a_partial_hit_as_a_full_block(name, check):
    trace = Trace.load(FINDINGS / name)
    assert run_trace(trace, ["kvcache"]).passed
    found = run_trace(trace, ["vllm", "kvcache"]).finding
    assert found is not None and found.check == check and found.target == "vllm", found
