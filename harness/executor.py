"""The one executor: runs ops on targets and the reference model in lockstep and checks them.

After every op it runs every registered check on each target's snapshot, then compares the
target's result, probe outcomes and snapshot with the reference (the model, or the first target
when the model is off). The first failure stops the run with a `Counterexample` that
names the step and the check, shows both states side by side, and carries the trace up to that
step. Every generator (state machines, atheris, a file) goes through here.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from kvfuzz.core.config import Config
from kvfuzz.core.errors import HarnessFault, InvalidTrace, KvfuzzError
from kvfuzz.core.signals import asked_to_stop
from kvfuzz.core.sides import Observations, Side
from kvfuzz.harness.build import BUILD, BUILD_DESCRIPTION, BuildFailure, ToleratedBuild
from kvfuzz.core.snapshot import Snapshot
from kvfuzz.harness.targets import get_target
from kvfuzz.core.trace import Op, Trace, normalize_op, op_text
from kvfuzz.core.extra_keys import Extras
from kvfuzz.properties import REGISTRY, CheckContext, RequestMeta
from kvfuzz.reference_model import ReferenceModel

TargetSpec = str | Callable[[Config, str], Side]

DIFF_RESULT = "DIFF-result"
DIFF_PROBE = "DIFF-probe"
DIFF_STATE = "DIFF-state"
CRASH = "CRASH"
_DIFF_DESCRIPTIONS = {
    DIFF_RESULT: "the op's result differs from the reference's",
    DIFF_PROBE: "allocate_slots outcomes or predictions, or lookup boundaries, differ from the "
                "reference's",
    DIFF_STATE: "the state after the op differs from the reference's",
    CRASH: "the harness could not drive or read the target",
    BUILD: BUILD_DESCRIPTION,
}


@dataclass
class Finding:
    """A failed check: where, what, and the trace that reproduces it."""

    check: str
    description: str
    message: str
    step: int
    target: str
    trace: Trace
    details: str = ""
    signature: tuple[str, ...] = ()
    """How it fails, beyond the check: for a DIFF the op kind and the differing field, for a
    CRASH the exception type and the place raised (file:function:line); empty for a named check.
    A shrunk trace must keep it (`kvfuzz.fuzz.shrink`), and findings are deduplicated by it."""
    target_raised: str = ""
    """The exception the target raised at the failing step (its `{"error": ...}` result, or
    what a CRASH or BUILD raised), "" when it returned normally: a finding with it is a kill
    by the target's exception alone (docs/mutation.md), whatever check fired."""

    def headline(self) -> str:
        where = f"step {self.step}" if self.step >= 0 else "the initial state"
        return f"[{self.check}] {where} on {self.target}: {self.message}"

    def report(self, with_trace: bool = True) -> str:
        """Headline, check, op and states; then the trace up to the step, one op a line
        (`with_trace=False` for a caller that has already printed the ops)."""
        op = self.trace.ops[self.step] if 0 <= self.step < len(self.trace.ops) else None
        lines = [self.headline(), f"  check: {self.check} — {self.description}"]
        if op is not None:
            lines.append(f"  op: {op}")
        if self.details:
            lines.append(self.details)
        if with_trace:
            trace = self.trace
            lines.append(f"  trace up to {'step ' + str(self.step) if self.step >= 0 else 'no op'}, "
                         f"{trace.level} level, config "
                         f"{json.dumps(trace.config.to_dict())}:")
            lines.extend(f"    {i}: {op_text(o, trace.level)}" for i, o in enumerate(trace.ops))
        return "\n".join(lines)


