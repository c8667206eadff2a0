"""Hypothesis settings profiles: `ci` (the default), `dev`, `nightly`.

Pick one with HYPOTHESIS_PROFILE=dev or `pytest --hypothesis-profile=nightly`.
"""

import os

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
