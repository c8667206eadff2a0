"""Real hazards the data checks expose in kvcache's driver semantics (reported to the lead).

The traces pass every structural invariant with the reference model in lockstep: kvcache does
what docs/traces.md specifies, and the bytes still go wrong. The xfails are strict, so a fix
shows up as a failure here and the marker must go. The data checks run on every device/dtype
of conftest.py.
"""

import pytest

from data_traces import (COPY_OF_A_COPY, FAILED_BLOCK_SHARER, PREEMPTED_AFTER_SCHEDULED,
                         SAME_STEP_COPY)
from kvfuzz.harness.executor import run_trace
from kvfuzz.properties import REGISTRY
from kvfuzz.properties.data import data_checks


class KVHazard(AssertionError):
    """D1 saw a request read KV its tokens did not produce."""


HAZARDS = [
    pytest.param(PREEMPTED_AFTER_SCHEDULED, id="preempted-after-scheduled",
                 marks=pytest.mark.xfail(strict=True, raises=KVHazard, reason=(
                     "docs/spec.md §10.7: the priority driver preempts a request after its "
                     "allocate_slots hashed blocks in the same step; their keys stay without "
                     "KV and a later hit reads never-written KV"))),
    pytest.param(SAME_STEP_COPY, id="same-step-copy-on-write",
                 marks=pytest.mark.xfail(strict=True, raises=KVHazard, reason=(
                     "Tier B: a partial hit on a tail block written in the same step is copied "
                     "before the forward pass writes it; the copy holds no KV"))),
    pytest.param(COPY_OF_A_COPY, id="copy-of-a-copy",
                 marks=pytest.mark.xfail(strict=True, raises=KVHazard, reason=(
                     "Mamba align: a same-step copy takes another copy's destination as its "
                     "source; run as one gather-then-scatter, it copies never-written KV"))),
    pytest.param(FAILED_BLOCK_SHARER, id="failed-block-sharer",
                 marks=pytest.mark.xfail(strict=True, raises=KVHazard, reason=(
                     "docs/spec.md §13.3: a request sharing a block a failing synchronous load "
                     "left unfilled keeps it computed for the request that marked it to "
                     "recompute; that one finishes first, and the sharer reads the block"))),
]


@pytest.mark.parametrize("hazard", [p.values[0] for p in HAZARDS], ids=[p.id for p in HAZARDS])
def test_hazard_trace_passes_the_structural_checks(hazard):
    result = run_trace(hazard, ["kvcache"], checks=list(REGISTRY))
    assert result.passed, result.finding and result.finding.headline()


@pytest.mark.parametrize("hazard", HAZARDS)
def test_kvcache_keeps_the_kv_right(hazard, device_dtype):
    result = run_trace(hazard, ["kvcache"], checks=list(REGISTRY) + data_checks(*device_dtype))
    if result.finding is not None and result.finding.check == "D1":
        raise KVHazard(result.finding.headline())
    assert result.passed, result.finding.headline()
