"""`kvfuzz mutate`: how many source mutants of the target a fixed-example campaign kills.

cosmic-ray (`pip install 'kvfuzz[mutate]'`) lists the mutants of the named files and applies
each one in place; for each, a fixed-example campaign (`kvfuzz.fuzz.campaign`, seeded, stopped at
its first finding) runs in a fresh interpreter under a timeout and says which check killed it;
when that finding is the target raising, the campaign goes on to the first finding of a check on
results, state, events or hashes, and a kill with none is one by the target's exception alone.
The files' original bytes are written back after every mutant and at the end, even on Ctrl-C,
SIGTERM or an error, and verified by SHA-256; a copy `FILE.kvfuzz-orig` stands beside each file
while it is mutated, so that a run killed outright is repaired by the next one.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvfuzz.core.errors import KvfuzzError, require

INSTALL = "pip install 'kvfuzz[mutate]'"
BACKUP = ".kvfuzz-orig"
KILLED, SURVIVED, TIMEOUT, INCOMPETENT = "killed", "survived", "timeout", "incompetent"
ERROR = "campaign-error"
"""The `check` of a mutant that made the campaign raise instead of failing a check."""
_PACKAGES = {"kvcache": "kvfuzz.kvcache", "vllm": "vllm"}


class MutateError(KvfuzzError):
    """A path to mutate is not a file of the target's package, or cannot be written."""


@dataclass(frozen=True)
class Mutant:
    """One cosmic-ray mutation: `occurrence` of `operator` in `path`, at `line`, `column`."""

    path: str
    operator: str
    occurrence: int
    line: int
    column: int
    scope: str = ""
    """The class and function around it (`BlockPool.cache_full_blocks`): what the report's
    areas are counted by."""


@dataclass
class Result:
    mutant: Mutant
    outcome: str
    check: str | None = None
    """The check whose finding killed it (killed only)."""
    seconds: float = 0.0
    diff: str = ""
    detail: str = ""
    semantic_check: str | None = None
    """The first check that fired on an op where the target did not raise (killed only); None
    for a kill by the target's exception alone (a CRASH, a refused build, a result or state
    check on an op that raised)."""
    semantic_detail: str = ""
    """Where that check fired and its message."""

    @property
    def by_exception_alone(self) -> bool:
        return self.outcome == KILLED and self.semantic_check is None


@dataclass
class Report:
    target: str
    examples: int
    seed: int
    total_mutants: int
    configs: tuple[str, ...] = ()
    """The built-in configs the campaign runs (empty: all)."""
    part: tuple[int, int] = (1, 1)
    """`--slice I/N`: this run holds the I-th of N disjoint parts of the drawn sample."""
    results: list[Result] = field(default_factory=list)
    interrupted: bool = False

    def counts(self, results: list[Result] | None = None) -> dict[str, int]:
        c = Counter(r.outcome for r in (self.results if results is None else results))
        return {o: c[o] for o in (KILLED, SURVIVED, TIMEOUT, INCOMPETENT)}

    def score(self, results: list[Result] | None = None) -> float | None:
        """Detected (killed or timed out) over the competent mutants."""
        c = self.counts(results)
        competent = c[KILLED] + c[SURVIVED] + c[TIMEOUT]
        return None if competent == 0 else (c[KILLED] + c[TIMEOUT]) / competent

    def as_json(self) -> dict[str, Any]:
        by_file = {p: [r for r in self.results if r.mutant.path == p]
                   for p in dict.fromkeys(r.mutant.path for r in self.results)}
        return {
            "target": self.target, "examples": self.examples, "seed": self.seed,
            "configs": list(self.configs), "slice": list(self.part),
            "total_mutants": self.total_mutants, "run": len(self.results),
            "interrupted": self.interrupted,
            "counts": self.counts(), "score": self.score(),
            "by_file": {p: {**self.counts(rs), "score": self.score(rs)}
                        for p, rs in by_file.items()},
            "by_check": dict(Counter(r.check for r in self.results if r.check)),
            "by_exception_alone": sum(r.by_exception_alone for r in self.results),
            "results": [{**asdict(r.mutant), **{k: v for k, v in asdict(r).items()
                                                if k != "mutant"}} for r in self.results],
        }


