"""Choice sources, and the configs and prompts drawn from them.

Every generator decision is one `below(n)` call on a choice source. `BytesChoices` reads the
decisions from a byte string: the campaign engines hand it the bytes Hypothesis draws (one
`st.binary` per example, stored in the example database) or the input libFuzzer mutates, so a
byte changed is a decision changed, and zeros are the simplest decisions. `DataChoices` asks
Hypothesis for each one (the pytest state machines, whose failing traces kvfuzz's shrinker
cuts).

Configs vary around the built-in shapes (core/configs.py) with small pools; prompts are built
from a few shared prefixes so that prefix hits, duplicates and evictions of shared blocks happen.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from hypothesis import strategies as st

from kvfuzz.core.config import Config, GroupConfig

TOKEN_VOCAB = 4
"""Tokens are drawn from a tiny vocabulary: identical blocks arise by chance, too."""

T = TypeVar("T")


class Exhausted(Exception):
    """The byte string ran out of decisions: the example ends at the op being built."""


class Choices(Protocol):
    def below(self, n: int) -> int:
        """A number in [0, n) (0 when n <= 1, without consuming a decision)."""


class BytesChoices:
    """Decisions read from bytes: one byte for up to 256 options, little-endian bytes above."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def below(self, n: int) -> int:
        if n <= 1:
            return 0
        pos = self.pos
        if n <= 256:
            if pos >= len(self.data):
                raise Exhausted
            self.pos = pos + 1
            return self.data[pos] % n
        end = pos + (n.bit_length() + 7) // 8
        if end > len(self.data):
            raise Exhausted
        self.pos = end
        return int.from_bytes(self.data[pos:end], "little") % n


class DataChoices:
    """Decisions drawn one by one with a Hypothesis draw function (`data.draw` or a
    composite's `draw`)."""

    __slots__ = ("draw",)

    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any]) -> None:
        self.draw = draw

    def below(self, n: int) -> int:
        return 0 if n <= 1 else self.draw(st.integers(0, n - 1))


def between(choices: Choices, low: int, high: int) -> int:
    return low + choices.below(high - low + 1)


def pick(choices: Choices, options: Sequence[T]) -> T:
    return options[choices.below(len(options))]


def flip(choices: Choices) -> bool:
    return choices.below(2) == 1


def _vary_group(choices: Choices, group: GroupConfig) -> GroupConfig:
    if group.kind == "sliding_window":
        return dataclasses.replace(group, sliding_window=pick(choices, (4, 5, 8, 9)))
    if group.kind == "chunked_local":
        return dataclasses.replace(group, attention_chunk_size=pick(choices, (4, 8, 12)))
    return group


ENCODER_SIZES = (3, 4, 5)
"""Encoder budgets and encoder cache sizes a config with a bounded encoder is run with: each
takes one input of the generators' (2 or 3 embeddings); 3 and 4 not both (docs/spec.md §7.2)."""

CROSS_ENCODER_BUDGETS = (12, 16, 24)
"""Encoder budgets an encoder-decoder config with a bounded encoder is run with: each takes
one request's encoder input (the generators' 1 to 12 tokens), not always two (§7.2)."""

SPECULATIVE_BLOCKS = (1, 2, 3)
"""State blocks for draft tokens a config with speculative decoding is run with: vLLM sets
every Mamba group's `num_speculative_blocks` to the one `num_speculative_tokens`."""


def _vary_speculative_blocks(
    choices: Choices, groups: tuple[GroupConfig, ...]
) -> tuple[GroupConfig, ...]:
    """One draft-token count for every state group of a config that decodes speculatively."""
    num = pick(choices, SPECULATIVE_BLOCKS)
    return tuple(dataclasses.replace(g, num_speculative_blocks=num) if g.kind == "mamba" else g
                 for g in groups)


