"""The pytest plugin of the run that test_vllm_suite.py starts over vLLM's own test files.

Loaded with `-p suite_plugin` (this folder on PYTHONPATH), in a pytest that runs the files
unchanged, in place in the release's source distribution, with `--noconftest`:

- unless KVFUZZ_SUITE_TARGET=vllm, `kvfuzz.dropin` is installed before any test file is
  imported, so `vllm.v1.core.*` (and the other names kvcache stands in for) are kvcache's;
- while the files are collected, a name that a kvcache module lacks imports as a stand-in
  that raises when it is called, read or tested against, so only the tests that use
  it fail, each with a message naming what kvcache lacks; once collection ends, a missing name is
  an AttributeError as usual;
- `importlib.reload()` of such a module (vLLM's none-hash tests reload `kv_cache_utils`) re-runs
  kvcache's module: reloaded by its vLLM name, it would otherwise run vLLM's own file of that
  name in its place, and the tests after it would run vLLM's code;
- a test that runs past KVFUZZ_SUITE_TIMEOUT seconds (default 20) is stopped with a
  SuiteTimeout (some of vLLM's connector tests wait on a network this run does not have);
- every test's outcome (`passed`, `failed`, `error`, `skipped`) and, for a failure, its last
  line go to the JSON file KVFUZZ_SUITE_OUT, with each collection error of a file.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import sys
import types
from typing import Any

import pytest

_collecting = False
_outcomes: dict[str, dict[str, str]] = {}
_collection_errors: dict[str, str] = {}


class _LackingMeta(type):
    """A stand-in's class: it fails wherever it is used, not where it is imported."""

    def _fail(cls, *_: Any, **__: Any) -> Any:
        raise LookupError(f"kvcache lacks {cls.__qualname__}")

    __call__ = __instancecheck__ = __subclasscheck__ = __iter__ = _fail

    def __getattr__(cls, name: str) -> Any:
        # While collecting, a member read at import (an enum value as a default) is a stand-in
        # too; dunder reads are pytest's and Python's probes.
        if _collecting and not name.startswith("__"):
            return lacking(f"{cls.__qualname__}.{name}")
        raise AttributeError(f"kvcache lacks {cls.__qualname__} (reading .{name})")

    def __getitem__(cls, _: Any) -> type:  # annotations such as Lacking[int]
        return cls

    def __or__(cls, _: Any) -> type:  # annotations such as Lacking | None
        return cls

    __ror__ = __or__


def lacking(qualname: str) -> type:
    """The stand-in for `qualname`, a name kvcache lacks."""
    return _LackingMeta(qualname.rpartition(".")[2], (), {"__qualname__": qualname})


class _Lenient(types.ModuleType):
    """A kvcache module under its vLLM name; reads and writes go to the module, and a missing
    name is a stand-in while the files are being collected. Its own import attributes
    (`__spec__`, `__name__`, ... set by a reload) stay on it, so the module keeps its own."""

    def __init__(self, name: str, module: types.ModuleType) -> None:
        super().__init__(name, module.__doc__)
        object.__setattr__(self, "_module", module)

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._module, name)
        except AttributeError:
            if _collecting and not name.startswith("__"):
                return lacking(f"{self.__name__}.{name}")
            raise

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._module, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._module, name)


class _ReloadKvcache:
    """A meta path finder and loader for reloads only: `importlib.reload(lenient)` finds this
    spec (reload passes the module as `target`) and reloads kvcache's module behind it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if isinstance(target, _Lenient):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: _Lenient) -> None:
        importlib.reload(module._module)


def _make_lenient() -> None:
    """Wrap each kvcache module the drop-in put under a vLLM name."""
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and module.__name__.startswith("kvfuzz.kvcache."):
            proxy = _Lenient(name, module)
            sys.modules[name] = proxy
            head, _, child = name.rpartition(".")
            setattr(sys.modules[head], child, proxy)


def pytest_configure(config: pytest.Config) -> None:
    global _collecting
    if os.environ.get("KVFUZZ_SUITE_TARGET", "kvcache") != "vllm":
        from kvfuzz import dropin

        dropin.install()
        _make_lenient()
        sys.meta_path.insert(0, _ReloadKvcache())
    _collecting = True


def pytest_collection_finish(session: pytest.Session) -> None:
    global _collecting
    _collecting = False


class SuiteTimeout(BaseException):
    """A test ran too long: a BaseException, so that a retry loop's `except Exception` in the
    code under test does not swallow it (pytest still reports the test as failed)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    seconds = int(os.environ.get("KVFUZZ_SUITE_TIMEOUT", "20"))

    def expire(*_: Any) -> None:
        raise SuiteTimeout(f"{item.nodeid} ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1)  # then every second, until it stops
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _last_line(report: Any) -> str:
    text = str(report.longrepr) if report.longrepr is not None else ""
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        text = str(report.longrepr[2])
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]  # the exception's own lines
    return (errors or lines or [""])[-1].removeprefix("E").strip()[:300]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _collection_errors[report.nodeid] = _last_line(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed"})
    if report.when == "call":
        entry["outcome"] = report.outcome
    elif report.failed:  # setup or teardown
        entry["outcome"] = "error"
    elif report.skipped:
        entry["outcome"] = "skipped"
    if not report.passed and "why" not in entry:
        entry["why"] = _last_line(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("KVFUZZ_SUITE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"tests": _outcomes, "collection_errors": _collection_errors}, f, indent=1)
