"""Check W1 on vLLM's own Scheduler: the block tables its worker builds from the
SchedulerOutputs alone equal the manager's (harness/vllm_worker_tables.py; docs/vllm.md, "What
the worker is told"); check W2 on vLLM's KVCacheManager (`--target vllm`): what
`get_block_ids(allow_none=True)` of allocate_slots' result tells the worker equals the blocks
each group was given, so the mutant S3 of docs/mutation.md dies without the Scheduler.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

from typing import Any

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

PROMPT = [2, 1, 3, 1, 2, 2, 2, 1, 1, 2, 3, 3, 0, 3, 2, 1, 3, 1, 3, 3, 3, 0, 2, 1, 0, 3, 1, 2]
"""28 tokens, 7 blocks of 4: the second step's sampled token needs an eighth block."""
TRACE = Trace(level="scheduler", config=BUILTIN["full"][1].replace(num_blocks=9), ops=[
    {"op": "add_request", "request_id": "r0", "prompt": PROMPT, "max_tokens": 2},
    {"op": "step"}, {"op": "step"}])
"""The shrunk finding of the mutant of `get_block_ids` on 0.34.0 (and of the plant)."""
ONE_BLOCK = Trace(level="api", config=BUILTIN["full"][1].replace(num_blocks=2), ops=[
    {"op": "add_request", "request_id": "r0", "prompt": [0], "max_tokens": 1},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 1}])
"""The mutant's shrunk W2 finding on `--target vllm --examples 300 --seed 38`: a one-token
prompt given its one block."""


def _mutated_get_block_ids(self: Any, allow_none: bool = False, group_ids: Any = None) -> Any:
    """vLLM 0.34.0 `KVCacheBlocks.get_block_ids` (`kv_cache_manager.py:105`) with `len == 0`
    -> `len == 1` (our restatement of the method, mutated): `allow_none` then answers None
    where every group has one block."""
    groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
    if allow_none and all(len(group) == 1 for group in groups):
        return None
    return tuple([b.block_id for b in group] for group in groups)


@pytest.mark.parametrize("target", ["vllm-scheduler", "vllm-async-scheduler"])
def test_the_worker_is_told_every_block_of_the_table(target):
    assert run_trace(TRACE, (target,)).passed


def test_the_plant_that_sends_no_single_new_block_is_w1():
    finding = run_trace(TRACE, ("vllm-scheduler-bug:one-new-block-unsent",)).finding
    assert finding is not None and finding.check == "W1", finding
    assert "group 0 has 7 blocks" in finding.message and "manager's 8" in finding.message


def test_the_mutant_of_get_block_ids_is_w1(monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    monkeypatch.setattr(KVCacheBlocks, "get_block_ids", _mutated_get_block_ids)
    finding = run_trace(TRACE, ("vllm-scheduler",)).finding
    assert finding is not None and finding.check == "W1", finding


def test_vllm_tells_the_worker_of_its_one_new_block():
    assert run_trace(ONE_BLOCK, ("vllm", "kvcache")).passed


def test_the_mutant_of_get_block_ids_is_w2_on_the_manager_target(monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    monkeypatch.setattr(KVCacheBlocks, "get_block_ids", _mutated_get_block_ids)
    finding = run_trace(ONE_BLOCK, ("vllm",)).finding
    assert finding is not None and finding.check == "W2", finding
    assert "allocated [[1]] per group" in finding.message and "reads None" in finding.message
