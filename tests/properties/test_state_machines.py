"""The state machines over every built-in config, kvcache against the reference model.

Sized by the Hypothesis profile (conftest.py): `ci` by default, `dev`, `nightly`.
"""

from harness.configs import BUILTIN
from properties.machines import ApiMachine, SchedulerMachine, machine_for

# Configs drawn at random around every built-in shape (HypoFuzz collects these too).
TestApiMachine = ApiMachine.TestCase
TestSchedulerMachine = SchedulerMachine.TestCase

# One test per built-in config and level, so every shape gets its share of examples.
for _name in BUILTIN:
    for _level in ("api", "scheduler"):
        _machine = machine_for(_level, config_names=(_name,),
                               name=f"{_level.title()}Machine_{_name}")
        globals()[f"Test{_machine.__name__}"] = _machine.TestCase
