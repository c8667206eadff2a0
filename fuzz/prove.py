"""`kvfuzz prove`: CrossHair checks the contracts on kvcache's pure arithmetic (fuzz/contracts.py).

Every public function of the contracts module whose docstring has a `post:` line is checked by
its own `crosshair check` process, as many at a time as there are CPUs. A function gets
`per_function_seconds` of CPU time, shared evenly among its postconditions
(`--per_condition_timeout`; `--per_path_timeout` is the smaller of that and its square root).
Verdicts: `proved` (CrossHair exhausted every path of every postcondition), `no counterexample`
(the budget ran out first), `FAILED` (a counterexample, printed with the postcondition it
breaks), `error` (CrossHair itself failed). Exit 1 on a counterexample, 2 on an error, else 0.
"""

from __future__ import annotations

import importlib
import inspect
import linecache
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvfuzz.core.errors import KvfuzzError

CONTRACTS = "kvfuzz.fuzz.contracts"
PROVED, UNKNOWN, FAILED, ERROR = "proved", "no counterexample", "FAILED", "error"
_MESSAGE = re.compile(r"^(?P<file>.+?):(?P<line>\d+): (?P<kind>\w+): (?P<text>.*)$")


@dataclass
class Verdict:
    name: str
    status: str
    seconds: float
    detail: str = ""


def contract_functions(module: str = CONTRACTS) -> list[str]:
    """The module's public functions that carry a postcondition, in definition order."""
    mod = importlib.import_module(module)
    return [name for name, fn in vars(mod).items() if not name.startswith("_")
            and inspect.isfunction(fn) and "post:" in (fn.__doc__ or "")]


def check_contract(module: str, name: str, seconds: float) -> Verdict:
    """Run `crosshair check` on one contract with a CPU budget of `seconds`."""
    doc = getattr(importlib.import_module(module), name).__doc__ or ""
    per_condition = seconds / max(1, doc.count("post:"))
    cmd = [sys.executable, "-m", "crosshair", "check", f"{module}.{name}", "--report_all",
           f"--per_condition_timeout={per_condition:g}",
           f"--per_path_timeout={min(per_condition, math.sqrt(per_condition)):g}"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=5 * seconds + 60)
    except subprocess.TimeoutExpired:
        return Verdict(name, ERROR, time.monotonic() - start, "crosshair did not finish")
    elapsed = time.monotonic() - start
    messages = [m for m in map(_MESSAGE.match, proc.stdout.splitlines()) if m]
    if proc.returncode == 1 and any(m["kind"] == "error" for m in messages):
        return Verdict(name, FAILED, elapsed, "\n".join(
            f"{_condition(m)}\n  counterexample: {m['text']}"
            for m in messages if m["kind"] == "error"))
    if proc.returncode != 0:
        return Verdict(name, ERROR, elapsed, (proc.stderr or proc.stdout).strip()[-2000:])
    proved = bool(messages) and all("Confirmed over all paths" in m["text"] for m in messages)
    return Verdict(name, PROVED if proved else UNKNOWN, elapsed)


def _condition(message: re.Match[str]) -> str:
    """The source line of the failing condition (`post: ...`)."""
    line = linecache.getline(message["file"], int(message["line"])).strip()
    return line or f"{message['file']}:{message['line']}"


def prove(per_function_seconds: float, module: str = CONTRACTS,
          names: Sequence[str] | None = None) -> int:
    """Check every contract (or `names`) of `module`; print verdicts; return the exit code."""
    if not per_function_seconds > 0:
        raise KvfuzzError(f"--per-function must be > 0, got {per_function_seconds}")
    names = list(names or contract_functions(module))
    print(f"kvfuzz prove: {len(names)} contracts in {module}, "
          f"{per_function_seconds:g} s of CPU per function")
    start = time.monotonic()
    verdicts = []
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for verdict in pool.map(lambda n: check_contract(module, n, per_function_seconds), names):
            verdicts.append(verdict)
            print(f"  {verdict.name:<38} {verdict.status:<17} {verdict.seconds:5.1f} s", flush=True)
            if verdict.detail:
                print("\n".join("      " + line for line in verdict.detail.splitlines()))
    counts = {s: sum(v.status == s for v in verdicts) for s in (PROVED, UNKNOWN, FAILED, ERROR)}
    print(f"{', '.join(f'{n} {s}' for s, n in counts.items() if n)} "
          f"in {time.monotonic() - start:.1f} s")
    if counts[FAILED]:
        return 1
    return 2 if counts[ERROR] else 0
