"""The target registry: names the executor and `kvfuzz --target` accept.

A target is a `SideFactory` (config, level) -> Side. Built-ins register themselves lazily so
that listing them imports neither vLLM nor torch. A plugin registers its own with
`register_target` (see README.md, "Adding a target").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from harness.config import Config
from harness.errors import KvfuzzError
from harness.sides import Side, SideFactory


class UnknownTarget(KvfuzzError):
    """No target is registered under that name."""


@dataclass(frozen=True)
class TargetInfo:
    name: str
    description: str
    locate: Callable[[], SideFactory]
    """Returns the factory; imports on first use."""

    def build(self, config: Config, level: str) -> Side:
        return self.locate()(config, level)


_TARGETS: dict[str, TargetInfo] = {}


def register_target(name: str, description: str, factory: SideFactory) -> None:
    """Make `factory` available as `--target NAME`."""
    _TARGETS[name] = TargetInfo(name, description, lambda: factory)


def _lazy(name: str, description: str, module: str, attr: str) -> None:
    _TARGETS[name] = TargetInfo(
        name, description, lambda: getattr(importlib.import_module(module), attr)
    )


def targets() -> list[TargetInfo]:
    _load_mutants()
    return list(_TARGETS.values())


def get_target(name: str) -> TargetInfo:
    if name not in _TARGETS:
        _load_mutants()
    try:
        return _TARGETS[name]
    except KeyError:
        known = ", ".join(sorted(_TARGETS))
        raise UnknownTarget(f"unknown target {name!r}; known targets: {known}") from None


def _load_mutants() -> None:
    importlib.import_module("harness.mutants")


_lazy("kvcache", "kvfuzz's own kvcache/ (the production implementation)",
      "harness.kvcache_target", "KvcacheSide")
_lazy("vllm", "vLLM 0.33.0's v1 KVCacheManager (needs the venv of ci/install-vllm.sh)",
      "harness.vllm_target", "VllmSide")
_lazy("vllm-strict", "vLLM 0.33.0 without the known deviations target vllm tolerates "
      "(docs/vllm.md)", "harness.vllm_target", "VllmStrictSide")
_lazy("model", "the reference model itself (checks the oracle against the invariants)",
      "reference_model", "ReferenceModel")
