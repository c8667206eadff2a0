"""A trace is data: replaying, shrinking or exporting one imports only the plugins the user
names with `--plugin`, never those its `meta.plugins` records (a downloaded corpus must not run
code). The recorded ones are shown, with the options that would import them."""

from __future__ import annotations

from kvfuzz.core.trace import Trace


def plugin_options(modules: list[str]) -> str:
    """The command-line options importing `modules`."""
    return " ".join(f"--plugin {m}" for m in modules)


def recorded_plugins(trace: Trace, passed: list[str]) -> tuple[list[str], str]:
    """The plugins `trace` records, and a note naming those not among `passed` (not imported)
    with the options to pass ("" when every one was passed)."""
    recorded = list(trace.meta.get("plugins", []))
    missing = [m for m in recorded if m not in passed]
    if not missing:
        return recorded, ""
    return recorded, (f"note: the trace records plugin(s) {', '.join(missing)}, not imported "
                      f"(a trace is data); if you trust them, pass `{plugin_options(missing)}`")
