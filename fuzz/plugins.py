"""User plugins: modules of invariants, targets or patches, named on the command line.

A plugin is imported only when the user names it (`kvfuzz ... --plugin MODULE`,
`pytest --kvfuzz-plugin MODULE`, `KVFUZZ_PLUGINS`). The names imported in this process are
recorded, so that a finding saved here says which plugins it needs to replay.
"""

from __future__ import annotations

import importlib

from kvfuzz.core.signals import asked_to_stop

IMPORTED: list[str] = []
"""Plugins imported in this process, in order."""


class PluginError(ImportError):
    """A plugin module failed to import: `name` is the module, the message says why."""


def import_plugins(plugins: tuple[str, ...] | list[str]) -> None:
    """Import each plugin module in order; PluginError names the first that fails."""
    for name in plugins:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # SystemExit, an interrupt no signal asked for, ...
            if asked_to_stop(exc):
                raise
            raise PluginError(f"{type(exc).__name__}: {exc}", name=name) from exc
        if name not in IMPORTED:
            IMPORTED.append(name)
