"""Shrinking a failing trace to a minimal one that fails the same way.

Works on traces from any source (a Hypothesis run, atheris, another tool, an old corpus):
candidates are replayed through the one executor, and a candidate counts only if it is a valid
trace that fails the same way: the same check and the same `Finding.signature` (for a DIFF the
op kind and the differing field, for a CRASH the exception type and place), so a shrink cannot
slip into another, already known failure; and a trace of valid use stays one (no op the model
answers as API misuse, docs/traces.md), so a finding on a target that does not validate misuse
(vLLM) cannot slip into a call it is free to take silently. Passes, repeated until none helps: shrink the config (fewer
blocks, default driver knobs; a generated config, `kvfuzz.fuzz.config_space`, also loses
groups and features), drop a whole request, drop chunks of ops (delta debugging,
halving the chunk size), simplify single ops (shorter prompts and token lists, smaller counts,
fields back to their defaults).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvfuzz.core.config import LOOP_RULES, SchedulerConfig
from kvfuzz.core.errors import ConfigError
from kvfuzz.harness.build import ToleratedBuild
from kvfuzz.harness.executor import Finding, RunResult, TargetSpec, run_trace
from kvfuzz.core.trace import OP_SCHEMAS, Op, Trace
from kvfuzz.fuzz.config_space import config_features, generated_variants, is_generated


@dataclasses.dataclass
class ShrinkResult:
    trace: Trace
    finding: Finding
    attempts: int
    seconds: float


class Shrinker:
    """Greedy, deterministic shrinking of one failing trace."""

    def __init__(
        self,
        targets: Sequence[TargetSpec],
        *,
        model: bool = True,
        check: str | None = None,
        signature: tuple[str, ...] | None = None,
        checks: Any = None,
        seconds: float = 60.0,
        on_progress: Callable[[Trace], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.targets = targets
        self.model = model
        self.check = check
        self.signature = signature
        self.checks = checks
        self.deadline = 0.0
        self.seconds = seconds
        self.best: Trace | None = None
        self.best_finding: Finding | None = None
        self.attempts = 0
        self.misuse = True
        """Whether a candidate may make API-misuse calls: only where the trace to shrink does."""
        self.last: RunResult | None = None
        """The latest replay (`fails`)."""
        self.on_progress = on_progress
        self.stop = stop
        """Asked before each replay: when it says so, the shrink raises KeyboardInterrupt
        (`best` is the smallest failing trace found so far)."""

    def fails(self, trace: Trace) -> Finding | None:
        """The finding if `trace` still fails the way being shrunk for."""
        if self.stop is not None and self.stop():
            raise KeyboardInterrupt
        self.attempts += 1
        try:
            self.last = run_trace(trace, self.targets, model=self.model, checks=self.checks)
        except ToleratedBuild:  # a config the target cannot build, as it documents
            self.last = RunResult(0)
            return None
        found = self.last.finding
        if found is None or self.check not in (None, found.check):
            return None
        if self.last.misuse_ops and not self.misuse:
            return None
        if self.signature not in (None, found.signature):
            return None
        return found

    def _why_not(self, result: RunResult) -> str:
        """Why a trace to shrink does not fail the way asked: it is invalid (where and why),
        it fails another way, or it passes."""
        if result.invalid is not None:
            return f"the trace is invalid, so there is nothing to shrink: {result.invalid}"
        wanted = (f" {self.check}" if self.check else "") + (
            f" as {'/'.join(self.signature)}" if self.signature else "")
        if result.finding is not None:
            other = result.finding
            return (f"the trace does not fail{wanted}: it fails [{other.check}]"
                    + (f" as {'/'.join(other.signature)}" if other.signature else "")
                    + f" at step {other.step} ({other.message})")
        return f"the trace does not fail{wanted}: it passes all {result.ops_run} ops"

    def shrink(self, trace: Trace) -> ShrinkResult:
        start = time.monotonic()
        self.deadline = start + self.seconds
        finding = self.fails(trace)
        if finding is None:
            raise ValueError(self._why_not(self.last))
        self.check, self.signature = finding.check, finding.signature
        self.misuse = self.last.misuse_ops > 0
        self.best, self.best_finding = finding.trace, finding
        changed = True
        while changed and not self._late():
            sizes = _size(self.best)
            self._shrink_config()
            self._drop_requests()
            self._drop_chunks()
            self._simplify_ops()
            changed = _size(self.best) < sizes
        best = self.best
        best.meta.update(self.best_finding.trace.meta)
        return ShrinkResult(best, self.best_finding, self.attempts, time.monotonic() - start)

    def _try(self, candidate: Trace) -> bool:
        """Adopt the candidate if it is smaller and still fails the check."""
        if self._late() or _size(candidate) >= _size(self.best):
            return False
        found = self.fails(candidate)
        if found is None:
            return False
        self.best, self.best_finding = found.trace, found
        if self.on_progress is not None:
            self.on_progress(found.trace)
        return True

    def _shrink_config(self) -> None:
        while any(self._try(c) for c in _config_variants(self.best)):
            pass

    def _drop_requests(self) -> None:
        k = 0
        while not self._late():
            ids = [op["request_id"] for op in self.best.ops if op["op"] == "add_request"]
            if k >= len(ids):
                return
            kept = [op for op in self.best.ops if op.get("request_id") != ids[k]]
            if not self._try(_with_ops(self.best, kept)):
                k += 1

    def _drop_chunks(self) -> None:
        """Delta debugging: remove runs of ops, halving the run length."""
        size = len(self.best.ops) // 2
        while size >= 1 and not self._late():
            i = 0
            while i < len(self.best.ops) and not self._late():
                ops = self.best.ops
                if not self._try(_with_ops(self.best, ops[:i] + ops[i + size:])):
                    i += size
            size //= 2

    def _simplify_ops(self) -> None:
        i = 0
        while i < len(self.best.ops) and not self._late():
            op = self.best.ops[i]
            for variant in _op_variants(op, self.best.level):
                ops = list(self.best.ops)
                ops[i:i + 1] = [variant]
                if self._try(_with_ops(self.best, ops)):
                    break
            else:
                i += 1

    def _late(self) -> bool:
        return time.monotonic() > self.deadline


def shrink_trace(trace: Trace, targets: Sequence[TargetSpec], **kwargs: Any) -> ShrinkResult:
    """Shrink `trace` for the check it fails on `targets` (see `Shrinker`)."""
    return Shrinker(targets, **kwargs).shrink(trace)


def _size(trace: Trace) -> tuple[int, int, int]:
    """Order on traces: fewer ops, then less content, then a smaller config."""
    weight = 0
    for op in trace.ops:
        for key, value in op.items():
            if isinstance(value, list):
                weight += len(value)
            elif isinstance(value, bool):
                weight += value
            elif isinstance(value, int):
                weight += abs(value)
            elif isinstance(value, dict):
                weight += len(value)
            elif isinstance(value, str) and key == "cache_salt":
                weight += 1
    cfg = trace.config
    knobs = sum(
        getattr(cfg.scheduler, f.name) != f.default for f in dataclasses.fields(SchedulerConfig)
    )
    return (len(trace.ops), weight, cfg.num_blocks + knobs + config_features(cfg))


def _with_ops(trace: Trace, ops: list[Op]) -> Trace:
    return Trace(trace.config, trace.level, ops, dict(trace.meta))


_NUMBERS_TO_SHRINK = ("num_new_tokens", "num_lookahead_tokens", "reserved_blocks", "priority",
                      "max_tokens", "num_encoder_tokens", "sample", "num_computed_tokens")


def _op_variants(op: Op, level: str) -> Iterator[Op]:
    schema = OP_SCHEMAS[level][op["op"]]
    for key, (_, default) in schema.items():
        value = op[key]
        if key in ("prompt", "tokens", "block_ids") and len(value) > 1:
            embeds = op.get("prompt_embeds") if key == "prompt" else None
            for cut in (slice(len(value) // 2), slice(-1), slice(1, None)):
                if embeds is None:
                    yield {**op, key: value[cut]}
                else:
                    yield {**op, key: value[cut], "prompt_embeds": embeds[cut]}
        elif key in ("prompt", "tokens") and value and value[0] != 0:
            yield {**op, key: [0] + value[1:]}
        elif key in _NUMBERS_TO_SHRINK and isinstance(value, int) and value > 0:
            yield {**op, key: value // 2}
            yield {**op, key: value - 1}
        elif key != "request_id" and default is not None and value != default:
            yield {**op, key: default}
        elif key in ("cache_salt", "mm_inputs", "prompt_embeds", "drafted") and value is not None:
            yield {**op, key: None}
        elif key == "lora_name" and value is not None:
            yield {**op, "lora_name": None, "lora_id": None, "lora_path": None}


def _config_variants(trace: Trace) -> Iterator[Trace]:
    cfg = trace.config
    changes: list[dict[str, Any]] = []
    if cfg.num_blocks > 2:
        changes += [{"num_blocks": max(2, cfg.num_blocks // 2)}, {"num_blocks": cfg.num_blocks - 1}]
    if cfg.scheduler != SchedulerConfig():
        for f in dataclasses.fields(SchedulerConfig):
            value, drafts = getattr(cfg.scheduler, f.name), f.name == "num_speculative_tokens"
            if (value == f.default or drafts and value == 1 or f.name in LOOP_RULES
                    or f.name == "async_scheduling"):
                continue  # the engine's rules, which a vLLM target sets and needs kept
            # Fixed drafts shrink to one, not none: the trace's `accept` verifies them, which
            # a target that takes no drafter's drafts cannot run without them.
            changes.append({"scheduler": dataclasses.replace(
                cfg.scheduler, **{f.name: value - 1 if drafts else f.default})})
    if is_generated(cfg):
        changes += generated_variants(cfg)
    for change in changes:
        try:
            yield Trace(cfg.replace(**change), trace.level, list(trace.ops), dict(trace.meta))
        except ConfigError:
            continue
