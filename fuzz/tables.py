"""README.md's tables of the built-in configs and the invariants, generated from the code
(`kvfuzz configs --markdown`, `kvfuzz invariants --markdown`; tests/fuzz/test_readme_tables.py
checks README holds exactly these)."""

from __future__ import annotations


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def configs_table() -> str:
    """Every built-in config: name, description, pool size and groups."""
    from kvfuzz.core.configs import BUILTIN

    rows = ["| config | shape | pool, groups |", "|---|---|---|"]
    for name, (description, config) in BUILTIN.items():
        groups = " + ".join(f"{g.kind} (bs {g.block_size})" for g in config.groups)
        rows.append(f"| `{name}` | {_cell(description)} | {config.num_blocks} blocks, "
                    f"{groups} |")
    return "\n".join(rows)


def invariants_table() -> str:
    """Every registered check: name, kind, what it says."""
    from kvfuzz.properties import REGISTRY

    rows = ["| check | kind | what it says |", "|---|---|---|"]
    rows += [f"| **{c.name}** | {c.kind} | {_cell(c.description)} |" for c in REGISTRY]
    return "\n".join(rows)
