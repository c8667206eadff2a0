"""Drafts steered across a Mamba "align" table's block end, then rejected (docs/vllm.md,
"Why campaigns missed two plants on 0.32 and 0.33").

A state group in "align" mode keeps `cdiv(tokens, block_size) + num_speculative_blocks`
blocks; a step over drafts that cross a block end grows its table by one, and when the drafts
are rejected and the next step proposes fewer, the table is longer than that step needs
(finding 028's negative count, and the plant `align-surplus-freed`). Uniform draws make that
shape in about 1 example in 100 (the most drafts, a request 1 to most - 1 tokens short of a
block end, the next step a spec step rejecting them all and proposing fewer): too few for a
30 s campaign on a loaded machine. So on a config with an align group and a drafter, one spec
step in two where some decoding request sits at such a position runs the shape's two steps
at once. A config without an align group draws exactly as before: not one decision more.
"""

from __future__ import annotations

from kvfuzz.core.config import Config
from kvfuzz.core.snapshot import RequestView


def align_block_size(config: Config) -> int:
    """The block size of the config's first Mamba "align" group, 0 without one."""
    return next((g.block_size for g in config.groups
                 if g.kind == "mamba" and g.mamba_cache_mode == "align"), 0)


def crosses_block_end(block_size: int, running: list[tuple[str, RequestView]],
                      most: int) -> bool:
    """Whether some decoding request, once the next step samples its token, sits 1 to
    `most - 1` tokens short of an align block end: `most` drafts then cross it, and a step
    that rejects them and proposes none needs a block fewer than the table grew to."""
    if not block_size or most < 2:
        return False
    return any(1 <= -(v.num_computed_tokens + 2) % block_size <= most - 1
               for _, v in running if v.num_tokens == v.num_computed_tokens + 1)
