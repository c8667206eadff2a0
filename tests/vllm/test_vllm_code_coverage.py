"""A campaign on the installed vLLM records vLLM's own v1/core code (fuzz/code_coverage.py)."""

import pytest

from kvfuzz.fuzz.campaign import Campaign, CampaignOptions
from kvfuzz.fuzz.code_coverage import count_lines
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]


def test_a_vllm_campaign_measures_v1_core(tmp_path):
    stats = Campaign(CampaignOptions(target="vllm", seconds=None, examples=24, seed=1,
                                     configs=("full", "hybrid"), corpus=tmp_path)).run()
    files = {site[0] for site in stats.code_total}
    assert {"core/block_pool.py", "core/kv_cache_manager.py",
            "core/single_type_kv_cache_manager.py"} <= files
    assert all(f.startswith("core/") for f in files)
    lines, branches = count_lines(stats.code_total)
    assert lines > 200 and branches > 20