def resumed(report: Report, file: Path) -> list[Result]:
    """The results in `file`, a report that an earlier run with the same target, examples,
    seed, configs and slice wrote (cut short, say): the mutants already measured."""
    data = json.loads(file.read_text())
    same = {"target": report.target, "examples": report.examples, "seed": report.seed,
            "configs": list(report.configs), "slice": list(report.part)}
    differs = [k for k, v in same.items() if data.get(k, [1, 1] if k == "slice" else None) != v]
    if differs:
        raise MutateError(f"--resume {file}: its {', '.join(differs)} differ from this run's")
    fields = {f for f in Mutant.__dataclass_fields__}
    return [Result(Mutant(**{k: v for k, v in r.items() if k in fields}),
                   **{k: v for k, v in r.items() if k not in fields}) for r in data["results"]]


def resolve(target: str, names: list[str]) -> list[Path]:
    """The source files `names` of the target's package: absolute, or relative to the folder
    holding the package (`vllm/v1/core/block_pool.py`), or to the package (`block_pool.py`)."""
    package, root = _package_root(target)
    paths = []
    for name in names:
        given = Path(name)
        candidates = [given] if given.is_absolute() else [root.parent / given, root / given]
        path = next((c.resolve() for c in candidates if c.is_file()), None)
        if path is None or root not in path.parents or path.suffix != ".py":
            raise MutateError(f"--paths {name}: not a .py file of {package} ({root})")
        if not os.access(path, os.W_OK) or path.stat().st_nlink > 1:  # a hard link: shared
            raise MutateError(f"--paths {name}: {path} is read-only or hard-linked; mutate a "
                              "copy in a venv of your own (docs/mutation.md)")
        paths.append(path)
    return paths


def _package_root(target: str) -> tuple[str, Path]:
    """The target's package and the folder it is installed in."""
    package = _PACKAGES.get(target)
    if package is None:
        raise MutateError(f"--target {target!r}: mutate knows {', '.join(sorted(_PACKAGES))}")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MutateError(f"--target {target}: package {package} is not installed")
    return package, Path(next(iter(spec.submodule_search_locations))).resolve()


def report_rows(file: Path) -> list[dict[str, Any]]:
    """The mutants (one row each) a `--report` file of an earlier run lists."""
    try:
        rows = json.loads(file.read_text())["results"]
        for row in rows:
            missing = {"path", "operator", "occurrence", "line", "outcome"} - set(row)
            if missing:
                raise KeyError(", ".join(sorted(missing)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MutateError(f"--rerun {file}: not a report of kvfuzz mutate ({exc!r})") from None
    return rows


def listed(target: str, found: list[Mutant], files: list[Path],
           survivors: bool = False) -> list[Mutant]:
    """The mutants of `found` that the earlier reports `files` list (with `survivors`, only
    those that survived there), in file and line order: matched by the file's path inside the
    package (`vllm/v1/core/block_pool.py`, wherever the report's copy was installed), operator
    and occurrence. A listed mutant whose file is not in `found`'s is left out; one that `found`
    lacks, or holds on another line, means the source changed since: MutateError."""
    _, root = _package_root(target)
    inside = {m.path: Path(m.path).relative_to(root.parent).as_posix() for m in found}
    index = {(inside[m.path], m.operator, m.occurrence): m for m in found}
    files_inside = set(inside.values())
    chosen = []
    for file in files:
        for row in report_rows(file):
            if survivors and row.get("outcome") != SURVIVED:
                continue
            path = Path(row["path"]).as_posix()
            where = next((f for f in files_inside if path == f or path.endswith("/" + f)), None)
            if where is None:
                continue
            mutant = index.get((where, row["operator"], row["occurrence"]))
            if mutant is None or mutant.line != row["line"]:
                raise MutateError(f"--rerun {file}: {where}:{row['line']} {row['operator']} "
                                  f"#{row['occurrence']} is not a mutant of the installed "
                                  "source (it changed since that report)")
            chosen.append(mutant)
    return sorted(set(chosen), key=lambda m: (m.path, m.line, m.operator, m.occurrence))


LineRange = tuple[str, int, int]
"""A file of the measure (its resolved path) and the first and last line to mutate in it."""


def line_ranges(paths: list[Path], given: list[tuple[str, int, int]]) -> list[LineRange]:
    """`--lines FILE:A-B`, each FILE named as one of `paths` by its name or a path ending."""
    ranges = []
    for name, first, last in given:
        named = [p for p in paths if p.match(name)]
        if len(named) != 1:
            why = "none" if not named else "more than one"
            raise MutateError(f"--lines {name}:{first}-{last}: {why} of --paths is {name}")
        ranges.append((str(named[0]), first, last))
    return ranges


def within(found: list[Mutant], ranges: list[LineRange]) -> list[Mutant]:
    """The mutants on a line inside one of `ranges`."""
    return [m for m in found if any(m.path == path and first <= m.line <= last
                                    for path, first, last in ranges)]


def mutants(paths: list[Path]) -> list[Mutant]:
    """Every mutant cosmic-ray's operators make of `paths`, in a stable order."""
    require("cosmic_ray", INSTALL, "kvfuzz mutate")
    from cosmic_ray.commands import init
    from cosmic_ray.work_db import WorkDB, use_db

    with tempfile.TemporaryDirectory(prefix="kvfuzz-mutate-") as tmp:
        with use_db(str(Path(tmp) / "session.sqlite"), WorkDB.Mode.create) as db:
            init(paths, db, {})
            found = [Mutant(str(m.module_path), m.operator_name, m.occurrence, *m.start_pos)
                     for item in db.work_items for m in item.mutations]
    scoped = {path: scopes(Path(path)) for path in {m.path for m in found}}
    found = [replace(m, scope=scoped[m.path].get(m.line, "")) for m in found]
    return sorted(set(found), key=lambda m: (m.path, m.operator, m.occurrence))


def scopes(path: Path) -> dict[int, str]:
    """Each line of `path` inside a class or function: the innermost class and function
    around it, dotted (`Outer.method`, `helper`)."""
    named: dict[int, str] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}" if prefix else child.name
                for line in range(child.lineno, (child.end_lineno or child.lineno) + 1):
                    named[line] = name
                walk(child, name)
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text()), "")
    return named


