"""The state machines against another target, for HypoFuzz (docs/hypofuzz.md).

`KVFUZZ_TARGET=bug:predictor-off-by-one` (any `kvfuzz targets` name) defines one API-level and
one scheduler-level test against it; without the variable the module has no tests, so plain
`pytest` is unaffected. The class names carry the target, so each target's failures get their
own Hypothesis database keys and replay only against that target.
"""

import os

from kvfuzz.fuzz.machines import machine_for

TARGET = os.environ.get("KVFUZZ_TARGET")

if TARGET:
    _suffix = TARGET.replace(":", "_").replace("-", "_")
    TestApiMachineOnTarget = machine_for(
        "api", targets=(TARGET,), allow_misuse=TARGET != "vllm", name=f"ApiMachine_{_suffix}"
    ).TestCase
    TestSchedulerMachineOnTarget = machine_for(
        "scheduler", targets=(TARGET,), name=f"SchedulerMachine_{_suffix}"
    ).TestCase