class Counterexample(Exception):
    """Raised by `Execution.apply` when a check fails; carries the `Finding`."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.report())
        self.finding = finding


@dataclass
class _Tracked:
    """One target and the history its checks need."""

    name: str
    side: Side
    snapshot: Snapshot
    memory: dict[str, Any] = field(default_factory=dict)


class Execution:
    """A trace being built and run op by op (generators call `apply` as they go)."""

    def __init__(
        self,
        config: Config,
        level: str,
        targets: Sequence[TargetSpec] = ("kvcache",),
        *,
        model: bool = True,
        checks: Iterable[Any] | None = None,
        meta: dict[str, Any] | None = None,
        stop: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.stop = stop
        """Called before every op and every check: it raises to end the run there (a campaign's
        SIGTERM or time budget, so that a huge pool's slow ops do not delay either)."""
        self._raised = ""
        """What the target being checked raised at the current step ("" if nothing)."""
        self.level = level
        self.trace = Trace(config, level, [], dict(meta or {}))  # type: ignore[arg-type]
        self.checks = list(REGISTRY if checks is None else checks)
        self._plan = [(check.kind == "transition", check.fn, check) for check in self.checks]
        """The checks in order, each as (is a transition check, its function, the check)."""
        self.requests: dict[str, Any] = {}
        self.model: Side | None = None
        if model:
            self.model = ReferenceModel(config, level)
        self.targets = [self._track(t) for t in targets]
        if not self.targets and self.model is None:
            raise ValueError("an execution needs at least one target or the model")
        self.results: list[Any] = []
        self.state = self.model.snapshot() if self.model is not None else self.targets[0].snapshot
        """The reference's snapshot after the last op (what generators consult)."""
        self.ops_checked = 0
        self.checks_run = 0
        ref_snap = self.state if self.model is not None else None
        for tracked in self.targets:
            self._run_checks(tracked, None, tracked.snapshot, None, None, Observations(),
                             ref_snap=ref_snap)

    def _track(self, target: TargetSpec) -> _Tracked:
        name = target if isinstance(target, str) else getattr(target, "__name__", "target")
        try:
            if isinstance(target, str):
                info = get_target(target)
                name = info.name
                side = info.build(self.config, self.level)
            else:
                side = target(self.config, self.level)
                name = getattr(side, "name", name)
            return _Tracked(name, side, side.snapshot())
        except (InvalidTrace, KvfuzzError):
            raise
        except BuildFailure as exc:  # the library's own error: a finding, or a tolerated one
            if exc.deviation is not None:
                raise ToleratedBuild(name, self.config.name, exc) from exc
            self._raised = exc.error
            self._fail(BUILD, exc.message, -1, name, signature=(exc.error, exc.place))
        except BaseException as exc:  # noqa: BLE001 - the adapter, not the trace, is at fault
            if asked_to_stop(exc):
                raise
            raise HarnessFault(f"target {name!r} (building its manager for config "
                               f"{self.config.name!r})", exc) from exc

    def offers(self, name: str) -> bool:
        """Whether every target implements an optional op or trace field (`ManagerSide.offers`);
        generators leave out what one of them lacks."""
        return all(getattr(t.side, "offers", lambda _: True)(name) for t in self.targets)

    @property
    def reference(self) -> Side:
        """The side every target is compared with."""
        return self.model if self.model is not None else self.targets[0].side

    @property
    def reference_name(self) -> str:
        return "model" if self.model is not None else self.targets[0].name

    def apply(self, raw_op: Op) -> Any:
        """Run one op everywhere and check it; returns the reference's result."""
        if self.stop is not None:
            self.stop()
        op = normalize_op(raw_op, self.level, f"step {len(self.trace.ops)}")
        step = len(self.trace.ops)
        self.trace.ops.append(op)
        if op["op"] == "add_request" and op["request_id"] not in self.requests:
            self.requests[op["request_id"]] = RequestMeta(
                tuple(op["prompt"]),
                op["cache_salt"],
                op["skip_reading_prefix_cache"],
                op["num_encoder_tokens"],
                Extras.of_op(op),
                op.get("prefix_cache_hit_limit"),
            )
        ref_result = ref_obs = ref_snap = None
        self._raised = ""
        try:
            if self.model is not None:
                ref_result = self.model.apply(op)
                ref_obs = self.model.observations()
                ref_snap = self.model.snapshot()
            for i, tracked in enumerate(self.targets):
                result, obs, snap = self._apply_target(tracked, op, step)
                self._raised = raised_by(result)
                before, tracked.snapshot = tracked.snapshot, snap
                # Named properties first: a failure then says which rule broke, not only that
                # the target and the reference disagree.
                self._run_checks(tracked, before, snap, op, result, obs, step, ref_snap)
                if self.model is None and i == 0:
                    ref_result, ref_obs, ref_snap = result, obs, snap
                else:
                    self._compare(tracked, step, result, obs, snap, ref_result, ref_obs, ref_snap)
        except InvalidTrace as exc:
            self.trace.ops.pop()
            exc.step, exc.op = step, op["op"]
            raise
        self.results.append(ref_result)
        self.state = ref_snap
        self.ops_checked += 1
        return ref_result

    def _apply_target(self, tracked: _Tracked, op: Op, step: int) -> tuple[Any, Observations, Snapshot]:
        try:
            result = tracked.side.apply(op)
            return result, tracked.side.observations(), tracked.side.snapshot()
        except KvfuzzError:  # an invalid trace, or one the target cannot take: usage errors
            raise
        except Exception as exc:  # noqa: BLE001 - a broken target is a finding, not a crash
            self._raised = type(exc).__name__
            self._fail(CRASH, f"{type(exc).__name__}: {exc}", step, tracked.name,
                       signature=(op["op"], type(exc).__name__, _place(exc)))
        except BaseException as exc:  # SystemExit, or an interrupt no signal asked for
            if asked_to_stop(exc):
                raise
            raise HarnessFault(f"target {tracked.name!r} (at step {step}, {op['op']})",
                               exc) from exc

    def _compare(self, tracked: _Tracked, step: int, result: Any, obs: Observations,
                 snap: Snapshot, ref_result: Any, ref_obs: Observations, ref_snap: Snapshot) -> None:
        ref_name = self.reference_name
        kind = self.trace.ops[step]["op"]
        if result != ref_result:
            self._fail(
                DIFF_RESULT,
                f"{tracked.name} returned {result!r}, {ref_name} returned {ref_result!r}",
                step, tracked.name, snap, ref_snap, ref_name,
                signature=(kind, _differing_key(result, ref_result)),
            )
        mine = [p.compared() for p in obs.allocations]
        theirs = [p.compared() for p in ref_obs.allocations]
        if mine != theirs:
            self._fail(
                DIFF_PROBE,
                f"allocate_slots (request, outcome, prediction): {tracked.name} {mine}, "
                f"{ref_name} {theirs}",
                step, tracked.name, snap, ref_snap, ref_name,
                signature=(kind, "allocations"),
            )
        if obs.lookups != ref_obs.lookups:
            self._fail(
                DIFF_PROBE,
                f"get_computed_blocks (request, hit, shared_prefix_boundary): {tracked.name} "
                f"{obs.lookups}, {ref_name} {ref_obs.lookups}",
                step, tracked.name, snap, ref_snap, ref_name,
            )
        if snap != ref_snap:
            diffs = snap.differences(ref_snap)
            self._fail(
                DIFF_STATE,
                f"{tracked.name} vs {ref_name}: " + "; ".join(diffs[:3])
                + (f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else ""),
                step, tracked.name, snap, ref_snap, ref_name,
                signature=(kind, _differing_field(snap, ref_snap)),
            )

    def _run_checks(self, tracked: _Tracked, before: Snapshot | None, after: Snapshot,
                    op: Op | None, result: Any, obs: Observations, step: int = -1,
                    ref_snap: Snapshot | None = None) -> None:
        """Every check on one target's state; a failure shows the reference's state beside it
        when there is one (the model's, or the first target's for the others)."""
        ctx = CheckContext(
            self.config, self.level, step, op or {"op": "init"}, result, obs, self.requests,
            tracked.memory,
        )
        ran = 0
        try:
            for transition, fn, check in self._plan:
                if self.stop is not None:
                    self.stop()
                try:
                    if transition:
                        if before is None:
                            continue
                        message = fn(before, after, ctx)
                    else:
                        message = fn(after, ctx)
                except BaseException as exc:  # noqa: BLE001 - the check is at fault (SystemExit too)
                    if asked_to_stop(exc):
                        raise
                    where = f"step {step}" if step >= 0 else "the initial state"
                    raise HarnessFault(f"check {check.name} (from {check.module or 'unknown'}, "
                                       f"at {where} on {tracked.name})", exc) from exc
                ran += 1
                if message:
                    if type(message) is not str:
                        self._bad_return(check, message, step, tracked.name)
                    self._fail(check.name, message, step, tracked.name, after, ref_snap,
                               self.reference_name, check.description)
                elif message is not None and type(message) is not str:
                    self._bad_return(check, message, step, tracked.name)
        finally:
            self.checks_run += ran

    @staticmethod
    def _bad_return(check: Any, value: Any, step: int, target: str) -> None:
        """A check returned neither None nor a message: its fault, named, never a finding."""
        where = f"step {step}" if step >= 0 else "the initial state"
        raise HarnessFault(
            f"check {check.name} (from {check.module or 'unknown'}, at {where} on {target})",
            TypeError(f"it returned {value!r} ({type(value).__name__}): a check returns None "
                      "when it holds and a message string when it does not"))

    def _fail(self, check: str, message: str, step: int, target: str,
              snap: Snapshot | None = None, ref_snap: Snapshot | None = None,
              ref_name: str = "model", check_description: str | None = None,
              signature: tuple[str, ...] = ()) -> NoReturn:
        description = check_description or _DIFF_DESCRIPTIONS.get(check, check)
        trace = self.trace.prefix(step + 1)
        trace.meta.update({"check": check, "target": target, "message": message})
        details = ""
        if snap is not None and ref_snap is not None:
            details = side_by_side(f"{target} after step {step}", snap.render(),
                                   f"{ref_name} after step {step}", ref_snap.render())
        elif snap is not None:
            details = f"--- {target} after step {step} ---\n{snap.render()}"
        raise Counterexample(Finding(check, description, message, step, target, trace, details,
                                     signature, self._raised))


def raised_by(result: Any) -> str:
    """The exception an op's result says the side raised (`{"error": "IndexError"}`), or ""."""
    if isinstance(result, dict) and isinstance(result.get("error"), str):
        return result["error"]
    return ""


def _place(exc: BaseException) -> str:
    """Where `exc` was raised: the innermost frame's file name, function and line."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.name}:{frame.lineno}"


def _differing_key(result: Any, reference: Any) -> str:
    """The first key where two dict results differ, else "result"."""
    if isinstance(result, dict) and isinstance(reference, dict):
        for key in sorted(set(result) | set(reference), key=str):
            if result.get(key) != reference.get(key):
                return str(key)
    return "result"


def _differing_field(snap: Snapshot, reference: Snapshot) -> str:
    """The first snapshot field where two states differ."""
    for f in fields(snap):
        if f.compare and getattr(snap, f.name) != getattr(reference, f.name):
            return f.name
    return "state"


def side_by_side(left_title: str, left: str, right_title: str, right: str, width: int = 60) -> str:
    """Two renderings in columns, lines that differ marked with '|'. A differing line cut to
    fit the left column is repeated in full, with its counterpart, below the table."""
    a, b = left.splitlines(), right.splitlines()
    rows = [f"  {left_title:<{width}}   {right_title}"]
    cut: list[str] = []
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else ""
        y = b[i] if i < len(b) else ""
        mark = " " if x == y else "|"
        shown = x if len(x) <= width else x[: width - 1] + "…"
        rows.append(f"  {shown:<{width}} {mark} {y}")
        if x != y and shown != x:
            cut += [f"  {left_title}: {x}", f"  {right_title}: {y}"]
    if cut:
        rows += ["  differing lines in full:", *cut]
    return "\n".join(rows)


@dataclass
class RunResult:
    """How a whole trace went."""

    ops_run: int
    finding: Finding | None = None
    invalid: InvalidTrace | None = None
    misuse_ops: int = 0
    """Ops, the failing one included, that the model answered as API misuse (docs/traces.md)."""

    @property
    def passed(self) -> bool:
        return self.finding is None and self.invalid is None


def _misuse_ops(execution: Execution) -> int:
    """The ops the model answered as API misuse (0 with the model off)."""
    return getattr(execution.model, "misuse_ops", 0)


def run_trace(
    trace: Trace,
    targets: Sequence[TargetSpec] = ("kvcache",),
    *,
    model: bool = True,
    checks: Iterable[Any] | None = None,
    on_step: Callable[[int, Op, Any], None] | None = None,
) -> RunResult:
    """Replay a trace from a fresh manager; stop at the first finding or invalid op."""
    try:
        execution = Execution(trace.config, trace.level, targets, model=model, checks=checks,
                              meta=trace.meta)
    except Counterexample as exc:  # a check fails on the initial state
        return RunResult(0, finding=exc.finding)
    for i, op in enumerate(trace.ops):
        try:
            result = execution.apply(op)
        except Counterexample as exc:
            return RunResult(i, finding=exc.finding, misuse_ops=_misuse_ops(execution))
        except InvalidTrace as exc:
            return RunResult(i, invalid=exc, misuse_ops=_misuse_ops(execution))
        if on_step is not None:
            on_step(i, op, result)
    return RunResult(len(trace.ops), misuse_ops=_misuse_ops(execution))
