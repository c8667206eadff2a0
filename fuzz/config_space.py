"""Configs generated over the knob space, not only listed: `generated_config(seed)`.

A draw picks every knob of docs/configs.md at random: one to three groups of any kind, block
sizes as multiples of a hash block size (1, 2, 4 or 8), per-group EAGLE and duplicated groups
(two identical specs, EAGLE on one), Mamba "align" with speculative and checkpoint blocks and a
checkpoint alignment of its own, windows, chunks, sinks, retention intervals, the KV
connector (and its load failure policy), events (with kv_cache_report_mode "full" where every
group is full attention), extra keys, partial hits, the watermark, hit-limit-carrying scheduler
knobs. The config is then built with `Config.from_dict` on its JSON form, exactly as
`--config-file` builds a file's (core/config_file.py), and a pool too small for one request of
max_model_len tokens is refused as vLLM refuses it at startup (`too_small_pool`); a draw
either refuses is skipped and the next one taken, from the same seeded stream, so a seed
always gives the same config. `cross_features` names which of the combinations the built-in
configs lack (EAGLE with a window below the hit alignment, retention with EAGLE, events with
sub-block partial entries, a Mamba align block size other than the alignment, merged identical
groups with EAGLE on one, a 1-token checkpoint alignment with hash block size 1) a config has.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.core.config_file import too_small_pool
from kvfuzz.core.errors import ConfigError

GENERATED = "generated"
"""The config name of a campaign's generated pairs (`kvfuzz run --generated-configs`)."""
TRIES = 500
"""Draws a seed may take before one validates (far more than needed: about one in three does)."""
KINDS = ("full", "full", "sliding_window", "sliding_window", "mamba", "mamba", "chunked_local",
         "mla", "sink_full", "rswa", "circular_buffer")
"""The kinds of a hybrid config's later groups, the common ones twice (cross and encoder_only
need caching off and come as whole-config draws, `_draw_groups`)."""

REPORTED_KINDS = ("full", "mla")
"""Kinds whose every hit block holds its key: kv_cache_report_mode "full" is drawn only for
configs of these (a window's or state group's hit re-announces the keys of its null blocks,
docs/spec.md §3.10)."""


class NoConfig(ConfigError):
    """No draw of a seed validated within TRIES (never seen; a bound, not an expectation)."""


def generated_config(seed: int) -> Config:
    """The config of `seed`: the first draw of its stream that validates like a config file."""
    rng = random.Random(seed)
    for _ in range(TRIES):
        data = draw(rng)
        data["name"] = f"gen-{seed & 0xFFFFFFFF:08x}"
        try:
            config = Config.from_dict(data)
        except ConfigError:
            continue
        if too_small_pool(config) is None:
            return config
    raise NoConfig(f"no valid config in {TRIES} draws of seed {seed}")


def draw(rng: random.Random) -> dict[str, Any]:
    """One draw of every knob, as a config file's data (it may not validate)."""
    hbs = rng.choice((1, 2, 4, 4, 8))
    caching = rng.random() < 0.9
    groups = _draw_groups(rng, hbs, caching)
    hybrid = len(groups) > 1
    data: dict[str, Any] = {
        "num_blocks": rng.choice((12, 16, 24, 32, 48, 64)),
        "groups": groups,
        "max_model_len": rng.choice((32, 64, 64, 128)),
        "enable_caching": caching,
        "use_eagle": rng.random() < 0.3,
        "partial_hits": hybrid and rng.random() < 0.3,
        "watermark": rng.choice((0.0, 0.0, 0.0, 0.05, 0.2)),
        "extra_keys": rng.random() < 0.3,
        "deferred_frees": rng.random() < 0.2,
        "kv_events": rng.random() < 0.35,
        "kv_connector": rng.random() < 0.2,
        "scheduler": _draw_scheduler(rng, groups),
    }
    if data["kv_events"] and all(g["kind"] in REPORTED_KINDS for g in groups) and (
            rng.random() < 0.5):
        data["kv_cache_report_mode"] = "full"
    if hybrid or rng.random() < 0.5:
        data["hash_block_size"] = hbs if hybrid else groups[0]["block_size"]
    if rng.random() < 0.3:
        sbs = _lcm([g["block_size"] for g in groups])
        data["prefix_cache_retention_interval"] = rng.choice((0, sbs, 2 * sbs))
    if any(g.get("mamba_cache_mode") == "align" for g in groups) and rng.random() < 0.5:
        data["enable_mamba_shared_prefix_checkpoint"] = True
    if data["kv_connector"] and rng.random() < 0.5:
        data["scheduler"]["kv_load_failure_policy"] = "fail"
    # An encoder that binds (§7.2), with chunked prefill (docs/vllm.md, `sched-encoder-budget`).
    if data["extra_keys"] and data["scheduler"]["chunked_prefill"] and rng.random() < 0.5:
        data["scheduler"]["encoder_budget"] = rng.choice((3, 4, 5))
        data["scheduler"]["encoder_cache_size"] = rng.choice((3, 4, 6))
    return data


