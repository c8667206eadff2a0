"""Prefix-cache retention (docs/spec.md §4.9.2, §8 RT1): under a retention interval a
sliding-window block gets a key only where a later request can resume from it.

Restated here from the spec, independently of kvcache and the model: a window hit needs the
`need` blocks before its end, so a block is worth a key only as one of the `need` blocks ending
at a kept boundary: a segment end (every R tokens; none for R = 0) or the caching request's
replay boundary `P − 1` rounded down to the hit alignment. Runs with EAGLE are not judged.
"""

from __future__ import annotations

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.snapshot import Snapshot
from kvfuzz.properties.registry import CheckContext, transition


def _kept(config: Config, group: GroupConfig, index: int, num_prompt_tokens: int) -> bool:
    """Whether block `index` of a window group ends within a kept boundary's run."""
    bs, alignment = group.block_size, config.alignment_tokens
    if alignment % bs:
        return True  # the mask falls back to dense
    need = -(-(group.sliding_window - 1) // bs)  # type: ignore[operator]
    retention = config.prefix_cache_retention_interval
    if retention and need >= retention // bs:
        return True
    first_token, end_token = index * bs, (index + need) * bs  # ends this block can be part of
    if retention and any(end % retention == 0 for end in range(first_token + bs, end_token + 1,
                                                                bs)):
        return True
    replay = (num_prompt_tokens - 1) // alignment * alignment
    return first_token < replay <= end_token and (replay - first_token) % bs == 0


@transition(
    "RT1",
    "retention: under a prefix-cache retention interval a sliding-window block gains a key "
    "only if it is among the blocks a hit ending at a segment end or at the caching "
    "request's replay boundary needs, spec §4.9.2",
    covers=("spec §4.9.2",),
)
def window_keys_at_kept_boundaries(before: Snapshot, after: Snapshot,
                                   ctx: CheckContext) -> str | None:
    config = ctx.config
    if config.prefix_cache_retention_interval is None or config.use_eagle:
        return None
    windows = {g for g, group in enumerate(config.groups) if group.kind == "sliding_window"}
    if not windows:
        return None
    for block, key in enumerate(after.block_keys):
        if key is None or key[0] not in windows or before.block_keys[block] == key:
            continue
        g, group = key[0], config.groups[key[0]]
        if len(key[2]) % group.block_size:
            continue  # a partial (Tier B) key: not the full-block mask's
        index = len(key[2]) // group.block_size - 1
        # Any request holding its tokens may have cached it (the one that did may have
        # finished in this very op, or shared it by a hit since): the most lenient judges.
        prompts = {len(ctx.requests[rid].prompt) for rid, view in after.requests.items()
                   if view.tokens[:len(key[2])] == key[2]}
        if prompts and not any(_kept(config, group, index, p) for p in prompts):
            return (f"group {g}: block {block} (position {index}) got a key, but no hit at a "
                    f"kept boundary reads it (retention "
                    f"{config.prefix_cache_retention_interval}, prompts of {sorted(prompts)} "
                    "tokens)")
    return None
