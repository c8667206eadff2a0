"""Hypothesis settings of kvfuzz's state machines: the profiles `ci`, `dev` and `nightly`.

They are registered with Hypothesis as `kvfuzz-ci`, `kvfuzz-dev` and `kvfuzz-nightly`, and
apply to the state machines that `kvfuzz.testing` builds; other Hypothesis tests keep their own
settings. The active one is, in order: the one `select` chose (`pytest --kvfuzz-profile`),
`KVFUZZ_PROFILE`, `ci` where the `CI` variable is set (Hypothesis' own convention), else `dev`.
`use_database` (`pytest --kvfuzz-database`, `KVFUZZ_DATABASE`) gives every profile one example
database, shared or local (`kvfuzz.fuzz.database`).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import ExampleDatabase

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                           HealthCheck.data_too_large],
)
# Each starts from Hypothesis' defaults, not from whatever profile is loaded, so `dev` and
# `nightly` keep their example database and random seeds on CI runners too.
_DEFAULT = settings.get_profile("default")
PROFILES = {
    "ci": settings(_DEFAULT, max_examples=60, stateful_step_count=30, derandomize=True,
                   print_blob=True, **_COMMON),
    "dev": settings(_DEFAULT, max_examples=20, stateful_step_count=20, **_COMMON),
    "nightly": settings(_DEFAULT, max_examples=2000, stateful_step_count=60, **_COMMON),
}
"""ci: derandomized, no database; dev: keeps the example database (.hypothesis/); nightly: deep."""
for _name, _settings in PROFILES.items():
    settings.register_profile(f"kvfuzz-{_name}", _settings)

_selected: str | None = None
_database: ExampleDatabase | None = None


def select(name: str | None) -> None:
    """Make `name` the active profile (None: back to the environment's choice)."""
    if name is not None and name not in PROFILES:
        raise ValueError(f"unknown kvfuzz profile {name!r}; known: {', '.join(PROFILES)}")
    global _selected
    _selected = name


def active() -> str:
    """The name of the active profile."""
    name = _selected or os.environ.get("KVFUZZ_PROFILE") or ("ci" if os.environ.get("CI")
                                                             else "dev")
    if name not in PROFILES:
        raise ValueError(f"KVFUZZ_PROFILE={name!r} is not a kvfuzz profile; known: "
                         f"{', '.join(PROFILES)}")
    return name


def use_database(database: ExampleDatabase) -> None:
    """Make `database` the example database of every profile, and Hypothesis' default one
    (HypoFuzz fuzzes only tests whose database is the default). A derandomized run keeps no
    database in Hypothesis, so the `ci` profile then draws random examples too."""
    global _database
    _database = database
    settings.register_profile("kvfuzz-database", settings(settings(), database=database,
                                                          derandomize=False))
    settings.load_profile("kvfuzz-database")


def active_settings() -> settings:
    chosen = PROFILES[active()]
    if _database is None:
        return chosen
    return settings(chosen, database=_database, derandomize=False)


def load_active() -> None:
    """Make the active profile, with the database of `use_database` if any, Hypothesis'
    default settings (for a suite's other `@given` tests)."""
    settings.register_profile("kvfuzz-active", active_settings())
    settings.load_profile("kvfuzz-active")