def _draw_groups(rng: random.Random, hbs: int, caching: bool) -> list[dict[str, Any]]:
    if not caching and rng.random() < 0.2:  # the kinds that need caching off
        kind = rng.choice(("cross", "encoder_only"))
        return [{"kind": "full", "block_size": hbs * rng.choice((1, 2, 4))},
                {"kind": kind, "block_size": hbs * rng.choice((1, 2, 4))}]
    count = rng.choice((1, 2, 2, 3))
    groups = [_draw_group(rng, "full" if rng.random() < 0.7 else rng.choice(KINDS[2:]), hbs,
                          caching)]
    for _ in range(count - 1):
        groups.append(_draw_group(rng, rng.choice(KINDS), hbs, caching))
    if rng.random() < 0.15:  # two identical specs (vLLM merges them), EAGLE on one
        twin = dict(rng.choice(groups))
        twin["eagle"] = not twin.get("eagle", False)
        groups.append(twin)
    return groups[:4]


def _draw_group(rng: random.Random, kind: str, hbs: int, caching: bool) -> dict[str, Any]:
    size = hbs * rng.choice((1, 1, 2, 4))
    group: dict[str, Any] = {"kind": kind, "block_size": size}
    if rng.random() < 0.15:
        group["eagle"] = True
    if kind == "sliding_window":
        group["sliding_window"] = rng.choice((2, 4, 8, 16, 32))
        if rng.random() < 0.2:
            group["extra_retained_tokens"] = rng.choice((1, size))
    elif kind == "chunked_local":
        group["attention_chunk_size"] = rng.choice((4, 8, 16))
    elif kind == "mamba":
        group["mamba_cache_mode"] = "align" if caching or rng.random() < 0.5 else "none"
        group["num_speculative_blocks"] = rng.choice((0, 0, 1, 2))
        if rng.random() < 0.5:
            group["num_prefill_checkpoint_blocks"] = rng.choice((1, 2))
            group["prefill_checkpoint_alignment"] = rng.choice((1, hbs, size, 2 * size))
    elif kind == "sink_full":
        group["sink_len"] = size * rng.choice((1, 2))
    elif kind == "rswa":
        group["rswa_window"] = rng.choice((4, 8, 16))
    return group


def _draw_scheduler(rng: random.Random, groups: list[dict[str, Any]]) -> dict[str, Any]:
    encoder = any(g["kind"] == "encoder_only" for g in groups)
    return {
        "policy": rng.choice(("fcfs", "fcfs", "priority")),
        "token_budget": rng.choice((8, 16, 32, 64)),
        "max_running": rng.choice((2, 4, 8)),
        "chunked_prefill": not encoder and rng.random() < 0.8,
        "full_sequence_must_fit": rng.random() < 0.2,
        "num_lookahead_tokens": rng.choice((0, 0, 0, 1, 2)),
        "reserved_blocks": rng.choice((0, 0, 1)),
    }


def _lcm(sizes: list[int]) -> int:
    import math

    return math.lcm(*sizes)


