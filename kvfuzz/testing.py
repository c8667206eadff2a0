"""kvfuzz's state machines in your own pytest suite, on your target, with your invariants.

    # test_my_manager.py
    from kvfuzz.testing import machine_for

    TestMine = machine_for("api", targets=("mine",), config_names=("full", "hybrid")).TestCase
    TestMineDriven = machine_for("scheduler", targets=("mine",)).TestCase

    $ pytest --kvfuzz-plugin my_target --kvfuzz-plugin my_checks test_my_manager.py

`my_target` registers "mine" with `kvfuzz.harness.register_target`, `my_checks` adds invariants
with `kvfuzz.properties.invariant` (README.md, "Your own suite"). Every op of every generated
trace runs on the target and on the reference model in lockstep, and every registered check
runs after it. A failure's trace is shrunk by kvfuzz's shrinker (as `kvfuzz shrink` does) and
saved under `.hypothesis/kvfuzz-findings/` for `kvfuzz replay`. The settings come from the kvfuzz profile
(`--kvfuzz-profile`, see `kvfuzz.fuzz.profiles`).

`machine_for_config_file("llama3.toml")` runs a machine on your own model shape (a config file,
docs/configs.md), as `kvfuzz run --config-file` does.
`ApiMachine` and `SchedulerMachine` are the two machines on kvcache over every built-in config;
`assert_invariants(manager)` checks the state invariants on a live vLLM-shaped manager in a
hand-written test (`kvcache_manager("hybrid")` builds kvcache's for a config), and
`replay_trace(trace, target)` is what a test exported by `kvfuzz export` runs.
"""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.fuzz.machines import ApiMachine, SchedulerMachine, machine_for, machine_for_config_file
from kvfuzz.fuzz.profiles import PROFILES
from kvfuzz.harness.spot_check import assert_invariants

__all__ = ["PROFILES", "ApiMachine", "SchedulerMachine", "assert_invariants", "kvcache_manager",
           "machine_for", "machine_for_config_file", "replay_trace"]


def kvcache_manager(config: str | Config) -> Any:
    """kvcache's KVCacheManager for a built-in config (by name) or a `Config`."""
    from kvfuzz.core.configs import builtin_config
    from kvfuzz.harness.kvcache_target import build_kvcache_manager

    return build_kvcache_manager(builtin_config(config) if isinstance(config, str) else config)


def replay_trace(trace: Any, target: str, *, plugins: tuple[str, ...] = (),
                 data: str | None = None) -> None:
    """Replay `trace` (a `Trace` or its JSON data) on `target` with the reference model and
    every invariant (and the data checks on `data`), after importing `plugins`; raise
    AssertionError with the report if a check fails or the trace no longer applies."""
    from kvfuzz.core.trace import Trace
    from kvfuzz.fuzz.campaign import selected_checks
    from kvfuzz.fuzz.plugins import import_plugins
    from kvfuzz.harness.executor import run_trace

    import_plugins(tuple(plugins))
    if not isinstance(trace, Trace):
        trace = Trace.from_dict(trace)
    result = run_trace(trace, [target], checks=selected_checks(data))
    assert result.invalid is None, f"the trace no longer applies: {result.invalid}"
    assert result.finding is None, result.finding.report()
