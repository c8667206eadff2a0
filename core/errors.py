"""Errors of the harness: bad configs and malformed traces (usage errors, never findings), and
faults of the code the harness runs (a check, an adapter, a plugin: exit 3, never a finding)."""


class KvfuzzError(Exception):
    """Base class of the harness's usage errors; the CLI maps them to exit code 2."""


class ConfigError(KvfuzzError, ValueError):
    """A config names an impossible or unsupported setting."""


class TraceFormatError(KvfuzzError, ValueError):
    """A trace file or trace object does not follow docs/traces.md."""


class InvalidTrace(KvfuzzError):
    """An op is not valid at the point of the trace where it stands.

    Raised by the executor (through the reference model or a target's harness) before the op
    reaches the implementation under test: the trace is malformed, not a counterexample.
    """

    def __init__(self, message: str, step: int | None = None, op: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.op = op

    def __str__(self) -> str:
        base = super().__str__()
        if self.step is None:
            return base
        return f"step {self.step}" + (f" ({self.op})" if self.op else "") + f": {base}"


class MissingDependency(KvfuzzError):
    """An optional dependency (a pip extra, or vLLM) that the command needs is not installed."""


def require(module: str, install: str, needed_by: str) -> None:
    """Raise MissingDependency, saying how to install it, unless `module` can be imported."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingDependency(f"{needed_by} needs {module}, which is not installed: {install}")


class HarnessFault(Exception):
    """Code the harness runs (a check, a target adapter, a plugin) raised: not a counterexample
    and not bad input, so the CLI exits 3 naming `source` and the exception (`__cause__`)."""

    def __init__(self, source: str, exc: BaseException) -> None:
        super().__init__(f"{source} raised {type(exc).__name__}: {exc}")
        self.source = source
