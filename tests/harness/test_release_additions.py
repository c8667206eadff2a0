"""What vLLM 0.33 and 0.34 added to the manager's API, driven as trace ops on kvcache and the
model: the lookup bound (`get_computed_blocks(max_cache_hit_length)`), the per-request hit limit
(`prefix_cache_hit_limit`), the read-only probe `get_num_cached_tokens` with its check P5,
`free_blocks(evict_first=True)` (the `release_deferred` field) with its check F1, and token ids
bounded to vLLM's int32 storage."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.errors import TraceFormatError
from kvfuzz.core.trace import MAX_TOKEN_ID, Trace, normalize_op
from kvfuzz.core.snapshot import Snapshot
from kvfuzz.harness.executor import Execution, run_trace

FULL = Config(12, (GroupConfig("full", 4),), max_model_len=64)
HYBRID = Config(24, (GroupConfig("full", 4), GroupConfig("sliding_window", 4, sliding_window=5)),
                max_model_len=64)
PROMPT = list(range(13))
FINDING = Path(__file__).resolve().parents[2] / "docs/findings/008-probe-ignores-hit-limit.json"


def _cached(config: Config) -> Execution:
    ex = Execution(config, "api", ["kvcache"])
    ex.apply({"op": "add_request", "request_id": "a", "prompt": PROMPT})
    ex.apply({"op": "allocate_slots", "request_id": "a", "num_new_tokens": len(PROMPT)})
    return ex


@pytest.mark.parametrize("config", [FULL, HYBRID], ids=["full", "hybrid"])
@pytest.mark.parametrize("limit, bound, expected", [
    (None, None, 12), (4, None, 4), (6, None, 4), (0, None, 0), (None, 9, 8), (8, 5, 4),
])
def test_the_hit_is_capped_by_limit_and_bound(config, limit, bound, expected):
    ex = _cached(config)
    ex.apply({"op": "add_request", "request_id": "b", "prompt": PROMPT + [99],
              "prefix_cache_hit_limit": limit})
    probe = ex.apply({"op": "get_num_cached_tokens", "request_id": "b"})
    lookup = ex.apply({"op": "get_computed_blocks", "request_id": "b",
                       "max_cache_hit_length": bound})
    assert lookup["num_computed_tokens"] <= expected
    if config is FULL:
        assert lookup["num_computed_tokens"] == expected
    if bound is None:
        assert probe["num_cached_tokens"] == lookup["num_computed_tokens"]
    # The lookup, capped, is adopted as usual.
    ex.apply({"op": "allocate_slots", "request_id": "b", "use_lookup": True,
              "num_new_tokens": len(PROMPT) + 1 - lookup["num_computed_tokens"]})


def test_the_probe_changes_nothing_and_keeps_the_lookup_alive():
    ex = _cached(FULL)
    ex.apply({"op": "add_request", "request_id": "b", "prompt": PROMPT + [99]})
    ex.apply({"op": "get_computed_blocks", "request_id": "b"})
    before = ex.targets[0].snapshot
    assert ex.apply({"op": "get_num_cached_tokens", "request_id": "b"}) == {"num_cached_tokens": 12}
    assert ex.targets[0].snapshot == before
    ex.apply({"op": "allocate_slots", "request_id": "b", "use_lookup": True, "num_new_tokens": 2})


def test_p5_catches_a_probe_that_ignores_the_limit():
    trace = Trace.load(FINDING)
    assert run_trace(trace, ["kvcache"]).passed
    result = run_trace(trace, ["bug:probe-ignores-hit-limit"], model=False)
    assert result.finding is not None and (result.finding.check, result.finding.step) == ("P5", 3)


def test_token_ids_are_bounded_to_int32():
    normalize_op({"op": "add_request", "request_id": "a", "prompt": [MAX_TOKEN_ID]}, "api")
    with pytest.raises(TraceFormatError, match=r"token id 2147483648 exceeds 2147483647"):
        normalize_op({"op": "add_request", "request_id": "a", "prompt": [1, 2**31]}, "api")
    with pytest.raises(TraceFormatError, match=r"append_tokens\).tokens: token id"):
        normalize_op({"op": "append_tokens", "request_id": "a", "tokens": [2**40]}, "api")


DEFERRED = Config(12, (GroupConfig("full", 4),), max_model_len=64, deferred_frees=True)


def _released(evict_first: bool) -> tuple[Execution, Snapshot]:
    """a's 13 tokens computed (3 cached blocks + 1 uncached), b's uncached block freed, then
    a's blocks freed deferred and released; with the state just before the release."""
    ex = Execution(DEFERRED, "api", ["kvcache"])
    ex.apply({"op": "add_request", "request_id": "a", "prompt": PROMPT})
    ex.apply({"op": "allocate_slots", "request_id": "a", "num_new_tokens": len(PROMPT)})
    ex.apply({"op": "add_request", "request_id": "b", "prompt": [50, 51]})
    ex.apply({"op": "allocate_slots", "request_id": "b", "num_new_tokens": 2})
    ex.apply({"op": "free", "request_id": "b"})
    ex.apply({"op": "free_deferred", "request_id": "a"})
    before = ex.state
    ex.apply({"op": "release_deferred", "evict_first": evict_first})
    return ex, before


def test_evict_first_frees_what_a_plain_free_does_but_queues_it_first():
    (plain, before), (first, _) = _released(False), _released(True)
    table = before.deferred_frees[0]
    p, f = plain.state, first.state
    # The same blocks freed, with the same keys: only their place in the queue differs.
    assert p.free_set() == f.free_set() and p.num_free_blocks == f.num_free_blocks
    assert p.block_keys == f.block_keys and p.cache == f.cache
    assert p.free_queue == (table[3], *before.free_queue, table[2], table[1], table[0])
    assert f.free_queue == (table[3], table[2], table[1], table[0], *before.free_queue)


def test_blocks_freed_evict_first_stay_hits_until_they_are_the_next_evicted():
    ex, _ = _released(True)
    head, keys = ex.state.free_queue[:4], ex.state.block_keys
    ex.apply({"op": "add_request", "request_id": "c", "prompt": PROMPT})
    hit = ex.apply({"op": "get_computed_blocks", "request_id": "c"})
    assert hit["num_computed_tokens"] == 12
    ex.apply({"op": "add_request", "request_id": "d", "prompt": [60] * 4})
    new = ex.apply({"op": "allocate_slots", "request_id": "d", "num_new_tokens": 4})
    assert new["block_ids"] == [[head[0]]]  # the uncached tail block, reused first
    ex.apply({"op": "add_request", "request_id": "e", "prompt": [61] * 8})
    new = ex.apply({"op": "allocate_slots", "request_id": "e", "num_new_tokens": 8})
    assert new["block_ids"] == [list(head[1:3])]  # then the cached ones, a's keys evicted
    assert all(keys[b] is not None and ex.state.block_keys[b] != keys[b] for b in head[1:3])


def test_evict_first_must_be_a_bool():
    normalize_op({"op": "release_deferred", "evict_first": True}, "api")
    with pytest.raises(TraceFormatError, match=r"release_deferred\).evict_first must be"):
        normalize_op({"op": "release_deferred", "evict_first": 1}, "api")
