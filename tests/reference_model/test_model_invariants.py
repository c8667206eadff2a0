"""The reference model judged by the same invariants as every target, through the executor.

The model is the oracle everything else is compared with, so it runs here alone (as target
`model`, no second model beside it) under the state machines, for every built-in config.
"""

from hypothesis import settings

from kvfuzz.core.configs import BUILTIN
from kvfuzz.fuzz.machines import machine_for

# A third of the profile's examples: the main state machines exercise the model too (every
# target op is compared with it); these runs add the invariants judged on the model itself.
_SETTINGS = settings(max_examples=max(10, settings.default.max_examples // 3))

for _name in BUILTIN:
    for _level in ("api", "scheduler"):
        _machine = machine_for(_level, targets=("model",), model=False, config_names=(_name,),
                               name=f"Model{_level.title()}Machine_{_name}")
        _machine.TestCase.settings = _SETTINGS
        globals()[f"Test{_machine.__name__}"] = _machine.TestCase
