"""kvfuzz.dropin: vLLM's KV-core module names resolve to kvcache's while installed, and
everything is put back afterwards. Runs with or without vLLM installed (tests/vllm/test_drop_in.py
checks the rest of an installed vLLM stays vLLM's)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from kvfuzz import dropin

# Each stands for the kvcache module of its last component.
NAMES = ("vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_coordinator",
         "vllm.v1.core.kv_cache_manager", "vllm.v1.core.kv_cache_utils",
         "vllm.v1.core.single_type_kv_cache_manager", "vllm.v1.kv_cache_interface",
         "vllm.v1.request", "vllm.distributed.kv_events")
PARENTS = ("vllm", "vllm.v1", "vllm.v1.core", "vllm.distributed")


def _state() -> dict[str, object]:
    """The dropped-in names and their parents as loaded, and the parents' attributes for them."""
    state: dict[str, object] = {n: sys.modules.get(n) for n in (*NAMES, *PARENTS)}
    for name in NAMES:
        head, _, child = name.rpartition(".")
        if head in sys.modules:
            state[f"{name} (attribute)"] = getattr(sys.modules[head], child, None)
    return state


def _put_back(before: dict[str, object]) -> None:
    """Everything as before, except what installing loaded from the installed vLLM itself; and
    no vLLM name left holding a kvfuzz module."""
    after = _state()
    for key, module in after.items():
        if before.get(key) is not None or module is None:
            assert module is before.get(key), key
        else:
            assert module.__name__ == key.removesuffix(" (attribute)"), key
    assert not [n for n, m in sys.modules.items()
                if n.split(".")[0] == "vllm" and m.__name__.startswith("kvfuzz")]


@pytest.fixture
def clean():
    before = _state()
    yield before
    dropin.uninstall()
    _put_back(before)


def test_each_name_imports_kvcaches_module_and_exit_puts_everything_back(clean):
    with dropin.dropped_in():
        for name in NAMES:
            ours = "kvfuzz.kvcache." + name.rpartition(".")[2]
            assert importlib.import_module(name) is importlib.import_module(ours), name
        import vllm.v1.core.kv_cache_utils as utils  # the `import a.b.c as x` form
        from vllm.v1.core import kv_cache_manager  # the `from package import module` form
        from vllm.v1.core.block_pool import BlockPool  # the `from module import name` form
        assert utils is sys.modules["kvfuzz.kvcache.kv_cache_utils"]
        assert kv_cache_manager is sys.modules["kvfuzz.kvcache.kv_cache_manager"]
        assert BlockPool is importlib.import_module("kvfuzz.kvcache").BlockPool
    _put_back(clean)


def test_exit_on_an_exception_puts_everything_back(clean):
    with pytest.raises(RuntimeError), dropin.dropped_in():
        raise RuntimeError("boom")
    _put_back(clean)


def test_install_is_idempotent_and_nested_use_uninstalls_at_the_outermost_exit(clean):
    dropin.install()
    dropin.install()
    with dropin.dropped_in():
        pass
    assert sys.modules["vllm.v1.request"] is importlib.import_module("kvfuzz.kvcache.request")
    dropin.uninstall()
    dropin.uninstall()
    _put_back(clean)
    with dropin.dropped_in():
        with dropin.dropped_in():
            pass
        assert sys.modules["vllm.v1.request"] is importlib.import_module("kvfuzz.kvcache.request")
    _put_back(clean)


def test_only_install_uninstall_and_dropped_in_are_public():
    public = {n for n, v in vars(dropin).items() if not n.startswith(("_", "@"))
              and getattr(v, "__module__", None) == dropin.__name__}
    assert public == {"install", "uninstall", "dropped_in"}


def test_a_vllm_module_first_imported_while_installed_is_forgotten_at_exit(clean):
    name = "vllm.v1.core.kvfuzz_test_user"
    with dropin.dropped_in():
        # What importing a vLLM module that binds kvcache's names leaves behind.
        user = types.ModuleType(name)
        sys.modules[name] = user
        setattr(sys.modules["vllm.v1.core"], "kvfuzz_test_user", user)
    assert name not in sys.modules
    assert not hasattr(sys.modules.get("vllm.v1.core"), "kvfuzz_test_user")
