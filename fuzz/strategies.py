"""Hypothesis strategies for configs and prompts.

Configs vary around the built-in shapes (harness/configs.py) with small pools; prompts are built
from a few shared prefixes so that prefix hits, duplicates and evictions of shared blocks happen.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import BUILTIN

TOKEN_VOCAB = 4
"""Tokens are drawn from a tiny vocabulary: identical blocks arise by chance, too."""


def _vary_group(draw: st.DrawFn, group: GroupConfig) -> GroupConfig:
    if group.kind == "sliding_window":
        return dataclasses.replace(group, sliding_window=draw(st.sampled_from([4, 5, 8, 9])))
    if group.kind == "chunked_local":
        return dataclasses.replace(
            group, attention_chunk_size=draw(st.sampled_from([4, 8, 12]))
        )
    return group


@st.composite
def configs(draw: st.DrawFn, names: tuple[str, ...] | None = None, vary: bool = True) -> Config:
    """A built-in config, optionally with its pool, window and driver knobs varied."""
    name = draw(st.sampled_from(sorted(names or BUILTIN)))
    base = BUILTIN[name][1]
    if not vary:
        return base
    sched = base.scheduler
    sched = dataclasses.replace(
        sched,
        token_budget=draw(st.sampled_from([8, 16, 32])),
        max_running=draw(st.integers(1, 4)),
        chunked_prefill=sched.chunked_prefill and draw(st.booleans()),
    )
    groups = tuple(_vary_group(draw, g) for g in base.groups)
    blocks_per_request = max(-(-base.max_model_len // (2 * g.block_size)) for g in groups)
    num_blocks = draw(st.integers(max(4, blocks_per_request // 2), base.num_blocks + 8))
    return dataclasses.replace(base, num_blocks=num_blocks, groups=groups, scheduler=sched)


def prefixes(max_len: int) -> st.SearchStrategy[list[list[int]]]:
    """A few shared prompt prefixes for one run, often a whole number of small blocks long."""
    token = st.integers(0, TOKEN_VOCAB - 1)
    length = st.sampled_from([4, 8, 12, 16]).filter(lambda n: n <= max_len) | st.integers(
        1, max_len
    )
    one = length.flatmap(lambda n: st.lists(token, min_size=n, max_size=n))
    return st.lists(one, min_size=1, max_size=3)


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


def prompts(shared: list[list[int]], max_len: int) -> st.SearchStrategy[list[int]]:
    """A prompt: one shared prefix exactly (a resend), or extended, or cut, then a short random
    tail; 1..max_len tokens. Four draws whatever the length, for speed."""
    choice = st.tuples(
        st.integers(0, len(shared) * len(_SHAPES) - 1),
        st.integers(0, max(len(p) for p in shared)),
        st.integers(0, _TAIL),
        st.integers(0, TOKEN_VOCAB**_TAIL - 1),
    )

    def build(drawn: tuple[int, int, int, int]) -> list[int]:
        which, cut, tail_len, tail_bits = drawn
        prefix = shared[which // len(_SHAPES)]
        shape = _SHAPES[which % len(_SHAPES)]
        if shape == "exact":
            return list(prefix[:max_len])
        cut = len(prefix) if shape == "extend" else min(cut, len(prefix))
        prompt = (prefix[:cut] + tokens_from(tail_bits, tail_len))[:max_len]
        return prompt or [tail_bits % TOKEN_VOCAB]

    return choice.map(build)


_MM_LENGTH = (2, 3)
"""Multimodal identifier i always spans _MM_LENGTH[i] positions (one content, one length)."""


@st.composite
def extra_keys(draw: st.DrawFn, prompt: list[int]) -> dict[str, Any]:
    """add_request fields for a multi-tenant request (docs/spec.md §2.8): maybe a LoRA adapter
    whose name may equal a cache salt, maybe one multimodal input, maybe prompt embeddings on a
    repeating 4-position mask (embedding positions get the placeholder token 0, which is
    written into `prompt`; half the time the whole prompt is zeros)."""
    fields: dict[str, Any] = {}
    lora = draw(st.sampled_from([None, None, ("a", 1), ("a", 2), ("b", 1)]))
    if lora is not None:
        fields["lora_name"], fields["lora_id"] = lora
    ident = draw(st.sampled_from([None, 0, 1]))
    if ident is not None and len(prompt) >= _MM_LENGTH[ident]:
        offset = draw(st.integers(0, len(prompt) - _MM_LENGTH[ident]))
        fields["mm_inputs"] = [[ident, offset, _MM_LENGTH[ident]]]
    mask = draw(st.sampled_from([None, 0, 15, 5]))
    if mask is not None:
        if draw(st.booleans()):
            # All placeholders: token and embedding positions then differ only by the mask.
            prompt[:] = [0] * len(prompt)
        embeds = [0 if mask >> (i % 4) & 1 else -1 for i in range(len(prompt))]
        prompt[:] = [0 if v == 0 else t for v, t in zip(embeds, prompt)]
        fields["prompt_embeds"] = embeds
    return fields
