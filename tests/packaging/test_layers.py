"""The parts of kvfuzz stand in layers: no part imports one above it, at module level or inside
a function, and the reference model shares no code with kvcache."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ALLOWED = {
    "core": {"core"},
    "kvcache": {"kvcache"},
    "reference_model": {"core", "reference_model"},
    "properties": {"core", "kvcache", "properties"},
    "harness": {"core", "kvcache", "reference_model", "properties", "harness"},
    "fuzz": {"core", "kvcache", "reference_model", "properties", "harness", "fuzz"},
}


def kvfuzz_imports(path: Path) -> set[str]:
    """The parts (`core`, `harness`, ...) a module imports, as `kvfuzz.PART...`."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            root, _, rest = name.partition(".")
            if root == "kvfuzz" and rest:
                parts.add(rest.partition(".")[0])
            elif root in ALLOWED:
                parts.add(f"bare {root}")
    return parts


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_a_part_imports_only_the_parts_below_it(part):
    wrong = {
        f"{path.relative_to(REPO)} imports {sorted(bad)}"
        for path in sorted((REPO / part).glob("*.py"))
        if (bad := kvfuzz_imports(path) - ALLOWED[part])
    }
    assert not wrong, "\n".join(sorted(wrong))


def test_the_checker_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kvfuzz.harness.executor import run_trace\n"
                      "import properties\n")
    assert kvfuzz_imports(module) == {"harness", "bare properties"}