def vary_config(choices: Choices, base: Config) -> Config:
    """`base` with its pool, window and driver knobs varied."""
    sched = dataclasses.replace(
        base.scheduler,
        token_budget=pick(choices, (8, 16, 32)),
        max_running=between(choices, 1, 4),
        chunked_prefill=base.scheduler.chunked_prefill and flip(choices),
    )
    if sched.encoder_budget is not None:
        # Binding for inputs of 2 and 3 (`mm_inputs`), with chunked prefill only: without it
        # vLLM 0.33 lets the encoder split a prompt (docs/vllm.md, `sched-encoder-budget`).
        bounded = sched.chunked_prefill
        if base.has_cross_attention:  # the budget alone (docs/vllm.md, `sched-encoder-decoder`)
            sched = dataclasses.replace(
                sched, encoder_budget=pick(choices, CROSS_ENCODER_BUDGETS) if bounded else None)
        else:
            sched = dataclasses.replace(
                sched, encoder_budget=pick(choices, ENCODER_SIZES) if bounded else None,
                encoder_cache_size=pick(choices, ENCODER_SIZES) if bounded else None)
    groups = tuple(_vary_group(choices, g) for g in base.groups)
    if any(g.num_speculative_blocks for g in groups):
        groups = _vary_speculative_blocks(choices, groups)
    blocks_per_request = max(-(-base.max_model_len // (2 * g.block_size)) for g in groups)
    fewest = max(4, blocks_per_request // 2)
    if base.watermark:  # a pool whose watermark keeps at least one block (else it has none)
        fewest = max(fewest, min(math.ceil(1 / base.watermark), base.num_blocks))
    num_blocks = between(choices, fewest, base.num_blocks + 8)
    retention = base.prefix_cache_retention_interval
    if retention is not None:  # 0 (replay boundaries only) or 1-4 scheduler blocks
        retention = base.scheduler_block_size * choices.below(5)
    return dataclasses.replace(base, num_blocks=num_blocks, groups=groups, scheduler=sched,
                               prefix_cache_retention_interval=retention)


def tokens(choices: Choices, length: int) -> list[int]:
    return [choices.below(TOKEN_VOCAB) for _ in range(length)]


_ROUND_LENGTHS = (4, 8, 12, 16)


def prefixes(choices: Choices, max_len: int) -> list[list[int]]:
    """A few shared prompt prefixes for one run, often a whole number of small blocks long."""
    out = []
    for _ in range(between(choices, 1, 3)):
        round_lengths = [n for n in _ROUND_LENGTHS if n <= max_len]
        if round_lengths and not flip(choices):
            length = pick(choices, round_lengths)
        else:
            length = between(choices, 1, max_len)
        out.append(tokens(choices, length))
    return out


def tokens_from(value: int, length: int) -> list[int]:
    """`length` tokens read as base-TOKEN_VOCAB digits of `value` (one draw for a whole tail,
    shrinking towards all zeros)."""
    out = []
    for _ in range(length):
        value, digit = divmod(value, TOKEN_VOCAB)
        out.append(digit)
    return out


_TAIL = 8
_SHAPES = ("exact", "extend", "cut")


def prompt(choices: Choices, shared: list[list[int]], max_len: int) -> list[int]:
    """A prompt: one shared prefix exactly (a resend), or extended, or cut, then a short random
    tail; 1..max_len tokens. Four decisions whatever the length, for speed."""
    which = choices.below(len(shared) * len(_SHAPES))
    cut = choices.below(max(len(p) for p in shared) + 1)
    tail_len = choices.below(_TAIL + 1)
    tail_bits = choices.below(TOKEN_VOCAB**_TAIL)
    prefix = shared[which // len(_SHAPES)]
    shape = _SHAPES[which % len(_SHAPES)]
    if shape == "exact":
        return list(prefix[:max_len])
    cut = len(prefix) if shape == "extend" else min(cut, len(prefix))
    out = (prefix[:cut] + tokens_from(tail_bits, tail_len))[:max_len]
    return out or [tail_bits % TOKEN_VOCAB]


_MM_LENGTH = (2, 3)
"""Multimodal identifier i always spans _MM_LENGTH[i] positions (one content, one length)."""


def mm_inputs(choices: Choices, length: int, boundaries: tuple[int, ...]) -> list[list[int]]:
    """None, one or two multimodal inputs `[identifier, offset, length]` in a `length`-token
    prompt. The first starts anywhere, exactly at a block end (a boundary of one of
    `boundaries`) or so that it ends exactly at one; a second, when drawn, starts right where
    the first ended or at the next block end after it (sorted and apart, as traces require):
    the places where an input's key moves from one block to the next."""
    first = pick(choices, (None, 0, 1))
    if first is None or length < _MM_LENGTH[first]:
        return []
    size = pick(choices, boundaries)
    room = length - _MM_LENGTH[first]
    offset = choices.below(room + 1)
    place = choices.below(3)
    if place == 1:  # starts at a block end
        offset = offset // size * size
    elif place == 2:  # ends at a block end
        end = (offset + _MM_LENGTH[first]) // size * size
        offset = end - _MM_LENGTH[first] if end >= _MM_LENGTH[first] else offset
    inputs = [[first, offset, _MM_LENGTH[first]]]
    second = pick(choices, (None, None, 0, 1))
    if second is not None:
        start = offset + _MM_LENGTH[first]
        if flip(choices):
            start = -(-start // size) * size
        if start + _MM_LENGTH[second] <= length:
            inputs.append([second, start, _MM_LENGTH[second]])
    return inputs


def extra_keys(choices: Choices, prompt: list[int],
               boundaries: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """add_request fields for a multi-tenant request (docs/spec.md §2.3): maybe a LoRA adapter
    whose name may equal a cache salt, maybe one or two multimodal inputs (`mm_inputs`), maybe
    prompt embeddings on a repeating 4-position mask (embedding positions get the placeholder
    token 0, written into `prompt`; half the time the whole prompt is zeros, so that token and
    embedding positions differ only by the mask). `boundaries` are the config's block and hash
    block sizes, where multimodal inputs are made to start and end."""
    fields: dict[str, Any] = {}
    # ("a", 1) pointed at id 2's path keys like ("a", 2): vLLM keys by name and path.
    lora = pick(choices, (None, None, ("a", 1, None), ("a", 2, None), ("b", 1, None),
                          ("a", 1, "/kvfuzz/lora/2")))
    if lora is not None:
        fields["lora_name"], fields["lora_id"], path = lora
        if path is not None:
            fields["lora_path"] = path
    inputs = mm_inputs(choices, len(prompt), boundaries)
    if inputs:
        fields["mm_inputs"] = inputs
    mask = pick(choices, (None, 0, 15, 5))
    if mask is not None:
        if flip(choices):
            prompt[:] = [0] * len(prompt)
        embeds = [0 if mask >> (i % 4) & 1 else -1 for i in range(len(prompt))]
        prompt[:] = [0 if v == 0 else t for v, t in zip(embeds, prompt)]
        fields["prompt_embeds"] = embeds
    return fields
