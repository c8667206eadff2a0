"""Draws steered to a config's own boundaries: where a config sets a knob, one decision in two
that the knob's edge depends on lands next to that edge (docs/mutation.md, "Draws at a config's
own boundaries").

- A watermark: an admission (API level) or an arrival (scheduler level) whose blocks take the
  pool to within the watermark of empty, where vLLM's admission test `needed + watermark >
  free - reserved` (kv_cache_manager.py:604-609 in 0.34.0) turns.
- A chunked-local group: a growth that ends on a chunk end without lookahead, and at a chunk end
  a growth whose lookahead cannot fit, so the chunk's blocks are nulled before the allocation
  fails (kv_cache_manager.py:578-589) and a later free walks a table of nulls alone
  (kv_cache_utils.py:223-240); at the scheduler level, prompts a whole number of chunks long.
- A hash lookahead beside a full-attention block larger than the hash block: a prompt whose
  last hash boundary inside a block waits on the lookahead, so its prefill keys the block on a
  shorter partial prefix and its first outputs promote it to the longer one
  (`cache_partial_block`'s promotion, block_pool.py:521-528; full_attention's prompt tail,
  single_type_kv_cache_manager.py:864-902).
- Mamba prefill checkpoints (every state group "align" with checkpoint blocks): a prompt whose
  checkpoint lies on a block end, where dense caching keys the same block as a full one and
  the checkpoint's re-key test (`block_hash_num_tokens == checkpoint_position`,
  single_type_kv_cache_manager.py:2080) decides, at least `CHECKPOINT_BLOCKS` blocks in and,
  where max_model_len allows, past token `SMALL_INTS`; and an admission that stops where the
  prompt's last chunk starts from the state one column below the checkpoint's, the closest a
  valid checkpoint lies (`checkpoint_col > initial_state_col`, kv_cache_interface.py:1236-1240;
  the column test of `_needs_internal_checkpoint`, single_type_kv_cache_manager.py:1664-1695),
  or from the checkpoint's own column, where it is just refused.

Uniform draws reach these edges in 1/10 to 1/50 of the examples of the configs that have them,
too few for the two examples each pair's first batch gets; a prompt is at most half of
max_model_len and 8 tokens more (`strategies.prompt`), so a checkpoint rarely lies past 4
blocks. A config without such a knob draws exactly as before: not one decision more.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, TypeVar

from kvfuzz.core.config import FULL_ATTENTION_KINDS, Config
from kvfuzz.core.snapshot import RequestView
from kvfuzz.fuzz.strategies import Choices, between, flip

V = TypeVar("V", bound=RequestView)

CHECKPOINT_BLOCKS = 4
"""Blocks a steered checkpoint lies past: from 5 blocks of prompt on, a column counted from the
prompt's end (`cdiv(P, bs) - 2`, the checkpoint's) and one counted from its middle
(`cdiv(P, bs) // 2`) part; below, such column arithmetic mostly coincides."""

SMALL_INTS = 256
"""CPython's cached small ints end here: past it two equal positions computed apart are two
objects, so a position compared by identity and one compared by value part."""


@dataclass(frozen=True)
class Edges:
    """The boundaries a config's knobs draw (0: the config has none of that kind)."""

    watermark_blocks: int
    """Blocks the watermark keeps free at an admission (vLLM: `int(watermark * num_blocks)`)."""
    chunk: int
    """The attention chunk of the config's first chunked-local group."""
    block_size: int
    """The block size of the group the edge is measured in (the chunked-local one, else the
    first)."""
    groups: int
    """Attention groups: each takes its own blocks for the same tokens."""
    max_model_len: int = 0
    """The longest sequence: a growth's lookahead reaches it at a chunk end."""
    tail_block_size: int = 0
    """The block size of a full-attention group whose prompt-tail partial entry waits on the
    hash lookahead (0: no such group, or no lookahead)."""
    hash_block_size: int = 0
    hash_lookahead: int = 0
    """num_hash_lookahead_tokens: a block's hash waits on this many tokens after it."""
    checkpoint_block_size: int = 0
    """The block size of the Mamba groups that export prefill checkpoints (0: none)."""
    checkpoint_unit: int = 0
    """The grid checkpoints lie on: the hit alignment (the hash block with sub-block hits)."""
    checkpoint_eagle: bool = False
    """Checkpoints step down a unit for EAGLE's dropped block."""

    def __bool__(self) -> bool:
        return bool(self.watermark_blocks or self.chunk)

    def tokens(self, blocks: int) -> int:
        """Tokens whose blocks over every group come to about `blocks`."""
        return blocks * self.block_size // self.groups


