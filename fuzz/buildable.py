"""Which configs a campaign runs on its target: each is built once before the run starts.

- It builds: it runs.
- The library raises building it (`kvfuzz.harness.build.BuildFailure`): it runs, so that the
  campaign's first example of it fails check BUILD, a finding like any other.
- That failure is a known deviation the target tolerates (finding 012 on `vllm`): it is left
  out and counted as tolerated.
- The installed release lacks the parts for it (a usage error, e.g. an option a vLLM release
  does not have), or a target that does not report build failures (a plugin's) raises: a
  built-in config the user did not name is left out, said at the start and again next to the
  totals; one the user named runs, and fails the run as such (exit 2, or 3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.core.errors import KvfuzzError
from kvfuzz.harness.build import BuildFailure


@dataclass
class Buildable:
    """The outcome of building a campaign's configs once."""

    kept: tuple[str, ...]
    left_out: dict[str, str] = field(default_factory=dict)
    """Config -> why the target cannot build it here (not a finding)."""
    tolerated: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Config -> (the known deviation `id name` that documents it, vLLM's error)."""

    def json(self) -> dict[str, Any]:
        """The report's `configs_left_out` and `configs_tolerated`."""
        return {"configs_left_out": dict(self.left_out),
                "configs_tolerated": {name: {"deviation": label, "error": reason}
                                      for name, (label, reason) in self.tolerated.items()}}

    def tolerated_counts(self, examples: dict[str, int]) -> dict[str, dict[str, Any]]:
        """Per known deviation (`id name`) tolerated: the examples it was tolerated in
        (`Stats.tolerated`) and the configs left out for it."""
        counts: dict[str, dict[str, Any]] = {
            label: {"examples": n, "configs_left_out": []} for label, n in examples.items()}
        for name, (label, _) in self.tolerated.items():
            counts.setdefault(label, {"examples": 0, "configs_left_out": []})
            counts[label]["configs_left_out"].append(name)
        return dict(sorted(counts.items()))

    def lines(self, target: str) -> list[str]:
        """One line per config left out, said at the start and again after the totals."""
        return ([f"config {name} left out: target {target} cannot build it here ({reason})"
                 for name, reason in self.left_out.items()]
                + [f"config {name} left out: target {target} tolerates {label}, a documented "
                   f"deviation ({reason})" for name, (label, reason) in self.tolerated.items()])


def probe_configs(build: Callable[[Config], Any], names: tuple[str, ...],
                  config_of: Callable[[str], Config], named: set[str]) -> Buildable:
    """Build each config of `names` once with `build` and sort them (module docstring);
    `named`: the configs the user named (`--config`, `--config-file`)."""
    result = Buildable(())
    kept: list[str] = []
    for name in names:
        try:
            build(config_of(name))
        except BuildFailure as exc:
            if exc.deviation is not None:
                result.tolerated[name] = (exc.deviation, exc.message)
                continue
        except KvfuzzError as exc:
            if name in named:
                raise
            result.left_out[name] = str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - a target without BUILD findings (a plugin's)
            if name in named:
                kept.append(name)  # the run then stops with exit 3 naming it
                continue
            result.left_out[name] = f"{type(exc).__name__}: {exc}"
            continue
        kept.append(name)
    if not kept and not result.tolerated:  # nothing left: run them, and fail as they fail
        return Buildable(names)
    result.kept = tuple(kept)
    return result
