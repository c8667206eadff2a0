"""kvcache and vLLM cache under a hash function of another length than SHA-256's (vLLM's xxhash
functions give 16 bytes): a three-way run (both targets and the reference model, through the
one executor) where both sides hash every request with one 16-byte function, as vLLM's
engine does with `prefix_caching_hash_algo="xxhash"` (docs/spec.md §2.4). The config space
has no hash-function field, so the sides here swap their hasher for one built from it.
"""

from __future__ import annotations

import hashlib
import pickle
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


class _Hash16:
    """A side whose requests hash with `blake2b_16` through its own library's vLLM-form hasher,
    the none hash made with it too; no router audit (the router knows only named functions)."""

    utils: Any

    def build_manager(self, config: Config) -> Any:
        manager = super().build_manager(config)  # type: ignore[misc]
        self.utils.NONE_HASH = blake2b_16(config.none_hash_seed)
        self._hasher = self.utils.get_request_block_hasher(
            config.resolved_hash_block_size, blake2b_16)
        return manager

    def router_chain(self, config: Config) -> None:
        return None


class Kvcache16(_Hash16, KvcacheSide):
    from kvfuzz.kvcache import kv_cache_utils as utils


class Vllm16(_Hash16, VllmSide):
    @property
    def utils(self) -> Any:  # type: ignore[override]
        return self.api["utils"]


@pytest.mark.parametrize("name", ["full", "hybrid"])
def test_both_cache_under_16_byte_hashes_as_the_model_says(name: str) -> None:
    machine = machine_for("api", targets=(Kvcache16, Vllm16), allow_misuse=False,
                          config_names=(name,), vary_configs=False)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=15, deadline=None, suppress_health_check=list(HealthCheck)))


def test_the_sides_key_blocks_under_16_byte_hashes() -> None:
    """What the run above compares is hits on 16-byte keys (kvcache used to refuse them)."""
    from kvfuzz.core.configs import BUILTIN
    from kvfuzz.core.trace import normalize_op

    for side_type in (Kvcache16, Vllm16):
        side = side_type(BUILTIN["hybrid"][1], "api")
        request = side.make_request(normalize_op(
            {"op": "add_request", "request_id": "a", "prompt": list(range(40)), "max_tokens": 4},
            "api"), 0.0)
        assert {len(h) for h in request.block_hashes} == {16}
        manager = side.manager
        assert manager.allocate_slots(request, 40) is not None
        keys = [b.block_hash for b in manager.block_pool.blocks if b.block_hash is not None]
        assert keys and {len(k) for k in keys} == {20}, side_type.__name__
