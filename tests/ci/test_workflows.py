"""The GitHub Actions workflows (ci/workflows/, copied to .github/workflows/) name what exists.

Every workflow parses and every job has a runner, a timeout and steps; every action is pinned;
every repository file a step runs or hashes exists; every `kvfuzz` command line is accepted by
fuzz/cli.py's own parser; every `pytest -m` mark, Hypothesis profile and pip extra is registered;
the steps and jobs referred to exist; tests.yml runs exactly README's `bash .ci/run`; the GPU
job's self-hosted labels are documented; the copies are exact; actionlint passes where present.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import settings

from fuzz.cli import _parser

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


def _all_commands() -> Iterator[tuple[str, list[str]]]:
    for path in WORKFLOWS:
        for step in _steps(_load(path)):
            for command in _commands(step.get("run", "")):
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
        for profile in re.findall(r"(?:HYPOTHESIS_PROFILE[:=]|--hypothesis-profile=) *(\w+)", text):
            settings.get_profile(profile)  # raises on a profile conftest.py does not register


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
