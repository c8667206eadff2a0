"""The GitHub Actions workflows (ci/workflows/, copied to .github/workflows/) name what exists.

Every workflow parses and every job has a runner, a timeout and steps; every action is pinned;
every repository file a step runs or hashes exists; every `kvfuzz` command line is accepted by
fuzz/cli.py's own parser; every `pytest -m` mark, kvfuzz profile and pip extra is registered;
every pytest run collects only modules whose imports its job installs (or that importorskip
them) and tests of the marks it selects; the steps and jobs referred to exist; tests.yml runs
exactly README's `bash .ci/run`; the GPU job's self-hosted labels are documented; the copies
are exact; actionlint passes where present.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvfuzz.fuzz.cli import _parser
from kvfuzz.fuzz.profiles import PROFILES

REPO = Path(__file__).resolve().parents[2]
CANONICAL = REPO / "ci" / "workflows"
COPIES = REPO / ".github" / "workflows"
ACTIONLINT_CONFIG = REPO / ".github" / "actionlint.yaml"
WORKFLOWS = sorted(CANONICAL.glob("*.yml"))
SYNC = "cp ci/workflows/*.yml .github/workflows/"

_EXPRESSION = re.compile(r"\$\{\{.*?\}\}", re.S)
_SHELL_VARIABLE = re.compile(r"\$\{?\w+\}?")
_OPERATOR_CHARS = set("();<>|&")
_SOURCE_DIRS = (".ci/", "ci/", "bench/", "tests/", "docs/")
SHARED = ("redis://", "rediss://", "readonly:", "$KVFUZZ_REDIS_URL")
"""`--database` specs of a shared server, which no cache has to carry between runs."""
_PINNED = re.compile(r"[\w.-]+/[\w.-]+(/[\w./-]+)?@(v\d+(\.\d+){0,2}|[0-9a-f]{40})")


def _load(path: Path) -> dict[str, Any]:
    workflow = yaml.safe_load(path.read_text())
    if True in workflow:  # YAML 1.1 reads an unquoted key `on` as True
        workflow["on"] = workflow.pop(True)
    return workflow


def _steps(workflow: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for job in workflow["jobs"].values():
        yield from job.get("steps", [])


def _commands(script: str) -> Iterator[list[str]]:
    """The simple commands of a `run:` script as shell words; `${{ ... }}` reads as 1."""
    pending = ""
    for line in _EXPRESSION.sub("1", script).replace("\\\n", " ").splitlines():
        pending += line + "\n"
        lexer = shlex.shlex(pending, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError:  # a quotation that closes on a later line
            continue
        pending = ""
        command: list[str] = []
        for word in [*words, ";"]:
            if set(word) <= _OPERATOR_CHARS:
                if command:
                    yield command
                command = []
            else:
                command.append(word)


def _job_commands(path: Path) -> Iterator[tuple[str, list[str]]]:
    for job_id, job in _load(path)["jobs"].items():
        for step in job["steps"]:
            for command in _commands(step.get("run", "")):
                yield job_id, command


def _all_commands() -> Iterator[tuple[str, list[str]]]:
    for path in WORKFLOWS:
        for _, command in _job_commands(path):
            yield path.name, command


def _after(command: list[str], program: str) -> list[str] | None:
    """The words after `program` (also as `.../program`) in a command, None without it."""
    for i, word in enumerate(command):
        if word == program or word.endswith("/" + program):
            return command[i + 1:]
    return None


def test_there_are_workflows_and_their_copies_match() -> None:
    assert {p.name for p in WORKFLOWS} >= {"tests.yml", "nightly.yml", "vllm.yml", "prove.yml",
                                            "gpu.yml"}
    copies = sorted(COPIES.glob("*.y*ml"))
    assert [p.name for p in copies] == [p.name for p in WORKFLOWS], (
        f".github/workflows/ must hold exactly ci/workflows/*.yml: run `{SYNC}`")
    for path in WORKFLOWS:
        assert (COPIES / path.name).read_bytes() == path.read_bytes(), (
            f".github/workflows/{path.name} differs from ci/workflows/{path.name}: run `{SYNC}`")


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_jobs_have_a_runner_a_timeout_and_steps(path: Path) -> None:
    workflow = _load(path)
    assert workflow["on"] and workflow["jobs"], f"{path.name}: no triggers or no jobs"
    for job_id, job in workflow["jobs"].items():
        assert job.get("runs-on"), f"{path.name}: job {job_id} has no runs-on"
        assert isinstance(job.get("timeout-minutes"), int), f"{path.name}: {job_id} has no timeout"
        assert job.get("steps"), f"{path.name}: job {job_id} has no steps"
        for step in job["steps"]:
            assert ("run" in step) != ("uses" in step), f"{path.name}: {job_id}: {step}"
        needs = job.get("needs", [])
        for need in [needs] if isinstance(needs, str) else needs:
            assert need in workflow["jobs"], f"{path.name}: {job_id} needs unknown job {need}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_step_references_name_steps_of_the_job(path: Path) -> None:
    for job_id, job in _load(path)["jobs"].items():
        ids = {step["id"] for step in job["steps"] if "id" in step}
        used = set(re.findall(r"\$\{\{[^}]*\bsteps\.([\w-]+)", repr(job)))
        assert used <= ids, f"{path.name}: {job_id} refers to unknown steps {used - ids}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_actions_are_pinned(path: Path) -> None:
    for step in _steps(_load(path)):
        if "uses" in step:
            assert _PINNED.fullmatch(step["uses"]), (
                f"{path.name}: `uses: {step['uses']}` is not pinned to @vN or a commit sha")


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_repository_files_named_by_steps_exist(path: Path) -> None:
    text = path.read_text()
    hashed = [name for args in re.findall(r"hashFiles\(([^)]*)\)", text)
              for name in re.findall(r"'([^']+)'", args)]
    for step in _steps(_load(path)):
        hashed += str(step.get("with", {}).get("cache-dependency-path", "")).split()
        for command in _commands(step.get("run", "")):
            for word in command:
                if (word.startswith(_SOURCE_DIRS) or word.endswith((".py", ".sh"))) and not (
                        word.startswith(("-", "$")) or any(c.isspace() for c in word)):
                    assert (REPO / word).exists(), f"{path.name}: `{word}` does not exist"
    for pattern in hashed:
        assert list(REPO.glob(pattern)), f"{path.name}: hashes `{pattern}`, which matches nothing"


def test_kvfuzz_command_lines_are_accepted_by_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    seen = set()
    for name, command in _all_commands():
        argv = _after(command, "kvfuzz")
        if argv is None:
            continue
        argv = [_SHELL_VARIABLE.sub("1", word) for word in argv]  # "$SECONDS" -> 1
        try:
            args = _parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{name}: fuzz/cli.py rejects `kvfuzz {shlex.join(argv)}`: "
                        f"{capsys.readouterr().err.strip()}")
        assert hasattr(args, "handler"), f"{name}: `kvfuzz {shlex.join(argv)}` has no command"
        seen.add(argv[0])
    assert seen >= {"run", "prove"}, f"kvfuzz commands found in the workflows: {seen}"


def test_campaign_databases_are_restored_and_saved_even_after_a_finding() -> None:
    databases = set()
    for path in WORKFLOWS:
        for job_id, job in _load(path)["jobs"].items():
            steps = job["steps"]
            for i, step in enumerate(steps):
                for command in _commands(step.get("run", "")):
                    argv = _after(command, "kvfuzz") or []
                    local = [argv[j + 1] for j, word in enumerate(argv[:-1])
                             if word == "--database" and not argv[j + 1].startswith(SHARED)]
                    if not local:
                        continue
                    db = local[0]
                    databases.add(f"{path.name}/{job_id}")
                    restores = [s for s in steps[:i] if s.get("uses", "").startswith(
                        "actions/cache/restore@") and s["with"]["path"] == db]
                    saves = [s for s in steps[i + 1:] if s.get("uses", "").startswith(
                        "actions/cache/save@") and s["with"]["path"] == db]
                    assert restores and saves and saves[0].get("if") == "always()", (
                        f"{path.name} {job_id}: restore --database {db} from the cache before "
                        "the campaign and save it after, `if: always()`")
                    key, prefix = restores[0]["with"]["key"], restores[0]["with"]["restore-keys"]
                    assert saves[0]["with"]["key"] == key and "github.run_id" in key and (
                        key.startswith(prefix)), (
                        f"{path.name} {job_id}: save {db} under a new key each run and restore "
                        "the newest through its prefix")
    assert "nightly.yml/campaign" in databases, f"campaigns with a database: {databases}"


def test_pytest_marks_and_hypothesis_profiles_are_registered() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    registered = {m.split(":")[0].strip() for m in pyproject["tool"]["pytest"]["ini_options"]
                  ["markers"]}
    used = set()
    for name, command in _all_commands():
        args = _after(command, "pytest") or []
        for flag, value in zip(args, args[1:]):
            if flag == "-m":
                marks = set(re.findall(r"\w+", value)) - {"and", "or", "not"}
                assert marks <= registered, f"{name}: `pytest -m {value}`: unregistered mark"
                used |= marks
    assert used >= {"vllm", "gpu"}, f"pytest marks found in the workflows: {used}"
    for path in WORKFLOWS:
        text = path.read_text()
        for profile in re.findall(r"(?:KVFUZZ_PROFILE[:=]|--kvfuzz-profile[= ]) *(\w+)", text):
            assert profile in PROFILES, f"{path.name}: no kvfuzz profile {profile!r}"
        assert "HYPOTHESIS_PROFILE" not in text, (
            f"{path.name}: kvfuzz's profiles are chosen with KVFUZZ_PROFILE")


# What a job's Python has beyond its own `pip install` lines, as pip extras: the GPU runner brings
# its CUDA torch (ci/README.md), ci/install-vllm.sh installs torch and the test requirements.
_BROUGHT = {("gpu.yml", "gpu"): {"torch"}, ("vllm.yml", "conformance"): {"torch", "test"}}
_PYTEST_VALUE_OPTIONS = {"-m", "-k", "-p", "-c", "-o", "-W", "-n"}


def _normal(name: str) -> str:
    """A distribution name, normalized (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip_installs(command: list[str]) -> Iterator[str]:
    """What a `pip install` command installs: the extras of `.[a,b]`, and packages named."""
    args = _after(command, "pip") or []
    words = args[args.index("install") + 1:] if "install" in args else []
    for before, word in zip(["", *words], words):
        if before in ("-c", "-r", "--constraint", "--requirement"):
            continue
        if match := re.fullmatch(r"\.\[([\w,-]+)\]", word):
            yield from match[1].split(",")
        elif not word.startswith(("-", ".")):
            yield _normal(re.split(r"[=<>!~\[]", word)[0])


def _extras_by_import() -> dict[str, set[str]]:
    """Import name -> the pip extras ("" for the base dependencies) that install it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    imports: dict[str, set[str]] = {}
    for name, dists in packages_distributions().items():
        for dist in dists:
            imports.setdefault(_normal(dist), set()).add(name)
    extras: dict[str, set[str]] = {}
    for extra, requirements in [("", project["dependencies"]),
                                *project["optional-dependencies"].items()]:
        for requirement in requirements:
            dist = _normal(re.split(r"[=<>!~\[; ]", requirement)[0])
            for name in imports.get(dist, {dist.replace("-", "_")}):
                extras.setdefault(name, set()).add(extra)
    return extras


def _project_module(name: str, here: Path) -> Path | None:
    """The file of the project's module `name` (a folder: a namespace package), else None.
    `kvfuzz.PART...` lives in the folder pyproject.toml maps PART to."""
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in package_dirs:
            parts = [package_dirs[".".join(parts[:i])], *parts[i:]]
            break
    for base in (REPO, here):  # pytest puts a test module's folder on sys.path
        path = base.joinpath(*parts)
        for candidate in (path.with_suffix(".py"), path / "__init__.py", path):
            if candidate.exists():
                return candidate
    return None


def _unguarded_imports(path: Path, seen: set[Path]) -> dict[str, Path]:
    """The third-party modules importing `path` imports at module level (through project
    modules too), each with the file importing it, less those `path` importorskips first."""
    found: dict[str, Path] = {}
    guarded: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Expr | ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "attr", "") == "importorskip"):
            guarded.add(node.value.args[0].value)
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module != "__future__":
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if _project_module(parts[0], path.parent) is None:
                if parts[0] not in sys.stdlib_module_names | guarded:
                    found.setdefault(parts[0], path)
                continue
            for i in range(1, len(parts) + 1):
                module = _project_module(".".join(parts[:i]), path.parent)
                if module is not None and module.is_file() and module not in seen:
                    seen.add(module)
                    for third, importer in _unguarded_imports(module, seen).items():
                        if third not in guarded:
                            found.setdefault(third, importer)
    return found


def _collected(paths: list[str]) -> list[Path]:
    """The test modules and conftest.py files pytest imports for `paths` (default: testpaths)."""
    if not paths:
        paths = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"][
            "ini_options"]["testpaths"]
    files: set[Path] = {REPO / "conftest.py"}
    for root in (REPO / p for p in paths):
        tests = [root] if root.is_file() else [*root.rglob("test_*.py"), *root.rglob("*_test.py")]
        for test in tests:
            files.add(test)
            files |= {d / "conftest.py" for d in test.parents
                      if d.is_relative_to(REPO) and (d / "conftest.py").is_file()}
    return sorted(files)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_pytest_runs_collect_only_what_their_job_installs(path: Path) -> None:
    extras_of = _extras_by_import()
    installed: dict[str, set[str]] = {}
    for job_id, command in _job_commands(path):
        have = installed.setdefault(job_id, {""} | _BROUGHT.get((path.name, job_id), set()))
        have.update(_pip_installs(command))
        args = _after(command, "pytest")
        if args is None:
            continue
        run = f"{path.name} job {job_id}: `pytest {shlex.join(args)}`"
        paths = [word for before, word in zip(["", *args], args)
                 if not word.startswith("-") and before not in _PYTEST_VALUE_OPTIONS]
        assert all((REPO / p).exists() for p in paths), f"{run}: a path does not exist"
        collected = _collected(paths)
        for test in collected:
            for module, importer in _unguarded_imports(test, set()).items():
                needed = extras_of.get(module, set())
                assert not needed or needed & have or _normal(module) in have, (
                    f"{run} collects {test.relative_to(REPO)}, which imports {module} (in "
                    f"{importer.relative_to(REPO)}) from extra {sorted(needed)}, not installed "
                    "there: narrow the paths or `pytest.importorskip` it")
        marks = args[args.index("-m") + 1] if "-m" in args else ""
        for mark in set(re.findall(r"\w+", marks)) - {"and", "or", "not"}:
            assert any(f"mark.{mark}" in test.read_text() for test in collected), (
                f"{run} collects no test marked {mark}")


def test_pip_extras_exist() -> None:
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])
    for name, command in _all_commands():
        for word in _after(command, "pip") or []:
            if match := re.fullmatch(r"\.\[([\w,-]+)\]", word):
                unknown = set(match[1].split(",")) - extras
                assert not unknown, f"{name}: `pip install {word}`: no extra {unknown}"


def test_the_tests_workflow_runs_the_readme_command_on_push_and_pull_request() -> None:
    assert "```bash\nbash .ci/run\n```" in (REPO / "README.md").read_text()
    workflow = _load(CANONICAL / "tests.yml")
    assert {"push", "pull_request"} <= set(workflow["on"])
    runs = [step["run"].strip() for step in _steps(workflow) if "run" in step]
    assert runs == ["bash .ci/run"], f"tests.yml runs {runs}, not exactly `bash .ci/run`"


def test_the_gpu_job_runs_on_documented_self_hosted_labels() -> None:
    readme = (REPO / "ci" / "README.md").read_text()
    declared = yaml.safe_load(ACTIONLINT_CONFIG.read_text())["self-hosted-runner"]["labels"]
    for job_id, job in _load(CANONICAL / "gpu.yml")["jobs"].items():
        labels = job["runs-on"]
        assert isinstance(labels, list) and "self-hosted" in labels, f"gpu.yml {job_id}: {labels}"
        for label in labels:
            assert f"`{label}`" in readme, f"ci/README.md does not document the label `{label}`"
        custom = set(labels) - {"self-hosted", "linux", "x64"}
        assert custom <= set(declared), f"declare {custom} in .github/actionlint.yaml"


@pytest.mark.skipif(shutil.which("actionlint") is None, reason="actionlint is not on PATH")
def test_actionlint_passes() -> None:
    result = subprocess.run(["actionlint", "-no-color", *map(str, sorted(COPIES.glob("*.yml")))],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_buildkite_example_runs_commands_the_cli_accepts(
        capsys: pytest.CaptureFixture[str]) -> None:
    """ci/buildkite/distributed.yml: N parallel campaigns on one Redis, then `kvfuzz merge`."""
    pipeline = yaml.safe_load((REPO / "ci" / "buildkite" / "distributed.yml").read_text())
    commands = []
    for step in pipeline["steps"]:
        script = step.get("command", "").replace("$$", "$")  # Buildkite's escaped `$`
        for command in _commands(script):
            argv = _after(command, "kvfuzz")
            if argv is not None:
                commands.append([_SHELL_VARIABLE.sub("1", word) for word in argv])
    for argv in commands:
        try:
            _parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"rejected: kvfuzz {shlex.join(argv)}: {capsys.readouterr().err}")
    assert [argv[0] for argv in commands] == ["run", "merge"]
    assert pipeline["steps"][0]["parallelism"] > 1
    assert "--database" in commands[0] and "--json" in commands[1]


def test_the_vllm_workflow_runs_every_release_install_vllm_supports():
    """One matrix job per release `ci/install-vllm.sh` installs; each installs its own."""
    script = (REPO / "ci" / "install-vllm.sh").read_text()
    supported = re.search(r"^supported=\(([^)]*)\)", script, re.M).group(1).split()
    job = yaml.safe_load((CANONICAL / "vllm.yml").read_text())["jobs"]["conformance"]
    assert job["strategy"]["matrix"]["vllm"] == supported
    assert job["strategy"]["fail-fast"] is False
    install = next(s["run"] for s in job["steps"] if "install-vllm.sh" in str(s.get("run", "")))
    assert "bash ci/install-vllm.sh ${{ matrix.vllm }}" in install
    cache = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/cache"))
    assert cache["with"]["path"] == "~/.cache/kvfuzz/vllm-${{ matrix.vllm }}"


def test_install_vllm_refuses_an_unsupported_version():
    out = subprocess.run(["bash", str(REPO / "ci" / "install-vllm.sh"), "0.31.0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "unsupported vLLM version '0.31.0'; supported: 0.32.0 0.33.0 0.34.0" in out.stderr


def test_install_vllm_refuses_a_directory_that_is_not_a_vllm_checkout(tmp_path):
    out = subprocess.run(["bash", str(REPO / "ci" / "install-vllm.sh"), str(tmp_path)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert f"'{tmp_path}' is not a vLLM checkout" in out.stderr


def test_the_dev_checkout_ci_steps_in_docs_install_the_checkout_and_run_what_the_cli_accepts(
        capsys: pytest.CaptureFixture[str]) -> None:
    """docs/vllm.md's GitHub Actions job and Buildkite step for vLLM maintainers: each installs
    the checkout with `ci/install-vllm.sh PATH`, then runs the conformance tests and a campaign
    the CLI accepts."""
    text = (REPO / "docs" / "vllm.md").read_text()
    section = text[text.index("### A CI step for vLLM maintainers"):text.index("## Run")]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    job = yaml.safe_load(blocks[0])["kvfuzz"]
    actions = next(s["run"] for s in job["steps"] if "run" in s)
    buildkite = yaml.safe_load(blocks[1])["steps"][0]["command"].replace("$$", "$")
    for script, checkout in ((actions, "vllm"), (buildkite, ".")):
        commands = list(_commands(script))
        installs = [c[1:] for c in commands if c[:1] == ["bash"]
                    and c[1].endswith("ci/install-vllm.sh")]
        assert installs == [[installs[0][0], checkout]], script
        assert any(_after(c, "pytest") == ["-q", "-m", "vllm", "tests/vllm"] for c in commands)
        runs = [c[1:] for c in commands if c[0].endswith("/kvfuzz")]
        assert runs and runs[0][:3] == ["run", "--target", "vllm"], script
        for argv in runs:
            try:
                _parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"rejected: kvfuzz {shlex.join(argv)}: {capsys.readouterr().err}")
