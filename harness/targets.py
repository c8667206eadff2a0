"""The target registry: names the executor and `kvfuzz --target` accept.

A target is a `SideFactory` (config, level) -> Side. Built-ins register themselves lazily so
that listing them imports neither vLLM nor torch. A plugin registers its own with
`register_target` (see README.md, "Adding a target").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from kvfuzz.core.config import Config
from kvfuzz.core.errors import KvfuzzError, require
from kvfuzz.core.sides import Side, SideFactory
from kvfuzz.harness.build import BuildFailure
from kvfuzz.harness.tolerance import Tolerance, tolerating


class UnknownTarget(KvfuzzError):
    """No target is registered under that name."""


@dataclass(frozen=True)
class TargetInfo:
    name: str
    description: str
    locate: Callable[[], SideFactory]
    """Returns the factory; imports on first use."""
    requires: tuple[str, str] | None = None
    """(module, how to install it) when the target needs an optional package."""

    def check_available(self) -> None:
        """A KvfuzzError (exit 2) saying what is missing if the target cannot be built here."""
        if self.requires is not None:
            require(*self.requires, f"target {self.name}")
        # A factory may probe what it needs beyond importability (the vLLM adapter does).
        check = getattr(self.locate(), "check_available", None)
        if check is not None:
            check()

    def build(self, config: Config, level: str) -> Side:
        return self.locate()(config, level)

    def engine_config(self, config: Config) -> Config:
        """`config` with the knobs the target's engine fixes set as it runs them (a factory's
        `engine_config`, where it has one; vLLM's schedulers set `in_flight_sampling` and the loop
        rules `self_preemption`, `blocked_waiting`)."""
        adapt = getattr(self.locate(), "engine_config", None)
        return config if adapt is None else adapt(config)

    def spec(self, tolerance: Tolerance | None = None) -> str | SideFactory:
        """What an execution takes for this target: its name, or with `tolerance` a factory
        tolerating those deviations (`kvfuzz.harness.tolerance`)."""
        if not tolerance:
            return self.name
        return tolerating(self.locate(), self.name, tolerance)

    def cannot_build(self, config: Config) -> str | None:
        """Why this target cannot build `config` here (its own exception, in one line), or
        None when it can."""
        try:
            self.build(config, "api")
        except KvfuzzError:
            raise
        except BuildFailure as exc:  # the library's own failure, e.g. vLLM's (docs/findings/012)
            return exc.message
        except Exception as exc:  # noqa: BLE001 - an adapter's failure, said in one line
            return f"{type(exc).__name__}: {exc}"
        return None


_TARGETS: dict[str, TargetInfo] = {}


def register_target(name: str, description: str, factory: SideFactory,
                    requires: tuple[str, str] | None = None) -> None:
    """Make `factory` available as `--target NAME` (`requires`: (module, how to install it)
    when it needs an optional package)."""
    _TARGETS[name] = TargetInfo(name, description, lambda: factory, requires)


def _lazy(name: str, description: str, module: str, attr: str,
          requires: tuple[str, str] | None = None) -> None:
    _TARGETS[name] = TargetInfo(
        name, description, lambda: getattr(importlib.import_module(module), attr), requires
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
    importlib.import_module("kvfuzz.harness.mutants")
    importlib.import_module("kvfuzz.harness.vllm_scheduler_plants")


_lazy("kvcache", "kvfuzz's own kvcache/ (the production implementation)",
      "kvfuzz.harness.kvcache_target", "KvcacheSide")
VLLM_REQUIRED = _VLLM = ("vllm", "install vLLM into this Python (docs/vllm.md says how, CPU-only machines too)")
_lazy("vllm", "the installed vLLM's v1 KVCacheManager, 0.32–0.34 or a checkout (ci/install-vllm.sh)",
      "kvfuzz.harness.vllm_target", "VllmSide", _VLLM)
_lazy("vllm-strict", "the installed vLLM without the known deviations target vllm tolerates "
      "(docs/vllm.md)", "kvfuzz.harness.vllm_target", "VllmStrictSide", _VLLM)
_lazy("vllm-scheduler", "the installed vLLM's own v1 Scheduler running scheduler-level traces, "
      "tolerating target vllm's known deviations (docs/vllm.md)",
      "kvfuzz.harness.vllm_scheduler_target", "VllmSchedulerSide", _VLLM)
_lazy("vllm-scheduler-strict", "the installed vLLM's own v1 Scheduler without tolerated "
      "deviations", "kvfuzz.harness.vllm_scheduler_target", "VllmSchedulerStrictSide", _VLLM)
_lazy("vllm-async-scheduler", "the installed vLLM's own AsyncScheduler, each step's output "
      "taken before the next", "kvfuzz.harness.vllm_scheduler_target", "VllmAsyncSchedulerSide",
      _VLLM)
_lazy("model", "the reference model itself (checks the oracle against the invariants)",
      "kvfuzz.reference_model", "ReferenceModel")
