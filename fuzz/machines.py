"""Hypothesis state machines that generate traces and run them through the executor.

`ApiMachine` and `SchedulerMachine` run the rules of `kvfuzz.fuzz.generator` (`ApiRules`,
`SchedulerRules`): Hypothesis picks the rule and draws each of its decisions. Both draw a config
first, and every op they make goes through `kvfuzz.harness.executor.Execution`, which checks
every registered invariant after every op. A failure is shrunk by kvfuzz's own shrinker
(`kvfuzz.fuzz.shrink`, as `kvfuzz shrink` does; Hypothesis' shrink phase is off, it shrank the
choices that make a trace, not the trace, for minutes): the short trace is saved under
`.hypothesis/kvfuzz-findings/` as a campaign saves one, is the failure's report, and replays
with `kvfuzz replay FILE`.

`machine_for` builds a variant for other targets, configs or with the model off. Every machine
class takes the settings of the active kvfuzz profile (`kvfuzz.fuzz.profiles`) when it is
defined; assign `Machine.TestCase.settings` to change them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import Phase, note, settings, strategies as st
from hypothesis.control import current_build_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvfuzz.core.config import Config
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import save_finding
from kvfuzz.fuzz import profiles
from kvfuzz.fuzz.generator import ApiRules, Rules, SchedulerRules
from kvfuzz.fuzz.plugins import IMPORTED
from kvfuzz.fuzz.strategies import DataChoices, pick, vary_config
from kvfuzz.harness.executor import Counterexample, Execution

FINDINGS_DIR = Path(".hypothesis") / "kvfuzz-findings"
SHRINK_SECONDS = 20.0
"""The most kvfuzz's shrinker spends on a machine's failure."""


class _TraceMachine(RuleBasedStateMachine):
    """Shared plumbing: the execution, its rules, failure reporting."""

    level = "api"
    rules_class: type[Rules] = ApiRules
    targets: tuple[Any, ...] = ("kvcache",)
    use_model = True
    config_names: tuple[str, ...] | None = None
    configs: tuple[Config, ...] = ()
    """Configs to run as given (a user's config files), instead of the built-in ones."""
    vary_configs = True
    allow_misuse = True
    checks: tuple[Any, ...] | None = None
    """Checks to run (None: every registered invariant); the data checks add theirs."""
    on_execution = None
    """Hook called with each new Execution (benchmarks collect traces through it)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        chosen = profiles.active_settings()
        cls.TestCase.settings = settings(
            chosen, phases=[p for p in chosen.phases if p is not Phase.shrink])

    def __init__(self) -> None:
        super().__init__()
        self.rules: Rules | None = None

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        choices = DataChoices(data.draw)
        if self.configs:
            config = self.configs[pick(choices, range(len(self.configs)))]
        else:
            config = BUILTIN[pick(choices, sorted(self.config_names or BUILTIN))][1]
        if self.vary_configs and not self.configs:
            config = vary_config(choices, config)
        execution = Execution(
            config, self.level, self.targets, model=self.use_model, checks=self.checks
        )
        self.rules = self.rules_class(execution, choices, allow_misuse=self.allow_misuse)
        self.rules.start()
        if type(self).on_execution is not None:
            type(self).on_execution(execution)

    @property
    def execution(self) -> Execution | None:
        return None if self.rules is None else self.rules.execution

    def can(self, rule_name: str) -> bool:
        return self.rules is not None and self.rules.feasible(rule_name)

    def run_rule(self, rule_name: str, data: st.DataObject) -> None:
        """Run one of the rules with Hypothesis drawing its decisions; on the final (minimal)
        failing run, save the trace."""
        self.rules.choices = DataChoices(data.draw)
        try:
            getattr(self.rules, rule_name)()
        except Counterexample as exc:
            if current_build_context().is_final:
                self._shrink_and_save(exc)
            raise  # the same exception from the same place: Hypothesis sees the same failure

    def _shrink_and_save(self, exc: Counterexample) -> None:
        """Shrink the failing trace with kvfuzz's shrinker, save it as `kvfuzz run` saves a
        finding, and make the shrunk finding the exception's report."""
        from kvfuzz.fuzz.findings import dedup_key
        from kvfuzz.fuzz.shrink import Shrinker

        found = exc.finding
        trace = found.trace.prefix(len(found.trace.ops))
        shrunk: bool | str = True
        try:
            result = Shrinker(self.targets, model=self.use_model, checks=self.checks,
                              check=found.check, signature=tuple(found.signature),
                              seconds=SHRINK_SECONDS).shrink(trace)
            trace, found = result.trace, result.finding
        except ValueError:  # it did not fail the same way again: keep it as it is
            shrunk = False
        trace.meta.update({"target": found.target, "check": found.check,
                           "config": trace.config.name, "level": trace.level,
                           "dedup_key": dedup_key(found.check, found.signature),
                           "shrunk": shrunk})
        if IMPORTED:
            trace.meta["plugins"] = list(IMPORTED)
        path = save_finding(trace, FINDINGS_DIR)
        exc.finding = found
        exc.args = (found.report(),)
        note(f"kvfuzz: {len(trace.ops)}-op trace saved to {path} (replay: kvfuzz replay "
             f"{path})")


def _rule(rule_name: str) -> Any:
    """A Hypothesis rule running the rule of that name, when it can run."""

    def run(self: _TraceMachine, data: st.DataObject) -> None:
        self.run_rule(rule_name, data)

    run.__name__ = rule_name
    return precondition(lambda self: self.can(rule_name))(rule(data=st.data())(run))


class ApiMachine(_TraceMachine):
    """Layer-1 calls, with the machine playing the scheduler (docs/traces.md, API level)."""

    level = "api"
    rules_class = ApiRules
    add_request = _rule("add_request")
    admit = _rule("admit")
    compute = _rule("compute")
    sample = _rule("sample")
    free = _rule("free")
    housekeeping = _rule("housekeeping")
    probe_cached_tokens = _rule("probe_cached_tokens")


class SchedulerMachine(_TraceMachine):
    """Requests arrive, finish and abort while the scheduler driver runs steps."""

    level = "scheduler"
    rules_class = SchedulerRules
    add_request = _rule("add_request")
    step = _rule("step")
    step_again = _rule("step_again")
    abort = _rule("abort")
    load_remote = _rule("load_remote")
    finish_load = _rule("finish_load")
    step_in_flight = _rule("step_in_flight")
    complete_step = _rule("complete_step")
    step_spec = _rule("step_spec")
    take_events = _rule("take_events")
    reset_prefix_cache = _rule("reset_prefix_cache")


def machine_for(
    level: str = "api",
    *,
    targets: tuple[Any, ...] = ("kvcache",),
    model: bool = True,
    config_names: tuple[str, ...] | None = None,
    vary_configs: bool = True,
    allow_misuse: bool = True,
    checks: tuple[Any, ...] | None = None,
    name: str | None = None,
    configs: tuple[Config, ...] = (),
) -> type[_TraceMachine]:
    """A state machine class for other targets or configs (e.g. vLLM, a planted bug); `configs`
    are run as given instead of the built-in ones (see `machine_for_config_file`)."""
    base = ApiMachine if level == "api" else SchedulerMachine
    attrs = {
        "targets": tuple(targets),
        "use_model": model,
        "config_names": config_names,
        "vary_configs": vary_configs,
        "allow_misuse": allow_misuse,
        "checks": checks,
        "configs": tuple(configs),
    }
    return type(name or f"{base.__name__}For{len(targets)}", (base,), attrs)


def machine_for_config_file(path: str | Path, level: str = "api",
                            **kwargs: Any) -> type[_TraceMachine]:
    """A state machine on the model shape of a config file (TOML or JSON, docs/configs.md), as
    `kvfuzz run --config-file` runs it; other arguments as for `machine_for`."""
    from kvfuzz.core.config_file import load_config_file

    return machine_for(level, configs=(load_config_file(path),), **kwargs)
