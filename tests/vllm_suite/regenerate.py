"""Rewrite `expected-failures-VERSION.toml` from a run of vLLM's own KV-core tests on kvcache.

    "$py" tests/vllm_suite/regenerate.py                  # $py: the venv of ci/install-vllm.sh
    "$py" tests/vllm_suite/regenerate.py --report FILE    # from a run's report (no new run)

Every test of `vllm-VERSION-passing.txt` (VERSION: the installed vLLM's) that does not pass on
kvcache is listed. A test listed before keeps its category and reason; only a `lacking` one whose
reason no longer starts with the error it now fails with first takes that error as its reason.
A test not listed before is listed under category `to-categorise` with its error: not one of
test_vllm_suite.CATEGORIES, so the suite refuses the file until a person moves each such test
to its category (and may write its reason in words). A listed test that now passes leaves the
list. The counts of each category are printed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

from test_vllm_suite import (
    CATEGORIES,
    HERE,
    _collection_error,
    _installed_version,
    _sdist,
    listed,
    run_suite,
)

NEW = "to-categorise"
"""The category of a test that fails and was not listed: a person's to decide."""

_VARYING = re.compile(r" at 0x[0-9a-f]+|-?\b\d{10,}\b")
"""What differs from run to run in an error's text: object addresses, hash values."""


def stable(why: str) -> str:
    """An error's text without what differs from run to run (so a test keeps its group)."""
    return _VARYING.sub(lambda m: "" if m.group().startswith(" at") else "<int>", why)

HEADER = """\
# vLLM {version}'s own KV-core tests that pass on vLLM {version} but not on kvcache, grouped by
# category (tests/vllm_suite/test_vllm_suite.py, CATEGORIES) and by the error each fails
# with first. A listed test that passes, or an unlisted one that fails, fails the suite.
# Rewritten by tests/vllm_suite/regenerate.py: categorise every "{new}" entry by hand.
"""


def regenerate(passing_on_vllm: list[str], report: dict,
               old: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """test id -> (category, reason) of every test vLLM passes that kvcache does not."""
    out: dict[str, tuple[str, str]] = {}
    for test in passing_on_vllm:
        result = report["tests"].get(test, {"outcome": "not run",
                                            "why": _collection_error(report, test)})
        if result["outcome"] == "passed":
            continue
        why = stable(result.get("why") or result["outcome"])
        category, reason = old.get(test, (NEW, why))
        if category == "lacking" and not reason.startswith(why):
            reason = why
        out[test] = (category, reason)
    return out


def render(version: str, entries: dict[str, tuple[str, str]]) -> str:
    """The toml text: one group per (category, reason), in CATEGORIES' order (new ones last),
    the largest group of a category first."""
    groups: dict[tuple[str, str], list[str]] = {}
    for test, key in entries.items():
        groups.setdefault(key, []).append(test)
    order = [*CATEGORIES, NEW]
    parts = [HEADER.format(version=version, new=NEW)]
    for (category, reason), tests in sorted(
        groups.items(), key=lambda item: (order.index(item[0][0]) if item[0][0] in order
                                          else len(order), -len(item[1]), item[0][1])):
        listed = "".join(f"  {json.dumps(test)},\n" for test in sorted(tests))
        parts.append(f"[[group]]\ncategory = {json.dumps(category)}\n"
                     f"reason = {json.dumps(reason)}\ntests = [\n{listed}]\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path,
                        help="a report suite_plugin.py wrote (KVFUZZ_SUITE_OUT) instead of a run")
    args = parser.parse_args(argv)
    version = _installed_version()
    passing = HERE / f"vllm-{version}-passing.txt"
    if not passing.exists():
        print(f"no list of vLLM {version}'s passing tests: {passing}", file=sys.stderr)
        return 2
    if args.report is not None:
        report = json.loads(args.report.read_text())
    else:
        sdist = _sdist(version)
        if sdist is None:
            print(f"no source distribution of vLLM {version}: bash ci/fetch-vllm-sdist.sh "
                  f"{version} (or KVFUZZ_VLLM_SDIST=DIR)", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            with open(Path(tmp) / "pytest.log", "wb") as log:
                report = run_suite(sdist, "kvcache", Path(tmp) / "report.json", log)
    entries = regenerate(passing.read_text().splitlines(), report,
                         listed(version))
    path = HERE / f"expected-failures-{version}.toml"
    path.write_text(render(version, entries))
    counts = Counter(category for category, _ in entries.values())
    print(f"{path}: {len(entries)} listed: "
          + ", ".join(f"{category} {n}" for category, n in counts.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
