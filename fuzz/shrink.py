"""Shrinking a failing trace to a minimal one that fails the same check.

Works on traces from any source (a Hypothesis run, atheris, another tool, an old corpus):
candidates are replayed through the one executor, and a candidate counts only if it is a valid
trace that fails the same check. Passes, repeated until none helps: drop a whole request, drop
chunks of ops (delta debugging, halving the chunk size), simplify single ops (shorter prompts
and token lists, smaller counts, fields back to their defaults), and shrink the config (fewer
blocks, default driver knobs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from harness.config import SchedulerConfig
from harness.errors import ConfigError
from harness.executor import Finding, TargetSpec, run_trace
from harness.trace import OP_SCHEMAS, Op, Trace


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
        checks: Any = None,
        seconds: float = 60.0,
        on_progress: Callable[[Trace], None] | None = None,
    ) -> None:
        self.targets = targets
        self.model = model
        self.check = check
        self.checks = checks
        self.deadline = 0.0
        self.seconds = seconds
        self.attempts = 0
        self.on_progress = on_progress

    def fails(self, trace: Trace) -> Finding | None:
        """The finding if `trace` still fails the check being shrunk for."""
        self.attempts += 1
        result = run_trace(trace, self.targets, model=self.model, checks=self.checks)
        if result.finding is not None and (
            self.check is None or result.finding.check == self.check
        ):
            return result.finding
        return None

    def shrink(self, trace: Trace) -> ShrinkResult:
        start = time.monotonic()
        self.deadline = start + self.seconds
        finding = self.fails(trace)
        if finding is None:
            raise ValueError("the trace does not fail" + (f" {self.check}" if self.check else ""))
        self.check = finding.check
        best, best_finding = finding.trace, finding
        improved = True
        while improved and not self._late():
            improved = False
            for candidate in self._candidates(best):
                if self._late():
                    break
                if _size(candidate) >= _size(best):
                    continue
                found = self.fails(candidate)
                if found is not None:
                    best, best_finding, improved = found.trace, found, True
                    if self.on_progress is not None:
                        self.on_progress(best)
                    break
        best.meta.update(best_finding.trace.meta)
        return ShrinkResult(best, best_finding, self.attempts, time.monotonic() - start)

    def _late(self) -> bool:
        return time.monotonic() > self.deadline

    def _candidates(self, trace: Trace) -> Iterator[Trace]:
        yield from _drop_requests(trace)
        yield from _drop_chunks(trace)
        yield from _simplify_ops(trace)
        yield from _simplify_config(trace)


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
            elif isinstance(value, str) and key == "cache_salt":
                weight += 1
    cfg = trace.config
    knobs = sum(
        getattr(cfg.scheduler, f.name) != f.default for f in dataclasses.fields(SchedulerConfig)
    )
    return (len(trace.ops), weight, cfg.num_blocks + knobs)


def _with_ops(trace: Trace, ops: list[Op]) -> Trace:
    return Trace(trace.config, trace.level, ops, dict(trace.meta))


def _drop_requests(trace: Trace) -> Iterator[Trace]:
    ids = [op["request_id"] for op in trace.ops if op["op"] == "add_request"]
    for rid in ids:
        yield _with_ops(trace, [op for op in trace.ops if op.get("request_id") != rid])


def _drop_chunks(trace: Trace) -> Iterator[Trace]:
    n = len(trace.ops)
    size = n // 2
    while size >= 1:
        for start in range(0, n, size):
            yield _with_ops(trace, trace.ops[:start] + trace.ops[start + size:])
        size //= 2


_NUMBERS_TO_SHRINK = ("num_new_tokens", "num_lookahead_tokens", "reserved_blocks", "priority",
                      "max_tokens", "num_encoder_tokens", "sample", "num_computed_tokens")


def _simplify_ops(trace: Trace) -> Iterator[Trace]:
    for i, op in enumerate(trace.ops):
        for variant in _op_variants(op, trace.level):
            ops = list(trace.ops)
            ops[i] = variant
            yield _with_ops(trace, ops)


def _op_variants(op: Op, level: str) -> Iterator[Op]:
    schema = OP_SCHEMAS[level][op["op"]]
    for key, (_, default) in schema.items():
        value = op[key]
        if key in ("prompt", "tokens", "block_ids") and len(value) > 1:
            yield {**op, key: value[: len(value) // 2]}
            yield {**op, key: value[:-1]}
            yield {**op, key: value[1:]}
        elif key in ("prompt", "tokens") and value and value[0] != 0:
            yield {**op, key: [0] + value[1:]}
        elif key in _NUMBERS_TO_SHRINK and isinstance(value, int) and value > 0:
            yield {**op, key: value // 2}
            yield {**op, key: value - 1}
        elif key != "request_id" and default is not None and value != default:
            yield {**op, key: default}
        elif key == "cache_salt" and value is not None:
            yield {**op, key: None}


def _simplify_config(trace: Trace) -> Iterator[Trace]:
    cfg = trace.config
    changes: list[dict[str, Any]] = []
    if cfg.num_blocks > 2:
        changes += [{"num_blocks": max(2, cfg.num_blocks // 2)}, {"num_blocks": cfg.num_blocks - 1}]
    if cfg.scheduler != SchedulerConfig():
        for f in dataclasses.fields(SchedulerConfig):
            if getattr(cfg.scheduler, f.name) != f.default:
                changes.append(
                    {"scheduler": dataclasses.replace(cfg.scheduler, **{f.name: f.default})}
                )
    for change in changes:
        try:
            yield Trace(cfg.replace(**change), trace.level, list(trace.ops), dict(trace.meta))
        except ConfigError:
            continue