def edges(config: Config) -> Edges:
    """The boundaries of `config` (falsy when it has no watermark or chunk edge)."""
    local = [g for g in config.groups if g.kind == "chunked_local" and g.attention_chunk_size]
    group = local[0] if local else config.groups[0]
    hbs = config.resolved_hash_block_size
    tails = [g for g in config.groups if g.kind in FULL_ATTENTION_KINDS and g.block_size != hbs]
    ahead = config.enable_caching and config.num_hash_lookahead_tokens
    tail = tails[0] if tails and ahead else None
    checkpoints = config.enable_caching and config.prefill_checkpoint_alignment is not None
    state = next(g for g in config.groups if g.kind == "mamba") if checkpoints else None
    return Edges(watermark_blocks=int(config.watermark * config.num_blocks),
                 chunk=local[0].attention_chunk_size if local else 0,
                 block_size=group.block_size, groups=len(config.groups),
                 max_model_len=config.max_model_len,
                 tail_block_size=tail.block_size if tail else 0,
                 hash_block_size=hbs, hash_lookahead=config.num_hash_lookahead_tokens,
                 checkpoint_block_size=state.block_size if state else 0,
                 checkpoint_unit=config.alignment_tokens if state else 0,
                 checkpoint_eagle=bool(state and config.use_eagle))


def near_edge(choices: Choices, edges: Edges, free: int) -> int:
    """Blocks that take the pool to its edge: `free + d` for d in [-watermark, watermark]
    (where `needed + watermark` and `needed - watermark` disagree, and either side of it), or
    the free blocks and one more without a watermark; at least 1."""
    wm = edges.watermark_blocks
    return max(1, free + (between(choices, -wm, wm) if wm else choices.below(2)))


