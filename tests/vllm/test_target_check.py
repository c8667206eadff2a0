"""The vLLM adapters carry every request field the generator sets (the startup check of
harness/target_check.py finds nothing dropped)."""

import pytest

from kvfuzz.harness.target_check import dropped_fields
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]


@pytest.mark.parametrize("name", ["vllm", "vllm-strict"])
def test_vllm_adapter_drops_no_field(name: str) -> None:
    assert dropped_fields(get_target(name)) == []