def baseline(target: str, examples: int, seed: int, paths: list[Path], timeout: float,
             configs: tuple[str, ...] = ()) -> tuple[str | None, dict[str, set[int]]]:
    """The campaign on the unmutated source, under coverage.py: the check it fails (None when
    it passes, as it must for the score to mean anything) and the lines of `paths` it runs."""
    require("coverage", INSTALL, "kvfuzz mutate")
    from coverage import CoverageData

    with tempfile.TemporaryDirectory(prefix="kvfuzz-baseline-") as tmp:
        data, out = Path(tmp) / "coverage", Path(tmp) / "result.json"
        spec = {"target": target, "examples": examples, "seed": seed, "corpus": tmp,
                "out": str(out), "configs": list(configs)}
        argv = [sys.executable, "-m", "coverage", "run", f"--data-file={data}",
                "--include=" + ",".join(map(str, paths)), "-m", "kvfuzz.fuzz.mutate",
                json.dumps(spec)]
        try:
            with terminable():
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the baseline campaign ran past {timeout:g} s") from None
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"the baseline campaign failed (exit {proc.returncode}):\n"
                               + (proc.stderr or proc.stdout)[-2000:])
        covered = CoverageData(basename=str(data))
        covered.read()
        lines = {str(p): set(covered.lines(str(p)) or ()) for p in paths}
        return json.loads(out.read_text())["check"], lines


Measured = tuple[list[Mutant], str | None, dict[str, set[int]]]
"""The mutants of the files, the check the baseline fails (None: it passes), its lines run."""


def saved_baseline(file: Path, key: dict[str, Any], compute: Callable[[], Measured]) -> Measured:
    """The mutant list and baseline saved in `file` when measured under `key` (the campaign's
    options and the SHA-256 of each file mutated), else `compute()`'s, saved there for the
    next slice: listing the mutants of large files and the baseline under coverage.py each
    take minutes."""
    if file.exists():
        saved = json.loads(file.read_text())
        if saved.get("key") == key:
            return ([Mutant(**m) for m in saved["mutants"]], saved["check"],
                    {p: set(lines) for p, lines in saved["lines"].items()})
    found, check, lines = compute()
    file.write_text(json.dumps({"key": key, "mutants": [asdict(m) for m in found],
                                "check": check,
                                "lines": {p: sorted(ls) for p, ls in lines.items()}}))
    return found, check, lines