def admission(choices: Choices, edges: Edges, free: int, computed: int, least: int,
              most: int) -> dict[str, Any] | None:
    """An admission's `allocate_slots` arguments steered to an edge, or None (the draw as it
    was): half the time on a config with edges. At a watermark, new blocks next to the edge
    (`near_edge`) with the watermark applied (a request already scheduled) and nothing else
    in the way (no reserve, gate or lookahead); on a chunked-local config, a chunk that ends
    on the next chunk end, without lookahead."""
    if not edges or not flip(choices):
        return None
    if edges.watermark_blocks:
        start = -(-computed // edges.block_size) * edges.block_size
        end = start + edges.tokens(near_edge(choices, edges, free))
        return {"num_new_tokens": min(max(end - computed, least), most),
                "num_lookahead_tokens": 0, "full_sequence_must_fit": False,
                "reserved_blocks": 0, "has_scheduled_reqs": True}
    end = (computed // edges.chunk + 1) * edges.chunk
    return {"num_new_tokens": min(max(end - computed, least), most), "num_lookahead_tokens": 0}


def growth(choices: Choices, edges: Edges, computed: int, most: int) -> tuple[int, int] | None:
    """(new tokens, lookahead) of a running request's growth steered to a chunk end, or None:
    half the time on a chunked-local config. At a chunk end the lookahead reaches the longest
    sequence, more blocks than most pools hold (the blocks the growth nulls first count as
    free), and the caller preempts the request when the growth fails, as a scheduler does;
    before one the growth stops on the next chunk end, without lookahead."""
    if not edges.chunk or not flip(choices):
        return None
    if computed and computed % edges.chunk == 0:
        return between(choices, 1, most), edges.max_model_len
    return min((computed // edges.chunk + 1) * edges.chunk - computed, most), 0


def prompt_length(choices: Choices, edges: Edges, free: int, longest: int) -> int | None:
    """A scheduler-level prompt's length steered to an edge, or None: half the time on a
    config with edges, a prompt whose blocks take the pool to its edge (`near_edge`), on a
    chunked-local config cut to whole chunks (its prefill ends on a chunk end, where its first
    decode step nulls the chunk's blocks, and the pool has none left to grow into)."""
    if not edges or not flip(choices):
        return None
    length = edges.tokens(near_edge(choices, edges, free))
    if edges.chunk:
        length = max(edges.chunk, length // edges.chunk * edges.chunk)
    return min(max(length, 1), longest)


def promotes_tail(length: int, edges: Edges) -> bool:
    """A prompt of `length` tokens keys its tail block on a partial prefix at prefill that its
    first outputs lengthen within the same block: the prompt's last hash boundary (the one
    before its last token: a config with a hash lookahead drops no EAGLE block,
    single_type_kv_cache_manager.py:876-885) lies past the hashes its prefill has, and neither
    boundary is a block end."""
    bs, hbs = edges.tail_block_size, edges.hash_block_size
    final = (length - 1) // hbs * hbs
    first = min(final, max(length - edges.hash_lookahead, 0) // hbs * hbs)
    return 0 < first < final and first % bs != 0 and final % bs != 0 and first // bs == final // bs


def promoted_tail_length(choices: Choices, edges: Edges, length: int, longest: int) -> int | None:
    """A prompt length steered to a promoted tail (`promotes_tail`), or None: half the time on
    a config with a hash lookahead and a full-attention block larger than the hash block, the
    longest such length up to `length`, else the shortest above it (up to `longest`)."""
    if not edges.tail_block_size or not flip(choices):
        return None
    lengths = [*range(min(length, longest), 0, -1), *range(length + 1, longest + 1)]
    return next((n for n in lengths if promotes_tail(n, edges)), None)


def checkpoint_position(length: int, edges: Edges) -> int:
    """Where the prefill of a `length`-token prompt exports its checkpoint (vLLM's
    `get_mamba_prefill_checkpoint_position`, kv_cache_interface.py:1203-1220)."""
    # Imported here: the atheris engine instruments kvcache, which must not be imported before
    # it is (the generator, which imports this module, is loaded first).
    from kvfuzz.kvcache.block_math import get_mamba_prefill_checkpoint_position

    return get_mamba_prefill_checkpoint_position(length, edges.checkpoint_unit,
                                                 edges.checkpoint_eagle, edges.hash_lookahead)


@functools.cache
def _checkpoint_lengths(edges: Edges, longest: int) -> tuple[int, ...]:
    """The prompt lengths up to `longest` whose checkpoint lies on a block end at least
    `CHECKPOINT_BLOCKS` blocks in; those past token `SMALL_INTS` alone where there are any."""
    bs = edges.checkpoint_block_size
    ends = [(n, checkpoint_position(n, edges)) for n in range(1, longest + 1)]
    ends = [(n, at) for n, at in ends if at % bs == 0 and at >= CHECKPOINT_BLOCKS * bs]
    past = [n for n, at in ends if at > SMALL_INTS]
    return tuple(past or (n for n, _ in ends))


def checkpoint_length(choices: Choices, edges: Edges, length: int, longest: int) -> int | None:
    """A prompt length steered to a prefill checkpoint on a block end (`_checkpoint_lengths`),
    or None: half the time on a config with prefill checkpoints, the shortest such length from
    `length` on, else the longest. Equal prompts stay equal, so two requests may compute the
    same checkpoint."""
    if not edges.checkpoint_block_size or not flip(choices):
        return None
    lengths = _checkpoint_lengths(edges, longest)
    return next((n for n in lengths if n >= length), lengths[-1] if lengths else None)


def checkpoint_split(choices: Choices, edges: Edges, computed: int, length: int) -> int | None:
    """The tokens an admission computes so that the prompt's last chunk starts next to its
    checkpoint's column (`cdiv(length, bs) - 2`), or None: half the time on a config with
    prefill checkpoints, up to the end of the column below it (the closest state a valid
    checkpoint starts from) or of the checkpoint's own column (just refused), when that lies
    past the `computed` tokens."""
    bs = edges.checkpoint_block_size
    if not bs or not flip(choices):
        return None
    start = (-(-length // bs) - 2 + choices.below(2)) * bs
    return start - computed if start > computed else None


def at_chunk_end(choices: Choices, edges: Edges,
                 running: list[tuple[str, V]]) -> list[tuple[str, V]]:
    """The running requests a growth or a free picks from: half the time on a chunked-local
    config, those whose computed tokens end on a chunk end (where a growth nulls the chunk's
    blocks, and a free after a failed one walks nulls alone), if any."""
    if not edges.chunk:
        return running
    ends = [(rid, v) for rid, v in running
            if v.num_computed_tokens and v.num_computed_tokens % edges.chunk == 0]
    return ends if ends and flip(choices) else running
