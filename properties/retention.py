"""Prefix-cache retention (docs/spec.md §4.9.2, §11.3, §8 RT1): under a retention interval a
sliding-window block or a Mamba "align" state block gets a key only where a later request can
resume from it.

Restated here from the spec, independently of kvcache and the model: a window hit needs the
`need` blocks before its end, so a block is worth a key only as one of the `need` blocks ending
at a kept boundary: a segment end (every R tokens; none for R = 0), or the caching request's
replay boundary `P − 1` or shared-prefix junction J (the driver's lookup found one, §6.3),
rounded down to the hit alignment. A state hit reads the one block ending at its boundary, so
a state key may cover only a segment end (a multiple of `(R // bs)·bs`, any block end when
that is at most one block), the replay boundary or J rounded down to the alignment and then to
a block end, the prompt's last hash boundary `(P − 1) // hbs · hbs` (registered whatever R),
or J itself (a prefill checkpoint there, §11.6). Runs with EAGLE are not judged.
"""

from __future__ import annotations

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.snapshot import Snapshot
from kvfuzz.properties.registry import CheckContext, transition


def _resumed_at(config: Config, num_prompt_tokens: int, junction: int) -> list[int]:
    """The replay boundary and the junction (if any), rounded down to the hit alignment."""
    alignment = config.alignment_tokens
    return [b // alignment * alignment for b in (num_prompt_tokens - 1, junction) if b]


def _kept(config: Config, group: GroupConfig, index: int, num_prompt_tokens: int,
          junction: int) -> bool:
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
    return any(first_token < boundary <= end_token and (boundary - first_token) % bs == 0
               for boundary in _resumed_at(config, num_prompt_tokens, junction))


def _state_kept(config: Config, group: GroupConfig, num_tokens: int,
                num_prompt_tokens: int, junction: int) -> bool:
    """Whether a state key covering `num_tokens` tokens is at a kept checkpoint."""
    bs, hbs = group.block_size, config.resolved_hash_block_size
    if num_tokens in ((num_prompt_tokens - 1) // hbs * hbs, junction):
        return True  # the prompt's last hash boundary, or a checkpoint at the junction
    if num_tokens % bs:
        return False
    retention = config.prefix_cache_retention_interval
    assert retention is not None
    segment = retention // bs * bs
    if retention and (segment <= bs or num_tokens % segment == 0):
        return True
    return any(num_tokens == boundary // bs * bs
               for boundary in _resumed_at(config, num_prompt_tokens, junction))


def _kept_key(config: Config, group: GroupConfig, key_tokens: int, num_prompt_tokens: int,
              junction: int) -> bool:
    if group.kind == "mamba":
        return _state_kept(config, group, key_tokens, num_prompt_tokens, junction)
    return _kept(config, group, key_tokens // group.block_size - 1, num_prompt_tokens, junction)


@transition(
    "RT1",
    "retention: under a prefix-cache retention interval a sliding-window block gains a key "
    "only if it is among the blocks a hit ending at a segment end or at the caching "
    "request's replay boundary or junction needs, spec §4.9.2; a Mamba 'align' state block "
    "only at a kept checkpoint (segment end, replay boundary, junction, the prompt's last "
    "hash boundary), §11.3",
    covers=("spec §4.9.2", "spec §11.3"),
)
def window_keys_at_kept_boundaries(before: Snapshot, after: Snapshot,
                                   ctx: CheckContext) -> str | None:
    config = ctx.config
    if config.prefix_cache_retention_interval is None or config.use_eagle:
        return None
    sparse = {g for g, group in enumerate(config.groups)
              if group.kind == "sliding_window" or group.mamba_cache_mode == "align"}
    if not sparse:
        return None
    for block, key in enumerate(after.block_keys):
        if key is None or key[0] not in sparse or before.block_keys[block] == key:
            continue
        g, group = key[0], config.groups[key[0]]
        if group.kind == "sliding_window" and len(key[2]) % group.block_size:
            continue  # a partial (Tier B) key: not the full-block mask's
        # Any request holding its tokens may have cached it (the one that did may have
        # finished in this very op, or shared it by a hit since): the most lenient judges.
        holders = {(len(ctx.requests[rid].prompt), view.shared_prefix_boundary)
                   for rid, view in after.requests.items()
                   if view.tokens[:len(key[2])] == key[2]}
        if holders and not any(_kept_key(config, group, len(key[2]), p, j) for p, j in holders):
            return (f"group {g}: block {block} got a key for {len(key[2])} tokens, but no hit "
                    f"at a kept boundary reads it (retention "
                    f"{config.prefix_cache_retention_interval}, (prompt tokens, junction) of "
                    f"{sorted(holders)})")
    return None
