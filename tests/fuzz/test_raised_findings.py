"""A finding says whether the target raised at its step, and `kvfuzz mutate`'s campaign goes on
past such findings to one a check made (docs/mutation.md: kills by a vLLM exception alone)."""

from pathlib import Path
from typing import Any

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.campaign import CampaignOptions, run_campaign
from kvfuzz.harness.executor import raised_by, run_trace
from kvfuzz.harness.targets import get_target

FULL = Config(12, (GroupConfig("full", 4),), max_model_len=32)
OPS = [
    {"op": "add_request", "request_id": "A", "prompt": list(range(10))},
    {"op": "allocate_slots", "request_id": "A", "num_new_tokens": 10},
    {"op": "free", "request_id": "A"},
]


class _RaisesOnAllocate:
    """kvcache, except that every allocate_slots raises IndexError after doing its work."""

    name = "raises-on-allocate"

    def __init__(self, config: Config, level: str) -> None:
        self.inner = get_target("kvcache").build(config, level)

    def apply(self, op: dict[str, Any]) -> Any:
        result = self.inner.apply(op)
        return {"error": "IndexError"} if op["op"] == "allocate_slots" else result

    def snapshot(self) -> Any:
        return self.inner.snapshot()

    def observations(self) -> Any:
        return self.inner.observations()


def test_a_finding_names_what_the_target_raised_at_its_step() -> None:
    raised = run_trace(Trace(FULL, "api", OPS), [_RaisesOnAllocate]).finding
    assert raised is not None and raised.step == 1 and raised.target_raised == "IndexError"
    checked = run_trace(Trace(FULL, "api", OPS), ["bug:free-forgets-decrement"]).finding
    assert checked is not None and checked.check == "P2" and checked.target_raised == ""
    assert run_trace(Trace(FULL, "api", OPS), ["kvcache"]).finding is None


def test_only_an_error_result_counts_as_raised() -> None:
    assert raised_by({"error": "ValueError"}) == "ValueError"
    assert raised_by({"block_ids": [[1]]}) == "" and raised_by(None) == ""
    assert raised_by({"error": None}) == ""


def _campaign(tmp_path: Path, count_raised: bool) -> Any:
    # The plant asserts on every state allocation that lookahead over-allocated: every finding
    # is the target raising (I10 or a result against {'error': 'AssertionError'}).
    options = CampaignOptions(target="bug:state-allocation-asserts-growth", seconds=None,
                              examples=40, seed=0, corpus=tmp_path / str(count_raised),
                              configs=("mamba_small_blocks",), levels=("api",), max_findings=1,
                              count_raised=count_raised, shrink_seconds=0.0, workers=1)
    return run_campaign(options, lambda stats: None)


def test_a_campaign_that_does_not_count_raised_findings_runs_past_them(tmp_path: Path) -> None:
    stopped = _campaign(tmp_path, True)
    assert len(stopped.findings) == 1 and stopped.findings[0].target_raised == "AssertionError"
    assert stopped.examples < 40
    went_on = _campaign(tmp_path, False)
    assert went_on.examples == 40 and went_on.findings
    assert all(f.target_raised == "AssertionError" for f in went_on.findings)
