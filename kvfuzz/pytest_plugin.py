"""kvfuzz's pytest plugin, loaded wherever kvfuzz is installed (entry point `pytest11`).

- `--kvfuzz-plugin MODULE` (repeatable) and `KVFUZZ_PLUGINS=mod1,mod2`: import your modules of
  invariants or targets before the tests, as `kvfuzz run --plugin` does, so kvfuzz's state
  machines check them after every op. A module that cannot be imported is a usage error.
- `--kvfuzz-profile ci|dev|nightly` (or `KVFUZZ_PROFILE`): the settings of kvfuzz's state
  machines; by default `ci` where `CI` is set, else `dev`, which keeps the example database.
- `--kvfuzz-database SPEC` (repeatable) and `KVFUZZ_DATABASE=spec1,spec2`: the example database
  of kvfuzz's state machines and Hypothesis' default one, as `kvfuzz run --database` takes it
  (a directory, `redis://HOST:PORT/N`, `readonly:SPEC`; docs/distributed.md). A Redis server
  that cannot be reached is a usage error.

A failure of kvfuzz's state machines is reported short: the trace kvfuzz's shrinker left, and
without Hypothesis' `Draw N: ...` lines (one per decision, hundreds) unless pytest runs with
`-v`. The report header names the profile, the plugins and the database.

Nothing else changes: tests that do not use kvfuzz keep their own Hypothesis settings (their
database too, unless they use the default one and a kvfuzz database is named).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

_DRAW = re.compile(r"^\s*Draw \d+(?: \([^)]*\))?: ")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvfuzz", "kvfuzz state machines")
    group.addoption("--kvfuzz-plugin", action="append", default=[], metavar="MODULE",
                    help="import MODULE (invariants, targets) before the tests; repeatable; "
                    "KVFUZZ_PLUGINS=mod1,mod2 adds more")
    group.addoption("--kvfuzz-profile", choices=("ci", "dev", "nightly"), default=None,
                    help="settings of kvfuzz's state machines (default: KVFUZZ_PROFILE, else "
                    "ci where CI is set, else dev)")
    group.addoption("--kvfuzz-database", action="append", default=[], metavar="SPEC",
                    help="example database: a directory, redis://HOST:PORT/N, readonly:SPEC; "
                    "repeatable; KVFUZZ_DATABASE=spec1,spec2 adds more")


def pytest_configure(config: pytest.Config) -> None:
    from_env = [m.strip() for m in os.environ.get("KVFUZZ_PLUGINS", "").split(",") if m.strip()]
    plugins = from_env + config.getoption("kvfuzz_plugin")
    profile = config.getoption("kvfuzz_profile")
    if profile is not None or "KVFUZZ_PROFILE" in os.environ:
        from kvfuzz.fuzz import profiles

        try:
            profiles.select(profile)
            profiles.active()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
    _database(config)
    if not plugins:
        return
    from kvfuzz.fuzz.plugins import PluginError, import_plugins

    for name in plugins:
        try:
            import_plugins((name,))
        except PluginError as exc:
            raise pytest.UsageError(f"cannot import kvfuzz plugin {name!r}: {exc}") from None


def pytest_report_header(config: pytest.Config) -> str:
    from kvfuzz.fuzz import profiles
    from kvfuzz.fuzz.plugins import IMPORTED

    database = ", ".join(_database_specs(config)) or repr(profiles.active_settings().database)
    return (f"kvfuzz: profile {profiles.active()}, plugins {', '.join(IMPORTED) or '(none)'}, "
            f"database {database}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    """A kvfuzz counterexample's report, short: its message (the shrunk trace) and Hypothesis'
    notes without the Draw lines, no traceback (all of it with -v)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.excinfo is None or item.config.getoption("verbose") > 0:
        return
    from kvfuzz.harness.executor import Counterexample

    if call.excinfo.errisinstance(Counterexample):
        exc = call.excinfo.value
        notes = "\n".join(getattr(exc, "__notes__", ())).splitlines()
        report.longrepr = "\n".join([f"kvfuzz counterexample {exc}",
                                     *(line for line in notes if not _DRAW.match(line))])


def _database_specs(config: pytest.Config) -> list[str]:
    from_env = [s.strip() for s in os.environ.get("KVFUZZ_DATABASE", "").split(",") if s.strip()]
    return from_env + config.getoption("kvfuzz_database")


def _database(config: pytest.Config) -> None:
    """`--kvfuzz-database`, `KVFUZZ_DATABASE`: checked, opened and made the machines' own."""
    specs = _database_specs(config)
    if not specs:
        return
    from kvfuzz.core.errors import KvfuzzError
    from kvfuzz.fuzz import profiles
    from kvfuzz.fuzz.database import check_reachable, open_database

    try:
        check_reachable(specs)
        database = open_database(specs)
    except KvfuzzError as exc:
        raise pytest.UsageError(f"kvfuzz database: {exc}") from None
    assert database is not None
    profiles.use_database(database)
