"""kvfuzz's state machines in your own pytest suite, on your target, with your invariants.

    # test_my_manager.py
    from kvfuzz.testing import machine_for

    TestMine = machine_for("api", targets=("mine",), config_names=("full", "hybrid")).TestCase
    TestMineDriven = machine_for("scheduler", targets=("mine",)).TestCase

    $ pytest --kvfuzz-plugin my_target --kvfuzz-plugin my_checks test_my_manager.py

`my_target` registers "mine" with `kvfuzz.harness.register_target`, `my_checks` adds invariants
with `kvfuzz.properties.invariant` (README.md, "Your own suite"). Every op of every generated
trace runs on the target and on the reference model in lockstep, and every registered check
runs after it. A failure is shrunk by Hypothesis, and its trace is saved under
`.hypothesis/kvfuzz-findings/` for `kvfuzz replay`. The settings come from the kvfuzz profile
(`--kvfuzz-profile`, see `kvfuzz.fuzz.profiles`).

`machine_for_config_file("llama3.toml")` runs a machine on your own model shape (a config file,
docs/configs.md), as `kvfuzz run --config-file` does.
`ApiMachine` and `SchedulerMachine` are the two machines on kvcache over every built-in config;
`assert_invariants(manager)` checks the state invariants on a live vLLM-shaped manager in a
hand-written test.
"""

from kvfuzz.fuzz.machines import ApiMachine, SchedulerMachine, machine_for, machine_for_config_file
from kvfuzz.fuzz.profiles import PROFILES
from kvfuzz.harness.spot_check import assert_invariants

__all__ = ["PROFILES", "ApiMachine", "SchedulerMachine", "assert_invariants", "machine_for",
           "machine_for_config_file"]
