"""The state machines over every built-in config, kvcache against the reference model.

Sized by the Hypothesis profile (conftest.py): `ci` by default, `dev`, `nightly`.
"""

from kvfuzz.core.configs import BUILTIN
from kvfuzz.fuzz.machines import ApiMachine, SchedulerMachine, machine_for

# Configs drawn at random around every built-in shape (HypoFuzz collects these too).
TestApiMachine = ApiMachine.TestCase
TestSchedulerMachine = SchedulerMachine.TestCase

# One test per built-in config and level, so every shape gets its share of examples.
for _name in BUILTIN:
    for _level in ("api", "scheduler"):
        _machine = machine_for(_level, config_names=(_name,),
                               name=f"{_level.title()}Machine_{_name}")
        globals()[f"Test{_machine.__name__}"] = _machine.TestCase


def test_a_machine_failure_shrinks_to_a_saved_trace_that_replays(tmp_path, monkeypatch):
    import pytest
    from hypothesis import settings

    import kvfuzz.fuzz.machines as machines
    from kvfuzz.harness.executor import Counterexample, run_trace
    from kvfuzz.core.trace import Trace

    monkeypatch.setattr(machines, "FINDINGS_DIR", tmp_path)
    broken = machine_for("api", targets=("bug:predictor-off-by-one",), config_names=("full",),
                         vary_configs=False)
    broken.TestCase.settings = settings(max_examples=200, stateful_step_count=20,
                                        database=None, deadline=None, derandomize=True)
    with pytest.raises(Counterexample) as err:
        broken.TestCase("runTest").runTest()
    assert err.value.finding.check == "P1"
    saved = list(tmp_path.glob("P1-*.json"))
    assert saved, "the minimal failing trace was not saved"
    trace = Trace.load(saved[0])
    assert len(trace.ops) <= 6
    assert run_trace(trace, ["bug:predictor-off-by-one"]).finding.check == "P1"
