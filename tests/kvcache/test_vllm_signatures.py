"""kvcache takes vLLM 0.34's signatures for hashing, requests and specs (docs/vllm.md, "kvcache
as a drop-in"), checked here without vLLM; tests/vllm_suite runs vLLM's own tests on them."""

from __future__ import annotations

import hashlib
import pickle
from types import SimpleNamespace

import pytest

from kvfuzz.kvcache import kv_cache_utils as utils
from kvcache_testkit import make_manager
from kvfuzz.kvcache.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec
from kvfuzz.kvcache.request import LoRARequest, Request


def sha256(value: object) -> bytes:
    """A hash function of vLLM's kind: any picklable value to 32 bytes."""
    return hashlib.sha256(pickle.dumps(value)).digest()


@pytest.fixture(autouse=True)
def none_hash(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(utils, "NONE_HASH", None)
    monkeypatch.setattr(utils, "_NONE_HASH_SEED", None)
    utils.init_none_hash(sha256)


def test_init_none_hash_hashes_vllms_seed():
    assert utils.NONE_HASH == sha256("vllm-none-hash")
    assert utils.get_none_hash_seed() == "vllm-none-hash"


def test_a_hasher_given_a_hash_function_chains_vllms_tuples():
    hasher = utils.get_request_block_hasher(2, sha256)
    request = Request("r", [1, 2, 3, 4, 5], block_hasher=hasher, cache_salt="s",
                      lora_request=LoRARequest("a", 1, "/p"))
    first = sha256((utils.NONE_HASH, (1, 2), (("lora", "a", "/p"), ("cache_salt", "s"))))
    assert request.block_hashes == [first, sha256((first, (3, 4), (("lora", "a", "/p"),)))]


def test_lookahead_hashes_a_block_once_the_tokens_after_it_exist():
    request = Request("r", [1, 2, 3], block_hasher=utils.get_request_block_hasher(2, sha256, 2))
    assert request.block_hashes == []
    request.append_output_token_ids(9)
    assert request.block_hashes == [sha256((utils.NONE_HASH, (1, 2), (None, 3, 9)))]


def test_a_mixed_prompts_mask_is_keyed():
    hasher = utils.get_request_block_hasher(2, sha256)
    a, b = (Request("r", [0, 0], block_hasher=hasher, prompt_embeds=[5, 5],
                    prompt_is_token_ids=mask) for mask in ([True, False], [False, True]))
    assert a.block_hashes != b.block_hashes


def test_multimodal_keys_and_next_index_as_vllm():
    feature = SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=3, length=4))
    request = Request("r", list(range(12)), mm_features=[feature])
    assert utils.generate_block_hash_extra_keys(request, 0, 4, 0) == ((("mm", "img", 3),), 0)
    assert utils.generate_block_hash_extra_keys(request, 4, 8, 0) == ((("mm", "img", -1),), 1)
    assert utils.generate_block_hash_extra_keys(request, 8, 12, 1) == (None, 1)


def test_kvcaches_own_chain_covers_the_lookahead_tokens():
    hasher = utils.get_request_block_hasher(2, None, 2, none_hash_seed="seed")
    request = Request("r", [1, 2, 3], block_hasher=hasher, cache_salt="s")
    assert request.block_hashes == []
    request.append_output_token_ids(9)
    tokens = b"".join(t.to_bytes(8, "little") for t in (1, 2))
    tail = b"".join(t.to_bytes(8, "little") for t in (3, 9))
    salt = b"\x01" + (1).to_bytes(4, "little") + b"s"
    message = (utils.none_hash("seed") + (2).to_bytes(4, "little") + tokens + salt
               + b"\x05" + (2).to_bytes(4, "little") + tail)
    assert request.block_hashes == [hashlib.sha256(message).digest()]
    other = Request("o", [1, 2, 3, 8], block_hasher=hasher, cache_salt="s")
    assert other.block_hashes != request.block_hashes  # the next tokens are part of the key


def test_lookahead_accepts_vllms_bools():
    hasher = utils.get_request_block_hasher(2, sha256, True)
    assert Request("r", [1, 2, 3], block_hasher=hasher).block_hashes == [
        sha256((utils.NONE_HASH, (1, 2), (None, 3)))
    ]


@pytest.mark.parametrize("sampling, pooling, want", [
    (SimpleNamespace(max_tokens=3), None, (3, None)),
    (None, SimpleNamespace(), (1, None)),
    (SimpleNamespace(max_tokens=3, prompt_logprobs=1, prompt_logprob_start=2), None, (3, 2)),
    (SimpleNamespace(max_tokens=3, skip_reading_prefix_cache=True), None, (3, 0)),
])
def test_vllms_parameters_decide_tokens_and_hit_limit(sampling, pooling, want):
    request = Request("r", [1, 2], sampling, pooling)
    assert (request.max_tokens, request.prefix_cache_hit_limit) == want
    assert request.skip_reading_external_kv is (want[1] is not None)


