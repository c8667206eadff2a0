"""A target's manager that raises while it is built: a finding (check BUILD), not a crash.

A `ManagerSide` whose `build_errors_are_findings` is set (the vLLM targets) turns an exception
of the library under test raised while its manager is built into a `BuildFailure`; the executor
reports it as a counterexample of check `BUILD` at the initial state, with the config as its
reproducer (`kvfuzz replay` fails it again, exit 1). It is deduplicated like any finding, by the
exception's type and the place it was raised. An exception raised in kvfuzz's own adapter code
(`harness/`, `core/`) stays a fault of the adapter (exit 3). A side that documents the failure
as a known deviation names it in `BuildFailure.deviation`; the executor then raises
`ToleratedBuild`, which a campaign counts as tolerated and a replay reports (exit 0).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

BUILD = "BUILD"
BUILD_DESCRIPTION = "the target's manager can be built for the config (its library raised)"

_OWN = tuple(os.path.realpath(Path(__file__).parent.parent / part) + os.sep
             for part in ("harness", "core"))
"""kvfuzz's adapter code: an exception raised there is the adapter's fault, not the library's."""


def raised_at(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of `exc`'s traceback (where it was raised)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1] if frames else None


def short_path(filename: str) -> str:
    """`filename` relative to the entry of sys.path that holds it (vllm/v1/core/x.py)."""
    path = os.path.abspath(filename)
    best = path
    for entry in sys.path:
        root = os.path.abspath(entry or ".") + os.sep
        if path.startswith(root) and len(path) - len(root) < len(best):
            best = path[len(root):]
    return best


class BuildFailure(Exception):
    """The library under test raised while a side built its manager."""

    def __init__(self, exc: BaseException, deviation: str | None = None) -> None:
        frame = raised_at(exc)
        self.error = type(exc).__name__
        self.place = (f"{os.path.basename(frame.filename)}:{frame.name}:{frame.lineno}"
                      if frame else "?")
        """Where it was raised, as `executor` signatures name a place."""
        where = (f" (raised at {short_path(frame.filename)}:{frame.lineno} in {frame.name})"
                 if frame else "")
        self.message = f"{self.error}: {exc}{where}"
        self.deviation = deviation
        """The label of the known deviation the side tolerates this failure as, if any."""
        super().__init__(self.message)


class ToleratedBuild(Exception):
    """A side cannot build its manager for a config, a failure it tolerates as a documented
    deviation: nothing can run on that config (a campaign leaves it out and counts it)."""

    def __init__(self, target: str, config: str, failure: BuildFailure) -> None:
        self.target, self.config, self.failure = target, config, failure
        self.deviation = failure.deviation or ""
        super().__init__(f"target {target} tolerates {self.deviation}: it cannot build config "
                         f"{config!r} ({failure.message})")


def library_fault(exc: Exception) -> bool:
    """Whether `exc` was raised outside kvfuzz's adapter code (in the library under test, or
    in a plugin patching it)."""
    frame = raised_at(exc)
    return frame is not None and not os.path.realpath(frame.filename).startswith(_OWN)
