"""The `kvfuzz` command line (also `python -m kvfuzz`).

Exit codes (`kvfuzz.fuzz.exits`): 0 no counterexample (or the command succeeded), 1 a
counterexample was found or a trace still fails, 2 usage or input error, 3 a check, adapter or
plugin (or kvfuzz) raised.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfuzz import __version__, shipped, versions
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import KvfuzzError, require

if TYPE_CHECKING:
    from kvfuzz.core.config import Config
from kvfuzz.fuzz.exits import EXIT_FOUND, EXIT_OK, EXIT_USAGE, PluginFault, guarded



class UsageError(KvfuzzError):
    """A command-line argument names something that does not exist."""


def main(argv: list[str] | None = None) -> int:
    """The `kvfuzz` command; its exit codes are those of `kvfuzz.fuzz.exits`."""
    return guarded(_main, argv)


def entry() -> None:
    """The `kvfuzz` program (and `python -m kvfuzz`): `main`, then the atexit handlers, then
    an exit that does not free every object one by one (after a campaign on a million-block
    pool that alone took seconds, and delayed the end of a run stopped by SIGTERM)."""
    import atexit

    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    atexit._run_exitfuncs()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    # --debug is read by `guarded`, before parsing; it may stand anywhere on the line.
    args = parser.parse_args([a for a in (sys.argv[1:] if argv is None else argv)
                              if a != "--debug"])
    if not hasattr(args, "handler"):
        parser.print_help()
        return EXIT_USAGE
    return args.handler(args)


_FILE_PLUGIN_HELP = ("import MODULE (repeat for more). Nothing else is imported: the plugins a trace "
                     "records are shown, with the --plugin options to pass")
_DATA_HELP = ("add the data checks D1, D2 (torch paged K/V written through the block tables) on "
              "DEVICE[:DTYPE], e.g. cpu, cuda:float16 (default when given alone: cpu)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfuzz",
        description="Hunt for counterexamples in paged KV-cache block managers.",
        epilog="Run `kvfuzz COMMAND --help` for a command's options.",
    )
    p.add_argument("--version", action="version", version=_version_line())
    p.add_argument("--debug", action="store_true",
                   help="print the full traceback of an internal or plugin error (exit 3)")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")

    run = sub.add_parser("run", help="run a fuzzing campaign",
                         description="Run a campaign: generate traces, check every invariant "
                         "after every op, save each counterexample shrunk in the corpus.")
    run.add_argument("--target", default="kvcache", help="target to fuzz (default: kvcache; "
                     "see `kvfuzz targets`)")
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--seconds", type=float, help="time budget (default: 60)")
    budget.add_argument("--examples", type=int, help="number of generated examples instead, "
                        "shared out over the workers")
    run.add_argument("--seed", type=int, default=0, help="campaign seed (default: 0)")
    run.add_argument("--workers", type=int, default=1,
                     help="processes with disjoint seeds (default: 1)")
    run.add_argument("--config", nargs="+", metavar="NAME", help="built-in configs (default: "
                     "all; see `kvfuzz configs`)")
    run.add_argument("--config-file", action="append", default=[], type=Path, metavar="FILE",
                     help="your model shape: a config (docs/configs.md) in TOML (.toml) or JSON; "
                     "repeat for more; run as given, besides any --config (default then: only "
                     "these)")
    run.add_argument("--level", nargs="+", choices=("api", "scheduler"),
                     default=["api", "scheduler"],
                     help="trace levels to generate (default: both)")
    run.add_argument("--plugin", nargs="+", default=[], metavar="MODULE",
                     help="import MODULE first in every worker (invariants, targets, patches)")
    run.add_argument("--corpus", type=Path, default=Path("kvfuzz-corpus"),
                     help="where findings are saved (default: ./kvfuzz-corpus)")
    run.add_argument("--json", type=Path, metavar="FILE", help="write a machine-readable report "
                     "(enough to rerun the campaign and plot trends)")
    run.add_argument("--html", type=Path, metavar="FILE", help="write the report as a "
                     "self-contained HTML page with plots (no network needed)")
    run.add_argument("--max-findings", type=int, metavar="N",
                     help="stop once N distinct bugs are found (default: run the whole budget)")
    run.add_argument("--interrupted-exit", type=int, metavar="N",
                     help="exit status of a run interrupted (Ctrl-C, SIGTERM) before its budget "
                     "was spent, with no finding (default: 2 where CI=true, so a CI job killed "
                     "by its timeout fails, else 0)")
    run.add_argument("--engine", choices=("hypothesis", "atheris"), default="hypothesis",
                     help="hypothesis (default) or atheris (coverage-guided libFuzzer)")
    run.add_argument("--no-model", action="store_true",
                     help="check invariants only, without the reference model in lockstep")
    run.add_argument("--generated-configs", action="store_true",
                     help="also run a pair `generated` per level: each batch a config drawn "
                     "from its seed over every knob, validated like --config-file, one the "
                     "target builds (docs/configs.md)")
    run.add_argument("--no-code-coverage", action="store_true",
                     help="do not record the target's own code coverage (lines and branches of "
                     "kvcache/ or vLLM's v1/core), nor weigh the pairs by the code they newly "
                     "reach: behaviour features alone (docs/engines.md)")
    run.add_argument("--steps", type=int, default=40,
                     help="max ops per generated trace (default: 40)")
    run.add_argument("--focus", nargs="+", default=[], metavar="NAME",
                     help="favour these configs and ops (e.g. watermark allocate_slots): more "
                     "batches for the configs, the ops' rules kept and weighed more")
    run.add_argument("--data", nargs="?", const="cpu", metavar="DEVICE[:DTYPE]", help=_DATA_HELP)
    run.add_argument("--database", action="append", metavar="SPEC",
                     help="Hypothesis' example database: a directory, redis://HOST:PORT/N "
                     "(shared by every worker and machine), readonly:SPEC (replay only); "
                     "repeat to combine. Failing examples saved there by earlier runs with the "
                     "same options replay first (default: none, so a seed gives the same "
                     "examples; hypothesis engine only; docs/distributed.md)")
    run.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                     help="run the batches as Ray tasks: on the cluster at ADDRESS (HOST:PORT, "
                     "ray://HOST:PORT or auto), or on a local one of 2 CPUs without ADDRESS "
                     "(kvfuzz[distributed]; docs/distributed.md)")
    _tolerance_options(run)
    run.add_argument("--ray-runtime-env", metavar="JSON",
                     help="Ray runtime environment of the tasks, e.g. to ship kvfuzz to nodes "
                     "without it: '{\"pip\": [\"kvfuzz[distributed]==VERSION\"]}'")
    run.set_defaults(handler=_cmd_run)

    replay = sub.add_parser("replay", help="re-run a saved trace step by step",
                            description="Replay a trace, printing each op, what changed and "
                            "the failing check. Exit 1 if it still fails, 0 if it passes.")
    replay.add_argument("file", type=Path)
    replay.add_argument("--target", help="target (default: the trace's, else kvcache)")
    replay.add_argument("--no-model", action="store_true", help="without the reference model")
    replay.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help=_FILE_PLUGIN_HELP)
    replay.add_argument("--quiet", action="store_true", help="print only the outcome")
    replay.add_argument("--config-file", type=Path, metavar="FILE",
                        help="run the trace's ops on this config (TOML or JSON, "
                        "docs/configs.md) instead of the trace's own")
    replay.add_argument("--data", nargs="?", const="cpu", metavar="DEVICE[:DTYPE]",
                        help=_DATA_HELP + "; default: the trace's own, if it was found with them")
    _tolerance_options(replay, ", default: the trace's own")
    replay.set_defaults(handler=_cmd_replay)

    shrink = sub.add_parser("shrink", help="shrink a failing trace",
                            description="Shrink a failing trace to a minimal one failing the "
                            "same check.")
    shrink.add_argument("file", type=Path)
    shrink.add_argument("--target", help="target (default: the trace's, else kvcache)")
    shrink.add_argument("--out", type=Path, help="output file (default: FILE.min.json, "
                        "written only when the trace shrank)")
    shrink.add_argument("--seconds", type=float, default=60.0, help="time budget (default: 60)")
    shrink.add_argument("--no-model", action="store_true", help="without the reference model")
    shrink.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help=_FILE_PLUGIN_HELP)
    shrink.add_argument("--data", nargs="?", const="cpu", metavar="DEVICE[:DTYPE]",
                        help=_DATA_HELP + "; default: the trace's own, if it was found with them")
    _tolerance_options(shrink, ", default: the trace's own")
    shrink.set_defaults(handler=_cmd_shrink)

    export = sub.add_parser("export", help="turn a trace into a pytest regression test",
                            description="Write a standalone pytest module that replays the "
                            "trace with kvfuzz.testing.replay_trace: it fails while the bug "
                            "is there.")
    export.add_argument("file", type=Path)
    out = export.add_mutually_exclusive_group(required=True)
    out.add_argument("--pytest", type=Path, metavar="OUT.py",
                     help="the test module to write (replays on kvfuzz's harness)")
    out.add_argument("--vllm-test", type=Path, metavar="OUT.py",
                     help="a plain vLLM test (imports only vllm, torch, pytest) of an api or "
                          "scheduler-level trace: fails while vLLM has the bug "
                          "(docs/findings/README.md)")
    export.add_argument("--target", help="target the test replays on (default: the trace's)")
    export.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help=_FILE_PLUGIN_HELP + " (the exported test imports the same)")
    export.set_defaults(handler=_cmd_export)

    merge = sub.add_parser("merge", help="merge campaigns' reports into one report and corpus",
                           description="Merge the JSON reports of several campaigns (parallel "
                           "CI jobs): their work summed, one finding per bug, its smallest "
                           "trace copied into one corpus. Exit 1 if there is a finding.")
    merge.add_argument("reports", nargs="+", type=Path, metavar="REPORT")
    merge.add_argument("--corpus", type=Path, default=Path("kvfuzz-corpus"),
                       help="where the findings' traces are copied (default: ./kvfuzz-corpus)")
    merge.add_argument("--json", type=Path, metavar="FILE", help="write the merged report")
    merge.set_defaults(handler=_cmd_merge)

    for name, helptext, handler in (
        ("targets", "list the targets (built-in, planted bugs bug:NAME, and your plugins')",
         _cmd_targets),
        ("invariants", "list the registered invariants and checks", _cmd_invariants),
        ("configs", "list the built-in configs", _cmd_configs),
    ):
        cmd = sub.add_parser(name, help=helptext, description=helptext[0].upper()
                             + helptext[1:] + ".")
        cmd.add_argument("--plugin", nargs="+", default=[], metavar="MODULE",
                         help="import MODULE first, so that what it registers is listed")
        if handler is not _cmd_targets:
            cmd.add_argument("--markdown", action="store_true",
                             help="as the Markdown table README.md holds")
        cmd.set_defaults(handler=handler)

    prove = sub.add_parser("prove", help="check the arithmetic contracts with CrossHair",
                           description="Symbolically check contracts on kvcache's pure "
                           "arithmetic; exit 1 with the counterexample when one fails.")
    prove.add_argument("--per-function", type=float, default=10.0, metavar="SECONDS",
                       help="time bound per function (default: 10)")
    prove.set_defaults(handler=_cmd_prove)
    _mutate_parser(sub)
    return p


def _tolerance_options(cmd: argparse.ArgumentParser, default: str = "") -> None:
    cmd.add_argument("--tolerate", nargs="+", default=None, metavar="ID",
                     help="also tolerate these documented deviations (finding ids such as 013, "
                     f"or names; vllm targets; docs/vllm.md{default})")
    cmd.add_argument("--no-tolerate", nargs="+", default=None, metavar="ID",
                     help="report these deviations although the target tolerates them"
                     + default)


def _tolerance(args: argparse.Namespace, meta: dict[str, Any] | None = None) -> Any:
    """`--tolerate` and `--no-tolerate` (else what the trace's meta recorded)."""
    from kvfuzz.harness.tolerance import Tolerance

    recorded = Tolerance.of_meta(meta) if meta is not None else Tolerance()
    return Tolerance(tuple(args.tolerate) if args.tolerate is not None else recorded.add,
                     tuple(args.no_tolerate) if args.no_tolerate is not None
                     else recorded.remove)


def _mutate_parser(sub: Any) -> None:
    m = sub.add_parser("mutate", help="mutation score: how many source mutants campaigns kill",
                       description="Mutate the target's source with cosmic-ray, one mutant at a "
                       "time, in place (always restored); run a fixed-example campaign on each; "
                       "report killed / survived / timed out per file and per check. Exit 0 "
                       "when it ran, 1 under --fail-under, 2 on bad usage or without cosmic-ray.")
    m.add_argument("--target", choices=("kvcache", "vllm"), default="kvcache")
    m.add_argument("--paths", nargs="+", required=True, metavar="FILE",
                   help="source files of the target, e.g. block_pool.py or "
                   "vllm/v1/core/block_pool.py")
    m.add_argument("--examples", type=int, default=300, help="examples per mutant (default: 300)")
    m.add_argument("--sample", type=int, metavar="K", help="run K mutants drawn with --seed "
                   "(default: all)")
    m.add_argument("--seed", type=int, default=0, help="sample and campaign seed (default: 0)")
    m.add_argument("--slice", type=_slice, default=(1, 1), metavar="I/N",
                   help="run only the I-th of N disjoint parts of the drawn sample (every N-th "
                   "mutant), so a long measure runs as N shorter commands (default: 1/1)")
    m.add_argument("--baseline", type=Path, metavar="FILE.json",
                   help="keep the baseline's covered lines in FILE and reuse them while the "
                   "sources and campaign options match (the slices of one measure share it)")
    m.add_argument("--resume", action="store_true",
                   help="keep the mutants already measured in --report's file (a run cut "
                   "short) and run only the rest")
    m.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per mutant before it counts as timed out (default: 300)")
    m.add_argument("--config", nargs="+", metavar="NAME", default=[],
                   help="built-in configs the campaign runs (default: all)")
    m.add_argument("--report", type=Path, metavar="FILE.json", help="write the full report")
    m.add_argument("--lines", nargs="+", type=_line_range, default=[], metavar="FILE:A-B",
                   help="mutate only lines A to B of FILE (one of --paths, by its name or a "
                   "path ending), e.g. kv_cache_coordinator.py:722-775 (default: every line)")
    m.add_argument("--rerun", nargs="+", type=Path, default=[], metavar="REPORT.json",
                   help="run the mutants these earlier reports list (the slices of one measure "
                   "together) instead of a new draw, e.g. after a change to the checks or the "
                   "configs; --sample, --lines and --all-lines do not apply")
    m.add_argument("--survivors", action="store_true",
                   help="with --rerun: only the mutants that survived there")
    m.add_argument("--all-lines", action="store_true",
                   help="mutate every line (default: only statements the unmutated campaign "
                   "runs, measured with coverage.py, outside type annotations)")
    m.add_argument("--fail-under", type=float, metavar="PERCENT",
                   help="exit 1 when the score is below PERCENT")
    m.set_defaults(handler=_cmd_mutate)


def _cmd_mutate(args: argparse.Namespace) -> int:
    from kvfuzz.core.configs import builtin_config
    from kvfuzz.fuzz import mutate

    require("cosmic_ray", mutate.INSTALL, "kvfuzz mutate")
    for option, value in (("--examples", args.examples), ("--sample", args.sample),
                          ("--timeout", args.timeout)):
        _positive(option, value)
    if args.resume and args.report is None:
        raise UsageError("--resume needs --report FILE.json, the report to resume")
    if args.rerun and (args.sample is not None or args.lines or args.all_lines):
        raise UsageError("--rerun runs the mutants its reports list: drop --sample, --lines "
                         "and --all-lines")
    if args.survivors and not args.rerun:
        raise UsageError("--survivors needs --rerun REPORT.json, the report whose survivors "
                         "to run")
    for file in args.rerun:
        mutate.report_rows(file)
    for option, path in (("--report", args.report), ("--baseline", args.baseline)):
        if path is not None:
            _writable(option, path)
    _check_target(args.target)
    for name in args.config:
        builtin_config(name)
    paths = mutate.resolve(args.target, args.paths)
    ranges = mutate.line_ranges(paths, args.lines)
    print(f"kvfuzz mutate: target {args.target}, {args.examples} examples per mutant, "
          f"seed {args.seed}")

    def show(i: int, n: int, report: Any) -> None:
        r = report.results[-1]
        by = f" by {r.check}" if r.check else ""
        print(f"[{i}/{n}] {r.outcome}{by}  {Path(r.mutant.path).name}:{r.mutant.line} "
              f"{r.mutant.operator} #{r.mutant.occurrence} {r.mutant.scope}  ({r.seconds:.1f} s)",
              flush=True)
        if args.report:  # so far: a run cut short keeps what it measured
            _write_json(args.report, {"versions": versions(), **report.as_json()})

    prior = mutate.resumed(mutate.Report(args.target, args.examples, args.seed, 0,
                                         tuple(args.config), args.slice), args.report
                           ) if args.resume and args.report.exists() else []

    def measure() -> mutate.Measured:
        return mutate.mutants(paths), *mutate.baseline(
            args.target, args.examples, args.seed, paths, 3 * args.timeout,  # coverage.py: slow
            tuple(args.config))

    try:
        everything, check, lines = measure() if args.baseline is None else mutate.saved_baseline(
            args.baseline, mutate.baseline_key(args.target, args.examples, args.seed, paths,
                                               tuple(args.config)), measure)
    except RuntimeError as exc:
        print(f"kvfuzz mutate: {exc}", file=sys.stderr)
        return 3
    if check is not None:
        configs = f" --config {' '.join(args.config)}" if args.config else ""
        print(f"the campaign fails on the unmutated source ({check}): fix that first; "
              f"`kvfuzz run --target {args.target} --examples {args.examples} "
              f"--seed {args.seed}{configs}` shows it")
        return EXIT_FOUND
    ran = mutate.eligible(everything, lines)
    print(f"{len(ran)} of {len(everything)} mutants lie on lines the campaign runs, outside "
          "type annotations")
    found = everything if args.all_lines else ran
    if ranges:
        found = mutate.within(found, ranges)
        spans = " ".join(f"{Path(p).name}:{a}-{b}" for p, a, b in ranges)
        print(f"{len(found)} of them lie in --lines {spans}")
    if args.rerun:
        found = mutate.listed(args.target, everything, args.rerun, args.survivors)
        runs = set(ran)
        print(f"--rerun: {len(found)} mutants listed"
              + (" as survivors" if args.survivors else "") + f", {sum(m in runs for m in found)}"
              " of them on lines this campaign runs")
    chosen = mutate.sample(found, args.sample, args.seed)
    if args.slice != (1, 1):
        drawn, chosen = len(chosen), mutate.part(chosen, *args.slice)
        print(f"slice {args.slice[0]}/{args.slice[1]}: {len(chosen)} of the {drawn} drawn mutants")
    report = mutate.Report(args.target, args.examples, args.seed, len(found),
                           tuple(args.config), args.slice)
    if prior:
        report.results = [r for r in prior if r.mutant in chosen]
        measured = {r.mutant for r in report.results}
        chosen = [m for m in chosen if m not in measured]
        print(f"resumed: {len(measured)} measured in {args.report}, {len(chosen)} to run")
    report = mutate.run(report, chosen, args.timeout, show)
    data = report.as_json()
    print(f"\n{data['run']} of {data['total_mutants']} mutants"
          + (" (interrupted; sources restored)" if report.interrupted else "") + ": "
          + ", ".join(f"{v} {k}" for k, v in data["counts"].items()))
    for path, row in data["by_file"].items():
        score = "-" if row["score"] is None else f"{100 * row['score']:.0f}%"
        print(f"  {Path(path).name:<34} killed {row['killed']:3d}  survived {row['survived']:3d}"
              f"  timeout {row['timeout']:3d}  score {score}")
    for name, n in sorted(data["by_check"].items(), key=lambda kv: -kv[1]):
        print(f"  killed by {name}: {n}")
    print(f"  killed by the target's exception alone: {data['by_exception_alone']} of "
          f"{data['counts']['killed']}")
    score = data["score"]
    print("score: " + ("-" if score is None else f"{100 * score:.1f}%"))
    for r in report.results:
        if r.outcome == mutate.SURVIVED:
            print(f"\nsurvived: {r.mutant.path}:{r.mutant.line} {r.mutant.operator}\n{r.diff}",
                  end="")
    if args.report:
        _write_json(args.report, {"versions": versions(), **data})
        print(f"report written to {args.report}")
    if args.fail_under is not None and (score is None or 100 * score < args.fail_under):
        return EXIT_FOUND
    return EXIT_OK


def _version_line() -> str:
    return "kvfuzz " + __version__ + " (" + ", ".join(
        f"{name} {v}" for name, v in versions().items() if name != "kvfuzz") + ")"


_TORCH = ("torch", "pip install 'kvfuzz[torch]' (on a CPU-only machine install the CPU build of "
          "torch first: README.md, Installing)")
_FUZZ = "pip install 'kvfuzz[fuzz]'"


def _plugins(plugins: list[str]) -> None:
    from kvfuzz.fuzz.plugins import PluginError, import_plugins

    try:
        import_plugins(tuple(plugins))
    except PluginError as exc:
        cause = exc.__cause__
        if isinstance(cause, ModuleNotFoundError) and cause.name and (
            exc.name == cause.name or exc.name.startswith(cause.name + ".")
        ):
            raise UsageError(f"cannot import plugin {exc.name!r}: no module named "
                             f"{cause.name!r}") from None
        raise PluginFault(f"plugin {exc.name!r} (while importing it)", cause or exc) from cause


def _line_range(text: str) -> tuple[str, int, int]:
    """`--lines FILE:A-B` (or `FILE:A`) with 1 <= A <= B."""
    name, _, span = text.rpartition(":")
    first, _, last = span.partition("-")
    last = last or first
    if not (name and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise argparse.ArgumentTypeError(f"{text!r}: want FILE:A-B with 1 <= A <= B, "
                                         "e.g. kv_cache_coordinator.py:722-775")
    return name, int(first), int(last)


def _slice(text: str) -> tuple[int, int]:
    """`--slice I/N` with 1 <= I <= N."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise argparse.ArgumentTypeError(f"{text!r}: want I/N with 1 <= I <= N, e.g. 2/5")
    return int(index), int(count)


def _positive(option: str, value: float | None) -> None:
    """A count or a duration, when given, must be positive."""
    if value is not None and not value > 0:  # `not >` also rejects NaN
        bound = ">= 1" if isinstance(value, int) else "> 0"
        raise UsageError(f"{option} must be {bound}, got {value}")


def _writable(option: str, path: Path, folder: bool = False) -> None:
    """The file `path` (the folder, if `folder`) can be written: the nearest existing folder
    where it is or would be made takes a temporary file, so nothing is left behind."""
    import tempfile

    if not folder and path.is_dir():
        raise UsageError(f"{option} {path} is a directory")
    where = path if folder else path.parent
    existing = next(p for p in (where, *where.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{option} {path}: {existing} is not a directory")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot write in {existing} ({exc.strerror})") from None


def _check_target(name: str) -> str:
    """The target's name, once it is known to exist and its dependencies to be installed."""
    from kvfuzz.harness.targets import get_target

    info = get_target(name)
    info.check_available()
    return info.name


def _hypothesis_home() -> None:
    """Hypothesis' own files (its cache of constants) go to kvfuzz's cache folder, not to
    ./.hypothesis, unless HYPOTHESIS_STORAGE_DIRECTORY says where; workers inherit it."""
    from hypothesis.configuration import set_hypothesis_home_dir

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    where = os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                                  str(cache / "kvfuzz" / "hypothesis"))
    set_hypothesis_home_dir(where)


def _buildable(target: str, tolerance: Any, names: tuple[str, ...],
               config_files: tuple[Config, ...], named: set[str]) -> Any:
    """The configs a campaign runs on `target`, built once each (`kvfuzz.fuzz.buildable`)."""
    from kvfuzz.core.configs import builtin_config
    from kvfuzz.fuzz.buildable import probe_configs
    from kvfuzz.harness.targets import get_target

    spec = get_target(target).spec(tolerance)
    files = {c.name: c for c in config_files}

    def build(config: Config) -> Any:
        return get_target(spec).build(config, "api") if isinstance(spec, str) \
            else spec(config, "api")

    engine = get_target(target).engine_config  # as the campaign runs a built-in config
    return probe_configs(build, names, lambda n: files.get(n) or engine(builtin_config(n)),
                         named | set(files))


def _check_bounds(args: argparse.Namespace, seconds: float | None,
                  configs: list[Config]) -> None:
    """`--workers`, `--steps` and each config's pool within the machine and the budget
    (`kvfuzz.fuzz.bounds`), before anything is built."""
    from kvfuzz.fuzz.bounds import check_configs, check_steps, check_workers

    if args.ray is None:
        check_workers(args.workers)
    check_steps(args.steps)
    check_configs(configs, args.workers, args.steps, seconds)


def _check_data(data: str | None) -> None:
    """`--data` needs torch."""
    if data is not None:
        require(*_TORCH, "--data")


def _cmd_run(args: argparse.Namespace) -> int:
    from kvfuzz.fuzz.campaign import (
        CampaignOptions, check_focus, interrupt, run_campaign, selected_checks,
    )
    from kvfuzz.fuzz.report import Timeline, campaign_report
    from kvfuzz.core.configs import builtin_config

    _plugins(args.plugin)
    _hypothesis_home()
    target = _check_target(args.target)
    if args.engine == "atheris":
        require("atheris", _FUZZ, "--engine atheris")
    _check_data(args.data)
    selected_checks(args.data)  # a bad --data spec fails here, before any worker starts
    config_files = _config_files(args.config_file, args.engine)
    configs = tuple(args.config or (() if config_files else BUILTIN))
    for option, value in (("--workers", args.workers), ("--examples", args.examples),
                          ("--seconds", args.seconds), ("--steps", args.steps),
                          ("--max-findings", args.max_findings)):
        _positive(option, value)
    if args.interrupted_exit is not None and not 0 <= args.interrupted_exit <= 255:
        raise UsageError(f"--interrupted-exit must be an exit status, 0 to 255, got "
                         f"{args.interrupted_exit}")
    seconds = None if args.examples is not None else (args.seconds or 60.0)
    _check_bounds(args, seconds, [builtin_config(name) for name in configs] + list(config_files))
    configs += tuple(c.name for c in config_files)
    tolerance = _tolerance(args)
    buildable = _buildable(target, tolerance, configs, config_files, set(args.config or ()))
    configs = buildable.kept
    databases = tuple(args.database or ())
    _check_databases(databases, args.engine)
    _check_ray(args)
    if args.generated_configs and args.engine != "hypothesis":
        raise UsageError("--generated-configs needs --engine hypothesis")
    _writable("--corpus", args.corpus, folder=True)
    for option, path in (("--json", args.json), ("--html", args.html)):
        if path is not None:
            _writable(option, path)
    options = CampaignOptions(
        target=target, seconds=seconds, examples=args.examples, seed=args.seed,
        workers=args.workers, configs=configs, plugins=tuple(args.plugin), corpus=args.corpus,
        model=not args.no_model, levels=tuple(args.level), steps=args.steps, engine=args.engine,
        data=args.data, database=databases, focus=tuple(args.focus), config_files=config_files,
        max_findings=args.max_findings,
        tolerance=tolerance, code_coverage=not args.no_code_coverage,
        generated=args.generated_configs,
    )
    check_focus(options.focus, configs)
    backend = _ray_backend(args, options)
    budget = f"{seconds:g} s" if seconds is not None else f"{args.examples} examples"
    workers = "Ray" if backend is not None else f"{args.workers} worker(s)"
    print(f"kvfuzz run: target {target}, {len(configs)} configs, {budget}, seed {args.seed}, "
          f"{workers}, engine {args.engine}"
          + ("" if options.model else ", no model")
          + (f", data checks on {args.data}" if args.data else ""))
    from kvfuzz.harness.target_check import warn_dropped
    from kvfuzz.harness.targets import get_target

    for line in (*buildable.lines(target), *warn_dropped(get_target(target))):
        print(line)
    if backend is not None:
        print(f"ray: {backend.describe()}")
    progress = _Progress(seconds, args.examples)
    timeline = Timeline()

    def on_progress(stats: Any) -> None:
        timeline.record(stats)
        progress.update(stats)
    # SIGINT and SIGTERM end a campaign: findings so far are kept and summarised. The handler
    # stays until the report is written, so a signal arriving late stops nothing half-written.
    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not configs:  # every config is one the target documents it cannot build
            from kvfuzz.fuzz.campaign import Stats

            stats = Stats()
        elif args.engine == "atheris":
            from kvfuzz.fuzz.atheris_engine import run_atheris

            stats = run_atheris(options, on_progress)
        else:
            stats = run_campaign(options, on_progress, backend=backend)
        progress.finish(stats)
        report = {"versions": versions(), "target": target, "configs": list(configs),
                  **buildable.json(),
                  "seed": args.seed,
                  "engine": args.engine, "workers": args.workers, "model": options.model,
                  "ray": None if args.ray is None else args.ray or "local",
                  "data": args.data,
                  **stats.summary(), **campaign_report(stats, options, timeline, target),
                  "tolerated": buildable.tolerated_counts(stats.tolerated)}
        _summary(stats, report)
        _after_totals(stats, buildable, target)
        if args.json:
            _write_json(args.json, report)
            print(f"report written to {args.json}")
        if args.html:
            from kvfuzz.fuzz.html_report import write_html

            write_html(args.html, report)
            print(f"HTML report written to {args.html}")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stats.findings:
        return EXIT_FOUND
    return _interrupted_exit(args.interrupted_exit) if stats.interrupted else EXIT_OK


def _interrupted_exit(given: int | None) -> int:
    """The status of an interrupted run with no finding: `--interrupted-exit`, else 2 where
    CI=true (a CI job killed by its timeout must not look green), else 0."""
    if given is not None:
        return given
    return 2 if os.environ.get("CI", "").lower() == "true" else EXIT_OK


def _config_files(paths: list[Path], engine: str) -> tuple[Any, ...]:
    """The configs of `--config-file`, each validated, their names distinct from each other and
    from the built-in ones."""
    from kvfuzz.core.config_file import load_config_file, too_small_pool

    if paths and engine != "hypothesis":
        raise UsageError("--config-file needs --engine hypothesis")
    configs = tuple(load_config_file(p) for p in paths)
    for path, config in zip(paths, configs):
        if (small := too_small_pool(config)) is not None:
            print(f"warning: --config-file {path}: {small}")
    names = [c.name for c in configs]
    for path, name in zip(paths, names):
        if name in BUILTIN or names.count(name) > 1:
            raise UsageError(f"--config-file {path}: its name {name!r} is already taken (by "
                             + ("a built-in config" if name in BUILTIN else "another file")
                             + "): give it another `name`")
    return configs


def _check_databases(specs: tuple[str, ...], engine: str) -> None:
    """`--database`: well-formed specs, writable directories, reachable Redis servers."""
    if not specs:
        return
    if engine != "hypothesis":
        raise UsageError("--database needs --engine hypothesis")
    from kvfuzz.fuzz.database import check_reachable, parse

    for part in map(parse, specs):
        if not part.shared and not part.readonly:
            _writable("--database", Path(part.location), folder=True)
    check_reachable(specs)


def _check_ray(args: argparse.Namespace) -> None:
    """`--ray` goes with the hypothesis engine and one driver, and `--ray-runtime-env` with it."""
    if args.ray is None:
        if args.ray_runtime_env is not None:
            raise UsageError("--ray-runtime-env needs --ray")
        return
    if args.engine != "hypothesis":
        raise UsageError("--ray needs --engine hypothesis")
    if args.workers != 1:
        raise UsageError("--ray and --workers exclude each other: Ray's CPUs are the workers")


def _ray_backend(args: argparse.Namespace, options: Any) -> Any:
    """With `--ray`: connected to the cluster, checked, and ready (None without it)."""
    if args.ray is None:
        return None
    from kvfuzz.fuzz.ray_backend import RayBackend, connect, runtime_env

    connect(args.ray or None, runtime_env(args.ray_runtime_env))
    return RayBackend(options)


def _write_json(path: Path, data: Any) -> None:
    from kvfuzz.core.trace import write_atomic

    write_atomic(path, json.dumps(data, indent=2))


class _Progress:
    """A live status line on a terminal, a line every 10 s otherwise."""

    def __init__(self, seconds: float | None, examples: int | None = None) -> None:
        self.start = time.monotonic()
        self.tty = sys.stdout.isatty()
        self.last = 0.0
        self.seconds = seconds
        self.examples = examples

    def line(self, stats: Any) -> str:
        """Within 80 columns: elapsed, time left (or the ETA of an --examples budget), pairs
        reached, rate, examples, coverage, findings."""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        when = ""
        if self.seconds is not None:
            when = f" left {_secs(max(0.0, self.seconds - elapsed))}"
        elif self.examples and stats.examples:
            eta = elapsed * max(0, self.examples - stats.examples) / stats.examples
            when = f" eta {_secs(eta)}"
        return (f"{_secs(elapsed)}{when} pairs {stats.pairs_done()}/{len(stats.pairs)} "
                f"{stats.operations / elapsed:5.0f} ops/s examples {stats.examples:6d} "
                f"cov {len(stats.features):5d} findings {len(stats.findings)}"
                + (f" edges {stats.edges}" if stats.edges else ""))

    def update(self, stats: Any) -> None:
        now = time.monotonic()
        if self.tty:
            print("\r" + self.line(stats), end="", flush=True)
        elif now - self.last >= 10:
            print(self.line(stats), flush=True)
            self.last = now

    def finish(self, stats: Any) -> None:
        if self.tty:
            print("\r" + self.line(stats))
        else:
            print(self.line(stats))


def _secs(seconds: float) -> str:
    """Five characters and an s: tenths below 1,000 s."""
    return f"{seconds:5.1f}s" if seconds < 999.95 else f"{seconds:5.0f}s"


def _summary(stats: Any, report: dict[str, Any]) -> None:
    from kvfuzz.fuzz.code_coverage import count_lines

    rows = [("elapsed", f"{stats.elapsed:.1f} s"), ("examples", stats.examples),
            ("operations", stats.operations),
            ("ops/s", f"{stats.operations / max(stats.elapsed, 1e-9):.0f}"),
            ("invariant checks", stats.checks), ("distinct coverage", len(stats.features)),
            *([("libFuzzer edges", stats.edges)] if stats.edges else []),
            *([("target code", "{} lines, {} branches".format(*count_lines(stats.code_total)))]
              if stats.code_total else []),
            *([("generated configs", _generated(stats.generated))] if stats.generated else []),
            ("findings", len(stats.findings))]
    if stats.interrupted:
        rows.append(("interrupted", "yes: stopped by Ctrl-C or SIGTERM, findings so far kept"))
    width = max(len(k) for k, _ in rows)
    print("\nsummary")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    if report["by_config"]:
        from kvfuzz.fuzz.report import summary_lines

        print("\n" + "\n".join(summary_lines(report["by_config"], report["warnings"])))
    _reach(stats)
    if stats.findings:
        _findings(stats.findings)


def _generated(configs: dict[str, list[str]]) -> str:
    """How many generated configs ran, and how many had each cross-feature combination."""
    counts: dict[str, int] = {}
    for features in configs.values():
        for name in features:
            counts[name] = counts.get(name, 0) + 1
    return f"{len(configs)}" + (" (" + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
                                + ")" if counts else "")


def _after_totals(stats: Any, buildable: Any, target: str) -> None:
    """The configs left out, said again, and the known deviations tolerated, each counted."""
    lines = buildable.lines(target)
    if lines:
        print("\n  " + "\n  ".join(lines))
    tolerated = buildable.tolerated_counts(stats.tolerated)
    if tolerated:
        print(f"\n  known deviations tolerated by target {target} (docs/findings/; report one "
              "with --no-tolerate ID):")
        for label, row in tolerated.items():
            left = row["configs_left_out"]
            print(f"    {label}: {row['examples']} example(s)"
                  + (f", config(s) left out: {', '.join(left)}" if left else ""))


def _reach(stats: Any) -> None:
    """Name the (level, config) pairs the budget did not reach, or reached too little."""
    from kvfuzz.fuzz.schedule import FEW_EXAMPLES

    for pairs, what in ((stats.unreached(), "not reached (no example)"),
                        (stats.few(), f"under {FEW_EXAMPLES} examples")):
        if pairs:
            more = f" (+{len(pairs) - 8} more)" if len(pairs) > 8 else ""
            print(f"\n  {len(pairs)} of {len(stats.pairs)} pairs {what}: "
                  + ", ".join("/".join(p) for p in pairs[:8]) + more)


def _findings(records: list[Any]) -> None:
    """One line per distinct bug, grouped per check, with its duplicates."""
    from kvfuzz.fuzz.findings import by_check

    print("\nfindings, one per distinct failure (replay with `kvfuzz replay FILE`)")
    for check, group in by_check(records).items():
        print(f"  [{check}] {group['bugs']} distinct, {group['duplicates']} duplicate(s)")
        for f in (r for r in records if r.check == check):
            state = ("already in the corpus" if f.known
                     else f"{f.ops} ops, " + {False: "raw, not shrunk",
                                              "partial": "shrink interrupted"}.get(f.shrunk,
                                                                                   "shrunk"))
            if f.target_raised:
                state += f"; the target raised {f.target_raised} there"
            elsewhere = (f" (also on {', '.join(f.elsewhere)}: other traces, not this file)"
                         if f.elsewhere else "")
            print(f"    {f.level}/{f.config} ({state}), found after "
                  f"{f.found_after_s:.1f} s, {f.duplicates} duplicate(s){elsewhere}: "
                  f"{f.message}" + (f"\n      {f.file}" if not f.corpus_error else ""))
            if f.corpus_error:
                where = (f"kept in {f.file}" if f.file else "written nowhere")
                print(f"      NOT in the corpus ({f.corpus_error}): {where}; the trace in full"
                      f" (also in the --json report):\n      {json.dumps(f.trace)}")


def _load(args: argparse.Namespace, data: str | None) -> tuple[Any, str, str | None]:
    """The trace FILE, its target and its data spec (`--target`, `--data`, else the trace's
    own), with the `--plugin` modules imported. A trace is data: the plugins it records are
    shown, never imported (`kvfuzz.fuzz.trust`). The check it records must be registered."""
    from kvfuzz.core.trace import Trace
    from kvfuzz.fuzz.trust import recorded_plugins

    trace = Trace.load(args.file)
    if getattr(args, "config_file", None) is not None:
        from kvfuzz.core.config_file import load_config_file

        trace = Trace(load_config_file(args.config_file), trace.level, trace.ops, trace.meta)
    from kvfuzz.fuzz.bounds import check_configs

    check_configs([trace.config], workers=1, steps=len(trace.ops), seconds=None)
    _plugins(args.plugin)
    recorded, note = recorded_plugins(trace, args.plugin)
    if note:
        print(note, file=sys.stderr)
    if recorded or args.plugin:
        trace.meta["plugins"] = list(dict.fromkeys(recorded + args.plugin))
    target = _check_target(args.target or str(trace.meta.get("target", "kvcache")))
    data = data or trace.meta.get("data")
    _check_data(data)
    _check_registered(args.file, trace.meta.get("check"), data, args.plugin, recorded)
    return trace, target, data


def _check_registered(path: Path, check: Any, data: str | None, plugins: list[str],
                      recorded: list[str]) -> None:
    """A trace's recorded check must exist here, or its replay would pass for want of it."""
    from kvfuzz.fuzz.campaign import selected_checks
    from kvfuzz.fuzz.trust import plugin_options
    from kvfuzz.harness.executor import BUILD, CRASH, DIFF_PROBE, DIFF_RESULT, DIFF_STATE
    from kvfuzz.properties import REGISTRY

    known = {c.name for c in (selected_checks(data) or REGISTRY)}
    if check is None or check in known | {BUILD, CRASH, DIFF_PROBE, DIFF_RESULT, DIFF_STATE}:
        return
    imported = f" (plugins imported: {', '.join(plugins)})" if plugins else ""
    missing = [m for m in recorded if m not in plugins]
    hint = (f"pass `{plugin_options(missing)}` (the plugins the trace records) if you trust "
            "them, or" if missing else "pass")
    raise UsageError(f"{path} records a failure of check {check!r}, which is not "
                     f"registered{imported}: {hint} `--plugin MODULE` naming the module that "
                     "defines it")


def _target_spec(args: argparse.Namespace, trace: Any, target: str) -> Any:
    """The target with `--tolerate`/`--no-tolerate`, else the trace's recorded tolerance
    (which a target documenting no deviation, e.g. kvcache, replays without)."""
    from kvfuzz.harness.targets import get_target

    tolerance = _tolerance(args, trace.meta)
    recorded = args.tolerate is None and args.no_tolerate is None
    if recorded and getattr(get_target(target).locate(), "deviation_catalogue", None) is None:
        return get_target(target).spec()
    if tolerance:
        trace.meta.update(tolerance.meta())
    return get_target(target).spec(tolerance)


def _cmd_replay(args: argparse.Namespace) -> int:
    from kvfuzz.fuzz.campaign import selected_checks
    from kvfuzz.core.errors import InvalidTrace
    from kvfuzz.harness.build import ToleratedBuild
    from kvfuzz.harness.executor import Counterexample, Execution
    from kvfuzz.core.trace import op_text

    trace, target, data = _load(args, args.data)
    spec = _target_spec(args, trace, target)
    print(f"replaying {args.file}: {len(trace.ops)} ops, {trace.level} level, config "
          f"{trace.config.name!r}, target {target}" + (", no model" if args.no_model else "")
          + (f", data checks on {data}" if data else ""))
    try:
        execution = Execution(trace.config, trace.level, [spec], model=not args.no_model,
                              checks=selected_checks(data))
    except Counterexample as exc:
        print(f"\nFAILED {exc.finding.report()}")
        return EXIT_FOUND
    except ToleratedBuild as exc:
        print(f"\ntolerated: {exc}; nothing run (--no-tolerate {exc.deviation.split()[0]} "
              "or --target vllm-strict reports it)")
        return EXIT_OK
    for i, op in enumerate(trace.ops):
        before = execution.targets[0].snapshot
        try:
            result = execution.apply(op)
        except Counterexample as exc:
            if not args.quiet:
                print(f"step {i}: {op_text(op, trace.level)}")
            # The steps above are the trace; --quiet printed none, so the report carries it.
            print(f"\nFAILED {exc.finding.report(with_trace=args.quiet)}")
            return EXIT_FOUND
        except InvalidTrace as exc:
            raise UsageError(f"invalid trace: {exc}") from None
        if not args.quiet:
            print(f"step {i}: {op_text(op, trace.level)} -> {json.dumps(result)}")
            for change in before.differences(execution.targets[0].snapshot)[:8]:
                print(f"    {_clip(change)}")
    print(f"\npassed: {len(trace.ops)} ops, {execution.checks_run} checks, no counterexample")
    return EXIT_OK


def _clip(text: str, width: int = 240) -> str:
    """A change line of a replay, cut to `width` (a big pool's free queue runs to pages)."""
    return text if len(text) <= width else f"{text[:width - 30]} ... ({len(text)} chars)"


def _cmd_shrink(args: argparse.Namespace) -> int:
    from kvfuzz.fuzz.campaign import selected_checks
    from kvfuzz.fuzz.shrink import shrink_trace

    _positive("--seconds", args.seconds)
    trace, target, data = _load(args, args.data)
    out = args.out or args.file.with_suffix(".min.json")
    _writable("--out", out)
    spec = _target_spec(args, trace, target)
    try:
        result = shrink_trace(trace, [spec], model=not args.no_model,
                              check=trace.meta.get("check"), seconds=args.seconds,
                              checks=selected_checks(data))
    except ValueError as exc:
        raise UsageError(f"{args.file}: {exc} on {target}") from None
    if args.out is None and (result.trace.ops, result.trace.config) == (trace.ops, trace.config):
        print(f"nothing to shrink: {args.file} ({len(trace.ops)} ops) is already minimal for "
              f"[{result.finding.check}] ({result.attempts} replays); nothing written")
        return EXIT_OK
    result.trace.meta["target"] = target
    result.trace.meta.update(_tolerance(args, trace.meta).meta())
    result.trace.meta["versions"] = versions()
    if data:
        result.trace.meta["data"] = data
    result.trace.save(out)
    print(f"shrunk {len(trace.ops)} -> {len(result.trace.ops)} ops in {result.seconds:.1f} s "
          f"({result.attempts} replays); still fails [{result.finding.check}]: "
          f"{result.finding.message}\nwritten to {out}")
    return EXIT_OK


def _cmd_export(args: argparse.Namespace) -> int:
    import keyword

    if args.vllm_test is not None:  # played on kvcache at export time, whatever the target
        from kvfuzz.core.trace import Trace
        from kvfuzz.fuzz.vllm_test_export import export_vllm_test

        trace = Trace.load(args.file)
        _writable("--vllm-test", args.vllm_test)
        export_vllm_test(trace, args.vllm_test, args.file)
        print(f"wrote {args.vllm_test}: run it with vLLM installed, "
              f"`python -m pytest {args.vllm_test}`")
        return EXIT_OK
    from kvfuzz.fuzz.export import export_pytest
    from kvfuzz.harness.build import ToleratedBuild
    from kvfuzz.harness.executor import run_trace

    stem = args.pytest.stem
    if args.pytest.suffix != ".py" or not stem.isidentifier() or keyword.iskeyword(stem):
        raise UsageError(f"--pytest {args.pytest}: not a Python module name (NAME.py, NAME an "
                         "identifier such as test_regression_p2)")
    trace, target, _ = _load(args, None)
    _writable("--pytest", args.pytest)
    try:  # a trace replay rejects would make a test that can never pass
        invalid = run_trace(trace, [target]).invalid
    except ToleratedBuild:
        invalid = None
    if invalid is not None:
        raise UsageError(f"{args.file}: invalid trace: {invalid}; nothing exported")
    export_pytest(trace, target, args.pytest, plugins=tuple(args.plugin))
    print(f"wrote {args.pytest}: run it with `python -m pytest {args.pytest}`")
    return EXIT_OK


def _cmd_merge(args: argparse.Namespace) -> int:
    from kvfuzz.fuzz.merge import merge_reports

    _writable("--corpus", args.corpus, folder=True)
    if args.json is not None:
        _writable("--json", args.json)
    merged = merge_reports(args.reports, args.corpus)
    print(f"merged {len(args.reports)} reports: {merged['examples']} examples, "
          f"{merged['operations']} operations, {merged['invariant_checks']} invariant checks")
    for row in merged["by_config"]:
        print(f"  {row['level'] + '/' + row['config']:<28} {row['examples']:>9} examples  "
              f"{row['findings']:>3} bug(s)")
    if merged["findings"]:
        print("\nfindings, one per distinct failure (replay with `kvfuzz replay FILE`)")
        for f in merged["findings"]:
            print(f"  [{f['check']}] {f['level']}/{f['config']}, {f['ops']} ops, "
                  f"{f['duplicates']} duplicate(s): {f['message']}\n      {f['file']}")
    if args.json is not None:
        _write_json(args.json, merged)
        print(f"report written to {args.json}")
    return EXIT_FOUND if merged["findings"] else EXIT_OK


def _cmd_targets(args: argparse.Namespace) -> int:
    from kvfuzz.harness.targets import targets

    _plugins(args.plugin)
    rows = [(t.name, t.description) for t in targets()]
    _table(rows)
    return EXIT_OK


def _cmd_invariants(args: argparse.Namespace) -> int:
    from kvfuzz.properties import REGISTRY

    _plugins(args.plugin)
    if args.markdown:
        from kvfuzz.fuzz.tables import invariants_table

        print(invariants_table())
        return EXIT_OK
    docs = shipped("docs")
    print(f"§ and I1-I20 refer to {docs / 'spec.md'}, bugs #N to {docs / 'bugs.md'}\n")
    for check in REGISTRY:
        covers = f" [covers {', '.join(check.covers)}]" if check.covers else ""
        print(f"{check.name:5} {check.kind:10} {check.description}{covers}")
    try:
        from kvfuzz.properties.data import DATA_CHECKS
    except ModuleNotFoundError:  # torch is not installed: the data checks are unavailable
        return EXIT_OK
    for check in DATA_CHECKS:
        print(f"{check.name:5} {check.kind:10} {check.description} [with --data]")
    return EXIT_OK


def _cmd_configs(args: argparse.Namespace) -> int:
    _plugins(args.plugin)
    if args.markdown:
        from kvfuzz.fuzz.tables import configs_table

        print(configs_table())
        return EXIT_OK
    rows = []
    for name, (description, config) in BUILTIN.items():
        groups = " + ".join(
            f"{g.kind}(bs {g.block_size})" for g in config.groups
        )
        rows.append((name, f"{description}; N={config.num_blocks}, {groups}"))
    _table(rows)
    return EXIT_OK


def _table(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, text in rows:
        print(f"{name:<{width}}  {text}")


def _cmd_prove(args: argparse.Namespace) -> int:
    require("crosshair", _FUZZ, "kvfuzz prove")
    from kvfuzz.fuzz.prove import prove

    return prove(args.per_function)
