"""kvcache's misuse contract under the randomized misuse driver (harness/misuse.py): thousands of
invalid calls mixed into valid use over the built-in configs are all refused with ValueError and
change nothing. The driver is seen catching the plant `touch-unvalidated`."""

from __future__ import annotations

from kvfuzz.core.configs import BUILTIN
from kvfuzz.harness.misuse import MisuseDriver, run_misuse

CONFIGS = {name: config for name, (_, config) in BUILTIN.items()}


def test_twenty_thousand_invalid_calls_are_refused_cleanly():
    report = run_misuse(CONFIGS, 20_000, seed=13)
    print(report.summary())
    assert report.calls >= 20_000 - len(CONFIGS) and report.valid_ops > report.calls / 2
    assert report.state_changes == [], report.state_changes[:5]
    assert report.wrong_outcomes == [], report.wrong_outcomes[:5]
    assert report.rejected == report.calls


def test_the_driver_catches_a_touch_without_validation():
    report = MisuseDriver(BUILTIN["full"][1], "bug:touch-unvalidated", seed=1).run(300)
    assert report.state_changes, report.summary()
    assert any("touch(" in what for what in report.state_changes)
    assert any("AttributeError" in what or "TypeError" in what for what in report.wrong_outcomes)
