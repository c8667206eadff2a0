"""Extra hash keys (docs/spec.md §2.3): LoRA adapters, multimodal inputs, prompt embeddings and
cache salts isolate blocks; equal values share them; each extra-key plant is caught by H2, and
without it by H1."""

import pytest

from kvfuzz.properties import REGISTRY

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import Execution, run_trace
from kvfuzz.kvcache.request import LoRARequest, Request

PROMPT = [0, 0, 0, 0, 1]


def _trace(first: dict, second: dict) -> Trace:
    ops = [
        dict(op="add_request", request_id="r0", prompt=PROMPT, **first),
        dict(op="get_computed_blocks", request_id="r0"),
        dict(op="allocate_slots", request_id="r0", num_new_tokens=5, use_lookup=True),
        dict(op="add_request", request_id="r1", prompt=PROMPT, **second),
        dict(op="get_computed_blocks", request_id="r1"),
    ]
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "api",
                            "config": BUILTIN["tenants"][1].to_dict(), "ops": ops})


LORA_A1 = dict(lora_name="a", lora_id=1)
PLANTS = {
    "lora-name-only": (LORA_A1, dict(lora_name="a", lora_id=2)),
    # vLLM 0.34 keys by name and path: the same name and id from another path is another key.
    "lora-keys-by-id": (LORA_A1, dict(lora_name="a", lora_id=1, lora_path="/elsewhere")),
    "lora-salt-untagged": (LORA_A1, dict(cache_salt="a")),
    "embeds-mask-dropped": (dict(prompt_embeds=[-1] * 5), dict(prompt_embeds=[0, 0, 0, 0, -1])),
}


def _second_hit(trace: Trace) -> int:
    execution = Execution(trace.config, trace.level, ["kvcache"])
    results = [execution.apply(op) for op in trace.ops]
    return results[-1]["num_computed_tokens"]


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_distinct_extra_keys_isolate_and_the_plant_shares(name):
    trace = _trace(*PLANTS[name])
    assert _second_hit(trace) == 0
    found = run_trace(trace, [f"bug:{name}"]).finding
    assert found is not None and found.check in ("H1", "H2"), found  # H2: an undocumented hash
    without_h2 = [c for c in REGISTRY if c.name != "H2"]
    found = run_trace(trace, [f"bug:{name}"], checks=without_h2).finding
    assert found is not None and found.check == "H1", found


def test_a_lora_adapter_is_keyed_by_name_and_path_not_id():
    """Another id loaded from the same path shares; the model agrees (no H1 or DIFF)."""
    trace = _trace(LORA_A1, dict(lora_name="a", lora_id=2, lora_path="/kvfuzz/lora/1"))
    assert _second_hit(trace) == 4
    assert run_trace(trace, ["kvcache"]).finding is None
    found = run_trace(trace, ["bug:lora-keys-by-id"]).finding
    assert found is not None, "keying by id misses the hit the model finds"


def test_equal_extra_keys_share_blocks():
    same = dict(lora_name="a", lora_id=1, mm_inputs=[[0, 1, 2]], prompt_embeds=[-1] * 5)
    assert _second_hit(_trace(same, same)) == 4


@pytest.mark.parametrize("second", [dict(mm_inputs=[[0, 2, 2]]), dict(mm_inputs=[[1, 1, 2]]),
                                    dict(cache_salt="b")])
def test_multimodal_offset_identifier_and_salt_isolate(second):
    first = dict(mm_inputs=[[0, 1, 2]], cache_salt="a")
    assert _second_hit(_trace(first, {**dict(mm_inputs=[[0, 1, 2]], cache_salt="a"), **second})) == 0


@pytest.mark.parametrize("fields, words", [
    (dict(lora_name="a"), "lora_name and lora_id"),
    (dict(lora_name="a", lora_id=0), "lora_id must be >= 1"),
    (dict(lora_name="a", lora_id=1, lora_path=""), "lora_path needs"),
    (dict(lora_path="/p"), "lora_path needs"),
    (dict(prompt_embeds=[-1]), "prompt_embeds has 1 values"),
    (dict(prompt_embeds=[0, -1, -1, -1, 0]), "placeholder 0"),
    (dict(mm_inputs=[[0, 4, 2]]), "inside the 5-token prompt"),
])
def test_invalid_extras_are_invalid_traces(fields, words):
    result = run_trace(_trace(fields, {}), ["kvcache"])
    assert result.invalid is not None and words in str(result.invalid)


def test_kvcache_request_rejects_bad_extras():
    with pytest.raises(ValueError, match="lora_int_id"):
        Request("r", [1, 2], lora_request=LoRARequest("a", 0, "/p"))
    with pytest.raises(ValueError, match="lora_path cannot be empty"):
        Request("r", [1, 2], lora_request=LoRARequest("a", 1))
    with pytest.raises(ValueError, match="prompt_embeds has 1 entries"):
        Request("r", [1, 2], prompt_embeds=[0])


def test_extras_beyond_a_block_do_not_change_its_key():
    """A multimodal input after block 0 leaves block 0 keyed like a plain request's."""
    later = dict(mm_inputs=[[0, 4, 1]], cache_salt="a")
    assert _second_hit(_trace(dict(cache_salt="a"), later)) == 4
