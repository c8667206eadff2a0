"""KV events (docs/spec.md §3.10) and deferred frees (§4.7): kvcache passes, each plant is
caught by its check, misuse is refused."""

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.kvcache_target import build_kvcache_manager

PROMPT = [1, 2, 3, 4, 5]
TWO_COPIES = [
    {"op": "add_request", "request_id": "a", "prompt": PROMPT},
    {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 5},
    {"op": "add_request", "request_id": "b", "prompt": PROMPT},
    {"op": "allocate_slots", "request_id": "b", "num_new_tokens": 5},
]
EVENTS = {
    "removed-while-held": TWO_COPIES + [{"op": "evict_blocks", "block_ids": [1]}],
    "reset-not-announced": TWO_COPIES + [
        {"op": "free", "request_id": "a"}, {"op": "free", "request_id": "b"},
        {"op": "reset_prefix_cache"}, {"op": "take_events"}],
    "stored-parent-dropped": [
        {"op": "add_request", "request_id": "a", "prompt": PROMPT * 2},
        {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 5},
        {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 5}],
}
# EV4 sees the missing AllBlocksCleared at the reset itself, before EV1's take_events.
CHECK = {"removed-while-held": "EV2", "reset-not-announced": "EV4",
         "stored-parent-dropped": "EV3", "deferred-free-whole-list": "I7"}
DEFERRED = [
    {"op": "add_request", "request_id": "a", "prompt": list(range(1, 18))},
    {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 17},
    {"op": "free_deferred", "request_id": "a"},
    {"op": "release_deferred"},
]


def _trace(config: str, ops: list) -> Trace:
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "api",
                            "config": BUILTIN[config][1].to_dict(), "ops": ops})


@pytest.mark.parametrize("plant", sorted(CHECK))
def test_kvcache_passes_and_the_plant_is_caught(plant):
    trace = _trace("deferred", DEFERRED) if plant.startswith("deferred") else \
        _trace("events", EVENTS[plant])
    assert run_trace(trace, ["kvcache"]).passed
    found = run_trace(trace, [f"bug:{plant}"]).finding
    assert found is not None and found.check == CHECK[plant], found


def test_take_events_needs_a_config_with_events():
    result = run_trace(_trace("full", [{"op": "take_events"}]), ["kvcache"])
    assert result.invalid is not None and "kv_events" in str(result.invalid)


def test_take_events_with_events_off_is_refused():
    manager = build_kvcache_manager(BUILTIN["full"][1])
    with pytest.raises(ValueError, match="events off"):
        manager.take_events()
