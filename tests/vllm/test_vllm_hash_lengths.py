"""kvcache and vLLM cache under a hash function of another length than SHA-256's (vLLM's xxhash
functions give 16 bytes): a three-way run (both targets and the reference model, through the
one executor) where both sides hash every request with one 16-byte function, as vLLM's
engine does with `prefix_caching_hash_algo="xxhash"` (docs/spec.md §2.4): vLLM's xxhash
functions where `xxhash` is installed, and a BLAKE2b one everywhere. The config space has no
hash-function field, so the sides here swap their hasher for one built from the function.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvfuzz.core.config import Config
from kvfuzz.fuzz.machines import machine_for
from kvfuzz.harness.kvcache_target import KvcacheSide
from kvfuzz.harness.vllm_target import VllmSide, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]


def blake2b_16(value: Any) -> bytes:
    """A hash function of vLLM's kind with xxhash's length: any picklable value to 16 bytes."""
    return hashlib.blake2b(pickle.dumps(value, protocol=5), digest_size=16).digest()


def _sides(hash_fn: Callable[[Any], bytes]) -> tuple[type, type]:
    """kvcache's and vLLM's sides, whose requests hash with `hash_fn` through their own
    library's vLLM-form hasher, the none hash made with it too; no router audit (the router
    knows only vLLM's named functions, and these sides are not built from a name)."""

    class Hashing:
        utils: Any

        def build_manager(self, config: Config) -> Any:
            manager = super().build_manager(config)  # type: ignore[misc]
            self.utils.NONE_HASH = hash_fn(config.none_hash_seed)
            self._hasher = self.utils.get_request_block_hasher(
                config.resolved_hash_block_size, hash_fn)
            return manager

        def router_chain(self, config: Config) -> None:
            return None

    class Kvcache(Hashing, KvcacheSide):
        from kvfuzz.kvcache import kv_cache_utils as utils

    class Vllm(Hashing, VllmSide):
        @property
        def utils(self) -> Any:  # type: ignore[override]
            return self.api["utils"]

    return Kvcache, Vllm


def _hash_fn(name: str) -> Callable[[Any], bytes]:
    """`blake2b_16`, or vLLM's function of that name (its xxhash ones need `xxhash`)."""
    if name == "blake2b_16":
        return blake2b_16
    pytest.importorskip("xxhash")
    import vllm.utils.hashing

    return getattr(vllm.utils.hashing, name)


FUNCTIONS = ["blake2b_16", "xxhash", "xxhash_cbor"]


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("name", ["full", "hybrid"])
def test_both_cache_under_16_byte_hashes_as_the_model_says(name: str, fn: str) -> None:
    machine = machine_for("api", targets=_sides(_hash_fn(fn)), allow_misuse=False,
                          config_names=(name,), vary_configs=False)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=15, deadline=None, suppress_health_check=list(HealthCheck)))


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_the_sides_key_blocks_under_16_byte_hashes(fn: str) -> None:
    """What the run above compares is hits on 16-byte keys (kvcache used to refuse them)."""
    from kvfuzz.core.configs import BUILTIN
    from kvfuzz.core.trace import normalize_op

    for side_type in _sides(_hash_fn(fn)):
        side = side_type(BUILTIN["hybrid"][1], "api")
        request = side.make_request(normalize_op(
            {"op": "add_request", "request_id": "a", "prompt": list(range(40)), "max_tokens": 4},
            "api"), 0.0)
        assert {len(h) for h in request.block_hashes} == {16}
        manager = side.manager
        assert manager.allocate_slots(request, 40) is not None
        keys = [b.block_hash for b in manager.block_pool.blocks if b.block_hash is not None]
        assert keys and {len(k) for k in keys} == {20}, side_type.__name__
