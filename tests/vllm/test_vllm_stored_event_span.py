"""Finding 026 on the installed vLLM: target `vllm` splits a BlockStored whose range holds null
or masked blocks into kvcache's events (`stored-event-spans-null-blocks`), `vllm-strict`
reports it (EV3), and an EV3 bug planted in vLLM's events is still caught under `vllm`.

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvfuzz.core.config import Config
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main as kvfuzz
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.vllm_target import STORED_SPANS_NULLS, VllmSide, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

FINDING = Path(__file__).resolve().parents[2] / "docs" / "findings" / (
    "026-stored-event-spans-null-blocks.json")
ALIGN_EVENTS = {"num_blocks": 3, "kv_events": True,
                "groups": [{"kind": "mamba", "block_size": 1, "mamba_cache_mode": "align"}]}
# The step's range is [block 1, null, block 2]: a null between two keyed blocks (loaded
# external tokens cached late), found by `kvfuzz run --target vllm --config full
# --generated-configs --examples 100 --seed 1`.
BETWEEN = Trace(Config.from_dict(ALIGN_EVENTS), "api", [
    {"op": "add_request", "request_id": "r0", "prompt": [2, 3, 0, 2, 3, 0, 1, 1, 2, 2, 1, 3],
     "max_tokens": 1},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 0,
     "has_scheduled_reqs": False, "num_external_computed_tokens": 10,
     "delay_cache_blocks": True},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 2},
])
# A sliding window with retention: the mask leaves the step's one full block unkept, and
# vLLM's event keys nothing but carries its 8 token ids (`kvfuzz run --target vllm --config
# full --generated-configs --seconds 45 --seed 2`, shrunk).
MASKED = Trace(Config.from_dict({
    "num_blocks": 3, "max_model_len": 32, "kv_events": True,
    "prefix_cache_retention_interval": 32,
    "groups": [{"kind": "sliding_window", "block_size": 8, "sliding_window": 4}]}), "api", [
    {"op": "add_request", "request_id": "r0", "prompt": [3, 3, 2, 1, 3, 0, 2, 1, 3, 0, 2, 0, 2, 1],
     "max_tokens": 1},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 10,
     "has_scheduled_reqs": False},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 2},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 1},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 1},
    {"op": "append_tokens", "request_id": "r0", "tokens": [0, 3]},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 1},
    {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 1},
])
TRACES = {"leading-nulls": Trace.load(FINDING), "null-between": BETWEEN, "masked": MASKED}


def _vllm(sides: list[VllmSide]) -> Any:
    def build(config: Config, level: str) -> VllmSide:
        sides.append(VllmSide(config, level))
        return sides[-1]
    return build


@pytest.mark.parametrize("name", TRACES)
def test_vllm_tolerates_the_span_and_vllm_strict_reports_it(name):
    trace = TRACES[name]
    assert run_trace(trace, ["kvcache"]).passed
    sides: list[VllmSide] = []
    assert run_trace(trace, [_vllm(sides)]).passed
    assert sides[0].tolerated[STORED_SPANS_NULLS] == {"r0"}
    strict = run_trace(trace, ["vllm-strict"])
    assert strict.finding is not None and strict.finding.check == "EV3"
    assert "token ids" in strict.finding.message


def _plant(monkeypatch: pytest.MonkeyPatch, rewrite: Any) -> None:
    """vLLM's BlockPool with each BlockStored that cache_full_blocks queues rewritten."""
    from vllm.v1.core.block_pool import BlockPool

    original = BlockPool.cache_full_blocks

    def cache_full_blocks(self: Any, request: Any, blocks: Any, num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, *args: Any,
                          **kwargs: Any) -> None:
        queued = len(self.kv_event_queue)
        original(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                 *args, **kwargs)
        if len(self.kv_event_queue) > queued:
            self.kv_event_queue[-1] = rewrite(self.kv_event_queue[-1], request, blocks,
                                              num_cached_blocks, block_size)

    monkeypatch.setattr(BlockPool, "cache_full_blocks", cache_full_blocks)


def _last_token_changed(event: Any, *_: Any) -> Any:
    """vLLM's event with its last token id one higher."""
    import msgspec

    return msgspec.structs.replace(event, token_ids=[*event.token_ids[:-1],
                                                     event.token_ids[-1] + 1])


def _fixed_but_parentless(event: Any, request: Any, blocks: Any, num_cached: int,
                          block_size: int) -> Any:
    """The event started at the range's first real block (the upstream fix's shape), with
    no parent: its tokens then make a prefix shorter than its key."""
    import msgspec

    first = next(i for i in range(num_cached, len(blocks)) if not blocks[i].is_null)
    skip = (first - num_cached) * block_size
    return msgspec.structs.replace(event, parent_block_hash=None,
                                   token_ids=event.token_ids[skip:])


@pytest.mark.parametrize("name, rewrite", [
    ("leading-nulls", _last_token_changed), ("null-between", _last_token_changed),
    ("masked", _last_token_changed), ("leading-nulls", _fixed_but_parentless),
    ("null-between", _fixed_but_parentless),
], ids=lambda p: p if isinstance(p, str) else p.__name__.strip("_"))
def test_an_ev3_bug_planted_in_vllm_is_still_caught_under_vllm(monkeypatch, name, rewrite):
    """The tolerance changes only vLLM's own event of the range (its keys, parent and token
    ids the request's): any other BlockStored reaches EV3 as it is."""
    _plant(monkeypatch, rewrite)
    sides: list[VllmSide] = []
    result = run_trace(TRACES[name], [_vllm(sides)])
    assert result.finding is not None and result.finding.check == "EV3"
    assert not sides[0].tolerated[STORED_SPANS_NULLS]


def test_a_campaign_counts_it_on_vllm_and_no_tolerate_reports_it(tmp_path, capsys):
    """On a Mamba "align" config with events, `vllm` passes and names 026 among the tolerated
    deviations; `--no-tolerate 026` makes it an EV3 finding, as on `vllm-strict`."""
    config = tmp_path / "align-events.json"
    config.write_text(json.dumps({**ALIGN_EVENTS, "num_blocks": 8, "name": "align_events"}))
    run = ["run", "--config-file", str(config), "--examples", "10", "--seed", "1",
           "--corpus", str(tmp_path / "corpus")]
    assert kvfuzz([*run, "--target", "vllm"]) == 0
    assert "026 stored-event-spans-null-blocks:" in capsys.readouterr().out
    for target in (["vllm", "--no-tolerate", "026"], ["vllm-strict"]):
        assert kvfuzz([*run, "--target", *target]) == 1
        assert "[EV3]" in capsys.readouterr().out
    assert kvfuzz(["replay", str(FINDING), "--target", "vllm", "--no-tolerate", "026",
                   "--quiet"]) == 1
