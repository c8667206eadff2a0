"""kv_cache_report_mode "full" (docs/spec.md §3.10): a lookup with a hit re-announces the
blocks it reuses as one BlockStored per run of real blocks in each group's hit (from token 0
on full attention; a window's null placeholders skipped, finding 027), EV6 holds the events to
that, and EV4 replays the op's events less those re-announcements."""

from pathlib import Path

import pytest

from kvfuzz.core.config import Config
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import ConfigError
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.kvcache_target import build_kvcache_manager
from kvfuzz.kvcache.kv_events import BlockStored
from kvfuzz.kvcache.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
from kvfuzz.kvcache.request import Request

CONFIG = BUILTIN["events_tenants"][1]
WINDOW = Path(__file__).resolve().parents[2] / "docs/findings/027-hit-report-names-null-blocks.json"

# Blocks of 4: a caches 3 full blocks and finishes; b shares 9 tokens (a 2-block hit), looked
# up, allocated on the hit, then its events taken; c (salted) shares no key.
OPS = [
    {"op": "add_request", "request_id": "a", "prompt": list(range(1, 14))},
    {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 13},
    {"op": "free", "request_id": "a"},
    {"op": "add_request", "request_id": "b", "prompt": list(range(1, 10)) + [40, 41]},
    {"op": "get_computed_blocks", "request_id": "b"},
    {"op": "allocate_slots", "request_id": "b", "num_new_tokens": 3, "use_lookup": True},
    {"op": "add_request", "request_id": "c", "prompt": list(range(1, 10)), "cache_salt": "s"},
    {"op": "get_computed_blocks", "request_id": "c"},
    {"op": "take_events"},
]


def _trace(level: str = "api", **config) -> Trace:
    ops = OPS if level == "api" else [
        {"op": "add_request", "request_id": "a", "prompt": list(range(1, 14))},
        {"op": "step"}, {"op": "step"}, {"op": "finish", "request_id": "a"},
        {"op": "add_request", "request_id": "b", "prompt": list(range(1, 10)) + [40, 41]},
        {"op": "step"}]
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": level,
                            "config": {**CONFIG.to_dict(), **config}, "ops": ops})


@pytest.mark.parametrize("level", ["api", "scheduler"])
def test_kvcache_passes_in_full_mode(level):
    assert run_trace(_trace(level), ["kvcache"]).passed


def test_kvcache_reannounces_the_hit_from_token_0():
    manager = build_kvcache_manager(CONFIG)
    hasher = get_request_block_hasher(4, None)
    a = Request("a", list(range(1, 14)), block_hasher=hasher)
    manager.allocate_slots(a, 13)
    manager.free(a)
    manager.take_events()
    b = Request("b", list(range(1, 12)), block_hasher=hasher, kv_cache_report_mode="full")
    blocks, hit, _ = manager.get_computed_blocks(b)
    [event] = manager.take_events()
    assert hit == 8 and isinstance(event, BlockStored)
    assert event.parent_block_hash is None and event.token_ids == list(range(1, 9))
    assert event.block_hashes == list(b.block_hashes[:2]) and event.block_size == 4
    plain = Request("p", list(range(1, 12)), block_hasher=hasher)
    assert manager.get_computed_blocks(plain)[1] == 8 and manager.take_events() == []


@pytest.mark.parametrize("level", ["api", "scheduler"])
def test_a_dropped_reannouncement_is_caught_by_ev6(level):
    found = run_trace(_trace(level), ["bug:cached-report-dropped"]).finding
    assert found is not None and found.check == "EV6", found


def test_reannouncing_without_the_mode_is_caught_by_ev4():
    found = run_trace(_trace(kv_cache_report_mode="incremental"),
                      ["bug:stored-on-every-hit"]).finding
    assert found is not None and found.check == "EV4", found


def test_a_report_mode_vllm_lacks_is_refused():
    with pytest.raises(ConfigError, match="kv_cache_report_mode must be one of"):
        Config.from_dict({**CONFIG.to_dict(), "kv_cache_report_mode": "partial"})


def test_a_window_hit_reannounces_only_its_real_blocks():
    """Finding 027: b's hit list on a sliding window (block size 4, window 4) is [null, null,
    block]; only the block is announced, chained on the key before it."""
    trace = Trace.load(WINDOW)
    assert run_trace(trace, ["kvcache"]).passed
    manager = build_kvcache_manager(trace.config)
    hasher = get_request_block_hasher(4, None)
    a = Request("a", list(range(1, 14)), block_hasher=hasher)
    manager.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    manager.allocate_slots(a, 5)
    manager.free(a)
    manager.take_events()
    b = Request("b", list(range(1, 14)), block_hasher=hasher, kv_cache_report_mode="full")
    blocks, hit, _ = manager.get_computed_blocks(b)
    [event] = manager.take_events()
    assert hit == 12 and [x.is_null for x in blocks.blocks[0]] == [True, True, False]
    assert event.block_hashes == [maybe_convert_block_hash(b.block_hashes[2])]
    assert event.parent_block_hash == maybe_convert_block_hash(b.block_hashes[1])
    assert event.token_ids == list(range(9, 13))


def test_reannouncing_a_windows_null_placeholders_is_caught():
    """vLLM's re-announcement planted in kvcache: the evicted first block's key is announced."""
    found = run_trace(Trace.load(WINDOW), ["bug:hit-report-names-null-blocks"]).finding
    assert found is not None and found.check == Trace.load(WINDOW).meta["check"], found


FINDING_036 = Path(__file__).resolve().parents[2] / "docs/findings"
PARTIAL_HITS = [FINDING_036 / "036-partial-hit-reported-as-full.json",
                Path(__file__).resolve().parents[1] / "traces/036-partial-hit-reported-as-full-short.json"]


@pytest.mark.parametrize("path", PARTIAL_HITS, ids=["api", "scheduler"])
def test_a_partial_hit_is_reannounced_as_its_partial_entry(path):
    """A full-mode hit that ends inside a block (partial_hits) re-announces that block as its
    partial entry was announced (finding 036): EV4 and EV6 hold on kvcache."""
    assert run_trace(Trace.load(path), ["kvcache"]).passed


@pytest.mark.parametrize("path", PARTIAL_HITS, ids=["api", "scheduler"])
def test_a_partial_hit_reannounced_as_a_full_block_is_caught(path):
    """vLLM's re-announcement planted in kvcache: the block under a full key no block holds."""
    found = run_trace(Trace.load(path), ["bug:hit-report-partial-as-full"]).finding
    assert found is not None and found.check in {"EV3", "EV4", "EV6"}, found



def test_a_hit_cut_inside_a_full_block_reannounces_its_full_key():
    """Groups of 2 and 4 tokens under EAGLE: r1's hit is cut to 2 tokens, inside the 4-token
    block r0 cached under its full key, which the block holds: that key is re-announced, not a
    2-token partial key no block holds (EV1 at the take_events)."""
    config = {"num_blocks": 4, "groups": [{"kind": "full", "block_size": 2},
                                          {"kind": "full", "block_size": 4}],
              "max_model_len": 64, "use_eagle": True, "partial_hits": True, "kv_events": True,
              "kv_cache_report_mode": "full"}
    ops = [{"op": "add_request", "request_id": r, "prompt": [3, 2, 1, 3], "cache_salt": "a",
            "max_tokens": 1} for r in ("r0", "r1")]
    ops += [{"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 4},
            {"op": "get_num_cached_tokens", "request_id": "r1"}, {"op": "take_events"}]
    trace = Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "api",
                             "config": config, "ops": ops})
    result = run_trace(trace, ["kvcache"])
    assert result.passed, result.finding
