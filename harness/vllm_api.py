"""What the installed vLLM offers, found by probing it (never by its version string).

`load_vllm()` imports vLLM's v1 KV cache manager once, looks up the helpers that moved between
releases, reads the signatures the adapter calls, and returns a `VllmApi`: the objects plus the
optional features this install has (`FEATURES`). An install the adapter cannot drive — a module
or helper missing, a new required argument, an argument the adapter passes that is gone —
raises `VllmUnsupported`, whose message says what was found and what kvfuzz supports; the CLI
turns it into exit 2.

Importing vLLM costs seconds (torch, transformers), so nothing here runs until a vLLM side is
built or checked.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfuzz.core.errors import KvfuzzError

SUPPORTED = "0.32–0.34 and development checkouts that keep their API"
"""The releases this adapter was written against (docs/vllm.md, per-release table)."""

INSTALL_HINT = "`bash ci/install-vllm.sh [VERSION]` installs one (docs/vllm.md)"


class VllmUnavailable(KvfuzzError):
    """vLLM is not importable in this Python, or this install cannot be driven."""


class VllmUnsupported(VllmUnavailable):
    """vLLM imports but offers an API the adapter cannot drive."""


# Where each object lives; the first location that imports wins (helpers move between releases).
_LOCATIONS: dict[str, tuple[str, ...]] = {
    "KVCacheManager": ("vllm.v1.core.kv_cache_manager:KVCacheManager",),
    "Request": ("vllm.v1.request:Request",),
    "RequestStatus": ("vllm.v1.request:RequestStatus",),
    "SamplingParams": ("vllm.sampling_params:SamplingParams",),
    "sha256": ("vllm.utils.hashing:sha256", "vllm.utils:sha256"),
    "utils": ("vllm.v1.core.kv_cache_utils",),
    "coordinator": ("vllm.v1.core.kv_cache_coordinator",),
    "interface": ("vllm.v1.kv_cache_interface",),
    "BlockPool": ("vllm.v1.core.block_pool:BlockPool",),
}

# Arguments the adapter passes; an install whose signature lacks one cannot be driven.
_REQUEST_ARGS = ("request_id", "prompt_token_ids", "sampling_params", "pooling_params",
                 "arrival_time", "cache_salt", "priority", "block_hasher")
_MANAGER_ARGS = ("kv_cache_config", "max_model_len", "scheduler_block_size", "hash_block_size",
                 "max_in_flight_tokens", "enable_caching", "use_eagle", "watermark")
_ALLOCATE_ARGS = ("num_new_computed_tokens", "new_computed_blocks", "num_lookahead_tokens",
                  "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks",
                  "has_scheduled_reqs")
_MANAGER_METHODS = ("get_computed_blocks", "allocate_slots", "free", "cache_blocks",
                    "evict_blocks", "reset_prefix_cache", "take_new_block_ids",
                    "take_kv_cache_block_copies", "get_block_ids")
_UTILS = ("get_request_block_hasher",)
_SPECS = ("KVCacheConfig", "KVCacheGroupSpec", "FullAttentionSpec", "SlidingWindowSpec",
          "ChunkedLocalAttentionSpec", "CrossAttentionSpec")


def _takes(obj: str, method: str, arg: str) -> Callable[["VllmApi"], bool]:
    return lambda api: arg in _parameters(getattr(api.objects[obj], method, None))


FEATURES: dict[str, tuple[str, Callable[["VllmApi"], bool]]] = {
    "lookup_bound": (
        "get_computed_blocks(request, max_cache_hit_length)",
        _takes("KVCacheManager", "get_computed_blocks", "max_cache_hit_length"),
    ),
    "hash_lookahead": (
        "KVCacheManager(num_hash_lookahead_tokens=)",
        _takes("KVCacheManager", "__init__", "num_hash_lookahead_tokens"),
    ),
    "prefill_lookahead": (
        "KVCacheManager(num_prefill_lookahead=)",
        _takes("KVCacheManager", "__init__", "num_prefill_lookahead"),
    ),
    "shared_prefix_checkpoint": (
        "KVCacheManager(enable_mamba_shared_prefix_checkpoint=)",
        _takes("KVCacheManager", "__init__", "enable_mamba_shared_prefix_checkpoint"),
    ),
    "cached_tokens_probe": (
        "KVCacheManager.get_num_cached_tokens(request)",
        lambda api: callable(getattr(api.objects["KVCacheManager"], "get_num_cached_tokens",
                                     None)),
    ),
    "request_hit_limit": (
        "Request.prefix_cache_hit_limit / get_max_cache_hit_length(bound)",
        lambda api: callable(getattr(api.objects["Request"], "get_max_cache_hit_length", None)),
    ),
    "deferred_free": (
        "KVCacheManager.pop_blocks_for_free(request), to free blocks after a step in flight",
        lambda api: callable(getattr(api.objects["KVCacheManager"], "pop_blocks_for_free",
                                     None)),
    ),
    "free_evict_first": (
        "BlockPool.free_blocks(blocks, evict_first)",
        _takes("BlockPool", "free_blocks", "evict_first"),
    ),
    "frontend_hashes": (
        "Request(block_hashes=): prompt block hashes precomputed by the frontend",
        _takes("Request", "__init__", "block_hashes"),
    ),
    "null_ref_counted": (
        "free_blocks and touch move the null block's ref_cnt (fixed in 0.33)",
        lambda api: _frees_null_block(api["BlockPool"]),
    ),
    "kv_events": (
        "KVCacheManager(enable_kv_cache_events=) and take_events()",
        _takes("KVCacheManager", "__init__", "enable_kv_cache_events"),
    ),
    "report_mode": (
        "Request.kv_cache_report_mode from SamplingParams.extra_args (\"full\": a prefix hit "
        "re-announces its blocks, BlockPool.emit_cached_block_events)",
        lambda api: callable(getattr(api.objects["BlockPool"], "emit_cached_block_events",
                                     None)),
    ),
    "prompt_embeds_mask": (
        "Request(prompt_is_token_ids=): prompts mixing token ids and embeddings",
        _takes("Request", "__init__", "prompt_is_token_ids"),
    ),
    "state_tail_rekeyed": (
        "a Mamba align group marks a state already keyed at the prompt's tail as cached again "
        "(fixed in 0.33)",
        lambda api: _rekeys_state_tail(),
    ),
    "kv_connector": (
        "allocate_slots(num_external_computed_tokens=, delay_cache_blocks=) for KV connector "
        "loads",
        lambda api: {"num_external_computed_tokens", "delay_cache_blocks"}
        <= set(_parameters(api["KVCacheManager"].allocate_slots)),
    ),
    "retention": (
        "KVCacheConfig(prefix_cache_retention_interval=): sparse prefix-cache retention",
        lambda api: "prefix_cache_retention_interval" in _parameters(
            api["interface"].KVCacheConfig),
    ),
    "state_retention": (
        "MambaManager.reachable_block_mask: state checkpoints thinned by the retention "
        "interval",
        lambda api: _masks_state_checkpoints(),
    ),
    "junction_eagle_unkept": (
        "under EAGLE the retention masks keep no block one below a shared-prefix junction "
        "(added in 0.33)",
        lambda api: _junction_without_eagle_block(),
    ),
    "prefill_checkpoints": (
        "MambaSpec(num_prefill_checkpoint_blocks=, prefill_checkpoint_alignment=): Mamba "
        "prefill checkpoint blocks",
        lambda api: {"num_prefill_checkpoint_blocks", "prefill_checkpoint_alignment"}
        <= set(_parameters(getattr(api["interface"], "MambaSpec", None))),
    ),
    "int32_tokens": (
        "token ids stored as int32 (vllm.v1.token_buffer.TokenBuffer)",
        lambda api: _importable("vllm.v1.token_buffer"),
    ),
}
"""Optional features: name -> (what it is, probe). Deviations and ops key on these names."""


@dataclass(frozen=True)
class VllmApi:
    """The installed vLLM: its objects and which optional `FEATURES` it has."""

    version: str
    location: str
    """Where vLLM is imported from (a site-packages or a source checkout)."""
    objects: dict[str, Any]
    features: frozenset[str] = field(default_factory=frozenset)

    def __getitem__(self, name: str) -> Any:
        return self.objects[name]

    def has(self, feature: str) -> bool:
        return feature in self.features

    def describe(self) -> str:
        """One line: version, location and features, for reports and `kvfuzz targets`."""
        feats = ", ".join(sorted(self.features)) or "none of the optional ones"
        return f"vLLM {self.version} at {self.location}; features: {feats}"


_API: VllmApi | None = None


def load_vllm() -> VllmApi:
    """The installed vLLM, probed once (VllmUnavailable / VllmUnsupported if it cannot be)."""
    global _API
    if _API is None:
        _API = _probe()
    return _API


def check_vllm() -> None:
    """Raise VllmUnavailable (a usage error: exit 2) unless the installed vLLM can be driven."""
    load_vllm()


def _probe() -> VllmApi:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # Import-time warnings of vLLM's dependencies (requests, transformers) are not ours to show.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _probe_quietly()


def _probe_quietly() -> VllmApi:
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        raise VllmUnavailable(f"vLLM is not importable here ({exc}); {INSTALL_HINT}") from None
    except Exception as exc:  # noqa: BLE001 - a broken install is a usage error, not a crash
        raise VllmUnavailable(f"importing vLLM failed: {type(exc).__name__}: {exc}; "
                              f"{INSTALL_HINT}") from None
    version = str(getattr(vllm, "__version__", "(no __version__)"))
    location = os.path.dirname(os.path.dirname(getattr(vllm, "__file__", "") or "?"))
    what = f"vLLM {version}"
    objects = {name: _locate(what, name, places) for name, places in _LOCATIONS.items()}
    _quiet_vllm_logs()
    _require_signature(what, objects["Request"].__init__, "Request()", _REQUEST_ARGS)
    _require_signature(what, objects["KVCacheManager"].__init__, "KVCacheManager()",
                       _MANAGER_ARGS)
    for method in _MANAGER_METHODS:
        if not callable(getattr(objects["KVCacheManager"], method, None)):
            _unsupported(what, f"KVCacheManager has no method {method}()")
    _require_signature(what, objects["KVCacheManager"].allocate_slots,
                       "KVCacheManager.allocate_slots()", _ALLOCATE_ARGS, positional=2)
    for name in _UTILS:
        if not hasattr(objects["utils"], name):
            _unsupported(what, f"vllm.v1.core.kv_cache_utils has no {name}")
    for name in _SPECS:
        if not hasattr(objects["interface"], name):
            _unsupported(what, f"vllm.v1.kv_cache_interface has no {name}")
    if not callable(getattr(objects["coordinator"], "partial_hash_hits_enabled", None)):
        _unsupported(what, "vllm.v1.core.kv_cache_coordinator has no partial_hash_hits_enabled()")
    import torch

    objects["dtype"] = torch.float16
    api = VllmApi(version, location, objects)
    features = frozenset(name for name, (_, probe) in FEATURES.items() if probe(api))
    return VllmApi(version, location, objects, features)


def _locate(what: str, name: str, places: tuple[str, ...]) -> Any:
    errors = []
    for place in places:
        module_name, _, attr = place.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            errors.append(f"{module_name}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - a broken install is a usage error
            _unsupported(what, f"importing {module_name} raised {type(exc).__name__}: {exc}")
        if not attr:
            return module
        if hasattr(module, attr):
            return getattr(module, attr)
        errors.append(f"{module_name} has no {attr}")
    _unsupported(what, f"{name} not found ({'; '.join(errors)})")


def _parameters(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _require_signature(what: str, fn: Any, call: str, passed: tuple[str, ...],
                       positional: int = 0) -> None:
    """Every argument the adapter passes exists; no other argument is required."""
    params = _parameters(fn)
    names = [n for n in params if n != "self"]
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for name in passed:
        if name not in params and not takes_kwargs:
            _unsupported(what, f"{call} no longer takes the argument {name}")
    given = set(passed) | set(names[:positional])
    for name, p in params.items():
        if (name != "self" and name not in given and p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)):
            _unsupported(what, f"{call} takes a new required argument {name}")


def _unsupported(what: str, problem: str) -> Any:
    raise VllmUnsupported(f"{what}: {problem}; kvfuzz supports vLLM {SUPPORTED}")


def vllm_source(module: str, qualname: str) -> str | None:
    """The source of `qualname` ("Class.method") in vLLM's `module`; None where there is no
    such module, class or method, or its source cannot be read (not this release)."""
    try:
        found: Any = importlib.import_module(module)
        for name in qualname.split("."):
            found = getattr(found, name)
        return inspect.getsource(found)
    except Exception:  # noqa: BLE001 - absent, different or unreadable: not this release
        return None


_MANAGERS = "vllm.v1.core.single_type_kv_cache_manager"


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - absent or broken: the feature is not there
        return False
    return True


def _rekeys_state_tail() -> bool:
    """Whether MambaManager._cache_partial_tail_block lacks 0.33's "already keyed here" return
    (read from its source; no source, or no such method: nothing to tolerate)."""
    source = vllm_source(_MANAGERS, "MambaManager._cache_partial_tail_block")
    return source is not None and "block_hash_num_tokens == num_tokens" not in source


def _junction_without_eagle_block() -> bool:
    """Whether SingleTypeKVCacheManager.cache_blocks keeps the junction but not, under EAGLE,
    the block below it (read from its source; no junction there: nothing to tolerate)."""
    source = vllm_source(_MANAGERS, "SingleTypeKVCacheManager.cache_blocks")
    if source is None:
        return False
    compact = "".join(source.split())
    return ("shared_prefix_boundary" in compact
            and "shared_prefix_boundary-self.block_size" not in compact)


def _masks_state_checkpoints() -> bool:
    """Whether vLLM's MambaManager defines its own caching mask (retention of state
    checkpoints) rather than inheriting the dense one."""
    try:
        manager = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
    except Exception:  # noqa: BLE001 - no such module: no such feature
        return False
    return "reachable_block_mask" in vars(getattr(manager, "MambaManager", object))


def _frees_null_block(block_pool: Any) -> bool:
    """A behavioural probe: does freeing the null block of a fresh pool change its ref_cnt?"""
    try:
        pool = block_pool(num_gpu_blocks=2, enable_caching=True, hash_block_size=16)
        pool.free_blocks([pool.null_block])
    except Exception:  # noqa: BLE001 - a pool that refuses has nothing to tolerate
        return False
    return pool.null_block.ref_cnt != 0


def _quiet_vllm_logs() -> None:
    """vLLM's own warnings (once per process or per request) must not flood a campaign."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "ERROR").upper()
    logging.getLogger("vllm").setLevel(getattr(logging, level, logging.ERROR))
