"""The repository's own suite: every Hypothesis test follows the active kvfuzz profile.

kvfuzz's pytest plugin (kvfuzz/pytest_plugin.py, installed with the package) gives
`--kvfuzz-plugin`, `KVFUZZ_PLUGINS` and `--kvfuzz-profile`; the state machines take the active
profile's settings. Here the profile is also loaded for the suite's other `@given` tests:
`KVFUZZ_PROFILE=nightly` or `--kvfuzz-profile=nightly` sizes everything, and
`--kvfuzz-database` (`KVFUZZ_DATABASE`) is every test's database.
"""

import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    from kvfuzz.fuzz import profiles

    profiles.load_active()
