"""What allocate_slots' result tells a scheduler's worker (check W2): the probes read
`get_block_ids(allow_none=True)` of every result beside the blocks layer 3 allocated per group,
on kvcache and its plant `one-new-block-reads-none` (the vLLM 0.34.0 mutant S3)."""

from __future__ import annotations

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.trace import Trace, normalize_op
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.targets import get_target

HYBRID = Config(20, (GroupConfig("full", 8), GroupConfig("sliding_window", 4, sliding_window=8)),
                name="hybrid", max_model_len=64)
OPS = [
    {"op": "add_request", "request_id": "r0", "prompt": list(range(12))},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 5},  # 1 + 2 blocks
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 1},  # none
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 3},  # 1 + 1
]
TRACE = Trace(level="api", config=HYBRID, ops=OPS)


def _probes(target: str) -> list:
    side = get_target(target).build(HYBRID, "api")
    seen = []
    for op in OPS:
        result = side.apply(normalize_op(op, "api"))
        if op["op"] == "allocate_slots":
            (probe,) = side.observations().allocations
            seen.append((result["block_ids"], probe.new_block_ids, probe.reported_new_block_ids))
        else:
            side.observations()
    return seen


def test_the_probe_reads_what_the_worker_is_told_beside_what_was_allocated():
    (first, none, one_each) = _probes("kvcache")
    ids, allocated, told = first
    assert allocated == told == tuple(tuple(group) for group in ids)
    assert [len(group) for group in allocated] == [1, 2]
    assert none[1] == ((), ()) and none[2] is None
    assert [len(group) for group in one_each[1]] == [1, 1] and one_each[2] == one_each[1]


def test_the_plant_tells_of_no_block_where_each_group_got_one():
    *_, (_, allocated, told) = _probes("bug:one-new-block-reads-none")
    assert [len(group) for group in allocated] == [1, 1] and told is None


def test_w2_passes_on_kvcache_and_names_the_plant():
    assert run_trace(TRACE, ["kvcache"]).passed
    finding = run_trace(TRACE, ["bug:one-new-block-reads-none"]).finding
    assert finding is not None and finding.check == "W2" and finding.step == 3, finding
    assert "reads None" in finding.message
