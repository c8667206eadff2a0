"""Hypothesis state machines that generate traces and run them through the executor.

`ApiMachine` plays the scheduler itself and makes layer-1 calls (lookups, admissions, decode
steps, frees, preemptions, cache/evict/reset, copies, and some API misuse); `SchedulerMachine`
adds requests and runs steps of the scheduler driver. Both draw a config first, and every op
they make goes through `kvfuzz.harness.executor.Execution`, which checks every registered invariant
after every op. On a failure Hypothesis shrinks the run; the final, minimal trace is saved under
`.hypothesis/kvfuzz-findings/` and printed, and replays with `kvfuzz replay FILE`.

`machine_for` builds a variant for other targets, configs or with the model off. Every machine
class takes the settings of the active kvfuzz profile (`kvfuzz.fuzz.profiles`) when it is
defined; assign `Machine.TestCase.settings` to change them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import note, strategies as st
from hypothesis.control import current_build_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvfuzz.harness.executor import Counterexample, Execution
from kvfuzz.core.snapshot import RequestView
from kvfuzz.core.trace import save_finding
from kvfuzz.fuzz import profiles
from kvfuzz.fuzz.plugins import IMPORTED
from kvfuzz.fuzz.strategies import TOKEN_VOCAB, configs, extra_keys, prefixes, prompts

FINDINGS_DIR = Path(".hypothesis") / "kvfuzz-findings"

_token = st.integers(0, TOKEN_VOCAB - 1)


class _TraceMachine(RuleBasedStateMachine):
    """Shared plumbing: the execution, the op counter, request views, failure reporting."""

    level = "api"
    targets: tuple[Any, ...] = ("kvcache",)
    use_model = True
    config_names: tuple[str, ...] | None = None
    vary_configs = True
    checks: tuple[Any, ...] | None = None
    """Checks to run (None: every registered invariant); the data checks add theirs."""
    max_requests = 8
    on_execution = None
    """Hook called with each new Execution (campaigns count ops and coverage through it)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.TestCase.settings = profiles.active_settings()

    def __init__(self) -> None:
        super().__init__()
        self.execution: Execution | None = None
        self.shared: list[list[int]] = [[0]]
        self.count = 0

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        config = data.draw(configs(self.config_names, self.vary_configs), label="config")
        self.execution = Execution(
            config, self.level, self.targets, model=self.use_model, checks=self.checks
        )
        self.shared = data.draw(prefixes(config.max_model_len // 2), label="prefixes")
        if type(self).on_execution is not None:
            type(self).on_execution(self.execution)

    # ----- helpers -----

    @property
    def config(self):
        return self.execution.config

    def apply(self, **op: Any) -> Any:
        try:
            return self.execution.apply(op)
        except Counterexample as exc:
            if current_build_context().is_final:
                # The exception's report already lists the trace, op by op.
                trace = exc.finding.trace.prefix(len(exc.finding.trace.ops))
                if IMPORTED:
                    trace.meta["plugins"] = list(IMPORTED)
                path = save_finding(trace, FINDINGS_DIR)
                note(f"kvfuzz: minimal trace saved to {path} (replay: kvfuzz replay {path})")
            raise

    def views(self, *statuses: str) -> list[tuple[str, RequestView]]:
        return [
            (rid, v) for rid, v in self.execution.state.requests.items() if v.status in statuses
        ]

    def new_request(self, data: st.DataObject, **extra: Any) -> str:
        rid = f"r{self.count}"
        self.count += 1
        max_len = self.config.max_model_len - 1
        salt = data.draw(st.sampled_from([None, None, None, "a", "b"]), label="salt")
        encoder = data.draw(st.integers(1, 12)) if self.config.has_cross_attention else 0
        prompt = data.draw(prompts(self.shared, max_len), label="prompt")
        if self.config.extra_keys:
            extra = {**data.draw(extra_keys(prompt), label="extra keys"), **extra}
        self.apply(
            op="add_request",
            request_id=rid,
            prompt=prompt,
            cache_salt=salt,
            num_encoder_tokens=encoder,
            **extra,
        )
        return rid

    def can_add(self) -> bool:
        return self.execution is not None and self.count < self.max_requests


class ApiMachine(_TraceMachine):
    """Layer-1 calls, with the machine playing the scheduler (docs/traces.md, API level)."""

    level = "api"
    allow_misuse = True

    @precondition(lambda self: self.can_add())
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        skip = data.draw(st.sampled_from([False] * 7 + [True]), label="skip_reading")
        self.new_request(data, skip_reading_prefix_cache=skip)

    @precondition(lambda self: self.views("WAITING", "PREEMPTED"))
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        rid, view = data.draw(st.sampled_from(self.views("WAITING", "PREEMPTED")), label="who")
        use_lookup = data.draw(st.sampled_from([True, True, True, False]), label="use_lookup")
        hit = 0
        if use_lookup:
            hit = self.apply(op="get_computed_blocks", request_id=rid)["num_computed_tokens"]
        remaining = view.num_tokens - hit
        least = 0 if hit and data.draw(st.booleans(), label="adopt_only") else 1
        self.apply(
            op="allocate_slots",
            request_id=rid,
            num_new_tokens=data.draw(st.integers(least, remaining), label="n"),
            use_lookup=use_lookup,
            num_lookahead_tokens=data.draw(st.integers(0, 2), label="lookahead"),
            full_sequence_must_fit=data.draw(st.booleans(), label="gate"),
            reserved_blocks=data.draw(st.integers(0, 2), label="reserved"),
            has_scheduled_reqs=data.draw(st.booleans(), label="has_scheduled"),
            num_encoder_tokens=self.execution.requests[rid].num_encoder_tokens,
        )

    def _running(self, computing: bool) -> list[tuple[str, RequestView]]:
        return [
            (rid, v)
            for rid, v in self.views("RUNNING")
            if (v.num_computed_tokens < v.num_tokens) == computing
            and (computing or v.num_tokens < self.config.max_model_len)
        ]

    @precondition(lambda self: self.execution is not None and self._running(True))
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        rid, view = data.draw(st.sampled_from(self._running(True)), label="who")
        self.apply(
            op="allocate_slots",
            request_id=rid,
            num_new_tokens=data.draw(
                st.integers(1, view.num_tokens - view.num_computed_tokens), label="n"
            ),
            num_lookahead_tokens=data.draw(st.integers(0, 2), label="lookahead"),
        )

    @precondition(lambda self: self.execution is not None and self._running(False))
    @rule(data=st.data())
    def sample(self, data: st.DataObject) -> None:
        rid, view = data.draw(st.sampled_from(self._running(False)), label="who")
        room = self.config.max_model_len - view.num_tokens
        tokens = data.draw(st.lists(_token, min_size=1, max_size=min(3, room)), label="tokens")
        self.apply(op="append_tokens", request_id=rid, tokens=tokens)

    @precondition(lambda self: self.views("RUNNING"))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid, _ = data.draw(st.sampled_from(self.views("RUNNING")), label="who")
        self.apply(op="free", request_id=rid, preempt=data.draw(st.booleans(), label="preempt"))

    @precondition(lambda self: self.execution is not None)
    @rule(data=st.data())
    def housekeeping(self, data: st.DataObject) -> None:
        """The less frequent calls, behind one rule so the main ones dominate a run."""
        kinds = ["evict_blocks", "reset_prefix_cache", "take_copies"]
        if self.views("RUNNING"):
            kinds.append("cache_blocks")
        if self.execution.state.retained_copies:
            kinds.append("release_copies")
        if self.allow_misuse and self.count:
            kinds.append("misuse")
        kind = data.draw(st.sampled_from(kinds), label="housekeeping")
        if kind == "evict_blocks":
            ids = st.integers(1, self.config.num_blocks - 1)
            self.apply(op="evict_blocks", block_ids=data.draw(st.lists(ids, max_size=3)))
        elif kind == "reset_prefix_cache":
            self.apply(op="reset_prefix_cache")
        elif kind == "take_copies":
            self.apply(op="take_kv_cache_block_copies")
            self.apply(op="take_new_block_ids")
        elif kind == "cache_blocks":
            rid, view = data.draw(st.sampled_from(self.views("RUNNING")), label="who")
            n = data.draw(st.none() | st.integers(0, view.num_computed_tokens), label="n")
            self.apply(op="cache_blocks", request_id=rid, num_computed_tokens=n)
        elif kind == "release_copies":
            self.apply(op="release_copies")
        else:
            self._misuse(data)

    def _misuse(self, data: st.DataObject) -> None:
        """Bad input must raise ValueError and change nothing (checked by I10)."""
        waiting = [rid for rid, _ in self.views("WAITING", "PREEMPTED")]
        running = [rid for rid, _ in self.views("RUNNING")]
        choices = ["evict_out_of_range"]
        if waiting:
            choices += ["free_untracked", "zero_tokens"]
        if running:
            choices += ["negative_tokens"]
        kind = data.draw(st.sampled_from(choices), label="misuse")
        if kind == "evict_out_of_range":
            self.apply(op="evict_blocks", block_ids=[self.config.num_blocks])
        elif kind == "free_untracked":
            self.apply(op="free", request_id=data.draw(st.sampled_from(waiting)))
        elif kind == "zero_tokens":
            self.apply(op="allocate_slots", request_id=data.draw(st.sampled_from(waiting)),
                       num_new_tokens=0)
        else:
            self.apply(op="allocate_slots", request_id=data.draw(st.sampled_from(running)),
                       num_new_tokens=-1)


class SchedulerMachine(_TraceMachine):
    """Requests arrive, finish and abort while the scheduler driver runs steps."""

    level = "scheduler"
    max_requests = 10

    @precondition(lambda self: self.can_add())
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        self.new_request(
            data,
            priority=data.draw(st.integers(0, 2), label="priority"),
            max_tokens=data.draw(st.integers(1, 6), label="max_tokens"),
        )

    @precondition(lambda self: self.execution is not None)
    @rule(sample=st.integers(0, TOKEN_VOCAB - 1))
    def step(self, sample: int) -> None:
        self.apply(op="step", sample=sample)

    @precondition(lambda self: self.execution is not None)
    @rule(sample=st.integers(0, TOKEN_VOCAB - 1))
    def step_again(self, sample: int) -> None:
        """A second step rule: steps dominate the runs."""
        self.apply(op="step", sample=sample)

    @precondition(lambda self: self.views("WAITING", "PREEMPTED", "RUNNING"))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = self.views("WAITING", "PREEMPTED", "RUNNING")
        rid, _ = data.draw(st.sampled_from(live), label="who")
        self.apply(op=data.draw(st.sampled_from(["abort", "finish"]), label="how"), request_id=rid)


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
) -> type[_TraceMachine]:
    """A state machine class for other targets or configs (e.g. vLLM, a planted bug)."""
    base = ApiMachine if level == "api" else SchedulerMachine
    attrs = {
        "targets": tuple(targets),
        "use_model": model,
        "config_names": config_names,
        "vary_configs": vary_configs,
        "allow_misuse": allow_misuse,
        "checks": checks,
    }
    return type(name or f"{base.__name__}For{len(targets)}", (base,), attrs)
