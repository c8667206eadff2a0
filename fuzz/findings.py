"""A campaign's findings: one per bug, on disk before shrinking, kept through Ctrl-C.

Two failures are the same bug when `dedup_key` says so: the same check and the same way of
failing (`Finding.signature`: for a DIFF the op kind and the differing field, for a CRASH the
exception type and place), whatever the worker, config, level, seed or run. Shrinking keeps the
key (`kvfuzz.fuzz.shrink`), so a raw failure whose key is known is a duplicate and is not shrunk
again. The corpus remembers keys between runs: each saved finding records its key in
`meta.dedup_key`, and a run into the same corpus counts a known bug as a duplicate of the file
already there and adds nothing.

A new failure is written raw to the corpus first (`meta.shrunk: false`), then shrunk and
written under the shrunk trace's digest (the raw file removed). An interrupt during the shrink
saves the smallest trace found so far (`meta.shrunk: "partial"`) and ends the campaign: `stop`
says when one was asked for, and the shrink then raises KeyboardInterrupt before its next replay
(a failure offered after that is kept raw).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfuzz.core.trace import Trace, save_finding
from kvfuzz.fuzz.schedule import Failure
from kvfuzz.fuzz.shrink import Shrinker


def dedup_key(check: str, signature: Sequence[str]) -> str:
    """The one key findings are deduplicated by (campaign workers, Ray, the corpus)."""
    return "/".join((check, *signature))


@dataclass
class FindingRecord:
    check: str
    message: str
    config: str
    level: str
    file: str
    ops: int
    found_after_s: float
    shrink_s: float
    key: str = ""
    duplicates: int = 0
    """Other failures of the same bug this campaign saw (not shrunk, not saved)."""
    known: bool = False
    """The bug was already in the corpus (`file`) before this run: nothing new saved."""
    shrunk: bool | str = True
    """False for a raw trace, "partial" when the shrink was interrupted."""
    elsewhere: list[str] = field(default_factory=list)
    """The other (level/config) pairs its duplicates came from: the same way of failing,
    found by other traces (`file` is this pair's)."""
    corpus_error: str = ""
    """Why the corpus could not take it (a full disk, a read-only folder): `file` is then a
    fallback path, or empty when none could be written, and `trace` holds it in full."""
    trace: dict[str, Any] | None = None
    """The trace itself, when it is not in the corpus (`corpus_error`)."""
    target_raised: str = ""
    """The exception the target raised at the failing step, "" when it returned normally: set,
    the finding is the target raising, whichever check reported it (`Finding.target_raised`)."""


class Findings:
    """The findings of one campaign into `corpus` (see the module docstring)."""

    def __init__(self, corpus: Path, meta: dict[str, Any], targets: Sequence[Any], *,
                 model: bool, checks: Any, shrink_seconds: float,
                 stop: Callable[[], bool] | None = None) -> None:
        self.corpus = corpus
        self.meta = meta
        """Recorded in every saved finding (target, seed, data, plugins)."""
        self.targets = targets
        self.model = model
        self.checks = checks
        self.shrink_seconds = shrink_seconds
        self.stop = stop
        self.records: dict[str, FindingRecord] = {}
        self.known = known_keys(corpus)

    def offer(self, failure: Failure, level: str, config: str, found_after: float) -> None:
        """Count `failure`; save and shrink it if it is a bug not seen before."""
        key = dedup_key(failure.check, failure.signature)
        if key in self.records:
            record = self.records[key]
            record.duplicates += 1
            pair = f"{level}/{config}"
            if pair != f"{record.level}/{record.config}" and pair not in record.elsewhere:
                record.elsewhere.append(pair)
            return
        if key in self.known:
            path, ops = self.known[key]
            self.records[key] = FindingRecord(
                failure.check, failure.message, config, level, str(path), ops,
                round(found_after, 3), 0.0, key, known=True, target_raised=failure.target_raised)
            return
        trace = Trace.from_dict(json.loads(failure.trace_json))
        trace.meta.update(self.meta)
        trace.meta.update({"check": failure.check, "config": config, "level": level,
                           "dedup_key": key})
        record = FindingRecord(failure.check, failure.message, config, level, "",
                               len(trace.ops), round(found_after, 3), 0.0, key, shrunk=False,
                               target_raised=failure.target_raised)
        self.records[key] = record
        self._save(record, _marked(trace, False))
        if self.stop is not None and self.stop():
            return
        start = time.monotonic()
        shrinker = Shrinker(self.targets, model=self.model, checks=self.checks,
                            check=failure.check, signature=tuple(failure.signature),
                            seconds=self.shrink_seconds, stop=self.stop)
        try:
            result = shrinker.shrink(trace)
            best, message, shrunk = result.trace, result.finding.message, True
            record.target_raised = result.finding.target_raised
        except ValueError:  # it did not fail again the same way on replay: keep it raw
            return
        except KeyboardInterrupt:
            if shrinker.best is None:
                raise
            best, message, shrunk = shrinker.best, record.message, "partial"
            self._keep(record, trace, best, message, shrunk, start)
            raise
        self._keep(record, trace, best, message, shrunk, start)

    def _keep(self, record: FindingRecord, raw: Trace, best: Trace, message: str,
              shrunk: bool | str, start: float) -> None:
        """Save `best` in place of the raw trace and update the record."""
        best.meta.update(raw.meta)
        best.meta["message"] = message  # the shrunk trace's own, not the raw one's
        before = record.file
        record.ops, record.message, record.shrunk = len(best.ops), message, shrunk
        self._save(record, _marked(best, shrunk))
        if before and before != record.file:
            try:
                Path(before).unlink(missing_ok=True)
            except OSError:
                pass
        record.shrink_s = round(time.monotonic() - start, 3)

    def _save(self, record: FindingRecord, trace: Trace) -> None:
        """Write `trace` to the corpus as `record`'s file. Should the corpus refuse it, the
        finding is kept all the same: in a fallback folder if one takes it, and in full in the
        record (the summary prints it, the --json report holds it)."""
        try:
            record.file = str(save_finding(trace, self.corpus))
            record.corpus_error, record.trace = "", None
            return
        except OSError as exc:
            record.corpus_error = f"cannot write in {self.corpus}: {exc.strerror or exc}"
        record.trace = trace.to_dict()
        try:
            record.file = str(save_finding(trace, fallback_folder()))
        except OSError:
            record.file = ""

    def all(self) -> list[FindingRecord]:
        return list(self.records.values())


def fallback_folder() -> Path:
    """Where findings go when the corpus cannot take them: kvfuzz-findings in the folder for
    temporary files."""
    return Path(tempfile.gettempdir()) / "kvfuzz-findings"


def _marked(trace: Trace, shrunk: bool | str) -> Trace:
    trace.meta["shrunk"] = shrunk
    return trace


def known_keys(corpus: Path) -> dict[str, tuple[Path, int]]:
    """The dedup keys of the findings already in `corpus` (files that record one), each with
    its file and number of ops."""
    keys: dict[str, tuple[Path, int]] = {}
    for path in sorted(corpus.glob("*.json")) if corpus.is_dir() else ():
        try:
            data = json.loads(path.read_text())
            meta, ops = data.get("meta", {}), data.get("ops", [])
        except (OSError, ValueError, AttributeError):
            continue
        key = meta.get("dedup_key") if isinstance(meta, dict) else None
        if isinstance(key, str) and isinstance(ops, list):
            keys.setdefault(key, (path, len(ops)))
    return keys


def by_check(records: Sequence[FindingRecord]) -> dict[str, dict[str, Any]]:
    """Findings grouped per check: the distinct bugs (representatives) and their duplicates."""
    groups: dict[str, dict[str, Any]] = {}
    for r in records:
        group = groups.setdefault(r.check, {"bugs": 0, "duplicates": 0, "new": 0, "files": []})
        group["bugs"] += 1
        group["duplicates"] += r.duplicates
        group["new"] += not r.known
        group["files"].append(r.file)
    return groups
