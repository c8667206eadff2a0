"""EV3 on the events of finding 026 (docs/findings/026-stored-event-spans-null-blocks.md): a
Mamba "align" step of two blocks, [null, block 1], caches block 1 under the key of [0, 0]."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kvfuzz.core.config import Config
from kvfuzz.core.sides import KvEvent, Observations
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.properties.events import stored_events_chain

STATE = (0, None, (0, 0))  # the key of block 1: group 0, prefix [0, 0]
START = (0, None, (0,))    # the key of the null position before it, never stored


def _ev3(event: KvEvent) -> str | None:
    ctx = SimpleNamespace(observations=Observations(kv_events=[event]))
    return stored_events_chain(None, None, ctx)  # type: ignore[arg-type]


def test_ev3_fails_a_hash_sent_with_the_token_ids_of_a_null_block_before_it():
    """vLLM's event: the range from token 0, one hash for two blocks of token ids."""
    vllm_event = KvEvent("stored", 0, (STATE,), None, (0, 0), 1)
    assert _ev3(vllm_event) == "BlockStored of 1 block(s) of 1 tokens carries 2 token ids"


def test_ev3_fails_token_ids_sent_with_no_hash_at_all():
    """vLLM's event for a range of nulls only (a hybrid's Mamba group before its state block)."""
    assert _ev3(KvEvent("stored", 0, (), None, (1, 2, 3, 4, 5, 6, 7, 8), 4)) is not None


def test_ev3_passes_the_event_started_at_the_first_real_block():
    """kvcache's event: chained on the null position's key, the token ids of block 1 alone."""
    assert _ev3(KvEvent("stored", 0, (STATE,), START, (0,), 1)) is None


def test_the_finding_trace_passes_on_kvcache():
    """kvcache sends the second shape on the finding's own trace (vLLM fails it: -m vllm,
    tests/vllm/test_vllm_conformance.py)."""
    trace = Trace.load(Path(__file__).resolve().parents[2] / "docs" / "findings"
                       / "026-stored-event-spans-null-blocks.json")
    assert trace.meta["check"] == "EV3" and trace.config.kv_events
    assert run_trace(trace, ["kvcache"]).passed



def test_a_null_between_keyed_blocks_splits_kvcache_event():
    """A step whose range is [block 1, null, block 2] (external tokens cached late): kvcache
    sends one event per keyed block, each chained on the position before it with its own
    token id, and passes EV3 (vLLM sends one event of two keys and three token ids)."""
    config = Config.from_dict({"num_blocks": 3, "kv_events": True, "groups": [
        {"kind": "mamba", "block_size": 1, "mamba_cache_mode": "align"}]})
    prompt = [2, 3, 0, 2, 3, 0, 1, 1, 2, 2, 1, 3]
    execution = Execution(config, "api", ["kvcache"])
    execution.apply({"op": "add_request", "request_id": "r0", "prompt": prompt, "max_tokens": 1})
    execution.apply({"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 0,
                     "has_scheduled_reqs": False, "num_external_computed_tokens": 10,
                     "delay_cache_blocks": True})
    side = execution.targets[0].side
    take, taken = side.manager.take_events, []
    side.manager.take_events = lambda: (taken.extend(new := take()), new)[1]
    execution.apply({"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 2})
    hashes = side.requests["r0"].block_hashes
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in taken] == [
        ([hashes[9]], hashes[8], [prompt[9]]), ([hashes[11]], hashes[10], [prompt[11]])]


def test_a_range_the_retention_mask_leaves_unkept_sends_no_kvcache_event():
    """A sliding window with retention, one full block the mask does not keep: kvcache keys
    nothing and sends no BlockStored for it (vLLM sends one keying nothing, with 8 token
    ids); EV3 and EV4 hold on the whole trace."""
    config = Config.from_dict({
        "num_blocks": 3, "max_model_len": 32, "kv_events": True,
        "prefix_cache_retention_interval": 32,
        "groups": [{"kind": "sliding_window", "block_size": 8, "sliding_window": 4}]})
    grow = [{"op": "allocate_slots", "request_id": "r", "num_new_tokens": n} for n in (2, 1, 1)]
    ops = [{"op": "add_request", "request_id": "r", "max_tokens": 1,
            "prompt": [3, 3, 2, 1, 3, 0, 2, 1, 3, 0, 2, 0, 2, 1]},
           {"op": "allocate_slots", "request_id": "r", "num_new_tokens": 10,
            "has_scheduled_reqs": False}, *grow,
           {"op": "append_tokens", "request_id": "r", "tokens": [0, 3]}, *grow[1:]]
    assert run_trace(Trace(config, "api", ops), ["kvcache"]).passed
    execution = Execution(config, "api", ["kvcache"])
    side = execution.targets[0].side
    take, taken = side.manager.take_events, []
    side.manager.take_events = lambda: (taken.extend(new := take()), new)[1]
    for op in ops:
        execution.apply(op)
    assert all(e.block_hashes for e in taken if type(e).__name__ == "BlockStored")
