"""Prompts whose state tail is one token long, on a config with hash blocks of 1 (docs/mutation.md,
"Resumed checkpoints and hash blocks of 1").

A Mamba "align" group keys the state a prompt's chunk ends on at the prompt's last hash
boundary, `(P - 1) // hbs * hbs` (`get_mamba_prefill_checkpoint_position`,
kv_cache_interface.py:1203-1220 in vLLM 0.34.0), which the scheduler's chunk split stops at
under sub-block hits (sched/scheduler.py:639-647). The partial tail's guard `num_tokens <= 0`
(single_type_kv_cache_manager.py:2090) turns at the smallest keyable state, one hash block: a
1-token state exists only with hash blocks of 1, and only a 2-token prompt keys one. Without
this draw the plant `one-token-state-unkeyed` is found in 5 of 80 examples of `mamba_hbs1`
(74 with it). So on a config with hash blocks of 1 and an align group, half the prompts are
cut (or repeated) to 2 tokens. Every other config draws exactly as before: not one decision
more.
"""

from __future__ import annotations

from kvfuzz.core.config import Config
from kvfuzz.fuzz.strategies import Choices, flip

ONE_TOKEN_STATE_PROMPT = 2
"""The prompt whose last hash boundary, with hash blocks of 1, is token 1."""


def keys_one_token_states(config: Config) -> bool:
    """Whether the config keys a Mamba state at 1 token: hash blocks of 1, an align group."""
    return config.enable_caching and config.resolved_hash_block_size == 1 and any(
        g.kind == "mamba" and g.mamba_cache_mode == "align" for g in config.groups)


def prompt_length(choices: Choices, config: Config) -> int | None:
    """A prompt's length steered to a 1-token state, or None (the draw as it was): half the
    time on a config that `keys_one_token_states`."""
    if not keys_one_token_states(config) or not flip(choices):
        return None
    return ONE_TOKEN_STATE_PROMPT