def cross_features(config: Config) -> set[str]:
    """Which of the cross-feature combinations the built-in configs lack `config` has."""
    eagle = config.use_eagle or any(g.eagle for g in config.groups)
    align = config.alignment_tokens
    mamba = [g for g in config.groups if g.kind == "mamba" and g.mamba_cache_mode == "align"]
    specs = [(g.kind, g.block_size, g.sliding_window, g.attention_chunk_size, g.sink_len,
              g.rswa_window, g.mamba_cache_mode) for g in config.groups]
    found = set()
    if eagle and any(g.kind == "sliding_window" and g.block_size < align for g in config.groups):
        found.add("eagle_window_below_alignment")
    if eagle and config.prefix_cache_retention_interval is not None:
        found.add("retention_eagle")
    if config.kv_events and config.partial_hash_hits:
        found.add("events_partial_entries")
    if any(g.block_size != align for g in mamba):
        found.add("mamba_align_block_off_alignment")
    if any(specs.count(s) > 1 and any(g.eagle for g, t in zip(config.groups, specs) if t == s)
           for s in specs):
        found.add("merged_groups_eagle_on_one")
    if config.resolved_hash_block_size == 1 and any(
            g.prefill_checkpoint_alignment == 1 and g.num_prefill_checkpoint_blocks
            for g in mamba):
        found.add("one_token_checkpoint_hbs_1")
    return found


FLAGS = ("use_eagle", "partial_hits", "extra_keys", "deferred_frees", "kv_events",
         "kv_connector", "enable_mamba_shared_prefix_checkpoint")
"""The config's feature switches a shrink turns off."""
GROUP_DEFAULTS = {"eagle": False, "extra_retained_tokens": 0, "num_speculative_blocks": 0,
                  "num_prefill_checkpoint_blocks": 0, "prefill_checkpoint_alignment": None}
"""Group fields a shrink sets back (a checkpoint alignment goes with its blocks)."""


def is_generated(config: Config) -> bool:
    """A config drawn by `generated_config` (its name says so)."""
    return config.name.startswith("gen-")


def config_features(config: Config) -> int:
    """How much a config has beyond the plainest: groups past the first, features switched
    on, group fields off their defaults (the shrinker's order on configs)."""
    return (len(config.groups) - 1 + sum(bool(getattr(config, f)) for f in FLAGS)
            + (config.watermark > 0) + (config.prefix_cache_retention_interval is not None)
            + (config.kv_cache_report_mode != "incremental")
            + (config.hash_block_size is not None)
            + (config.scheduler.kv_load_failure_policy != "recompute")
            + sum(getattr(g, k) != v for g in config.groups for k, v in GROUP_DEFAULTS.items()))


def generated_variants(config: Config) -> list[dict[str, Any]]:
    """Smaller versions of a generated config, as `Config.replace` changes: a group dropped,
    a feature off, a group field back to its default (the caller skips those that do not
    validate)."""
    changes: list[dict[str, Any]] = []
    groups = config.groups
    if len(groups) > 1:
        changes += [{"groups": groups[:i] + groups[i + 1:]} for i in range(len(groups))]
    changes += [{flag: False} for flag in FLAGS if getattr(config, flag)]
    if config.watermark > 0:
        changes.append({"watermark": 0.0})
    if config.kv_cache_report_mode != "incremental":
        changes.append({"kv_cache_report_mode": "incremental"})
    if config.prefix_cache_retention_interval is not None:
        changes.append({"prefix_cache_retention_interval": None})
    if config.hash_block_size is not None:
        changes.append({"hash_block_size": None})
    if config.scheduler.kv_load_failure_policy != "recompute":
        changes.append({"scheduler": dataclasses.replace(config.scheduler,
                                                         kv_load_failure_policy="recompute")})
    for i, group in enumerate(groups):
        fields = {k: v for k, v in GROUP_DEFAULTS.items() if getattr(group, k) != v}
        if "num_prefill_checkpoint_blocks" in fields:
            fields["num_prefill_checkpoint_blocks"] = {"num_prefill_checkpoint_blocks": 0,
                                                       "prefill_checkpoint_alignment": None}
        for key, value in fields.items():
            change = value if isinstance(value, dict) else {key: value}
            replaced = dataclasses.replace(group, **change)
            changes.append({"groups": groups[:i] + (replaced,) + groups[i + 1:]})
    return changes


CROSS_FEATURES = ("eagle_window_below_alignment", "retention_eagle", "events_partial_entries",
                  "mamba_align_block_off_alignment", "merged_groups_eagle_on_one",
                  "one_token_checkpoint_hbs_1")
