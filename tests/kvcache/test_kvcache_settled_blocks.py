"""`scheduler.settled_blocks` (docs/spec.md §7): on a Mamba hybrid with prefix caching, the
blocks a request's accepted drafts fill are cached right after the output ("at_output", vLLM
0.34) or by the request's next step ("next_step", 0.32 and 0.33). kvfuzz's driver
(kvcache/scheduler.py) and the model (reference_model/scheduler.py) run in lockstep, so a side
that ignores the rule is a DIFF; the model's cache shows which rule ran."""

from __future__ import annotations

from typing import Any

import pytest

from kvfuzz.core.config import Config
from kvfuzz.core.errors import ConfigError
from kvfuzz.harness.executor import Execution


def _config(rule: str) -> Config:
    return Config.from_dict({"num_blocks": 24, "groups": [
        {"kind": "full", "block_size": 4},
        {"kind": "mamba", "block_size": 4, "mamba_cache_mode": "align",
         "num_speculative_blocks": 1}],
        "scheduler": {"num_lookahead_tokens": 1, "settled_blocks": rule}})


def _cached_after_each_decode(rule: str) -> list[int]:
    """a (6 tokens) prefills in chunks of 4 and 2, sampling token 6 with a draft for token 7;
    the next step verifies it (computed 6 -> 8) and keeps it, which completes block 1 (tokens
    4-7) only at the output; one more step follows. The model's cached blocks after each."""
    ex = Execution(_config(rule), "scheduler", ("kvcache",))
    ex.apply({"op": "add_request", "request_id": "a", "prompt": [1, 2, 3, 1, 2, 3],
              "max_tokens": 6})
    ex.apply({"op": "step"})
    counts = []
    for op in ({"op": "step", "draft": 1}, {"op": "step", "accept": 1}, {"op": "step"}):
        ex.apply(op)
        counts.append(len(ex.state.cache))
    return counts


@pytest.mark.parametrize("rule, counts", [("at_output", [2, 4, 4]), ("next_step", [2, 2, 4])])
def test_the_blocks_accepted_drafts_fill_are_cached_when_the_rule_says(rule, counts):
    """Block 0 of both groups is cached by the prefill; block 1's two at the output that
    keeps the draft ("at_output") or at a's next step ("next_step")."""
    assert _cached_after_each_decode(rule) == counts


def test_a_bad_settled_blocks_rule_is_refused_naming_it():
    with pytest.raises(ConfigError, match="scheduler.settled_blocks must be one of .*'later'"):
        Config.from_dict({"num_blocks": 8, "groups": [{"kind": "full", "block_size": 4}],
                          "scheduler": {"settled_blocks": "later"}})
