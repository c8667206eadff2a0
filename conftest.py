"""Hypothesis settings profiles: `ci` (the default), `dev`, `nightly`; and user plugins.

Pick a profile with HYPOTHESIS_PROFILE=dev or `pytest --hypothesis-profile=nightly`. Name a
module of your own invariants (or targets) with `pytest --kvfuzz-plugin MODULE` (repeatable) or
KVFUZZ_PLUGINS=mod1,mod2: it is imported before the tests run, as `kvfuzz run --plugin` does,
so the state machines check it after every op.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                           HealthCheck.data_too_large],
)
# Hypothesis loads its own `ci` profile where CI is set; every profile here starts from the
# defaults instead, so `nightly` keeps its example database and random seeds on CI runners too.
_DEFAULT = settings.get_profile("default")
settings.register_profile("ci", _DEFAULT, max_examples=60, stateful_step_count=30,
                          derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("dev", _DEFAULT, max_examples=20, stateful_step_count=20, **_COMMON)
settings.register_profile("nightly", _DEFAULT, max_examples=2000, stateful_step_count=60,
                          **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kvfuzz-plugin", action="append", default=[], metavar="MODULE",
                     help="import MODULE (invariants, targets) before the tests; repeatable; "
                     "KVFUZZ_PLUGINS=mod1,mod2 adds more")


def pytest_configure(config: pytest.Config) -> None:
    from_env = [m.strip() for m in os.environ.get("KVFUZZ_PLUGINS", "").split(",") if m.strip()]
    plugins = from_env + config.getoption("kvfuzz_plugin")
    if not plugins:
        return
    from fuzz.campaign import import_plugins

    for name in plugins:
        try:
            import_plugins((name,))
        except ImportError as exc:
            raise pytest.UsageError(f"cannot import kvfuzz plugin {name!r}: {exc}") from None
