"""README.md's configs and invariants tables are the code's: every built-in config and every
registered check, as `kvfuzz configs --markdown` and `kvfuzz invariants --markdown` print them."""

import re
from pathlib import Path

from kvfuzz.core.configs import BUILTIN
from kvfuzz.fuzz.tables import configs_table, invariants_table
from kvfuzz.properties import REGISTRY

README = Path(__file__).resolve().parents[2] / "README.md"


def _section(name: str) -> str:
    found = re.search(rf"<!-- {name} table: generated.*?-->\n(.*?)\n<!-- end {name} table -->",
                      README.read_text(), re.S)
    assert found, f"README has no generated {name} table"
    return found.group(1).strip()


def test_configs_table_matches_the_code() -> None:
    assert _section("configs") == configs_table()
    assert all(f"| `{name}` |" in configs_table() for name in BUILTIN)


def test_invariants_table_matches_the_code() -> None:
    assert _section("invariants") == invariants_table()
    assert all(f"| **{c.name}** |" in invariants_table() for c in REGISTRY if c.builtin)
