"""Resumed requests re-prefilled in one chunk onto a block-end checkpoint (docs/mutation.md,
"Resumed checkpoints and hash blocks of 1").

On a config whose Mamba "align" groups have prefill checkpoint blocks, the chunk that reaches a
request's prefill end (`max(prompt, tokens - 1)`, kv_cache_manager.py:550 in vLLM 0.34.0)
exports the state at its checkpoint, `get_mamba_prefill_checkpoint_position` of the chunk's end
(single_type_kv_cache_manager.py:1766-1771, kv_cache_interface.py:1203-1244), and the manager
keys it there when it is the prompt's checkpoint or a block end retention keeps (:2050-2079).
A new request's prefill end is its prompt's, so its checkpoint is the prompt's; only a request
with outputs prefilled past its prompt in one chunk (one preempted and resumed) has a
checkpoint that is not, and the retention test alone decides whether a block end there is kept.
Without this draw the plant `resumed-checkpoint-dropped` is found in 3 of 120 API examples of
the checkpoint configs (29 with it).

So on such a config, half the samples append the fewest outputs after which a re-prefill can
checkpoint on a block end (`outputs`), half the frees preempt a running request with such
outputs (`to_preempt`), and half the admissions pick such a preempted request (`to_resume`)
and take it back in the one chunk whose checkpoint lands there (`Checkpoints.resumed_chunk`).
A config without checkpoint blocks draws exactly as before: not one decision more.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfuzz.core.config import Config
from kvfuzz.core.snapshot import RequestView
from kvfuzz.fuzz.strategies import Choices, flip


@dataclass(frozen=True)
class Checkpoints:
    """What places a config's prefill checkpoints (vLLM's names in the docstrings)."""

    block_size: int
    """The state groups' block size."""
    unit: int
    """`cache_hit_alignment_tokens`: the hash block under sub-block hits, else the block."""
    hash_block_size: int
    alignment: int
    """`prefill_checkpoint_alignment`: the checkpoint's distance from the chunk's start is a
    multiple of it."""
    drop_eagle: bool
    """EAGLE's block drop: the checkpoint steps down one unit more."""
    lookahead: int
    """`num_hash_lookahead_tokens`: tokens the checkpoint's hash waits on."""

    def position(self, end: int) -> int:
        """The checkpoint of a chunk ending at `end` (or of a prompt of `end` tokens)."""
        limit = end if self.drop_eagle else end - max(1, self.lookahead)
        return max(limit // self.unit * self.unit - (self.unit if self.drop_eagle else 0), 0)

    def exports(self, start: int, end: int, position: int) -> bool:
        """Whether a chunk from `start` to `end` can export the state at `position`."""
        bs, hbs = self.block_size, self.hash_block_size
        return (start % hbs == 0 and -(-end // bs) - 2 > (start - 1) // bs
                and start + hbs <= position and start < position < end
                and (position - start) % self.alignment == 0)

    def resumed_chunk(self, start: int, prompt: int, tokens: int) -> int | None:
        """The new tokens of a chunk from `start` that reaches the prefill end of a request of
        `tokens` tokens (`prompt` of them its prompt) and exports a checkpoint on a block end
        other than the prompt's; None when no such chunk exists."""
        for end in range(max(prompt, tokens - 1), tokens + 1):
            position = self.position(end)
            if (position and position % self.block_size == 0
                    and position != self.position(prompt) and self.exports(start, end, position)):
                return end - start
        return None


def checkpoints(config: Config) -> Checkpoints | None:
    """The config's prefill checkpoints, None without checkpoint blocks (or without caching)."""
    alignment = config.prefill_checkpoint_alignment  # set only where every state group has them
    if not config.enable_caching or alignment is None:
        return None
    hbs = config.resolved_hash_block_size
    bs = next(g.block_size for g in config.groups if g.kind == "mamba")
    return Checkpoints(block_size=bs, unit=hbs if config.partial_hash_hits else bs,
                       hash_block_size=hbs, alignment=alignment, drop_eagle=config.use_eagle,
                       lookahead=config.num_hash_lookahead_tokens)


def resumable(points: Checkpoints, view: RequestView, prompt: int) -> bool:
    """Whether the request has outputs and its re-prefill from token 0 can checkpoint on a
    block end other than its prompt's."""
    return view.num_tokens > prompt and points.resumed_chunk(0, prompt, view.num_tokens) is not None


def outputs(choices: Choices, points: Checkpoints | None, view: RequestView, prompt: int,
            room: int) -> int | None:
    """Tokens a sample appends, steered: half the time on a checkpoint config, the fewest (up
    to `room`) after which the request is `resumable`, if any; else None (the draw as it was)."""
    if points is None:
        return None
    tokens = view.num_tokens
    fewest = next((n for n in range(1, room + 1)
                   if points.resumed_chunk(0, prompt, tokens + n) is not None), None)
    return fewest if fewest is not None and flip(choices) else None


def to_preempt(choices: Choices, points: Checkpoints | None, running: list[tuple[str, RequestView]],
               prompts: dict[str, int]) -> list[tuple[str, RequestView]]:
    """The running requests a free preempts, steered: half the time on a checkpoint config,
    those that are `resumable`, if any; else none (the draw as it was)."""
    if points is None:
        return []
    chosen = [(rid, v) for rid, v in running if resumable(points, v, prompts[rid])]
    return chosen if chosen and flip(choices) else []


def to_resume(choices: Choices, points: Checkpoints | None, waiting: list[tuple[str, RequestView]],
              prompts: dict[str, int]) -> list[tuple[str, RequestView]]:
    """The waiting requests an admission is steered to: half the time on a checkpoint config,
    the preempted ones that are `resumable`, if any; else none (the draw as it was). A steered
    admission skips the lookup, whose hit on the state the prompt left would start the chunk
    past every checkpoint it can export (the checkpoint's column must lie above the initial
    state's, kv_cache_interface.py:1236-1240), and takes the `Checkpoints.resumed_chunk`."""
    if points is None:
        return []
    chosen = [(rid, v) for rid, v in waiting
              if v.status == "PREEMPTED" and resumable(points, v, prompts[rid])]
    return chosen if chosen and flip(choices) else []
