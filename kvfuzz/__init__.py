"""kvfuzz: property-based verification and fuzzing of paged KV-cache block managers.

The import root of every part (layers low to high; no part imports one above it):

- `kvfuzz.core`: the ground floor, plain data: configs, traces, snapshots, observations, errors
- `kvfuzz.kvcache`: the production four-layer block manager, with vLLM's names
- `kvfuzz.reference_model`: the slow, obvious oracle
- `kvfuzz.properties`: the checks, and `invariant` / `transition` to add your own
- `kvfuzz.harness`: the one executor, the target adapters (`register_target`, `ManagerSide`)
- `kvfuzz.fuzz`: the generators (state machines, atheris), campaigns and the `kvfuzz` CLI
- `kvfuzz.testing`: the state machines for your own pytest suite

The behavioural contract is docs/spec.md and the catalogue of real bugs docs/bugs.md; both ship
inside the package (`kvfuzz.docs`).
"""

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path



def _version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:  # kvfuzz imported from a checkout that was never installed
        return "unknown"


__version__ = _version("kvfuzz")


def versions() -> dict[str, str]:
    """The versions a report or a finding records: kvfuzz's and Hypothesis', and vLLM's when a
    vLLM target has imported it (never imported here: it costs seconds)."""
    out = {"kvfuzz": __version__, "hypothesis": _version("hypothesis")}
    vllm = sys.modules.get("vllm")
    if vllm is not None:
        out["vllm"] = str(getattr(vllm, "__version__", "unknown"))
    return out


def shipped(folder: str) -> Path:
    """A folder of files that ships with kvfuzz (`docs`, `ci`): inside the package when it was
    installed from a wheel, beside it in a checkout."""
    here = Path(__file__).resolve().parent
    for where in (here / folder, here.parent / folder):
        if where.is_dir():
            return where
    raise FileNotFoundError(f"kvfuzz's {folder}/ is missing from {here}")