def baseline_key(target: str, examples: int, seed: int, paths: list[Path],
                 configs: tuple[str, ...]) -> dict[str, Any]:
    """What a saved baseline must match to be reused."""
    return {"target": target, "examples": examples, "seed": seed, "configs": list(configs),
            "sources": {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}}


Span = tuple[tuple[int, int], tuple[int, int]]


def annotation_spans(tree: ast.Module) -> list[Span]:
    """Where the type annotations lie ((line, column) from, to), which the runtime never
    evaluates here."""
    notes = [n for node in ast.walk(tree) for n in (
        [node.returns] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        else [node.annotation] if isinstance(node, (ast.arg, ast.AnnAssign)) else [])
        if n is not None]
    return [((n.lineno, n.col_offset), (n.end_lineno or n.lineno, n.end_col_offset or 0))
            for n in notes]


def innermost_statements(tree: ast.Module) -> dict[int, int]:
    """Each line inside a statement -> the first line of the innermost statement around it."""
    spans = sorted(((n.lineno, n.end_lineno or n.lineno) for n in ast.walk(tree)
                    if isinstance(n, ast.stmt)), key=lambda s: (s[0], -s[1]))
    inner: dict[int, int] = {}
    for first, last in spans:  # inner statements come later and overwrite
        for line in range(first, last + 1):
            inner[line] = first
    return inner


def eligible(found: list[Mutant], lines: dict[str, set[int]]) -> list[Mutant]:
    """The mutants inside a statement that ran and outside type annotations. coverage.py
    names a statement by its first line, so a mutant counts by the innermost statement around
    it."""
    trees = {path: ast.parse(Path(path).read_text()) for path in lines}
    inner = {path: innermost_statements(tree) for path, tree in trees.items()}
    notes = {path: annotation_spans(tree) for path, tree in trees.items()}

    def keep(m: Mutant) -> bool:
        first = inner[m.path].get(m.line)
        where = (m.line, m.column)
        return (first is not None and first in lines[m.path]
                and not any(a <= where < b for a, b in notes[m.path]))

    return [m for m in found if keep(m)]


def sample(found: list[Mutant], k: int | None, seed: int) -> list[Mutant]:
    """`k` of `found` drawn with `seed` (all when k is None), in file and line order."""
    chosen = found if k is None or k >= len(found) else random.Random(seed).sample(found, k)
    return sorted(chosen, key=lambda m: (m.path, m.line, m.operator, m.occurrence))


def part(chosen: list[Mutant], index: int, count: int) -> list[Mutant]:
    """The `index`-th (from 1) of `count` disjoint parts of `chosen`, every count-th mutant, so
    each part spans every file; the parts together are `chosen`."""
    return chosen[index - 1::count]


class Originals:
    """The files' original bytes: written back and verified by hash on `restore()`."""

    def __init__(self, paths: list[Path]) -> None:
        self.saved: dict[Path, tuple[bytes, str]] = {}
        for path in paths:
            backup = path.with_name(path.name + BACKUP)
            if backup.exists():  # left by a run killed outright: its bytes are the original
                print(f"kvfuzz mutate: restoring {path} from {backup}", file=sys.stderr)
                path.write_bytes(backup.read_bytes())
            data = path.read_bytes()
            self.saved[path] = (data, hashlib.sha256(data).hexdigest())
            backup.write_bytes(data)

    def restore(self) -> None:
        for path, (data, digest) in self.saved.items():
            if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                path.write_bytes(data)
            if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                raise RuntimeError(f"kvfuzz mutate: could not restore {path}")

    def close(self) -> None:
        self.restore()
        for path in self.saved:
            path.with_name(path.name + BACKUP).unlink(missing_ok=True)


