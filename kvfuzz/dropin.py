"""kvcache dropped in for vLLM's KV cache core: code that imports `vllm.v1.core.block_pool`,
`vllm.v1.core.kv_cache_manager`, ... gets kvcache's modules, and the rest of `vllm` stays vLLM's.

    from kvfuzz.dropin import dropped_in

    with dropped_in():
        from vllm.v1.core.kv_cache_manager import KVCacheManager   # kvfuzz.kvcache's
        from vllm.sampling_params import SamplingParams            # vLLM's own

The names that resolve to kvcache (`vllm.` left out): `v1.core.block_pool`,
`v1.core.kv_cache_coordinator`, `v1.core.kv_cache_manager`, `v1.core.kv_cache_utils`,
`v1.core.single_type_kv_cache_manager`, `v1.kv_cache_interface`, `v1.request` and
`distributed.kv_events`. Everything else (`vllm.v1.core.sched`, `vllm.sampling_params`,
`vllm.utils.hashing`, ...) is vLLM's, and a vLLM module that imports one of the names above while
installed gets kvcache's.

The whole public API is three functions:

- `install()` puts kvcache's modules in `sys.modules` under vLLM's names, and sets them as
  attributes of their parent packages, keeping whatever was there;
- `uninstall()` puts back what `install()` replaced (a no-op when not installed);
- `dropped_in()` is a context manager doing `install()` on entry and `uninstall()` on exit.

`install()` is idempotent (a second call changes nothing) and returns nothing. The parent packages
(`vllm`, `vllm.v1`, `vllm.v1.core`, `vllm.distributed`) are imported from the installed vLLM;
where vLLM is not installed they are empty placeholder packages that `uninstall()` removes, so
code that imports only the names above runs without vLLM. Before replacing anything,
`install()` imports vLLM's own versions of those modules, so the vLLM modules they pull in
(`vllm.config`, `vllm.sampling_params`, ...) keep vLLM's classes. Only imports made while
installed resolve to kvcache: a vLLM module imported earlier keeps what it bound, and
`uninstall()` forgets every vLLM module first imported while installed, so a later import
loads it afresh against vLLM's own modules.
Anything kvcache lacks (a name, a parameter) fails where it is used, as it would on a vLLM
release without it; nothing is faked.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

_MODULES: dict[str, str] = {
    "vllm.v1.core.block_pool": "kvfuzz.kvcache.block_pool",
    "vllm.v1.core.kv_cache_coordinator": "kvfuzz.kvcache.kv_cache_coordinator",
    "vllm.v1.core.kv_cache_manager": "kvfuzz.kvcache.kv_cache_manager",
    "vllm.v1.core.kv_cache_utils": "kvfuzz.kvcache.kv_cache_utils",
    "vllm.v1.core.single_type_kv_cache_manager": "kvfuzz.kvcache.single_type_kv_cache_manager",
    "vllm.v1.kv_cache_interface": "kvfuzz.kvcache.kv_cache_interface",
    "vllm.v1.request": "kvfuzz.kvcache.request",
    "vllm.distributed.kv_events": "kvfuzz.kvcache.kv_events",
}
"""vLLM's module name -> the kvcache module that stands in for it."""

_MISSING = object()
# What install() did, to undo newest first: ("installed", modules imported before),
# ("module", name, old) and ("attr", package, child, old).
_saved: list[tuple] = []


def _parent(name: str) -> types.ModuleType:
    """The package `name`, imported from vLLM, or an empty placeholder package where vLLM has
    none (recorded so that uninstall() removes it)."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    head, _, child = name.rpartition(".")
    module = types.ModuleType(name, "placeholder package of kvfuzz.dropin: vLLM is not installed")
    module.__path__ = []
    _saved.append(("module", name, _MISSING))
    sys.modules[name] = module
    if head:
        _set_attr(_parent(head), child, module)
    return module


def _set_attr(package: types.ModuleType, child: str, value: object) -> None:
    _saved.append(("attr", package, child, getattr(package, child, _MISSING)))
    setattr(package, child, value)


def install() -> None:
    """Make vLLM's KV-core names import kvcache's modules (idempotent)."""
    if _saved:
        return
    # vLLM's own modules first, so that the rest of vLLM (its config, sampling params, ...)
    # binds vLLM's names before they are replaced.
    for name in _MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:  # no vLLM, or a release without this module
            pass
    # The first entry marks "installed" and holds what was imported before, so that
    # uninstall() can drop the vLLM modules first imported against kvcache.
    _saved.append(("installed", set(sys.modules)))
    for name, ours in _MODULES.items():
        module = importlib.import_module(ours)
        head, _, child = name.rpartition(".")
        package = _parent(head)
        _saved.append(("module", name, sys.modules.get(name, _MISSING)))
        sys.modules[name] = module
        _set_attr(package, child, module)


def uninstall() -> None:
    """Put back what install() replaced, newest first (a no-op when not installed)."""
    while _saved:
        entry = _saved.pop()
        if entry[0] == "installed":
            _forget_imported_since(entry[1])
        elif entry[0] == "module":
            _, name, old = entry
            if old is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
        elif entry[0] == "attr":
            _, package, child, old = entry
            if old is _MISSING:
                if hasattr(package, child):
                    delattr(package, child)
            else:
                setattr(package, child, old)


def _forget_imported_since(before: set[str]) -> None:
    """Drop the vLLM modules first imported while installed: they bound kvcache's names."""
    for name in [n for n in sys.modules if n.partition(".")[0] == "vllm" and n not in before]:
        module = sys.modules.pop(name)
        head, _, child = name.rpartition(".")
        package = sys.modules.get(head)
        if package is not None and getattr(package, child, None) is module:
            delattr(package, child)


@contextmanager
def dropped_in() -> Iterator[None]:
    """`install()` for the duration of a with-block, `uninstall()` after it (even on error).
    Nested uses install once and the outermost exit uninstalls."""
    outermost = not _saved
    install()
    try:
        yield
    finally:
        if outermost:
            uninstall()
