"""The data checks over spec-decode steps (docs/traces.md, `step {draft, accept}`): a pass over
drafts the step rejects writes their positions with tokens the request never takes; the mirror
keeps only the positions of its tokens, and the next pass rewrites the rest."""

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.properties import REGISTRY
from kvfuzz.properties.data import data_checks

ADD = {"op": "add_request", "request_id": "r", "prompt": [0, 1, 2, 3, 4], "max_tokens": 6}


@pytest.mark.parametrize("config", ["eagle", "eagle_hybrid"])
@pytest.mark.parametrize("accept", [0, 1, None])
def test_rejected_drafts_leave_the_kv_right(config, accept, device_dtype):
    """Drafts rejected (0 or 1 kept) or all kept; then a second request hits the first's
    blocks and reads them (D1) while the first decodes on."""
    ops = [ADD, {"op": "step", "draft": 4}, {"op": "step", "accept": accept, "draft": 3},
           {"op": "step", "accept": 0}, {"op": "add_request", "request_id": "s",
                                         "prompt": [0, 1, 2, 3, 4, 9, 9, 9, 9], "max_tokens": 2},
           {"op": "step"}, {"op": "step"}]
    trace = Trace(BUILTIN[config][1], "scheduler", ops)
    result = run_trace(trace, ["kvcache"], checks=list(REGISTRY) + data_checks(*device_dtype))
    assert result.passed, result.finding.headline()