@contextmanager
def terminable() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile, so cleanups run and children are killed."""

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def guarded(paths: list[Path]) -> Iterator[Originals]:
    """Originals of `paths`, restored on any exit; SIGTERM ends the run like Ctrl-C."""
    with terminable():
        originals = Originals(paths)
        try:
            yield originals
        finally:
            originals.close()


def run_mutant(mutant: Mutant, campaign: dict[str, Any], timeout: float) -> Result:
    """Apply `mutant` (the caller restores the file) and run the campaign on it."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import apply_mutation

    path = Path(mutant.path)
    before = path.stat().st_mtime_ns
    original, mutated = apply_mutation(path, cosmic_ray.plugins.get_operator(mutant.operator)(),
                                       mutant.occurrence)
    if mutated is None:
        return Result(mutant, INCOMPETENT, detail="cosmic-ray made no mutation")
    try:
        compile(mutated, str(path), "exec")
    except SyntaxError as exc:
        return Result(mutant, INCOMPETENT, detail=f"not Python: {exc.msg}")
    if path.stat().st_mtime_ns // 10**9 == before // 10**9:
        # a cached .pyc of the original records its mtime in seconds: make it stale
        os.utime(path, ns=(before + 2 * 10**9, before + 2 * 10**9))
    diff = "".join(difflib.unified_diff(original.splitlines(True), mutated.splitlines(True),
                                        f"a/{path.name}", f"b/{path.name}", n=1))
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvfuzz-mutant-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", "kvfuzz.fuzz.mutate",
                json.dumps({**campaign, "corpus": tmp, "out": str(out)})]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            return Result(mutant, TIMEOUT, seconds=time.monotonic() - start, diff=diff)
        seconds = time.monotonic() - start
        if proc.returncode != 0 or not out.exists():
            # The baseline passed, so the mutant made the campaign itself raise (a manager
            # that cannot be built, say): detected, though by no check.
            return Result(mutant, KILLED, ERROR, seconds, diff,
                          detail=f"exit {proc.returncode}: {_exception(proc.stderr)}")
        found = json.loads(out.read_text())
    check = found["check"]
    return Result(mutant, KILLED if check else SURVIVED, check, seconds, diff,
                  detail=found.get("message") or "", semantic_check=found.get("semantic_check"),
                  semantic_detail=found.get("semantic_message") or "")


def _exception(stderr: str) -> str:
    """The last `SomeError: message` line of a traceback (else its last line)."""
    lines = stderr.strip().splitlines() or [""]
    raised = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception|Exit)\b", ln)]
    return (raised or lines)[-1]


def run(report: Report, chosen: list[Mutant], timeout: float,
        on_result: Callable[[int, int, Report], None]) -> Report:
    """Run the `chosen` mutants, a fixed campaign on each, into `report`; `on_result` sees the
    report after each mutant."""
    campaign = {"target": report.target, "examples": report.examples, "seed": report.seed,
                "configs": list(report.configs)}
    paths = sorted({Path(m.path) for m in chosen})
    with guarded(paths) as originals:
        try:
            for i, mutant in enumerate(chosen, 1):
                try:
                    result = run_mutant(mutant, campaign, timeout)
                finally:
                    originals.restore()
                report.results.append(result)
                on_result(i, len(chosen), report)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the mutants run so far are the report
            report.interrupted = True
    return report


def _campaign(spec: dict[str, Any]) -> None:
    """The child: one fixed-example campaign, stopped at its first finding on which the target
    did not raise; writes the check of its first finding and of that one (or nulls) to
    spec["out"]."""
    from kvfuzz.fuzz.campaign import CampaignOptions, run_campaign

    options = CampaignOptions(target=spec["target"], seconds=None, examples=spec["examples"],
                              seed=spec["seed"], corpus=Path(spec["corpus"]), max_findings=1,
                              count_raised=False, shrink_seconds=0.0)
    if spec["configs"]:
        options.configs = tuple(spec["configs"])
    stats = run_campaign(options, lambda stats: None)
    first = stats.findings[0] if stats.findings else None
    checked = next((f for f in stats.findings if not f.target_raised), None)
    Path(spec["out"]).write_text(json.dumps({
        "check": first and first.check, "message": first and f"{first.level}/{first.config}: {first.message}",
        "semantic_check": checked and checked.check,
        "semantic_message": checked and f"{checked.level}/{checked.config}: {checked.message}",
        "examples": stats.examples}))


if __name__ == "__main__":
    _campaign(json.loads(sys.argv[1]))
