"""`kvfuzz merge`: one report and one corpus from the reports of several campaigns.

N parallel CI jobs (one seed each, one shared example database) each leave a JSON report
(`kvfuzz run --json`) beside their corpus. Merging sums their work (examples, operations,
checks, per (level, config) pair), keeps one finding per bug (the campaign's dedup key; the
check for a report that records none) with the smallest trace as its representative, copied
into one corpus, and counts the others as duplicates. A finding that its campaign's corpus
could not take is written from the trace its report holds; the known deviations tolerated are
summed per deviation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kvfuzz.core.errors import KvfuzzError
from kvfuzz.core.trace import Trace, save_finding

SUMMED = ("examples", "operations", "invariant_checks")


class MergeError(KvfuzzError):
    """A report cannot be read (exit 2)."""


def _load(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MergeError(f"cannot read the report {path}: {exc}") from None
    if not isinstance(report, dict) or not isinstance(report.get("findings"), list):
        raise MergeError(f"{path} is not a `kvfuzz run --json` report")
    return report


def _trace_file(report: Path, named: str) -> Path | None:
    """A finding's trace file: as the report names it, relative to the report's folder (where
    the campaign ran), else the file of that name anywhere below that folder."""
    if not named:  # the campaign's corpus could not take it (its trace is in the report)
        return None
    for candidate in (Path(named), report.parent / named):
        if candidate.is_file():
            return candidate
    return next(report.parent.rglob(Path(named).name), None)


def merge_reports(paths: list[Path], corpus: Path) -> dict[str, Any]:
    """The merged report of `paths`; each bug's representative trace is copied into `corpus`."""
    merged: dict[str, Any] = {key: 0 for key in SUMMED}
    merged.update(seconds=0.0, interrupted=False, campaigns=[])
    pairs: dict[tuple[str, str], dict[str, Any]] = {}
    bugs: dict[str, dict[str, Any]] = {}
    pair_bugs: dict[tuple[str, str], set[str]] = {}
    for path in paths:
        report = _load(path)
        merged["campaigns"].append({"report": str(path), "seed": report.get("seed"),
                                    "examples": report.get("examples", 0),
                                    "findings": len(report["findings"])})
        for key in SUMMED:
            merged[key] += report.get(key, 0)
        merged["seconds"] = max(merged["seconds"], report.get("seconds", 0.0))
        merged["interrupted"] = merged["interrupted"] or bool(report.get("interrupted"))
        for label, row in (report.get("tolerated") or {}).items():
            mine = merged.setdefault("tolerated", {}).setdefault(
                label, {"examples": 0, "configs_left_out": []})
            mine["examples"] += row.get("examples", 0)
            mine["configs_left_out"] = sorted({*mine["configs_left_out"],
                                               *row.get("configs_left_out", [])})
        for row in report.get("by_config", []):
            mine = pairs.setdefault((row["level"], row["config"]),
                                    {"level": row["level"], "config": row["config"],
                                     "examples": 0, "operations": 0, "findings": 0})
            for key in ("examples", "operations"):
                mine[key] += row.get(key, 0)
        for finding in report["findings"]:
            key = finding.get("key") or finding["check"]
            pair_bugs.setdefault((finding["level"], finding["config"]), set()).add(key)
            found = dict(finding, key=key, source=_trace_file(path, finding["file"]))
            best = bugs.get(key)
            if best is None:
                bugs[key] = dict(found, duplicates=finding.get("duplicates", 0))
                continue
            best["duplicates"] += 1 + finding.get("duplicates", 0)
            if (found["ops"], Path(found["file"]).name) < (best["ops"], Path(best["file"]).name):
                bugs[key] = dict(found, duplicates=best["duplicates"])
    corpus.mkdir(parents=True, exist_ok=True)
    for bug in bugs.values():
        source = bug.pop("source")
        if source is None and isinstance(bug.get("trace"), dict):  # kept in the report only
            bug["file"] = str(save_finding(Trace.from_dict(bug.pop("trace")), corpus))
            continue
        if source is None:
            bug["file"] = None  # the campaign's corpus did not come with its report
            continue
        target = corpus / source.name
        if source.resolve() != target.resolve():
            shutil.copyfile(source, target)
        bug["file"] = str(target)
    for pair, row in pairs.items():
        row["findings"] = len(pair_bugs.get(pair, ()))  # distinct bugs seen on the pair
    merged["by_config"] = list(pairs.values())
    merged["findings"] = sorted(bugs.values(), key=lambda b: (b["check"], b["key"]))
    return merged
