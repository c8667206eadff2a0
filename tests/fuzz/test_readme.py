"""README's console examples are what their commands print: each `$ COMMAND` of a ```console
block runs (in a fresh folder holding README's `my_checks.py`) and its output is compared line
by line. Only what varies from run to run is masked: durations and rates, and the live lines
a slow machine prints in between."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

NEEDS_TORCH = "--data"
"""Commands run only where torch is installed (the data checks)."""

_TIMES = [
    (re.compile(r"\b\d+\.\d+ ?s\b"), "<seconds>"),  # 2.0s, 2.0 s, in 0.21s
    (re.compile(r"\b\d+ ops/s\b"), "<rate> ops/s"),  # the live line
    (re.compile(r"^(\s*ops/s\s+)\d+$"), r"\1<rate>"),  # the summary row
]
_LIVE = re.compile(r"^\s*\d+\.\d+s\s+(left|eta|pairs)\b")


def _blocks(text: str) -> list[str]:
    return re.findall(r"```console\n(.*?)```", text, flags=re.S)


def _examples() -> list[tuple[str, list[str]]]:
    """(command, expected output lines) of every console example that runs here."""
    out = []
    for block in _blocks(README.read_text()):
        command, lines = None, []
        for line in block.splitlines() + ["$ "]:
            if line.startswith("$ "):
                if command and (NEEDS_TORCH not in command
                                or importlib.util.find_spec("torch") is not None):
                    out.append((command, lines))
                command, lines = line[2:], []
            else:
                lines.append(line)
    return out


def _my_checks() -> str:
    return re.search(r"```python\n(# my_checks.py\n.*?)```", README.read_text(), re.S).group(1)


def _normal(lines: list[str]) -> list[str]:
    """Lines with durations and rates masked, spaces collapsed (columns follow the numbers),
    and only the first and last live lines (more come every 10 s on a slow machine)."""
    live = [i for i, line in enumerate(lines) if _LIVE.match(line)]
    drop = set(live[1:-1])
    kept = []
    for i, line in enumerate(lines):
        if i in drop:
            continue
        for pattern, mask in _TIMES:
            line = pattern.sub(mask, line)
        kept.append(" ".join(line.split()))
    while kept and not kept[-1]:
        kept.pop()
    return kept


def _argv(command: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(command, comments=True)
    env = {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] == "kvfuzz":
        words[:1] = [sys.executable, "-m", "kvfuzz"]
    elif words[0] == "python":
        words[0] = sys.executable
    return env, words


def test_the_readme_shows_its_examples():
    commands = [c for c, _ in _examples()]
    assert any(c.startswith("kvfuzz run") for c in commands)
    assert any("kvfuzz export" in c for c in commands)
    assert any("--plugin my_checks --target bug:" in c for c in commands)


def test_readme_console_examples_print_what_the_readme_shows(tmp_path):
    (tmp_path / "my_checks.py").write_text(_my_checks())
    for command, expected in _examples():
        extra, argv = _argv(command)
        path = [str(REPO)]
        if "PYTHONPATH" in extra:  # as the command says, relative to its folder
            path.insert(0, str(tmp_path / extra.pop("PYTHONPATH")))
        env = {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(path)}
        env.pop("CI", None)  # the exported test runs under the default profile, as a user's
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        actual = (done.stdout + done.stderr).splitlines()
        assert _normal(actual) == _normal(expected), f"$ {command}\n" + "\n".join(actual)