def test_vllms_layout_fields_are_taken():
    spec = MambaSpec(block_size=4, shapes=((8,),), dtypes=("float16",))
    assert spec.shapes == ((8,),)
    assert MLAAttentionSpec(block_size=4, cache_dtype_str="auto").cache_dtype_str == "auto"


def xxhash(value: object) -> bytes:
    """Stands in for vLLM's xxhash: only its module and name decide the none hash's seed."""
    return hashlib.sha256(pickle.dumps(value)).digest()[:16]


xxhash.__module__ = "vllm.utils.hashing"


def test_the_none_hash_seed_is_vllms_fixed_one_for_a_crypto_hash_and_random_for_xxhash(
    monkeypatch,
):
    assert utils.DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert utils.resolve_none_hash_seed(sha256) == "vllm-none-hash"
    seeds = {utils.resolve_none_hash_seed(xxhash) for _ in range(3)}
    assert len(seeds) == 3 and "vllm-none-hash" not in seeds
    utils.init_none_hash(xxhash)
    assert utils.NONE_HASH == xxhash(utils.get_none_hash_seed())
    monkeypatch.setenv("PYTHONHASHSEED", "12345")
    assert utils.resolve_none_hash_seed(xxhash) == utils.resolve_none_hash_seed(sha256) == "12345"


def test_a_tensors_embeddings_are_hashed_once_per_block_from_their_raw_bytes(monkeypatch):
    torch = pytest.importorskip("torch")
    embeds = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    request = Request("r", None, prompt_embeds=embeds)
    assert request.all_token_ids == [0, 0, 0, 0] and request.num_prompt_tokens == 4
    assert bytes(utils.tensor_data(embeds[2:4])) == embeds[2:4].numpy().tobytes()
    assert bytes(utils.tensor_data(embeds.t())) == embeds.t().contiguous().numpy().tobytes()
    calls = []
    monkeypatch.setattr(utils, "tensor_data", lambda t: calls.append(t) or b"x")
    keys = [utils.generate_block_hash_extra_keys(request, 0, 2, 0)[0] for _ in range(2)]
    assert keys == [(("prompt_embeds", hashlib.sha256(b"x").digest()),)] * 2
    assert len(calls) == 1


def test_event_extra_keys_drop_their_tags():
    keys = (("lora", "a", "/p"), ("mm", "img", 2), ("cache_salt", "s"))
    assert utils.to_event_extra_keys([keys, None]) == [("a", ("img", 2), "s"), None]
    assert utils.to_event_extra_keys([]) is None and utils.to_event_extra_keys(None) is None


@pytest.mark.parametrize("num_hashes, lookahead, kept", [
    (3, 0, True), (2, 0, False), (4, 0, False), (2, 2, True), (3, 2, False)])
def test_a_frontends_hashes_are_kept_only_when_they_count_the_prompts_blocks(
    num_hashes, lookahead, kept
):
    hashes = [bytes([i]) * 32 for i in range(num_hashes)]
    request = SimpleNamespace(block_hashes=hashes, prompt_token_ids=list(range(10)))
    config = SimpleNamespace(hash_block_size=3, num_lookahead_tokens=lookahead)
    assert utils.frontend_block_hashes(request, config) == (hashes if kept else None)
    assert utils.frontend_block_hashes(request, None) is None


@pytest.mark.parametrize("setting, want", [(None, "int"), ("1", "int"), ("0", "bytes")])
def test_events_publish_hashes_as_vllms_maybe_convert_block_hash(monkeypatch, setting, want):
    if setting is None:
        monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", setting)
    digest = bytes(range(32))
    converted = utils.maybe_convert_block_hash(digest)
    assert converted == (int.from_bytes(digest[24:], "big") if want == "int" else digest)
    m = make_manager(16, FullAttentionSpec(block_size=2), enable_kv_cache_events=True,
                     num_hash_lookahead_tokens=1)
    request = Request("r", [1, 2, 3, 4, 5],
                      block_hasher=utils.get_request_block_hasher(2, sha256, 1))
    assert m.allocate_slots(request, 5) is not None
    (stored,) = m.take_events()
    assert stored.block_hashes == [utils.maybe_convert_block_hash(h)
                                   for h in request.block_hashes]
    assert type(stored.block_hashes[0]).__name__ == want
    assert stored.lookahead_token_ids == [[3], [5]]
