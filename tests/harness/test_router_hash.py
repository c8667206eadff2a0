"""H2's router view of block hashes (harness/router_hash.py): the documented chains agree with
the targets' own hashers on plain, salted and extra-key requests, and a plant that keeps its
hashes self-consistent but off the documentation is seen."""

from __future__ import annotations

import pytest

from kvfuzz.core.extra_keys import Extras
from kvfuzz.harness.router_hash import VLLM_HASH_FUNCTIONS, HashAudit, kvcache_chain, vllm_chain
from kvfuzz.harness.vllm_api import load_vllm
from kvfuzz.harness.vllm_target import vllm_available

TOKENS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
REQUESTS = [  # (salt, extras): plain, salted, LoRA + salt, multimodal across blocks, embeddings
    (None, None),
    ("tenant", None),
    ("tenant", Extras("adapter", 3)),
    ("tenant", Extras("adapter", 1, "/kvfuzz/lora/2")),
    (None, Extras(mm_inputs=((0, 2, 5), (1, 9, 3)))),
    (None, Extras(prompt_embeds=(-1, 0, 0, -1, 2, 0, -1, -1, -1, -1, -1, -1, -1, -1))),
]


def _kvcache_hashes(salt, extras, hbs, lookahead=0):
    from kvfuzz.kvcache.kv_cache_utils import get_request_block_hasher
    from kvfuzz.core.extra_keys import lora_path
    from kvfuzz.kvcache.request import LoRARequest, MultiModalFeature, Request

    embeds = extras and extras.prompt_embeds
    tokens = [0 if embeds and v >= 0 else t for t, v in zip(TOKENS, embeds or [-1] * 99)]
    request = Request(
        "r", tokens, max_tokens=1, cache_salt=salt,
        block_hasher=get_request_block_hasher(hbs, None, lookahead, none_hash_seed="seed"),
        lora_request=LoRARequest(extras.lora_name, extras.lora_id,
                                 lora_path(extras.lora_id, extras.lora_path))
        if extras and extras.lora_name else None,
        mm_features=[MultiModalFeature(f"mm-{i}", o, n) for i, o, n in
                     (extras.mm_inputs if extras else ())],
        prompt_embeds=None if not embeds else [max(v, 0) for v in embeds],
        prompt_is_token_ids=None if not embeds else [v < 0 for v in embeds],
    )
    return request.block_hashes, tokens


@pytest.mark.parametrize("hbs", [1, 4])
@pytest.mark.parametrize("salt, extras", REQUESTS)
def test_kvcache_hashes_are_the_documented_ones(salt, extras, hbs):
    hashes, tokens = _kvcache_hashes(salt, extras, hbs)
    assert len(hashes) == len(tokens) // hbs
    audit = HashAudit(kvcache_chain("seed"), hbs)
    assert audit.audit("r", hashes, tokens, salt, extras) is None
    # A consistent change of every hash (what the plant plain-extras-empty does) is seen.
    changed = [bytes(h[:-1]) + bytes([h[-1] ^ 1]) for h in hashes]
    assert "documented hash function" in HashAudit(kvcache_chain("seed"), hbs).audit(
        "r", changed, tokens, salt, extras)


@pytest.mark.parametrize("lookahead", [1, 3])
@pytest.mark.parametrize("salt, extras", REQUESTS)
def test_kvcache_lookahead_hashes_are_the_documented_ones(salt, extras, lookahead):
    hashes, tokens = _kvcache_hashes(salt, extras, 4, lookahead)
    assert len(hashes) == (len(tokens) - lookahead) // 4
    assert HashAudit(kvcache_chain("seed", lookahead), 4, lookahead).audit(
        "r", hashes, tokens, salt, extras) is None
    # The chain without the lookahead is not the documented one.
    assert HashAudit(kvcache_chain("seed"), 4).audit("r", hashes, tokens, salt, extras)


def test_the_audit_extends_the_chain_as_the_request_grows():
    hashes, tokens = _kvcache_hashes(None, None, 4)
    audit = HashAudit(kvcache_chain("seed"), 4)
    assert audit.audit("r", hashes[:1], tokens[:4], None, None) is None
    assert audit.audit("r", hashes[:2], tokens[:8], None, None) is None
    assert audit.audited("r") == 2
    assert "hash 2" in audit.audit("r", hashes[:2] + [hashes[0]], tokens, None, None)
    assert audit.audit("r", hashes, tokens, None, None) is None


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable")
@pytest.mark.parametrize("lookahead", [0, 2])
@pytest.mark.parametrize("name", sorted(VLLM_HASH_FUNCTIONS))
@pytest.mark.parametrize("salt, extras", [r for r in REQUESTS if not (r[1] and r[1].prompt_embeds)])
def test_vllm_hashes_are_the_documented_ones_per_hash_function(name, salt, extras, lookahead):
    """vLLM's own request hasher, given each hash function it offers (and a hash lookahead,
    where the release takes one), agrees with the chain written from its documentation."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from kvfuzz.core.extra_keys import lora_path
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils import hashing
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    if name.startswith("xxhash"):
        pytest.importorskip("xxhash")
    fn = hashing.get_hash_fn_by_name(name)
    if lookahead and not load_vllm().has("hash_lookahead"):
        pytest.skip("this vLLM has no hash lookahead")
    saved = getattr(kv_cache_utils, "NONE_HASH", None)
    kv_cache_utils.NONE_HASH = fn("seed")
    try:
        request = Request(
            "r", list(TOKENS), SamplingParams(max_tokens=1), None, arrival_time=0.0,
            cache_salt=salt, block_hasher=kv_cache_utils.get_request_block_hasher(
                4, fn, *((lookahead,) if lookahead else ())),
            lora_request=LoRARequest(extras.lora_name, extras.lora_id,
                                     lora_path(extras.lora_id, extras.lora_path))
            if extras and extras.lora_name else None,
            mm_features=[MultiModalFeatureSpec(data=None, modality="image",
                                               identifier=f"mm-{i}",
                                               mm_position=PlaceholderRange(offset=o, length=n))
                         for i, o, n in (extras.mm_inputs if extras else ())] or None,
        )
        hashes = list(request.block_hashes)
    finally:
        kv_cache_utils.NONE_HASH = saved
    assert len(hashes) == (len(TOKENS) - lookahead) // 4
    audit = HashAudit(vllm_chain("seed", name, lookahead=lookahead), 4, lookahead)
    assert audit.audit("r", hashes, TOKENS, salt, extras) is None
