"""EV4 and copies lost unannounced: a block that stores a key and loses it in the same op while
another block keeps the key (a failed synchronous load evicts the blocks it did not fill)
announces no removal (docs/spec.md §3.10); the probes see the copy lost, so EV4 allows exactly
that store beyond the holders after the op, and no more."""

from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace

CONFIG = {"num_blocks": 3, "groups": [{"kind": "full", "block_size": 4}], "max_model_len": 64,
          "kv_events": True}
# r0 and r7 compute the same 4-token block in one step, each in its own block; r7's block was
# to be filled by a synchronous load that loads nothing, so the step evicts it: its copy of
# the key is lost while r0's block keeps it (two BlockStored, no BlockRemoved).
OPS = [
    {"op": "add_request", "request_id": "r0", "prompt": [2, 1, 1, 3], "max_tokens": 1},
    {"op": "add_request", "request_id": "r7", "prompt": [2, 1, 1, 3], "max_tokens": 1},
    {"op": "load_remote", "request_id": "r7", "num_external_tokens": 1, "sync": True,
     "num_loaded_tokens": 0},
    {"op": "step"},
]


def _trace() -> Trace:
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "scheduler",
                            "config": CONFIG, "ops": OPS})


def test_a_copy_stored_and_lost_in_one_op_passes_ev4():
    result = run_trace(_trace(), ["kvcache"])
    assert result.passed, result.finding


def test_without_the_lost_copy_seen_ev4_fails(monkeypatch):
    """The allowance is the probe's: a pop it does not record leaves the store unexplained."""
    from kvfuzz.harness.probes import ManagerProbes

    monkeypatch.setattr(ManagerProbes, "_around_pop",
                        lambda self, original, key, block_id: original(key, block_id))
    found = run_trace(_trace(), ["kvcache"]).finding
    assert found is not None and found.check == "EV4", found


def test_a_store_announced_twice_is_still_caught(monkeypatch):
    """Each BlockStored queued twice: one more than the lost copy explains."""
    from kvfuzz.kvcache.kv_events import EventfulBlockPool

    original = EventfulBlockPool.register_full_blocks

    def twice(self, *args, **kwargs):
        queued = len(self.kv_event_queue)
        original(self, *args, **kwargs)
        self.kv_event_queue.extend(self.kv_event_queue[queued:])

    monkeypatch.setattr(EventfulBlockPool, "register_full_blocks", twice)
    found = run_trace(_trace(), ["kvcache"]).finding
    assert found is not None and found.check == "EV4", found


def test_a_removal_of_the_held_copy_is_still_caught():
    found = run_trace(_trace(), ["bug:removed-while-held"]).finding
    assert found is not None and found.check == "EV2", found
