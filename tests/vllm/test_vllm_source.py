"""`vllm_source` (harness/vllm_api.py), which the release probes read vLLM's code through: a
method's text where the installed vLLM has it, None where it does not.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

import pytest

from kvfuzz.harness.vllm_api import vllm_source
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]


def test_a_method_is_read_and_an_absent_one_is_none():
    source = vllm_source("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output")
    assert source is not None and source.lstrip().startswith("def update_from_output(")
    assert vllm_source("vllm.v1.core.sched.scheduler", "Scheduler.no_such_method") is None
    assert vllm_source("vllm.no_such_module", "Scheduler.update_from_output") is None
