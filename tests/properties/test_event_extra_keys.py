"""EV5 (docs/spec.md §3.10): kvcache's BlockStored events name each block's extra keys as
vLLM's do, and a plant that names block 0's keys for every block is caught."""

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.snapshot import CacheKey
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.properties.events import expected_extra_keys


def _trace(ops: list) -> Trace:
    config = {**BUILTIN["events"][1].to_dict(), "extra_keys": True}
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "api",
                            "config": config, "ops": ops})


# Block size 4: request a has an adapter, inputs over [2, 6) and [6, 18), a salt; b has
# embeddings after 5 token ids (both targets render its digest their own way).
EXTRAS = _trace([
    {"op": "add_request", "request_id": "a", "prompt": list(range(1, 30)), "cache_salt": "s",
     "lora_name": "ad", "lora_id": 1, "mm_inputs": [[0, 2, 4], [1, 6, 12]]},
    {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 29},
    {"op": "free", "request_id": "a"},
    {"op": "add_request", "request_id": "b", "prompt": [1, 2, 3, 4, 5] + [0] * 11,
     "prompt_embeds": [-1] * 5 + list(range(11))},
    {"op": "allocate_slots", "request_id": "b", "num_new_tokens": 16},
])
SALTED = _trace([
    {"op": "add_request", "request_id": "a", "prompt": list(range(1, 10)), "cache_salt": "s"},
    {"op": "allocate_slots", "request_id": "a", "num_new_tokens": 9},
])


def test_kvcache_passes_with_every_kind_of_extra_key():
    assert run_trace(EXTRAS, ["kvcache"]).passed


@pytest.mark.parametrize("trace", [EXTRAS, SALTED], ids=["extras", "salted"])
def test_extra_keys_at_start_is_caught_by_ev5(trace):
    found = run_trace(trace, ["bug:stored-extra-keys-at-start"]).finding
    assert found is not None and found.check == "EV5", found


def test_expected_keys_read_from_the_key_identity():
    blocks = ((("lora", "ad", "/p"), ("mm", 0, 2), ("cache_salt", "s")),
              (("lora", "ad", "/p"), ("mm", 0, -2), ("mm", 1, 2)))
    key: CacheKey = (0, ("extras", *blocks), tuple(range(8)))  # type: ignore[assignment]
    assert expected_extra_keys(key, 4) == ("ad", (0, -2), (1, 2))
    assert expected_extra_keys(key, 8) == ("ad", (0, 2), (1, 6), "s")
    assert expected_extra_keys((0, "s", (1, 2, 3, 4)), 4) == ("s",)
    assert expected_extra_keys((0, "s", (1, 2, 3, 4)), 2) == ()
    assert expected_extra_keys((0, None, (1, 2)), 2) == ()
